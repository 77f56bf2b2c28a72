"""The server's traffic as the traffic view draws it, built from the core's events
(engine/generation/service.py): one track per request (when it arrived, was admitted, got its first
token, was preempted and admitted again, finished; the prompt tokens it found in the prefix
cache; its tokens as a run) and one row per step (batch, tokens, queue, KV cache by request and
the prefix cache's kept blocks, preemptions). Qt-free; bounded (the oldest requests and steps
are dropped first)."""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice
from dataclasses import dataclass, field

import numpy as np

from engine.base.events import Finished, Preempted, Prefilled, TokenGenerated
from engine.runs import Run
from engine.generation.service import RequestArrived, RequestEvent, TrafficStep
from engine.base.units import format_bytes, format_rate, format_seconds

STEP_FIELDS = ("at_s", "step_s", "batch", "decode_tokens", "prefill_tokens", "waiting", "running", "kv_bytes",
               "kept_bytes", "preempted", "cached_tokens", "kv_blocks_used", "kv_blocks_kept", "shared_bytes",
               "kv_blocks_shared")


@dataclass
class RequestTrack:
    request_id: int
    arrived_s: float
    client: str = ""
    endpoint: str = ""
    prompt: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    finished: Finished | None = None
    run: Run = field(default_factory=Run)
    kv_bytes: int = 0
    blocks: int = 0
    """KV blocks it holds now."""
    shared_blocks: int = 0
    """Of those, the blocks other running requests hold too."""
    cached_tokens: int = 0
    """Prompt tokens it found in the prefix cache."""
    preempted_s: list[float] = field(default_factory=list)
    """When it was preempted (its blocks taken back; it waited and was computed again)."""
    marks: list[tuple[str, float]] = field(default_factory=list)
    """(phase, from when), in order: waiting, prefill, decode, and again after each preemption."""

    def __post_init__(self) -> None:
        if not self.marks:
            self.marks.append(("waiting", self.arrived_s))

    def mark(self, phase: str, at: float) -> None:
        if self.marks[-1][0] != phase:
            self.marks.append((phase, max(at, self.marks[-1][1])))

    def admitted(self, at: float) -> None:
        """It holds a place in the batch since ``at`` (a step's start): a prefill span after its
        last wait, before the first token that step may already have given it."""
        last = max(i for i, (name, _) in enumerate(self.marks) if name == "waiting")
        if last == len(self.marks) - 1:
            self.marks.append(("prefill", max(at, self.marks[-1][1])))
        elif self.marks[last + 1][0] == "decode":
            self.marks.insert(last + 1, ("prefill", min(max(at, self.marks[last][1]), self.marks[last + 1][1])))

    @property
    def phase(self) -> str:
        if self.finished_s is not None:
            return "done"
        return self.marks[-1][0]

    def spans(self, now: float) -> list[tuple[str, float, float]]:
        """(phase, start, end) of each phase so far; an unfinished one ends ``now``."""
        end = self.finished_s if self.finished_s is not None else now
        out = []
        for i, (name, at) in enumerate(self.marks):
            stop = self.marks[i + 1][1] if i + 1 < len(self.marks) else end
            out.append((name, at, max(at, stop)))
        return out

    def describe(self) -> str:
        f = self.finished
        cached = f" ({self.cached_tokens} from the prefix cache)" if self.cached_tokens else ""
        parts = [f"request {self.request_id} from {self.client or '?'} ({self.endpoint})",
                 f"prompt {self.prompt_tokens} tokens{cached}, up to {self.max_tokens} new"]
        if self.admitted_s is not None:
            parts.append(f"waited {format_seconds(self.admitted_s - self.arrived_s)}")
        if self.preempted_s:
            times = "once" if len(self.preempted_s) == 1 else f"{len(self.preempted_s)} times"
            parts.append(f"preempted {times} (KV blocks ran out): waited and was computed again")
        if f is not None:
            parts.append(f"{f.tokens} tokens, TTFT {format_seconds(f.ttft_s)}")
            if f.decode_tokens_per_s:
                parts.append(format_rate(f.decode_tokens_per_s))
            parts.append(f"end-to-end {format_seconds(f.total_s)}, ended: {f.reason}")
        else:
            parts.append(f"{self.run.count} tokens so far, {self.phase}")
        held = f", {self.blocks} blocks" if self.blocks else ""
        if self.shared_blocks:
            held += f", {self.shared_blocks} of them shared with other requests (held once)"
        parts.append(f"KV cache {format_bytes(self.kv_bytes)}{held}")
        return "\n".join(parts)


class TrafficLog:
    """Append traffic events (:meth:`add`); read tracks, step columns and latency figures."""

    def __init__(self, max_requests: int = 2000, max_steps: int = 20000) -> None:
        self.requests: OrderedDict[int, RequestTrack] = OrderedDict()
        self.max_requests = max_requests
        self._steps: deque[tuple] = deque(maxlen=max_steps)
        self._kv: deque[tuple[tuple[int, int], ...]] = deque(maxlen=max_steps)
        """Per step: (batch slot, KV bytes of its own blocks) of each request holding cache (see :meth:`kv_stack`)."""
        self._slot_of: dict[int, int] = {}
        self.kv_budget_bytes: int | None = None
        self.block_map: tuple[int, ...] = ()
        """The pool's blocks after the last step: holders of each (-1 cached, 0 empty)."""
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []
        self.e2e_s: list[float] = []
        self.generated = 0
        self.finished = 0
        self.now = 0.0
        self.version = 0

    def clear(self) -> None:
        self.__init__(self.max_requests, self._steps.maxlen)

    def add(self, event) -> None:
        if isinstance(event, RequestArrived):
            self.requests[event.request_id] = RequestTrack(
                event.request_id, event.at_s, event.client, event.endpoint, event.prompt, event.prompt_tokens,
                event.max_tokens)
            while len(self.requests) > self.max_requests:
                self.requests.popitem(last=False)
            self.now = max(self.now, event.at_s)
        elif isinstance(event, RequestEvent):
            track = self.requests.get(event.request_id)
            inner = event.event
            self.now = max(self.now, event.at_s)
            if track is None:
                return
            if isinstance(inner, TokenGenerated):
                track.run.extend([inner])
                self.generated += 1
                track.mark("decode", event.at_s)
                if inner.index == 0:
                    track.first_token_s = event.at_s
                    self.ttft_s.append(inner.latency_s)
                else:
                    self.itl_s.append(inner.latency_s)
            elif isinstance(inner, Prefilled):
                track.run.extend([inner])
                track.cached_tokens = inner.cached_tokens
            elif isinstance(inner, Preempted):
                track.preempted_s.append(event.at_s)
                track.mark("waiting", event.at_s)
                track.kv_bytes = track.blocks = track.shared_blocks = 0
            elif isinstance(inner, Finished):
                track.run.finish(inner)
                track.finished, track.finished_s = inner, event.at_s
                track.kv_bytes = 0
                if track.admitted_s is None:  # ended while waiting
                    track.admitted_s = event.at_s
                self.e2e_s.append(inner.total_s)
                self.finished += 1
        elif isinstance(event, TrafficStep):
            step = event.step
            self.kv_budget_bytes = event.kv_budget_bytes
            self.block_map = event.blocks
            self.now = max(self.now, event.at_s)
            held, own = [], 0
            holding = {state.request_id for state in event.requests if state.kv_bytes}
            for rid in [r for r in self._slot_of if r not in holding]:
                del self._slot_of[rid]
            for state in event.requests:
                track = self.requests.get(state.request_id)
                if track is not None:
                    if state.phase != "waiting" and track.admitted_s is None:
                        track.admitted_s = event.at_s - step.step_s
                    if state.phase != "waiting":
                        track.admitted(event.at_s - step.step_s)
                    track.kv_bytes, track.blocks = state.kv_bytes, state.blocks
                    track.shared_blocks = state.shared_blocks
                    track.cached_tokens = max(track.cached_tokens, state.cached_tokens)
                if state.kv_bytes:
                    slot = self._slot_of.get(state.request_id)
                    if slot is None:
                        taken = set(self._slot_of.values())
                        slot = self._slot_of[state.request_id] = next(i for i in range(len(taken) + 1)
                                                                      if i not in taken)
                    # its own blocks' bytes: the blocks it shares with others are one band of their own
                    mine = state.kv_bytes - state.kv_bytes * state.shared_blocks // max(state.blocks, 1)
                    held.append((slot, mine))
                    own += mine
            self._steps.append((event.at_s, step.step_s, step.batch, step.decode_tokens, step.prefill_tokens,
                                step.waiting, step.running, step.kv_cache_bytes, step.kv_kept_bytes,
                                step.preempted, step.cached_tokens, step.kv_blocks_used, step.kv_blocks_kept,
                                max(0, step.kv_cache_bytes - own), step.kv_blocks_shared))
            self._kv.append(tuple(held))
        else:
            return
        self.version += 1

    # -- reading ------------------------------------------------------------------------------
    def steps(self) -> dict[str, np.ndarray]:
        """One array per :data:`STEP_FIELDS`, oldest step first."""
        if not self._steps:
            return {name: np.zeros(0) for name in STEP_FIELDS}
        table = np.array(self._steps, dtype=float)
        return {name: table[:, i] for i, name in enumerate(STEP_FIELDS)}

    def output_rate(self, window_s: float = 1.0, steps: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(time, tokens per second made over the ``window_s`` before it), at every step
        (``steps``: :meth:`steps` when the caller has it already)."""
        s = steps if steps is not None else self.steps()
        at, made = s["at_s"], s["batch"]
        if not len(at):
            return at, at
        total = np.cumsum(made)
        start = np.searchsorted(at, at - window_s, side="right")
        before = np.where(start > 0, total[np.maximum(start - 1, 0)], 0)
        # always over the whole window: the first steps of a burst ramp up rather than divide a
        # token or two by a few ms (a 1,000 tok/s spike at the first step of the first request)
        return at, (total - before) / window_s

    def kv_stack(self, since_s: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(step times, [slots × steps] each request's own KV bytes, the blocks running requests
        share (held once), the prefix cache's kept bytes) for the steps after ``since_s``: the
        bands of a stacked chart, whose requests and shared band add up to the step's KV bytes. A
        slot holds one request at a time (the lowest free one when it starts holding cache), so
        there are as many bands as requests ever ran at once, not one per request of the last
        minute (a hundred filled curves would make every redraw slow)."""
        times = np.fromiter((row[0] for row in self._steps), float, len(self._steps))
        first = int(np.searchsorted(times, since_s))
        held = list(self._kv)[first:]
        slots = 1 + max((slot for column in held for slot, _ in column), default=-1)
        table = np.zeros((slots, len(held)))
        for j, column in enumerate(held):
            for slot, kv in column:
                table[slot, j] = kv
        at, shared_at = STEP_FIELDS.index("kept_bytes"), STEP_FIELDS.index("shared_bytes")
        kept = np.fromiter((row[at] for row in islice(self._steps, first, None)), float, len(held))
        shared = np.fromiter((row[shared_at] for row in islice(self._steps, first, None)), float, len(held))
        return times[first:], table, shared, kept

    def in_core(self) -> tuple[int, int]:
        """(running, waiting) after the last step."""
        if not self._steps:
            return 0, 0
        last = self._steps[-1]
        return int(last[6]), int(last[5])

    def now_figures(self, window_s: float = 1.0) -> tuple[float, int]:
        """(output tok/s over the last ``window_s``, KV bytes held) after the last step, read from
        the newest steps only (the summary line asks 20 times a second)."""
        if not self._steps:
            return 0.0, 0
        last = self._steps[-1]
        made = 0
        for row in reversed(self._steps):
            if row[0] <= last[0] - window_s:
                break
            made += row[2]
        return made / window_s, int(last[7])

