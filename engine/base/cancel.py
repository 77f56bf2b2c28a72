"""A thread-safe cancel flag, checked by the engine once per token or loading step."""

from __future__ import annotations

import threading


class CancelToken:
    """Set from any thread; read by the engine between steps."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled (``True``) or ``timeout`` seconds passed (``False``)."""
        return self._event.wait(timeout)

