"""Batched decoding: B prompts through the model together, one forward pass per step for all.

Why batching pays: at batch 1 each decode step reads every weight once to make one token;
at batch B the same read makes B tokens, so until compute runs out the aggregate tok/s
grows almost B-fold while each request's own speed barely drops. The cost is memory: each
sequence has its own KV cache.

Prompts of different lengths are left-padded to one length; the attention mask hides the
pads and the positions count only real tokens (as ``model.generate`` does), so each
sequence's greedy tokens equal those of running it alone. A finished sequence (end of
sequence, stop string, its own limit) keeps a row in the batch, fed padding, until all end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.cancel import CancelToken
from engine.decoding import PREFILL_CHUNK, stop_reason
from engine.detokenize import IncrementalDetokenizer
from engine.errors import (
    EngineError,
    InvalidRequestError,
    NonFiniteError,
    OutOfMemoryError,
    is_out_of_memory,
    non_finite_message,
)
from engine.events import (
    BatchEvent,
    BatchFinished,
    BatchStep,
    Finished,
    SequenceResult,
    StepCompleted,
    TokenGenerated,
)
from engine.kv import cache_bytes
from engine.memory import MemoryProbe
from engine.request import GenerationRequest
from engine.sampling import make_sampler
from engine.threads import adapt as adapt_threads

if TYPE_CHECKING:
    from engine.model import LoadedModel


_NEVER = CancelToken()
"""Never cancelled: batches check their own cancel token between steps."""


def stream_batch(loaded: "LoadedModel", request: GenerationRequest, prompts: list[list[int]],
                 cancel: CancelToken | None = None) -> Iterator[BatchEvent]:
    """Generate for every prompt in ``prompts`` (token ids) at once; sampling, limits and stop
    strings of ``request`` apply to each sequence on its own (its prompt text is not used)."""
    if not prompts or any(not p for p in prompts):
        raise InvalidRequestError("A batch needs at least one prompt, and no prompt may be empty.")
    if loaded.model is None:
        raise EngineError("This model was unloaded: load it again to generate.")
    request = request.validated()
    run = _run_on_core if loaded.fast is not None else _run
    try:
        yield from run(loaded, request, [list(p) for p in prompts], cancel or CancelToken())
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(
                f"Out of memory on {loaded.device} at batch {len(prompts)}: every sequence has its own KV "
                "cache; use a smaller batch, fewer tokens or a smaller precision.") from exc
        raise EngineError(f"Batched generation failed: {type(exc).__name__}: {exc}") from exc


class _Sequence:
    def __init__(self, index: int, prompt: list[int], loaded, request: GenerationRequest, device) -> None:
        import torch

        self.index = index
        self.prompt_tokens = len(prompt)
        self.seen = torch.tensor(prompt, dtype=torch.long, device=device)
        self.sampler = make_sampler(request.sampling, device)  # each its own generator, seeded alike
        self.detok = IncrementalDetokenizer(loaded.tokenizer)
        self.tokens: list[int] = []
        self.latencies: list[float] = []
        self.reason: str | None = None

    def result(self) -> SequenceResult:
        decode = self.latencies[1:]
        return SequenceResult(
            index=self.index, reason=self.reason or "cancelled", tokens=len(self.tokens),
            prompt_tokens=self.prompt_tokens, ttft_s=self.latencies[0] if self.latencies else None,
            mean_token_latency_s=sum(decode) / len(decode) if decode else None,
            token_ids=tuple(self.tokens), text=self.detok.text,
        )


def _run_on_core(loaded: "LoadedModel", request: GenerationRequest, prompts: list[list[int]],
                 cancel: CancelToken) -> Iterator[BatchEvent]:
    """A fast-path batch through the engine core (its slot cache decodes all rows in one step):
    every prompt a request, all read in the first step as the reference batch reads them
    together, then one step per token. A sequence that ends leaves the batch (its cache freed);
    the batch's figures are those of its fullest step."""
    from engine.core import CoreSettings, EngineCore

    batch = len(prompts)
    core = EngineCore(loaded, CoreSettings(token_budget=sum(len(p) for p in prompts) + batch, max_batch=batch,
                                           prefill_chunk=max(len(p) for p in prompts)))
    rows = {core.submit(request, cancel, prompt): i for i, prompt in enumerate(prompts)}
    finals: dict[int, Finished] = {}
    latencies: list[float] = []
    fullest = None
    while not core.idle:
        ids: list[int | None] = [None] * batch
        texts = [""] * batch
        for event in core.step():
            if isinstance(event, TokenGenerated):
                ids[rows[event.request_id]], texts[rows[event.request_id]] = event.token_id, event.text
            elif isinstance(event, Finished):
                if event.reason == "error":
                    raise NonFiniteError(event.error)
                finals[rows[event.request_id]] = event
            elif isinstance(event, StepCompleted):
                step = event
        latencies.append(step.step_s)
        if fullest is None or step.kv_cache_bytes >= fullest.kv_cache_bytes:
            fullest = step
        yield BatchStep(step=step.step, token_ids=tuple(ids), texts=tuple(texts), latency_s=step.step_s,
                        elapsed_s=step.elapsed_s, active=step.batch, kv_cache_bytes=step.kv_cache_bytes,
                        kv_cache_bytes_predicted=step.kv_cache_bytes_predicted, memory=step.memory)
    results = tuple(SequenceResult(
        index=i, reason=f.reason, tokens=f.tokens, prompt_tokens=f.prompt_tokens, ttft_s=f.ttft_s,
        mean_token_latency_s=f.decode_s / (f.tokens - 1) if f.tokens > 1 else None, token_ids=f.token_ids,
        text=f.text) for i, f in sorted(finals.items()))
    yield _batch_finished(results, latencies[0] if latencies else 0.0, latencies, core.start, core.probe,
                          fullest.kv_cache_bytes if fullest else 0,
                          fullest.kv_cache_bytes_predicted if fullest else 0,
                          any(r.reason == "cancelled" for r in results))


def _batch_finished(results: tuple[SequenceResult, ...], prefill_s: float, step_latencies: list[float],
                    start: float, probe: MemoryProbe, kv: int, kv_predicted: int | None,
                    cancelled: bool) -> BatchFinished:
    """A batch's totals from its sequences and step times (the first step reads the prompts)."""
    decode_s = sum(step_latencies[1:])
    decode_tokens = sum(max(0, r.tokens - 1) for r in results)
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
        cancelled=cancelled,
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _run(loaded: "LoadedModel", request: GenerationRequest, prompts: list[list[int]],
         cancel: CancelToken) -> Iterator[BatchEvent]:
    import torch
    from transformers import DynamicCache

    model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
    context = loaded.info.context_length
    eos = frozenset() if request.ignore_eos else loaded.eos_ids
    keep = {"logits_to_keep": 1} if loaded.supports_logits_to_keep else {}
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = next(iter(sorted(loaded.eos_ids)), 0)
    plain_greedy = request.sampling.greedy and request.sampling.repetition_penalty == 1.0
    batch, width = len(prompts), max(len(p) for p in prompts)
    if context is not None and width >= context:
        raise InvalidRequestError(f"A prompt of {width:,} tokens leaves no room in the {context:,}-token context.")
    sequences = [_Sequence(i, p, loaded, request, device) for i, p in enumerate(prompts)]

    ids = torch.full((batch, width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    adapt_threads(force=True)
    probe = MemoryProbe(device)
    probe.reset_peak()
    probe.sample()
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    steps = 0
    prefill_s = 0.0
    step_latencies: list[float] = []

    def finished(kv: int, in_cache: int, cancelled: bool) -> BatchFinished:
        for seq in sequences:
            if seq.reason is None:
                seq.reason = "cancelled"
        return _batch_finished(tuple(seq.result() for seq in sequences), prefill_s, step_latencies, start, probe,
                               kv, loaded.predicted_kv_bytes(in_cache, batch), cancelled)

    for chunk in range(0, width, PREFILL_CHUNK):
        if cancel.cancelled:
            yield finished(cache_bytes(cache), chunk, True)
            return
        end = chunk + PREFILL_CHUNK
        with torch.inference_mode():
            out = model(input_ids=ids[:, chunk:end], attention_mask=mask[:, :end], position_ids=positions[:, chunk:end],
                        cache=cache, use_cache=True, **keep)
    prefill_s = time.perf_counter() - start
    step_start = start
    next_positions = positions[:, -1:] + 1

    while True:
        adapt_threads()
        with torch.inference_mode():
            scores = out.logits[:, -1].float()
            if not bool(torch.isfinite(scores).all()):
                raise NonFiniteError(non_finite_message(loaded.info.precision, loaded.info.name, steps))
            if plain_greedy:
                picked = scores.argmax(dim=-1).tolist()
            else:
                picked = [seq.sampler(scores[seq.index], seq.seen) if seq.reason is None else pad
                          for seq in sequences]
        chosen: list[int | None] = []
        texts: list[str] = []
        for seq, token in zip(sequences, picked):
            if seq.reason is not None:
                chosen.append(None)
                texts.append("")
                continue
            seq.tokens.append(token)
            if not plain_greedy or request.sampling.repetition_penalty != 1.0:
                seq.seen = torch.cat([seq.seen, torch.tensor([token], device=device)])
            piece = seq.detok.add(token)
            # the single-sequence rule; cancel is the batch's, checked once per step below
            seq.reason, _ = stop_reason(token, piece, seq.detok.text, request, eos, len(seq.tokens),
                                        seq.prompt_tokens + len(seq.tokens), context, _NEVER)
            if seq.reason is not None:
                piece += seq.detok.flush()
            chosen.append(token)
            texts.append(piece)
        in_cache = width + steps
        now = time.perf_counter()
        latency = now - step_start
        step_latencies.append(latency)
        for seq, token in zip(sequences, chosen):
            if token is not None:
                seq.latencies.append(latency)
        kv = cache_bytes(cache)
        active = sum(token is not None for token in chosen)
        yield BatchStep(step=steps, token_ids=tuple(chosen), texts=tuple(texts), latency_s=latency,
                        elapsed_s=now - start, active=active, kv_cache_bytes=kv,
                        kv_cache_bytes_predicted=loaded.predicted_kv_bytes(in_cache, batch), memory=probe.sample())
        steps += 1
        if all(seq.reason is not None for seq in sequences) or cancel.cancelled:
            yield finished(kv, in_cache, cancel.cancelled and any(seq.reason is None for seq in sequences))
            return
        step_start = time.perf_counter()
        feed = torch.tensor([[token if token is not None else pad] for token in chosen], dtype=torch.long,
                            device=device)
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
        with torch.inference_mode():
            out = model(input_ids=feed, attention_mask=mask, position_ids=next_positions, cache=cache,
                        use_cache=True, **keep)
        next_positions = next_positions + 1
