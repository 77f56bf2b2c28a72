"""The pieces every decode loop shares (the engine core's, speculative decoding's, the batch
sweep's): the likeliest scores, the prompt-and-answer history, and the :class:`Finished` event
built from a request's tokens and latencies (the stop rules: engine/generation/output.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.base.events import Finished
from engine.base.memory import MemoryProbe

if TYPE_CHECKING:
    import torch

PREFILL_CHUNK = 512
"""Long prompts go through in chunks of at most this many tokens, so cancel works during prefill."""


TOP_CHUNK = 128
"""Scores per chunk when looking for the largest few (see :func:`top_scores`)."""


def top_scores(scores: "torch.Tensor", k: int) -> tuple[list[int], list[float]]:
    """The k largest scores, best first (ties: the lower id first).

    On the CPU, with numpy: the k largest lie in the k chunks of 128 scores whose maxima are the
    largest (each of them is at most its chunk's maximum), so one vectorised pass of chunk maxima
    and a partition of k·128 candidates replace a partition of the whole vocabulary, a tenth of
    the work for the default model's 49,152 scores."""
    import numpy as np
    import torch

    if scores.device.type == "cpu":
        values = scores.numpy()
        full = len(values) // TOP_CHUNK * TOP_CHUNK
        if full // TOP_CHUNK > 4 * k:
            maxima = values[:full].reshape(-1, TOP_CHUNK).max(axis=1)
            chunks = np.argpartition(maxima, -k)[-k:]
            candidates = (chunks[:, None] * TOP_CHUNK + np.arange(TOP_CHUNK)).ravel()
            candidates = np.concatenate([candidates, np.arange(full, len(values))])  # the tail past the last chunk
        else:
            candidates = np.arange(len(values))
        picked = candidates[np.argpartition(values[candidates], -k)[-k:]]
        order = np.lexsort((picked, -values[picked]))  # best first, then the lower id
        ids = picked[order]
        return ids.tolist(), values[ids].tolist()
    values, ids = torch.topk(scores, k)
    return ids.tolist(), values.tolist()


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


def failed_event(request_id: int, message: str, tokens: int = 0, prompt_tokens: int = 0,
                 total_s: float = 0.0) -> Finished:
    """The Finished event of a request that failed where its totals can't be trusted."""
    return Finished(reason="error", tokens=tokens, prompt_tokens=prompt_tokens, ttft_s=None, decode_s=0.0,
                    decode_tokens_per_s=None, total_s=total_s, peak_memory_bytes=None, peak_rss_bytes=None,
                    kv_cache_bytes=0, kv_cache_bytes_predicted=None, request_id=request_id, error=message)


class SeenTokens:
    """Prompt and answer ids in one tensor (for the repetition penalty and the next input),
    grown by doubling so ``max_new_tokens`` can be large without a large allocation. On the
    CPU each new id is set through the tensor's numpy view of the same memory, without a tensor
    operation (setting a tensor element is slow in a decode step's cold caches)."""

    def __init__(self, prompt_ids: list[int], room: int, device) -> None:
        import torch

        self._data = torch.empty(len(prompt_ids) + max(1, room), dtype=torch.long, device=device)
        self._data[: len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
        self._array = self._data.numpy() if self._data.device.type == "cpu" else None
        self.count = len(prompt_ids)

    def append(self, token: int) -> None:
        import torch

        if self.count == self._data.numel():
            self._data = torch.cat([self._data, torch.empty_like(self._data)])
            self._array = self._data.numpy() if self._array is not None else None
        if self._array is not None:
            self._array[self.count] = token
        else:
            self._data[self.count] = token
        self.count += 1

    def all(self) -> "torch.Tensor":
        return self._data[: self.count]

    def last(self) -> "torch.Tensor":
        return self._data[self.count - 1: self.count].unsqueeze(0)
