import json
import shutil

import pytest
import torch

from engine.base.cancel import CancelToken
from engine.base.errors import (
    CancelledError,
    CorruptModelError,
    DeviceUnavailableError,
    ModelNotFoundError,
    NotAModelError,
    UnsafeCheckpointError,
    UnsupportedPrecisionError,
)
from engine.base.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.models.precision import PRECISIONS, get_precision
from engine.base.request import GenerationRequest
from engine.generation.generate import generate


def unique_param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_precision_loads_and_generates_on_cpu(tiny_llama, precision):
    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    info = loaded.info
    assert info.precision == precision and info.device == "cpu"
    assert info.load_s > 0
    tokens = [e for e in generate(loaded, GenerationRequest("fox", mode="raw", max_new_tokens=4, ignore_eos=True))
              if isinstance(e, TokenGenerated)]
    assert len(tokens) == 4


def test_no_hub_kernels_are_swapped_in(tiny_llama, monkeypatch):
    """transformers 5 swaps layers for kernels downloaded from the hub unless told not to. On a lent
    H200, offline, that failed every load ('not available in the local cache'), and without the
    `kernels` package it refused them all; the engine asks for none, so both loads work."""
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "is_kernels_available", lambda: False)
    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    assert loaded.model.use_kernels is False
    tokens = [e for e in generate(loaded, GenerationRequest("fox", mode="raw", max_new_tokens=3, ignore_eos=True))
              if isinstance(e, TokenGenerated)]
    assert len(tokens) == 3
    loaded.close()


def test_weights_bytes_and_parameters(tiny_llama):
    fp32 = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    bf16 = load_model(LoadRequest(str(tiny_llama), "bf16", "cpu"))
    nf4 = load_model(LoadRequest(str(tiny_llama), "nf4", "cpu"))
    int8 = load_model(LoadRequest(str(tiny_llama), "int8", "cpu"))
    params = sum(p.numel() for p in fp32.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in fp32.model.buffers())
    assert fp32.info.parameters == params == bf16.info.parameters == nf4.info.parameters == int8.info.parameters
    assert fp32.info.weights_bytes == 4 * params + buffers
    assert bf16.info.weights_bytes == 2 * params + buffers
    # quantized: fewer bytes, and more than the bare packed weights (scales are counted)
    assert nf4.info.weights_bytes < int8.info.weights_bytes < bf16.info.weights_bytes
    assert nf4.info.weights_bytes > unique_param_bytes(nf4.model)


def test_load_facts(tiny_models):
    info = load_model(LoadRequest(str(tiny_models["qwen2"]), "bf16", "cpu")).info
    assert (info.model_type, info.architecture) == ("qwen2", "Qwen2ForCausalLM")
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.context_length) == (3, 2, 16, 256)
    assert info.compute_dtype == "bfloat16"
    assert info.kv_bytes_per_token == 2 * 3 * 2 * 16 * 2
    assert info.source == "folder" and info.original_format == "safetensors"
    assert "thread" in info.device_name


def test_progress_is_reported_and_ends_ready(tiny_llama):
    events = []
    load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"), progress=events.append)
    stages = [e.stage for e in events]
    assert stages[:2] == ["imports", "resolve"] and stages[-1] == "ready"
    weights = [e for e in events if e.stage == "weights"]
    assert weights and weights[-1].done == weights[-1].total > 0
    assert [e.done for e in weights] == sorted(e.done for e in weights)


def test_cancel_during_weights_then_load_again(tiny_llama):
    cancel = CancelToken()

    def progress(event):
        if event.stage == "weights" and event.done >= 1:
            cancel.cancel()

    with pytest.raises(CancelledError):
        load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"), progress=progress, cancel=cancel)
    again = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    assert again.info.parameters > 0


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="No such"):
        load_model(LoadRequest(str(tmp_path / "nope"), "fp32", "cpu"))
    with pytest.raises(ModelNotFoundError):
        load_model(LoadRequest("./relative/missing.gguf", "fp32", "cpu"))


def test_folder_without_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotAModelError, match="holds no model"):
        load_model(LoadRequest(str(tmp_path), "fp32", "cpu"))


def test_folder_with_config_but_no_weights(tmp_path, tiny_llama):
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    with pytest.raises(NotAModelError, match="no weights"):
        load_model(LoadRequest(str(tmp_path), "fp32", "cpu"))


def test_corrupt_config(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="config.json"):
        load_model(LoadRequest(str(folder), "fp32", "cpu"))


def test_unknown_architecture(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotAModelError, match="does not know"):
        load_model(LoadRequest(str(folder), "fp32", "cpu"))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, tiny_llama, damage):
    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        load_model(LoadRequest(str(folder), "fp32", "cpu"))


def test_pickle_checkpoint_needs_opt_in(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    folder = shutil.copytree(tiny_llama, tmp_path / "pickled")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert not list(folder.glob("*.safetensors")) and list(folder.glob("*.bin"))
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        load_model(LoadRequest(str(folder), "fp32", "cpu"))
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu", allow_pickle=True))
    assert loaded.info.original_format == "pickle"


def test_unknown_precision_is_refused():
    with pytest.raises(UnsupportedPrecisionError, match="int3"):
        get_precision("int3")


def test_bitsandbytes_on_mps_is_refused_by_the_support_table():
    for name in ("int8", "nf4", "fp4"):
        with pytest.raises(UnsupportedPrecisionError, match="mps"):
            PRECISIONS[name].check_device("mps")
    PRECISIONS["fp16"].check_device("mps")  # no error


def test_refusals_come_before_any_weight_is_read(tmp_path, tiny_llama):
    """The weights here are garbage: a refusal that read them would raise CorruptModelError."""
    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UnsupportedPrecisionError):
        load_model(LoadRequest(str(folder), "int3", "cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="CUDA"):
            load_model(LoadRequest(str(folder), "fp32", "cuda"))
    with pytest.raises(DeviceUnavailableError, match="Unknown device"):
        load_model(LoadRequest(str(folder), "fp32", "tpu9"))


def test_generate_after_close_is_refused(tiny_llama):
    from engine.base.errors import EngineError

    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    loaded.close()
    with pytest.raises(EngineError, match="unloaded"):
        generate(loaded, GenerationRequest("fox", mode="raw"))


def test_loads_in_several_threads_at_once_are_all_correct(tiny_models):
    """transformers' loader changes process-wide state; the engine serializes loads."""
    import threading

    requests = [LoadRequest(str(tiny_models[arch]), precision, "cpu")
                for arch, precision in (("llama", "fp32"), ("qwen2", "int8"), ("gemma2", "nf4"), ("gpt2", "bf16"))]
    expected = [load_model(r).info.weights_bytes for r in requests]
    results, stages = [None] * len(requests), []

    def load(i):
        results[i] = load_model(requests[i], progress=lambda e: stages.append(e.stage))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.info.weights_bytes for r in results] == expected
    for loaded in results:
        tokens = [e for e in generate(loaded, GenerationRequest("fox", mode="raw", max_new_tokens=3, ignore_eos=True))
                  if isinstance(e, TokenGenerated)]
        assert len(tokens) == 3
    assert "queued" in stages


def test_a_model_without_a_chat_template_gets_its_familys_and_says_so(tmp_path, byte_tokenizer):
    """A Gemma whose tokenizer lost its chat template (as some GGUFs have) answers chat requests
    in Gemma's turn format, and the load says the template was recognised; a model whose family
    can't be told keeps none, and chat requests say to use raw mode."""
    import copy

    from engine.base.errors import InvalidRequestError
    from engine.base.request import GenerationRequest
    from engine.models.loading import LoadRequest, load_model
    from engine.models.templates import recognise
    from tests.tiny import build_model_folder

    tokenizer = copy.deepcopy(byte_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = None
    folder = build_model_folder(tmp_path / "gemma", "gemma2", tokenizer)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    assert loaded.info.has_chat_template and loaded.info.chat_template.startswith("Gemma's, recognised")
    ids = loaded.encode(GenerationRequest("Hello there", system_prompt="Be brief."))
    text = loaded.tokenizer.decode(ids)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n<start_of_turn>model\n")
    assert recognise("gemma2", {"<|im_start|>": 1}) is None  # the architecture alone is not enough

    phi = copy.deepcopy(byte_tokenizer)
    phi.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]})
    phi.chat_template = None
    loaded = load_model(LoadRequest(str(build_model_folder(tmp_path / "phi3", "phi3", phi)), "fp32", "cpu"))
    assert loaded.info.chat_template.startswith("Phi-3's, recognised")
    text = loaded.tokenizer.decode(loaded.encode(GenerationRequest("Hello there", system_prompt="Be brief.")))
    assert text.endswith("<|system|>\nBe brief.<|end|>\n<|user|>\nHello there<|end|>\n<|assistant|>\n")

    plain = copy.deepcopy(byte_tokenizer)
    plain.chat_template = None
    folder = build_model_folder(tmp_path / "gpt2", "gpt2", plain)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    assert not loaded.info.has_chat_template and loaded.info.chat_template.startswith("none")
    with pytest.raises(InvalidRequestError, match="raw mode"):
        loaded.encode(GenerationRequest("Hello there"))
