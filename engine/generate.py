"""The decode loop: prefill the prompt, then one forward pass per token over a KV cache.

Our own loop rather than ``model.generate()`` with a streamer, so every token comes with
what it cost (latency, KV bytes measured and predicted, memory) and a cancel flag is
checked between tokens. Greedy output equals ``model.generate(do_sample=False)``.

Timing: ``latency_s`` is the engine's own time for a token, from when the consumer hands
control back to when the token is ready, so a slow consumer (a terminal, a GUI) never
makes the model look slow. ``elapsed_s`` and ``total_s`` are wall clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.cancel import CancelToken
from engine.detokenize import IncrementalDetokenizer
from engine.errors import EngineError, NonFiniteError, OutOfMemoryError, is_out_of_memory, non_finite_message
from engine.events import Alternative, Finished, GenerationEvent, Prefilled, TokenGenerated
from engine.memory import MemoryProbe
from engine.request import GenerationRequest
from engine.sampling import make_sampler
from engine.threads import adapt as adapt_threads

if TYPE_CHECKING:
    import torch

    from engine.model import LoadedModel

PREFILL_CHUNK = 512
"""Long prompts go through in chunks of this many tokens, so cancel works during prefill."""


def top_scores(scores: "torch.Tensor", k: int) -> tuple[list[int], list[float]]:
    """The k largest scores, best first. numpy's argpartition on the CPU (about half of torch.topk's time)."""
    import numpy as np
    import torch

    if scores.device.type == "cpu":
        values = scores.numpy()
        ids = np.argpartition(values, -k)[-k:]
        ids = ids[np.argsort(-values[ids], kind="stable")]
        return ids.tolist(), values[ids].tolist()
    values, ids = torch.topk(scores, k)
    return ids.tolist(), values.tolist()


def stream(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
           cancel: CancelToken) -> Iterator[GenerationEvent]:
    try:
        yield from _run(loaded, request, prompt_ids, cancel)
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(
                f"Out of memory on {loaded.device} while generating: shorten the prompt or answer, "
                "or pick a smaller precision."
            ) from exc
        raise EngineError(f"Generation failed: {type(exc).__name__}: {exc}") from exc


def finished_event(reason: str, tokens: list[int], latencies: list[float], prompt_tokens: int, start: float,
                   probe: MemoryProbe, kv: int, kv_predicted: int | None, text: str, stop_string: str | None = None,
                   **extra) -> Finished:
    """The Finished event of a generation: its totals from the tokens and their latencies
    (the first is the TTFT), the peak memory the probe saw, the cache at the end."""
    decode_s = sum(latencies[1:])
    n = len(tokens)
    peak_device = probe.peak_device()
    return Finished(
        reason=reason, tokens=n, prompt_tokens=prompt_tokens, ttft_s=latencies[0] if latencies else None,
        decode_s=decode_s, decode_tokens_per_s=(n - 1) / decode_s if n >= 2 and decode_s > 0 else None,
        total_s=time.perf_counter() - start,
        peak_memory_bytes=peak_device if peak_device is not None else probe.peak_rss,
        peak_rss_bytes=probe.peak_rss, kv_cache_bytes=kv, kv_cache_bytes_predicted=kv_predicted,
        token_ids=tuple(tokens), text=text, stop_string=stop_string, **extra,
    )


def stop_reason(token: int, piece: str, text: str, request: GenerationRequest, eos: frozenset[int],
                generated: int, length: int, context: int | None,
                cancel: CancelToken) -> tuple[str | None, str | None]:
    """Why generation ends after ``token`` (its ``piece`` ends ``text``), with the stop string
    that matched; ``(None, None)`` to go on. ``length``: prompt and answer tokens so far."""
    if token in eos:
        return "eos", None
    if request.stop:
        longest = max(len(s) for s in request.stop)
        tail = text[-(longest + len(piece)):]
        stop_string = next((s for s in request.stop if s in tail), None)
        if stop_string:
            return "stop_string", stop_string
    if generated >= request.max_new_tokens:
        return "length", None
    if context is not None and length >= context:
        return "context", None
    if cancel.cancelled:
        return "cancelled", None
    return None, None


class SeenTokens:
    """Prompt and answer ids in one tensor (for the repetition penalty and the next input),
    grown by doubling so ``max_new_tokens`` can be large without a large allocation."""

    def __init__(self, prompt_ids: list[int], room: int, device) -> None:
        import torch

        self._data = torch.empty(len(prompt_ids) + max(1, room), dtype=torch.long, device=device)
        self._data[: len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
        self.count = len(prompt_ids)

    def append(self, token: int) -> None:
        import torch

        if self.count == self._data.numel():
            self._data = torch.cat([self._data, torch.empty_like(self._data)])
        self._data[self.count] = token
        self.count += 1

    def all(self) -> "torch.Tensor":
        return self._data[: self.count]

    def last(self) -> "torch.Tensor":
        return self._data[self.count - 1: self.count].unsqueeze(0)


def _run(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
         cancel: CancelToken) -> Iterator[GenerationEvent]:
    import torch

    tokenizer, device = loaded.tokenizer, loaded.device
    context = loaded.info.context_length
    eos = frozenset() if request.ignore_eos else loaded.eos_ids
    special = frozenset(tokenizer.all_special_ids)
    sampler = make_sampler(request.sampling, device)
    plain_greedy = request.sampling.greedy and request.sampling.repetition_penalty == 1.0
    detok = IncrementalDetokenizer(tokenizer)
    probe = MemoryProbe(device)
    n_prompt = len(prompt_ids)
    top_k = request.top_alternatives
    room = request.max_new_tokens if context is None else min(request.max_new_tokens, context - n_prompt)
    seen = SeenTokens(prompt_ids, min(room, 4096), device)
    predicted = loaded.predicted_kv_bytes
    tokens: list[int] = []
    latencies: list[float] = []

    def finished(reason, kv, kv_pred, stop_string=None) -> Finished:
        return finished_event(reason, tokens, latencies, n_prompt, start, probe, kv, kv_pred, detok.text,
                              stop_string)

    adapt_threads(force=True)  # as many threads as other programs leave cores free
    probe.reset_peak()
    probe.sample()
    start = time.perf_counter()
    runner = loaded.runner(n_prompt + room)
    prompt = seen.all().unsqueeze(0)
    for chunk_start in range(0, n_prompt, PREFILL_CHUNK):
        if cancel.cancelled:
            yield finished("cancelled", runner.kv_bytes(), predicted(chunk_start))
            return
        with torch.inference_mode():
            logits = runner.forward(prompt[:, chunk_start:chunk_start + PREFILL_CHUNK])
    prefill_s = time.perf_counter() - start
    yield Prefilled(prompt_tokens=n_prompt, prefill_s=prefill_s,
                    prefill_tokens_per_s=n_prompt / prefill_s if prefill_s > 0 else 0.0,
                    kv_cache_bytes=runner.kv_bytes(), kv_cache_bytes_predicted=predicted(n_prompt),
                    memory=probe.sample())

    step_start = time.perf_counter()
    while True:
        adapt_threads()
        # inference mode only around tensor work: it is per thread, and must not stay on
        # in the consumer's code between tokens
        with torch.inference_mode():
            if tokens:
                logits = runner.forward(seen.last())
            scores = logits.float()
            if top_k:
                ids, values = top_scores(scores, top_k)
            if plain_greedy and top_k >= 2 and values[0] > values[1]:
                token = ids[0]  # the argmax, already found by top_scores (no tie to break)
            else:
                token = sampler(scores, seen.all())
            log_total = float(torch.logsumexp(scores, dim=-1))
            chosen = float(scores[token]) - log_total
        if not math.isfinite(log_total):  # any NaN or +inf score: nothing after this is real
            raise NonFiniteError(non_finite_message(loaded.info.precision, loaded.info.name, len(tokens)),
                                 finished("error", runner.kv_bytes(), predicted(n_prompt + len(tokens))))
        alternatives = (tuple(Alternative(i, loaded.token_text(i), v - log_total) for i, v in zip(ids, values))
                        if top_k else ())
        tokens.append(token)
        seen.append(token)
        piece = detok.add(token)

        reason, stop_string = stop_reason(token, piece, detok.text, request, eos, len(tokens), n_prompt + len(tokens),
                                          context, cancel)
        if reason is not None:
            piece += detok.flush()

        in_cache = n_prompt + len(tokens) - 1  # the newest token is not in the cache yet
        kv = runner.kv_bytes()
        memory = probe.sample()
        now = time.perf_counter()
        latency = now - step_start + (prefill_s if not latencies else 0.0)
        latencies.append(latency)
        yield TokenGenerated(
            index=len(tokens) - 1, token_id=token, text=piece, logprob=chosen,
            top_alternatives=alternatives, latency_s=latency, elapsed_s=now - start,
            kv_cache_bytes=kv, kv_cache_bytes_predicted=predicted(in_cache), memory=memory,
            special=token in special,
        )
        step_start = time.perf_counter()
        if reason is None and cancel.cancelled and not detok.pending:
            reason = "cancelled"  # set while the consumer handled the token: stop before another step
        if reason is not None:
            yield finished(reason, kv, predicted(in_cache), stop_string)
            return
