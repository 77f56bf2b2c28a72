"""Work that would block the event loop (reading configs, counting parameters, measuring this
machine, scanning the history), run on a pool thread, its result handed back on the GUI thread.

A window owns one :class:`Background`; results that arrive after it closed are dropped. The
engine's model work does not go here: that is the session's job queue (app/worker.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from PySide6.QtCore import QObject, Signal, Slot

log = logging.getLogger(__name__)

BACKGROUND_NICE = 5
"""How much lower than the GUI thread the engine and background threads are scheduled."""


def yield_to_the_gui() -> None:
    """Schedule the calling thread below the GUI thread. On a machine with as many busy threads as
    cores (torch's team fills every core while it decodes), an equal GUI thread waits its turn for
    tens of ms; a lower one gets the core when it has something to draw and costs the engine
    nothing when it hasn't. Linux keeps a nice value per thread, and the threads this one starts
    (torch's OpenMP team among them) inherit it; elsewhere this does nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError:  # not allowed here: the threads stay equal
        pass


class Background(QObject):
    """``submit(work, done, failed)``: ``work()`` runs off the GUI thread; ``done(result)`` or
    ``failed(exc)`` runs on the GUI thread afterwards (unless :meth:`close` came first)."""

    _delivered = Signal(int, object, object)  # ticket, result, exception

    def __init__(self, parent: QObject | None = None, workers: int = 2) -> None:
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="background",
                                        initializer=yield_to_the_gui)
        self._waiting: dict[int, tuple[Callable, Callable | None]] = {}
        self._tickets = itertools.count(1)
        self._closed = False
        self._delivered.connect(self._deliver)  # queued: emitted from a pool thread

    def submit(self, work: Callable[[], object], done: Callable[[object], None],
               failed: Callable[[BaseException], None] | None = None) -> int:
        ticket = next(self._tickets)
        self._waiting[ticket] = (done, failed)

        def run() -> None:
            try:
                result, error = work(), None
            except Exception as exc:  # handed to ``failed`` on the GUI thread
                result, error = None, exc
            try:
                self._delivered.emit(ticket, result, error)
            except RuntimeError:  # the owner was deleted meanwhile: nobody is waiting
                pass

        self._pool.submit(run)
        return ticket

    @Slot(int, object, object)
    def _deliver(self, ticket: int, result, error) -> None:
        callbacks = self._waiting.pop(ticket, None)
        if callbacks is None or self._closed:
            return
        done, failed = callbacks
        if error is None:
            done(result)
        elif failed is not None:
            failed(error)
        else:
            log.warning("background work failed: %s", error, exc_info=error)

    def close(self) -> None:
        """Drop what has not been delivered; work already running finishes on its own."""
        self._closed = True
        self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
