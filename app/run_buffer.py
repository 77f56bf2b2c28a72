"""Per-token measurements of the current generation, kept in growing numpy arrays.

The worker's signals append here (cheap); the plots and the status bar read from here
on a timer. No Qt in this file.
"""

from __future__ import annotations

import numpy as np

from engine.events import Finished, Prefilled, TokenGenerated

_FIELDS = ("latency_s", "elapsed_s", "kv_bytes", "kv_predicted", "rss", "device_allocated",
           "device_reserved", "device_peak")


class RunBuffer:
    """Columns of floats, one row per generated token (NaN where a value is absent)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._columns = {name: np.full(capacity, np.nan) for name in _FIELDS}
        self.count = 0
        self.prefilled: Prefilled | None = None
        self.finished: Finished | None = None
        self.weights_bytes: int | None = None
        self.version = 0  # bumps on every change, so a timer can skip idle redraws

    def reset(self, weights_bytes: int | None = None) -> None:
        for column in self._columns.values():
            column[: self.count] = np.nan
        self.count = 0
        self.prefilled = self.finished = None
        self.weights_bytes = weights_bytes
        self.version += 1

    def _grow(self) -> None:
        self._capacity *= 2
        for name, column in self._columns.items():
            grown = np.full(self._capacity, np.nan)
            grown[: self.count] = column[: self.count]
            self._columns[name] = grown

    def extend(self, events) -> None:
        """Append a batch of a generation's events: its tokens, one column at a time (a
        ``Prefilled`` among them is kept as :attr:`prefilled`; other events are not the buffer's)."""
        events = list(events)
        for event in events:
            if isinstance(event, Prefilled):
                self.prefilled = event
        events = [e for e in events if isinstance(e, TokenGenerated)]
        if not events:
            return
        while self.count + len(events) > self._capacity:
            self._grow()
        rows = slice(self.count, self.count + len(events))

        def fill(name, values):
            self._columns[name][rows] = [np.nan if v is None else v for v in values]

        fill("latency_s", [e.latency_s for e in events])
        fill("elapsed_s", [e.elapsed_s for e in events])
        fill("kv_bytes", [e.kv_cache_bytes for e in events])
        fill("kv_predicted", [e.kv_cache_bytes_predicted for e in events])
        fill("rss", [e.memory.rss_bytes for e in events])
        fill("device_allocated", [e.memory.device_allocated_bytes for e in events])
        fill("device_reserved", [e.memory.device_reserved_bytes for e in events])
        fill("device_peak", [e.memory.device_peak_bytes for e in events])
        self.count += len(events)
        self.version += 1

    @classmethod
    def from_series(cls, series: dict, weights_bytes: int | None = None) -> "RunBuffer":
        """A buffer holding a saved run's columns (``engine.history.series_from``); unknown names are ignored."""
        lengths = [len(v) for k, v in series.items() if k in _FIELDS]
        count = max(lengths, default=0)
        buffer = cls(max(1024, count))
        for name, values in series.items():
            if name in _FIELDS:
                buffer._columns[name][: len(values)] = [np.nan if v is None else v for v in values]
        buffer.count = count
        buffer.weights_bytes = weights_bytes
        buffer.version += 1
        return buffer

    def column(self, name: str) -> np.ndarray:
        return self._columns[name][: self.count]

    def has(self, name: str) -> bool:
        """Whether any token carried this measurement (device columns are empty on the CPU)."""
        return self.count > 0 and not np.all(np.isnan(self.column(name)))

    def index(self) -> np.ndarray:
        return np.arange(self.count, dtype=float)

    def tokens_per_s(self) -> np.ndarray:
        """Instantaneous speed of each token: 1 / its latency (the first one's is the TTFT)."""
        return 1.0 / self.column("latency_s")

    def rolling_tokens_per_s(self, window: int = 16) -> np.ndarray:
        """Tokens per second over the last ``window`` decode steps (the TTFT left out)."""
        latency = self.column("latency_s").copy()
        if latency.size:
            latency[0] = np.nan
        out = np.full(latency.size, np.nan)
        steps = np.nan_to_num(latency[1:])
        if steps.size:
            total = np.cumsum(steps)
            counts = np.arange(1, steps.size + 1)
            start = np.maximum(counts - window, 0)
            summed = total - np.concatenate(([0.0], total))[start]
            out[1:] = (counts - start) / summed
        return out

    def decode_tokens_per_s(self) -> float | None:
        """Live decode speed: the finished figure when there is one, else (n − 1) / Σ step latencies,
        the way the engine computes it at the end."""
        if self.finished is not None:
            return self.finished.decode_tokens_per_s
        if self.count < 2:
            return None
        span = float(np.sum(self.column("latency_s")[1:]))
        return (self.count - 1) / span if span > 0 else None
