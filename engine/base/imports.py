"""torch and transformers imported once, by one thread at a time.

transformers is a lazy module, and importing it and torch pulls in a few hundred other modules.
Python takes a lock per module while it imports one; two threads importing these at once (the
app's first model load on the engine's thread, the cost explorer reading a config on a pool
thread) can take two of those locks in opposite orders. Python breaks such a deadlock by handing
one thread a module that is still being initialised, and that thread's import then fails:
"cannot import name 'AutoConfig' from 'transformers'", seen here when the cost explorer was
opened while the default model loaded; it then said the model had no config on this machine.

So the first import of either goes through :func:`heavy_imports`, under one lock: a thread that
comes while another imports waits for it, then finds everything imported.
"""

from __future__ import annotations

import threading

from engine.base import heap

_lock = threading.Lock()
_done = False


def heavy_imports() -> None:
    """Import torch, transformers and the parts of it every model load and config read reach
    for, unless done already; wait while another thread does it."""
    global _done
    if _done:
        return
    with _lock:
        if _done:
            return
        with heap.settling():  # the modules imported live as long as the process (engine/base/heap.py)
            import torch  # noqa: F401
            from transformers import (  # noqa: F401
                AutoConfig,
                AutoModelForCausalLM,
                AutoTokenizer,
                DynamicCache,
                StaticCache,
                modeling_utils,
            )
        _done = True
