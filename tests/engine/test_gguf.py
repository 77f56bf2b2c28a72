import pytest

from engine.base.errors import CorruptModelError, ModelNotFoundError
from engine.models.gguf_files import gguf_architecture, summarize_gguf
from engine.models.loading import LoadRequest, load_model
from tests.tiny import write_gguf


@pytest.fixture
def small_gguf(tmp_path):
    return write_gguf(tmp_path / "small.gguf")


def test_summary_of_a_good_file(small_gguf):
    summary = summarize_gguf(small_gguf)
    assert (summary.architecture, summary.name, summary.file_type) == ("llama", "small", "ALL_F32")
    assert summary.tensor_types == {"F32": 2}


@pytest.mark.parametrize("keep", [100, 0.6])
def test_truncated_gguf_is_refused(tmp_path, small_gguf, keep):
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        summarize_gguf(cut)
    cut.write_bytes(data[:30])  # cut inside the architecture's key: the header read alone refuses it too
    with pytest.raises(CorruptModelError, match="truncated"):
        gguf_architecture(cut)


@pytest.mark.parametrize("read", [summarize_gguf, gguf_architecture])
def test_not_a_gguf(tmp_path, read):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(CorruptModelError, match="not a GGUF"):
        read(fake)


@pytest.mark.parametrize("read", [summarize_gguf, gguf_architecture])
def test_gguf_header_with_garbage(tmp_path, read):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(CorruptModelError, match="bad.gguf"):
        read(bad)


def big_vocabulary_gguf(path, arch):
    """A header as a real model's: arrays (a tokenizer's strings, its scores) and numbers, here
    before the architecture, so reading up to it skips every kind of value."""
    def more(writer):
        architecture = writer.kv_data[0].pop("general.architecture")
        writer.add_uint32("test.count", 7)
        writer.add_array("test.nested", [[1, 2], [3]])
        writer.add_token_list([f"tok{i}" for i in range(20_000)])
        writer.add_token_scores([0.5] * 1000)
        writer.kv_data[0]["general.architecture"] = architecture
    return write_gguf(path, arch, "big", more)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_the_architecture_is_read_from_the_header_alone(tmp_path, arch):
    path = big_vocabulary_gguf(tmp_path / "big.gguf", arch)
    assert gguf_architecture(path) == summarize_gguf(path).architecture == arch


def test_a_fast_precision_for_an_unsupported_gguf_is_refused_before_the_imports(tmp_path, monkeypatch):
    """Refusing int8-fast for a Gemma (1) GGUF took seconds: torch and transformers imported, then
    the whole 256k-token header parsed, for one string."""
    import gguf

    from engine.base.errors import UnsupportedPrecisionError

    path = big_vocabulary_gguf(tmp_path / "gemma.gguf", "gemma")
    monkeypatch.setattr(gguf, "GGUFReader", None)  # the full reader is not needed for this
    stages = []
    with pytest.raises(UnsupportedPrecisionError,
                       match="fast path runs llama, qwen2, qwen3, smollm3, phi3, mistral, gemma2, gemma3 models, not gemma\\."):
        load_model(LoadRequest(str(path), "int8-fast", "cpu"), progress=lambda e: stages.append(e.stage))
    assert "imports" not in stages


def test_loading_a_corrupt_gguf_says_so_and_leaves_no_cache(tmp_path, isolated_cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CorruptModelError, match="broken.gguf"):
        load_model(LoadRequest(str(bad), "fp32", "cpu"))
    converted = isolated_cache / "converted"
    assert not converted.exists() or not any(converted.iterdir())


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelNotFoundError):
        summarize_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("outcome", ["the other finishes", "cancelled while waiting"])
def test_a_conversion_waits_for_another_into_the_same_folder(small_gguf, isolated_cache, monkeypatch, outcome):
    """Two processes converting one GGUF at once (two windows opened on a first run, two test
    workers): the second waits on the folder's lock file, saying so, instead of removing the
    first's work in progress as a killed conversion's; it then takes the first's result without
    converting again, or stops at once when cancelled while it waits."""
    import threading

    from filelock import FileLock

    from engine.base.cancel import CancelToken
    from engine.base.errors import CancelledError
    from engine.models import gguf_files
    from engine.base.progress import ProgressReporter

    out_dir = isolated_cache / "converted" / "small"
    out_dir.parent.mkdir(parents=True)
    other = out_dir.parent / ".small.tmp-1"  # the other process's conversion under way
    other.mkdir()
    monkeypatch.setattr(gguf_files, "_convert", lambda *a: pytest.fail("converted again"))
    waiting, cancel, result = threading.Event(), CancelToken(), []

    def seen(progress):
        if progress.message.startswith("Waiting for another process"):
            waiting.set()

    def convert():
        try:
            result.append(gguf_files.convert_gguf(small_gguf, out_dir, ProgressReporter(seen, cancel)))
        except CancelledError as exc:
            result.append(exc)

    lock = FileLock(str(out_dir.parent / ".small.lock"))
    with lock:
        thread = threading.Thread(target=convert)
        thread.start()
        assert waiting.wait(30)
        assert other.is_dir()  # not taken for a killed conversion's
        if outcome == "cancelled while waiting":
            cancel.cancel()
            thread.join(30)
            assert isinstance(result[0], CancelledError) and not out_dir.exists()
            return
        other.rename(out_dir)  # the other process finishes
        (out_dir / gguf_files.PROVENANCE).write_text("{}")
        (out_dir / "config.json").write_text("{}")
    thread.join(30)
    assert result == [out_dir] and gguf_files.is_converted(out_dir)


@pytest.mark.parametrize("arch,supplied", [("qwen3", "head_dim 24 (attention.key_length)"),
                                           ("phi3", "partial_rotary_factor 12/16 (rope.dimension_count)"),
                                           ("gemma3", "query_pre_attn_scalar 16 (llama.cpp's rule)"),
                                           ("gemma2", "query_pre_attn_scalar 16 (llama.cpp's rule)")])
def test_a_gguf_of_a_fast_path_architecture_loads_as_its_original_and_runs_fast(
        tmp_path, default_model_folder, default_gguf, isolated_cache, arch, supplied):
    """A Qwen3 (heads 24 wide where hidden ÷ heads is 16), a Phi-3 (the rotary embedding on 12 of
    each head's 16), a Gemma 3 (norms kept as 1 + w, local and global layers) and a Gemma 2
    (soft-capped scores and logits) written as
    llama.cpp writes them: transformers' GGUF reading misses the head width, the rotary share and
    Gemma's query scale, the conversion supplies them from the header or llama.cpp's rule (and
    keeps in words that it did), and the GGUF answers as the original does, on the reference and
    the fast path. (The same prompt ids for each: transformers reads a Gemma GGUF's vocabulary as
    a Gemma tokenizer, and this one carries the default model's.)"""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from engine.base.request import GenerationRequest
    from engine.base.events import Finished
    from engine.generation.core import CoreSettings, EngineCore
    from engine.models.gguf_files import PROVENANCE
    from tests.tiny import build_model_folder, write_model_gguf

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    # (llama.cpp's Gemma 2 has no head of its own: the embedding's)
    overrides = {"qwen3": {"head_dim": 24}, "gemma2": {"tie_word_embeddings": True}}.get(arch, {})
    folder = build_model_folder(tmp_path / arch, arch, tokenizer, vocab_size=len(tokenizer), **overrides)
    path = write_model_gguf(tmp_path / f"{arch}.gguf", folder, arch, default_gguf)
    request = GenerationRequest("(given as ids)", mode="raw", max_new_tokens=12, ignore_eos=True)
    ids = tokenizer("The quick brown fox")["input_ids"]

    def answer(model: str, precision: str) -> tuple:
        loaded = load_model(LoadRequest(model, precision, "cpu"))
        core = EngineCore(loaded, CoreSettings())
        core.submit(request, prompt_ids=ids)
        return next(e for e in core.run() if isinstance(e, Finished)).token_ids, loaded

    original, _ = answer(str(folder), "fp32")
    converted, loaded = answer(str(path), "fp32")
    assert converted == original
    said = json.loads((Path(loaded.info.path) / PROVENANCE).read_text()).get("supplied", [])
    assert supplied in said if supplied else not said
    assert answer(str(path), "fp32-fast")[0] == original
