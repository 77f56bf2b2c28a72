"""What you see is what runs, in the engine: non-finite scores stop a run with a clear message,
precisions the model can't take are refused from its header before any conversion, and a
load that would not fit beside the current model is recognised."""

import shutil

import pytest
import torch

from engine.storage import history
from engine.base.errors import NonFiniteError, UnsupportedPrecisionError
from engine.base.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from tests.tiny import write_gguf
from engine.generation.generate import generate

PROMPT = "The quick brown fox"


def _nan_after(tiny_llama, tmp_path, steps: int):
    """A copy of the tiny llama whose embedding of its ``steps``-th greedy answer token is NaN:
    the first ``steps`` tokens come out as before, then every score is NaN."""
    from safetensors.torch import load_file, save_file

    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=8, ignore_eos=True)
    answer = [e.token_id for e in generate(loaded, request) if isinstance(e, TokenGenerated)]
    prompt = set(loaded.encode(request))
    token = answer[steps - 1]
    assert token not in prompt and token not in answer[: steps - 1], "pick another prompt: the token repeats"
    folder = tmp_path / "nan-llama"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name][token] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, request, answer[:steps]


def test_non_finite_scores_stop_the_run_and_keep_it(tiny_llama, tmp_path):
    folder, request, before = _nan_after(tiny_llama, tmp_path, steps=3)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    seen = []
    with pytest.raises(NonFiniteError) as caught:
        for event in generate(loaded, request):
            seen.append(event)
    message = str(caught.value)
    assert "fp32" in message and "NaN" in message and "token 4" in message and "try" in message
    partial = caught.value.finished
    assert partial.reason == "error" and partial.tokens == 3
    assert list(partial.token_ids) == before  # the finite part is the normal answer, kept
    assert [e.token_id for e in seen if isinstance(e, TokenGenerated)] == before
    # the kept run can go into the history, marked failed
    record = history.record_from(loaded.info, partial, "single", error=message)
    assert record.tokens == 3 and record.extra["error"] == message


def test_sampling_from_non_finite_scores_says_why(tiny_llama, tmp_path):
    """The check comes before the sampler, which would otherwise fail on NaN without a reason."""
    from engine.base.sampling import SamplingParams

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-norm"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    weights[next(k for k in weights if k.endswith("model.norm.weight"))][0] = float("nan")  # every score NaN
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    sampled = GenerationRequest(PROMPT, mode="raw", max_new_tokens=4, sampling=SamplingParams(temperature=0.8, seed=1))
    with pytest.raises(NonFiniteError, match="NaN") as caught:
        list(generate(loaded, sampled))
    assert caught.value.finished.tokens == 0


def test_batched_and_sweep_paths_refuse_non_finite_scores(tiny_llama, tmp_path):
    from engine.measure.batch import stream_batch

    folder, request, _ = _nan_after(tiny_llama, tmp_path, steps=2)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    prompt = loaded.encode(request)
    with pytest.raises(NonFiniteError, match="fp32"):
        list(stream_batch(loaded, request, [prompt, prompt]))


@pytest.mark.parametrize("precision", ["int8-fast", "int4-fast", "fp32-fast", "bf16-fast"])
def test_fast_precision_refused_from_the_gguf_header_before_converting(tmp_path, isolated_cache, precision):
    from engine.models.gguf_files import converted_dir_for

    path = write_gguf(tmp_path / "tiny-gemma.gguf", "gemma")
    stages = []
    with pytest.raises(UnsupportedPrecisionError, match="not gemma") as caught:
        load_model(LoadRequest(str(path), precision, "cpu"), progress=lambda e: stages.append(e.stage))
    assert "fp32, bf16, int8 or nf4" in str(caught.value)
    assert "convert" not in stages and not converted_dir_for(path).exists()


def test_fast_precision_refused_from_the_config_before_reading_weights(tiny_models, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_models["gpt2"], folder)
    (folder / "model.safetensors").write_bytes(b"not weights")  # never read: refused before
    with pytest.raises(UnsupportedPrecisionError, match="gpt2"):
        load_model(LoadRequest(str(folder), "int8-fast", "cpu"))


def test_a_load_that_does_not_fit_beside_the_current_model(tiny_llama, monkeypatch):
    from engine.estimates import estimate

    assert estimate.fits_beside_loaded(str(tiny_llama), "fp32", "cpu")
    monkeypatch.setattr(estimate, "available_bytes", lambda device: 1024)
    assert not estimate.fits_beside_loaded(str(tiny_llama), "fp32", "cpu")


def test_closing_a_model_frees_it(tiny_llama):
    import gc
    import weakref

    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    model = weakref.ref(loaded.model)
    loaded.close()
    gc.collect()
    assert model() is None and loaded.model is None


def test_history_series_keep_every_token(loaded_llama):
    events = list(generate(loaded_llama, GenerationRequest(PROMPT, mode="raw", max_new_tokens=6, ignore_eos=True)))
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    series = history.series_from(tokens)
    assert series["latency_s"] == [t.latency_s for t in tokens]
    assert series["kv_bytes"] == [t.kv_cache_bytes for t in tokens]
    assert "device_allocated" not in series  # absent on the CPU: left out, not zeros
    assert all(torch.isfinite(torch.tensor(series["latency_s"])))
