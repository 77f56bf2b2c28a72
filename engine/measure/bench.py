"""Run one generation and gather everything it measured into the bench JSON contract.

The CLI, benchmarks and tests consume this; the keys are documented in docs/cli.md.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from dataclasses import asdict
from importlib import metadata

import engine
from engine.base.cancel import CancelToken
from engine.base.events import EndpointAnswered, GenerationEvent, Loaded, ServerSampled
from engine.models.model import LoadedModel
from engine.base.request import GenerationRequest
from engine.runs import Run
from engine.generation.generate import generate

_PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "gguf", "safetensors",
             "huggingface_hub", "tokenizers", "numpy", "psutil")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"inference_workbench": engine.__version__,
                                    "python": sys.version.split()[0], "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def measure(events, weights_bytes: int | None = None,
            on_event: Callable[[GenerationEvent], None] | None = None) -> Run:
    """Consume a generation's events into a :class:`Run`, passing each to ``on_event``."""
    measured = Run(weights_bytes)
    for event in events:
        if on_event is not None:
            on_event(event)
        measured.extend([event])
    assert measured.finished is not None, "the stream always ends with Finished"
    return measured


def run(loaded: LoadedModel, request: GenerationRequest, cancel: CancelToken | None = None,
        on_event: Callable[[GenerationEvent], None] | None = None) -> dict:
    """Generate, passing each event to ``on_event``; return the bench report."""
    return report(loaded.info, request, measure(generate(loaded, request, cancel), loaded.info.weights_bytes, on_event))


def report(info: Loaded, request: GenerationRequest, measured: Run) -> dict:
    """The bench JSON of one finished run of ``info``'s model."""
    prefilled, tokens, finished = measured.prefilled, measured.tokens, measured.finished
    finished_fields = {k: v for k, v in asdict(finished).items() if k not in ("token_ids", "text")}
    return {
        "model": info.name,
        "model_ref": info.path if info.source != "default" else "default",
        "source": info.source,
        "original_format": info.original_format,
        "precision": info.precision,
        "device": info.device,
        "device_name": info.device_name,
        "parameters": info.parameters,
        "weights_bytes": info.weights_bytes,
        "load_s": info.load_s,
        "prompt_tokens": finished.prompt_tokens,
        "tokens": finished.tokens,
        "tokens_counted_by": counted_by(measured),
        "token_ids": list(finished.token_ids),
        "text": finished.text,
        "finish_reason": finished.reason,
        "stop_string": finished.stop_string,
        "ttft_s": finished.ttft_s,
        "prefill_s": prefilled.prefill_s if prefilled else None,
        "prefill_tokens_per_s": prefilled.prefill_tokens_per_s if prefilled else None,
        "decode_s": finished.decode_s,
        "decode_tokens_per_s": finished.decode_tokens_per_s,
        "total_s": finished.total_s,
        "per_token_latency_s": [t.latency_s for t in tokens],
        "elapsed_s_series": [t.elapsed_s for t in tokens],
        "logprobs": [t.logprob for t in tokens],
        "kv_cache_bytes": finished.kv_cache_bytes,
        "kv_cache_bytes_predicted": finished.kv_cache_bytes_predicted,
        "kv_cache_bytes_series": [t.kv_cache_bytes for t in tokens],
        "kv_cache_bytes_predicted_series": [t.kv_cache_bytes_predicted for t in tokens],
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "kv_dtype": info.kv_dtype,
        "rss_bytes_series": [t.memory.rss_bytes for t in tokens],
        "device_allocated_bytes_series": [t.memory.device_allocated_bytes for t in tokens],
        "peak_memory_bytes": finished.peak_memory_bytes,
        "peak_rss_bytes": finished.peak_rss_bytes,
        "request": {
            "mode": request.mode,
            "system_prompt": request.system_prompt,
            "max_new_tokens": request.max_new_tokens,
            "stop": list(request.stop),
            "ignore_eos": request.ignore_eos,
            "sampling": asdict(request.sampling),
        },
        "loaded": asdict(info),
        "finished": finished_fields,
        **_served(measured),
        "versions": versions(),
    }


def counted_by(measured: Run) -> str:
    """How the answer's tokens were counted: ``token ids`` (generated here), or for a served model
    ``logprobs`` or ``usage per chunk`` (per token, from its stream), ``usage`` (only its final
    total: its chunks, which may carry several tokens each, name no ids) or ``chunks`` (no usage
    either: a chunk counted as one token)."""
    answered = next((e for e in measured.events if isinstance(e, EndpointAnswered)), None)
    if answered is None:
        return "token ids"
    if answered.counted_by == "chunks" and answered.usage_completion_tokens == measured.finished.tokens:
        return "usage"
    return answered.counted_by


def _served(measured: Run) -> dict:
    """A served model's answer: how its tokens were counted, and what the server said meanwhile."""
    answered = next((e for e in measured.events if isinstance(e, EndpointAnswered)), None)
    if answered is None:
        return {}
    return {"endpoint": {**asdict(answered),
                         "server_samples": [asdict(e) for e in measured.events if isinstance(e, ServerSampled)]}}
