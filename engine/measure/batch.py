"""Batched decoding: B prompts through the model together, one forward pass per step for all.

Why batching pays: at batch 1 each decode step reads every weight once to make one token;
at batch B the same read makes B tokens, so until compute runs out the aggregate tok/s
grows almost B-fold while each request's own speed barely drops. The cost is memory: each
sequence has its own KV cache.

Every prompt is a request of the model's engine service (engine/generation/service.py), all
submitted together and stepped here, one step a turn: the core reads the prompts, then decodes one
token for every sequence per step in one forward pass (the fast path's paged cache, or transformers'
forward over a left-padded batched cache), so each sequence's greedy tokens equal those of running
it alone. A finished sequence (end of sequence, stop string, its own limit) leaves the batch and its
cache is freed at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError, InvalidRequestError, OutOfMemoryError, is_out_of_memory
from engine.base.events import (BatchEvent, BatchFinished, BatchStep, Finished, SequenceResult, StepCompleted,
                                TokenGenerated)
from engine.base.memory import MemoryProbe
from engine.base.request import GenerationRequest
from engine.generation.core import CoreSettings
from engine.generation.service import EngineService, Ticket, failure

if TYPE_CHECKING:
    from engine.models.model import LoadedModel


def stream_batch(loaded: "LoadedModel", request: GenerationRequest, prompts: list[list[int]],
                 cancel: CancelToken | None = None, service: EngineService | None = None) -> Iterator[BatchEvent]:
    """Generate for every prompt in ``prompts`` (token ids) at once; sampling, limits and stop
    strings of ``request`` apply to each sequence on its own (its prompt text is not used).
    ``service``: the model's own engine service (idle), lent for the batch; ``None``: one of its own."""
    if not prompts or any(not p for p in prompts):
        raise InvalidRequestError("A batch needs at least one prompt, and no prompt may be empty.")
    if loaded.model is None:
        raise EngineError("This model was unloaded: load it again to generate.")
    request = request.validated()
    out_of_memory = (f"Out of memory on {loaded.device} at batch {len(prompts)}: every sequence has its own KV "
                     "cache; use a smaller batch, fewer tokens or a smaller precision.")
    try:
        yield from _run_on_service(loaded, request, [list(p) for p in prompts], cancel or CancelToken(), service)
    except OutOfMemoryError as exc:  # the service's words are for every request in flight: the batch's
        raise OutOfMemoryError(out_of_memory) from exc
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(out_of_memory) from exc
        raise EngineError(f"Batched generation failed: {type(exc).__name__}: {exc}") from exc


def _run_on_service(loaded: "LoadedModel", request: GenerationRequest, prompts: list[list[int]],
                    cancel: CancelToken, service: EngineService | None) -> Iterator[BatchEvent]:
    """The batch through an engine service (its core's runner decodes all rows in one step):
    every prompt a request, all read in the first step, then one step per token, no KV budget
    (the sweep checks memory before), no prefix cache (every row computes its prompt, as a batch
    of different prompts would). A sequence that ends leaves the batch (its cache freed); the
    batch's figures are those of its fullest step."""

    batch = len(prompts)
    settings = CoreSettings(token_budget=sum(len(p) for p in prompts) + batch, max_batch=batch,
                            prefill_chunk=max(len(p) for p in prompts))
    if service is None:
        yield from _batch(EngineService(loaded, settings), request, prompts, cancel)
        return
    with service.borrowed(settings):
        yield from _batch(service, request, prompts, cancel)


def _batch(service: EngineService, request: GenerationRequest, prompts: list[list[int]],
           cancel: CancelToken) -> Iterator[BatchEvent]:
    batch = len(prompts)
    start = time.perf_counter()
    service.core.probe.reset_peak()
    service.core.upkeep.memory(fresh=True)  # the first step's memory sample after the reset
    # a batch shows each step's tokens, never their alternatives: not worked out (at 16 rows, 16
    # cold passes over a step's scores, a visible share of a quantized step)
    request = replace(request, reuse_prefix=False, top_alternatives=0)
    arrived: list[tuple[int, object]] = []  # (row, event), as the service hands them over
    # each row its own cancel token (one failing row ends alone), the batch's cancel passed to all
    tickets = [service.submit(Ticket(request, lambda event, row=i: arrived.append((row, event)), prompt_ids=prompt,
                                     token_texts=False)) for i, prompt in enumerate(prompts)]
    finals: dict[int, Finished] = {}
    latencies: list[float] = []
    fullest = watched = None
    watched_tokens: dict[int, float] = {}  # each row's own time for its token of the watched step
    while not all(t.ended for t in tickets):
        # the first decode step, every row in it: its activations read from the allocator (and
        # its time left out of the decode figures, as the watch slows it on the CPU)
        if cancel.cancelled:
            for ticket in tickets:
                ticket.abort()
        step = service.turn(watch=len(latencies) == 1)
        if step is None and not arrived and not all(t.ended for t in tickets):
            raise EngineError("The engine service lost requests of this batch.")
        ids: list[int | None] = [None] * batch
        texts = [""] * batch
        step_tokens: dict[int, float] = {}
        for row, event in arrived:
            error = failure(event)
            if error is not None:
                raise error
            if isinstance(event, TokenGenerated):
                ids[row], texts[row] = event.token_id, event.text
                step_tokens[row] = event.latency_s
            elif isinstance(event, Finished):
                finals[row] = event
        arrived.clear()
        if step is None:
            continue
        latencies.append(step.step_s)
        if step.activation_bytes is not None:
            watched, watched_tokens = step, step_tokens
        if fullest is None or step.kv_cache_bytes >= fullest.kv_cache_bytes:
            fullest = step
        yield BatchStep(step=step.step, token_ids=tuple(ids), texts=tuple(texts), latency_s=step.step_s,
                        elapsed_s=time.perf_counter() - start, active=step.batch, kv_cache_bytes=step.kv_cache_bytes,
                        kv_cache_bytes_predicted=step.kv_cache_bytes_predicted, memory=step.memory)
    results = tuple(SequenceResult(
        index=i, reason=f.reason, tokens=f.tokens, prompt_tokens=f.prompt_tokens, ttft_s=f.ttft_s,
        mean_token_latency_s=_per_token(f, watched_tokens.get(i)), token_ids=f.token_ids,
        text=f.text) for i, f in sorted(finals.items()))
    yield _batch_finished(results, latencies[0] if latencies else 0.0, latencies, start, service.core.probe,
                          fullest.kv_cache_bytes if fullest else 0,
                          fullest.kv_cache_bytes_predicted if fullest else 0,
                          any(r.reason == "cancelled" for r in results), watched)


def _per_token(finished: Finished, left_out: float | None) -> float | None:
    """A sequence's mean decode-step time, its token of the watched step left out (``left_out``:
    that token's own time, as the sequence counted it; the step's wall time runs on after its
    tokens are timed, and on a busy machine that tail can outweigh a small model's other steps)."""
    steps = finished.tokens - 1 - (1 if left_out is not None else 0)
    return (finished.decode_s - (left_out or 0.0)) / steps if steps > 0 else None


def _batch_finished(results: tuple[SequenceResult, ...], prefill_s: float, step_latencies: list[float],
                    start: float, probe: MemoryProbe, kv: int, kv_predicted: int | None,
                    cancelled: bool, watched: StepCompleted | None = None) -> BatchFinished:
    """A batch's totals from its sequences and step times (the first step reads the prompts;
    ``watched``, the step whose activations were read, is left out of the decode figures)."""
    decode_s = sum(step_latencies[1:]) - (watched.step_s if watched else 0.0)
    decode_tokens = sum(max(0, r.tokens - 1) for r in results) - (watched.decode_tokens if watched else 0)
    generated = sum(r.tokens for r in results)
    total = time.perf_counter() - start
    peak_device = probe.peak_device()
    return BatchFinished(
        batch=len(results), sequences=results, prefill_s=prefill_s, total_s=total, generated_tokens=generated,
        aggregate_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
        end_to_end_tokens_per_s=generated / total if generated and total > 0 else None,
        mean_ttft_s=_mean([r.ttft_s for r in results if r.ttft_s is not None]),
        mean_per_token_latency_s=_mean([r.mean_token_latency_s for r in results
                                        if r.mean_token_latency_s is not None]),
        peak_memory_bytes=peak_device if peak_device is not None else probe.peak_rss,
        peak_rss_bytes=probe.peak_rss, kv_cache_bytes=kv, kv_cache_bytes_predicted=kv_predicted,
        cancelled=cancelled, activation_bytes=watched.activation_bytes if watched else None,
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
