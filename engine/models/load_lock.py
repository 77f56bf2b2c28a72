"""One model load at a time, process-wide.

transformers' loading code changes process-wide state while it runs (the default dtype, the
meta-device patches of ``init_empty_weights``, weight tying): two loads in two threads at
once corrupt each other (seen here: a 4-lane comparison loading together gave a fp32 model
with meta tensors and an int8 one with a random, untied output head). Generation needs no
such lock; loading, converting and counting parameters on the meta device take this one.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from engine.base.cancel import CancelToken
from engine.base.errors import CancelledError

_LOCK = threading.RLock()


@contextmanager
def exclusive(cancel: CancelToken | None = None, waiting=None):
    """Hold the loading lock; ``waiting()`` is called once if another load holds it first.
    Checks ``cancel`` while waiting, raising through ``cancel``'s owner."""
    if not _LOCK.acquire(blocking=False):
        if waiting is not None:
            waiting()
        while not _LOCK.acquire(timeout=0.1):
            if cancel is not None and cancel.cancelled:
                raise CancelledError("Loading was cancelled.")
    try:
        yield
    finally:
        _LOCK.release()
