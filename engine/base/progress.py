"""Loading progress and cancel, reported as plain values through a callback.

transformers draws tqdm bars while it converts and loads weights. We install one hook,
once, that hands those bars to the reporter of the thread doing the loading (so two
lanes loading at once each see their own progress) and falls back to the library's
own bar everywhere else. Each step of a bar checks the cancel flag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from engine.base.cancel import CancelToken
from engine.base.errors import CancelledError
from engine.base.events import LoadProgress

T = TypeVar("T")

_local = threading.local()
_install_lock = threading.Lock()
_installed = False

# tqdm descriptions transformers uses, mapped to our stage names.
_STAGES = {
    "loading weights": "weights",
    "converting and de-quantizing gguf tensors": "convert",
    "writing model shards": "save",
}


class ProgressReporter:
    """Forwards :class:`LoadProgress` to a callback and raises when cancelled."""

    def __init__(self, callback: Callable[[LoadProgress], None] | None = None,
                 cancel: CancelToken | None = None) -> None:
        self._callback = callback
        self.cancel = cancel or CancelToken()
        self._last: tuple[str, int] | None = None

    def check(self) -> None:
        if self.cancel.cancelled:
            raise CancelledError("Loading was cancelled.")

    def report(self, stage: str, done: int = 0, total: int = 0, message: str = "") -> None:
        """Emit progress (at most ~100 events a stage) and check for cancel."""
        self.check()
        if self._callback is None:
            return
        step = (stage, done * 100 // total if total else done)
        if step == self._last and done != total:
            return
        self._last = step
        self._callback(LoadProgress(stage=stage, done=done, total=total, message=message))

    def iterate(self, stage: str, items: Iterable[T], total: int | None = None,
                message: str = "") -> Iterator[T]:
        if total is None:
            try:
                total = len(items)  # type: ignore[arg-type]
            except TypeError:
                total = 0
        self.report(stage, 0, total, message)
        done = 0
        for item in items:
            yield item
            done += 1
            self.report(stage, done, total, message)


class _ReportingBar:
    """Enough of tqdm's interface for transformers' loading loops."""

    def __init__(self, reporter: ProgressReporter, args: tuple, kwargs: dict) -> None:
        self._iterable = args[0] if args else kwargs.get("iterable")
        desc = str(kwargs.get("desc") or "")
        self._stage = _STAGES.get(desc.strip(" .").lower(), "loading")
        self._message = desc.strip(" .")
        total = kwargs.get("total")
        if total is None and self._iterable is not None:
            try:
                total = len(self._iterable)
            except TypeError:
                total = 0
        self.total = int(total or 0)
        self.n = 0
        self._reporter = reporter
        reporter.report(self._stage, 0, self.total, self._message)

    def __iter__(self):
        for item in self._iterable:
            yield item
            self.update(1)

    def __len__(self) -> int:
        return self.total

    def update(self, n: float = 1) -> None:
        self.n += int(n)
        self._reporter.report(self._stage, min(self.n, self.total) if self.total else self.n,
                              self.total, self._message)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, _name):  # set_description, set_postfix, refresh, …
        return lambda *a, **k: None


def _current() -> ProgressReporter | None:
    return getattr(_local, "reporter", None)


def _install_hooks() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        from transformers.utils import logging as hf_logging

        previous = None

        def hook(factory, args, kwargs):
            reporter = _current()
            if reporter is not None:
                return _ReportingBar(reporter, args, kwargs)
            if previous is not None:
                return previous(factory, args, kwargs)
            return factory(*args, **kwargs)

        previous = hf_logging.set_tqdm_hook(hook)

        # The GGUF de-quantization loop uses tqdm.auto directly, not the hook above.
        try:
            from transformers import modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:
            gguf_utils = None
        if gguf_utils is not None and hasattr(gguf_utils, "tqdm"):
            original = gguf_utils.tqdm

            def gguf_tqdm(*args, **kwargs):
                reporter = _current()
                if reporter is not None:
                    return _ReportingBar(reporter, args, kwargs)
                return original(*args, **kwargs)

            gguf_utils.tqdm = gguf_tqdm
        _installed = True


@contextmanager
def reporting(reporter: ProgressReporter):
    """Route transformers' progress bars in this thread to ``reporter``."""
    _install_hooks()
    outer = _current()
    _local.reporter = reporter
    try:
        yield reporter
    finally:
        _local.reporter = outer

