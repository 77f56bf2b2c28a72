"""The run store: one request's events, appended once, and the series read from them.

Every view of a generation reads a :class:`Run`: the main window's transcript and status bar,
the four live plots, a comparison lane, the history (what it saves) and the traffic view. The
engine's figures are kept as they came (one row per token, NaN where a value is absent), so no
widget recomputes what the engine measured. Appending is cheap (the worker's event batches);
reading is what the ~20 Hz redraw does. No Qt here.
"""

from __future__ import annotations

from collections.abc import Iterable

import math

import numpy as np

from engine.base.events import EndpointAnswered, Finished, Prefilled, ServerSampled, TokenGenerated

COLUMNS = ("latency_s", "elapsed_s", "kv_bytes", "kv_predicted", "rss", "device_allocated",
           "device_reserved", "device_peak")
"""Per-token columns, named as :func:`engine.storage.history.series_from` saves them."""


def figures(event) -> tuple:
    """One row of :data:`COLUMNS` from a ``TokenGenerated`` (or a ``BatchStep``: same fields)."""
    memory = event.memory
    return (event.latency_s, event.elapsed_s, event.kv_cache_bytes, event.kv_cache_bytes_predicted,
            memory.rss_bytes, memory.device_allocated_bytes, memory.device_reserved_bytes,
            memory.device_peak_bytes)


class Run:
    """The events of one request and their per-token columns.

    ``events`` holds everything the request emitted, in order; ``tokens`` its tokens; ``text`` the
    answer without special tokens. ``version`` bumps on every change, so a timer can skip redraws
    when nothing arrived.
    """

    def __init__(self, weights_bytes: int | None = None, capacity: int = 1024) -> None:
        self.events: list = []
        self.tokens: list[TokenGenerated] = []
        self.prefilled: Prefilled | None = None
        self.finished: Finished | None = None
        self.error: str | None = None
        self.served = False
        """A served model's run (engine/endpoint): its KV and memory are the server's, not seen here."""
        self.server_samples: list[ServerSampled] = []
        """What the server's /metrics said while it answered."""
        self.answered: EndpointAnswered | None = None
        self.weights_bytes = weights_bytes
        self.version = 0
        self._capacity = capacity
        self._columns = np.full((len(COLUMNS), capacity), np.nan)
        self._pieces: list[str] = []
        self._text = ""
        self._joined = 0

    # -- appending ---------------------------------------------------------------------------
    def extend(self, events: Iterable) -> None:
        """Append a batch of the request's events (tokens, its ``Prefilled``, its ``Finished``, or
        events other views read, which are only kept)."""
        events = list(events)
        if not events:
            return
        self.events.extend(events)
        tokens = []
        for event in events:
            if isinstance(event, TokenGenerated):
                tokens.append(event)
                self.served = self.served or event.memory.device == "remote"
            elif isinstance(event, ServerSampled):
                self.server_samples.append(event)
                self.served = True
            elif isinstance(event, EndpointAnswered):
                self.answered = event
                self.served = True
            elif isinstance(event, Prefilled):
                self.prefilled = event
            elif isinstance(event, Finished):
                self.finished = event
        if tokens:
            start = len(self.tokens)
            while start + len(tokens) > self._capacity:
                self._grow()
            rows = np.array([figures(t) for t in tokens], dtype=float)  # None → NaN
            self._columns[:, start:start + len(tokens)] = rows.T
            self.tokens.extend(tokens)
            self._pieces.extend(t.text for t in tokens if not t.special)
        self.version += 1

    def finish(self, event: Finished) -> None:
        self.extend([event])

    def fail(self, message: str, partial: Finished | None = None) -> None:
        """The request failed: ``partial`` (when the engine kept the answer so far, e.g. NaN scores)
        becomes its finish, marked by ``error``."""
        self.error = message
        if partial is not None:
            self.events.append(partial)
            self.finished = partial
        self.version += 1

    def _grow(self) -> None:
        self._capacity *= 2
        grown = np.full((len(COLUMNS), self._capacity), np.nan)
        grown[:, : self.count] = self._columns[:, : self.count]
        self._columns = grown

    @classmethod
    def from_series(cls, series: dict, weights_bytes: int | None = None) -> "Run":
        """A run holding a saved run's columns (``engine.storage.history.series_from``), without its events;
        unknown names are ignored."""
        count = max((len(v) for k, v in series.items() if k in COLUMNS), default=0)
        run = cls(weights_bytes, max(1024, count))
        for name, values in series.items():
            if name in COLUMNS:
                run._columns[COLUMNS.index(name), : len(values)] = [np.nan if v is None else v for v in values]
        run._saved_count = count
        run.version += 1
        return run

    # -- reading -------------------------------------------------------------------------------
    _saved_count: int | None = None

    @property
    def count(self) -> int:
        return self._saved_count if self._saved_count is not None else len(self.tokens)

    @property
    def text(self) -> str:
        """The answer so far without special tokens; joined only for what arrived since the last read."""
        if self._joined < len(self._pieces):
            self._text += "".join(self._pieces[self._joined:])
            self._joined = len(self._pieces)
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    def column(self, name: str) -> np.ndarray:
        return self._columns[COLUMNS.index(name), : self.count]

    def has(self, name: str) -> bool:
        """Whether any token carried this measurement (device columns are empty on the CPU)."""
        return self.count > 0 and not np.all(np.isnan(self.column(name)))

    def index(self) -> np.ndarray:
        return np.arange(self.count, dtype=float)

    def tokens_per_s(self) -> np.ndarray:
        """Instantaneous speed of each token: 1 / its latency (the first one's is the TTFT); NaN for
        a token that came in the same chunk as the one before it (no time of its own to divide by)."""
        latency = self.column("latency_s")
        with np.errstate(divide="ignore"):
            return np.where(latency > 0, 1.0 / latency, np.nan)

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

    def ttft_s(self) -> float | None:
        return float(self.column("latency_s")[0]) if self.count else None

    def kv_bytes(self) -> float | None:
        """The cache now; ``None`` before the first token or where it can't be seen (a server's)."""
        value = float(self.column("kv_bytes")[-1]) if self.count else math.nan
        return None if math.isnan(value) else value

    def peak_memory_bytes(self) -> float | None:
        if self.finished is not None and self.finished.peak_memory_bytes is not None:
            return self.finished.peak_memory_bytes
        return float(np.nanmax(self.column("rss"))) if self.has("rss") else None

    def latency_stats(self) -> dict:
        """Mean, p50 and p95 of the decode steps (the first token's latency is the TTFT)."""
        steps = np.sort(self.column("latency_s")[1:])
        steps = steps[np.isfinite(steps)]
        if not steps.size:
            return {"latency_mean_s": None, "latency_p50_s": None, "latency_p95_s": None}

        def pct(q: float) -> float:
            return float(steps[min(steps.size - 1, int(q * steps.size))])

        return {"latency_mean_s": float(steps.mean()), "latency_p50_s": pct(0.5), "latency_p95_s": pct(0.95)}
