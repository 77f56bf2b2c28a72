"""Garbage-collector pauses, kept out of the measurements and the GUI.

A full (generation 2) collection walks every object the collector tracks: transformers' modules
and a loaded model's Python objects come to about a million, so one takes a good fraction of a second,
with the GIL held, stalling every thread: the window's event loop, a server's other requests, the
token being timed. Once something long-lived is made (a model loaded, the app started), :func:`settle`
freezes the objects alive then (``gc.freeze``): later collections skip them. :func:`release`, when a
model is dropped, unfreezes and collects once, so the reference cycles of a dropped model are freed
(a frozen cycle is never collected), then freezes what is left.

Where the collection runs matters in a Qt app: it destroys whatever sits in garbage cycles, a
closed window's widgets among them, and Qt widgets must be destroyed on the GUI thread (one
destroyed by a collection on the model's worker thread crashed the app when a local model was
dropped for an endpoint). The app hands :func:`collect_on` a function that has the GUI thread
run :func:`collect`; elsewhere (the CLI, the server) it runs at once.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_collector: Callable[[], None] | None = None


def settle() -> None:
    """Freeze what is alive now: collections from here on skip it."""
    with _lock:
        gc.freeze()


def collect_on(collector: Callable[[], None] | None) -> None:
    """Have :func:`release` call ``collector`` instead of collecting itself: a function that gets
    :func:`collect` run where it is safe (a Qt app's GUI thread); ``None``: collect at once."""
    global _collector
    _collector = collector


def release() -> None:
    """Something long-lived was dropped: one full collection over everything, then freeze again
    (on the thread :func:`collect_on` names, if any)."""
    if _collector is not None:
        _collector()
    else:
        collect()


def collect() -> None:
    """One full collection over everything, frozen objects included; then freeze what is left."""
    with _lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@contextmanager
def settling() -> Iterator[None]:
    """For making many long-lived objects at once (importing torch and transformers: ~1e6 of them):
    no collections meanwhile (each would walk everything made so far), then :func:`settle`."""
    with _lock:
        was_enabled = gc.isenabled()
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            gc.freeze()
            if was_enabled:
                gc.enable()
