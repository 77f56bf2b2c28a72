"""What the engine core looks at on its own clock, not at every step: the thread count (how busy
the machine is, engine/generation/threads.py) and the memory a step's events carry
(engine/base/memory.py). Both change far slower than a step takes, so reading them every step
only adds to the step's own time; the plots redraw at about 20 Hz, so a memory sample fresher
than a frame shows nothing new.
"""

from __future__ import annotations

import time

from engine.base.memory import MemoryProbe, MemorySample
from engine.generation.threads import INTERVAL_S, adapt

MEMORY_INTERVAL_S = 0.05
"""The longest a memory sample is reused for the steps after it."""


class Upkeep:
    """One core's clock for the thread count and the memory sample."""

    def __init__(self, probe: MemoryProbe) -> None:
        self.probe = probe
        self._threads_at = self._memory_at = float("-inf")
        self._memory: MemorySample | None = None

    def before_step(self) -> None:
        """Fit the thread count to the machine, when the last look is old enough."""
        now = time.monotonic()
        if now - self._threads_at >= INTERVAL_S:
            self._threads_at = now
            adapt()

    def memory(self, fresh: bool = False) -> MemorySample:
        """The memory now: a new sample when the last is older than :data:`MEMORY_INTERVAL_S`
        (or ``fresh``), else the last one."""
        now = time.monotonic()
        if fresh or self._memory is None or now - self._memory_at >= MEMORY_INTERVAL_S:
            self._memory, self._memory_at = self.probe.sample(), now
        return self._memory
