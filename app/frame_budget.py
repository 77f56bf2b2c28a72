"""Keep the GUI thread's share of the CPU small while the model generates.

On a 2-core machine the GUI thread runs on a core that the model's matrix multiplies
also want; every millisecond it paints is taken from them, and more: a descheduled
OpenMP thread stalls its partner at the next barrier. So redraws are paced by what they
cost: a redraw that took ``c`` seconds of GUI-thread CPU (its Python work and the painting
Qt does right after) is followed by at least ``c / budget`` seconds without one. A cheap
redraw still happens at every tick of the 20 Hz timer, an expensive one (a big window, a
slow machine) less often.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class FrameBudget:
    def __init__(self, budget: float = 0.02, clock=time.perf_counter, cpu_clock=time.thread_time) -> None:
        self.budget = budget
        self._clock, self._cpu_clock = clock, cpu_clock
        self._next = 0.0
        self._started: float | None = None
        self.last_cost = 0.0
        self.skipped = 0

    def due(self) -> bool:
        """Whether a redraw may start now (call from the GUI thread, once per tick)."""
        if self._started is None and self._clock() >= self._next:
            return True
        self.skipped += 1
        return False

    def begin(self) -> None:
        self._started = self._cpu_clock()

    def end(self) -> None:
        """Call once the redraw has been painted (e.g. from a zero-delay timer after it)."""
        if self._started is None:
            return
        self.last_cost = self._cpu_clock() - self._started
        self._started = None
        self._next = self._clock() + self.last_cost / self.budget

    def reset(self) -> None:
        self._next = 0.0
        self._started = None


def in_turns(steps: list[Callable[[], None]], done: Callable[[], None] | None = None,
             wanted: Callable[[], bool] = lambda: True, owner=None) -> None:
    """Run ``steps`` one per turn of the event loop, then ``done``; stop early once ``wanted()`` is
    false (newer inputs replaced these), or once ``owner`` (a QObject: the widget drawn) is deleted.
    A timer of one millisecond between two steps, not a zero one: the loop serves its due timers and paints in
    between, so no turn pays for two charts."""
    from PySide6.QtCore import QTimer

    def later() -> None:
        if owner is None:
            QTimer.singleShot(1, step)
        else:  # with a context object: Qt drops the call if the owner is gone by then
            QTimer.singleShot(1, owner, step)

    def step() -> None:
        if not wanted():
            return
        steps.pop(0)()
        if steps:
            later()
        elif done is not None:
            done()

    later()
