import pytest

from engine.estimates.estimate import config_for, count_parameters, looked_up_bytes, predict, weights_bytes
from engine.models.loading import LoadRequest, load_model, weights_read_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "nf4"])
def test_predicted_weights_match_what_loads(tiny_llama, precision):
    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    count = count_parameters(loaded.model.config)
    assert count.total == loaded.info.parameters
    buffers = sum(b.numel() * b.element_size() for b in loaded.model.buffers())
    predicted = weights_bytes(count, precision) + buffers
    # the tiny model's head is untied: a token reads all but its input table, less one row
    read = weights_read_bytes(loaded.model, loaded.info.weights_bytes)
    table = count.embedding * loaded.model.get_input_embeddings().weight.element_size()
    assert not count.tied and read == loaded.info.weights_bytes - table + table // count.embedding * count.embedding_dim
    looked_up, row = looked_up_bytes(count, precision)  # what the cost model leaves out of a step's read
    if precision == "int8":  # LLM.int8 also keeps the indices of outlier columns it met
        assert loaded.info.weights_bytes == pytest.approx(predicted, rel=1e-3)
        assert read == pytest.approx(predicted - looked_up + row, rel=1e-3)
    else:
        assert loaded.info.weights_bytes == predicted
        assert read == predicted - looked_up + row


def test_tied_embeddings_count_once(tiny_llama):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    untied = count_parameters(config).total
    config.tie_word_embeddings = True
    assert untied - count_parameters(config).total == config.vocab_size * config.hidden_size


@pytest.mark.parametrize("precision", ["fp32", "bf16", "nf4", "fp32-fast", "bf16-fast", "int8-fast", "int4-fast"])
def test_a_tied_table_is_read_whole_unless_a_quantized_copy_heads_the_model(tmp_path, byte_tokenizer, precision):
    """A tied head reads the embedding table whole at every token, so a step reads all the
    weights; the fast path's int8 / int4 give the head a quantized copy of its own, after which
    the table is only looked up: predicted from the config, measured from the loaded modules."""
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "tied", "llama", byte_tokenizer, tie_word_embeddings=True)
    count = count_parameters(config_for(str(folder)))
    loaded = load_model(LoadRequest(str(folder), precision, "cpu"))
    measured = weights_read_bytes(loaded.model, loaded.info.weights_bytes)
    whole = weights_bytes(count, precision)
    table, row = looked_up_bytes(count, precision)
    if precision in ("int8-fast", "int4-fast"):
        assert (table, row) == (2 * count.embedding, 2 * count.embedding_dim)  # the bf16 table, and a row of it
    else:
        assert (table, row) == (0, 0)
    predicted = whole - table + row  # the cost model's read for one sequence (costs.estimate)
    assert count.tied and measured - predicted == loaded.info.weights_bytes - whole  # the rotary buffer


def test_config_sources(tiny_llama, tmp_path, isolated_cache):
    assert config_for(str(tiny_llama)).model_type == "llama"
    assert config_for("default").num_hidden_layers == 30  # the shipped config until it is fetched
    assert config_for(str(tmp_path / "missing")) is None
    assert config_for("nobody/not-cached") is None


def test_prediction_against_free_memory(tiny_llama):
    config = config_for(str(tiny_llama))
    prediction = predict(config, "bf16", "cpu", context_tokens=100)
    assert prediction.kv_bytes == 100 * prediction.kv_bytes_per_token
    assert prediction.total_bytes == prediction.weights_bytes + prediction.kv_bytes
    assert prediction.available_bytes > 0 and prediction.fits is True


@pytest.mark.default_model
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "nf4"])
def test_default_model_prediction_is_exact_but_buffers(default_model_folder, precision):
    loaded = load_model(LoadRequest("default", precision, "cpu"))
    predicted = weights_bytes(count_parameters(loaded.model.config), precision)
    # off by the rotary inv_freq buffer (32 floats), and for int8 its outlier indices
    assert loaded.info.weights_bytes == pytest.approx(predicted, rel=1e-4)
    if precision != "int8":
        assert loaded.info.weights_bytes - predicted == 128 * 2


def test_nf4_absmax_bytes_follow_bitsandbytes_cpu_layout(tiny_llama, monkeypatch):
    """bitsandbytes repacks 4-bit weights with a bf16 absmax only where the CPU has AVX-512 BF16;
    elsewhere (and on a GPU) the absmax stays fp32."""
    from engine.estimates import estimate

    count = count_parameters(config_for(str(tiny_llama)))
    blocks = -(-count.linear // estimate.BNB_BLOCK)
    monkeypatch.setattr(estimate, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    with_bf16 = weights_bytes(count, "nf4")
    monkeypatch.setattr(estimate, "cpu_flags", lambda: frozenset({"avx2"}))
    assert weights_bytes(count, "nf4") - with_bf16 == 2 * blocks
    assert weights_bytes(count, "nf4", "cuda") == weights_bytes(count, "nf4")
