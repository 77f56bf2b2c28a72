"""What a load shows besides the model panel's progress: the first run's fetch dialog (the default
model downloaded, checked and converted) and the fast path's compile notes."""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot
from PySide6.QtWidgets import QMessageBox

from app.fetch_dialog import FETCH_STAGES, FetchDialog, OPENING_STAGES
from engine.base.events import LoadProgress


class LoadFeedback(QObject):
    def __init__(self, main) -> None:
        super().__init__(main)
        self.main = main
        self.fetch_dialog = None  # open while the default model is fetched or converted

    @Slot(object)
    def on_progress(self, event: LoadProgress) -> None:
        self.main.model_panel.show_progress(event)

        # the dialog opens only when something is fetched or converted (a later load of the
        # converted copy reports "tokenizer" too, and must not flash the first-run dialog)
        opening = self.fetch_dialog is None and event.stage in OPENING_STAGES
        if self.main._loading_default and event.stage in FETCH_STAGES and (self.fetch_dialog is not None or opening):
            if self.fetch_dialog is None:
                self.fetch_dialog = FetchDialog(self.main)
                self.fetch_dialog.cancel_requested.connect(self.main.session.cancel_load)
            self.fetch_dialog.show_progress(event)

    def close_fetch_dialog(self) -> None:
        if self.fetch_dialog is not None:
            self.fetch_dialog.finish()
            self.fetch_dialog.deleteLater()
            self.fetch_dialog = None

    @Slot(object)
    def on_compile_started(self) -> None:
        self.main.model_panel.stage.setText(
            "Fast path: getting the compiled decode steps ready (one sequence, then batches). Built once per "
            "model, precision and thread count by a background process at low priority (a few minutes on two "
            "cores), loaded in seconds afterwards; until then generation runs the eager steps.")

    def on_compile_finished(self, report) -> None:
        if self.main.loaded is None:
            return
        if report.error == "cancelled":
            return
        text = f"Fast path: {report.describe()}."
        if not report.error:
            text += (" It runs the tokens while generation has those threads (the eager step when the machine's "
                     "load takes one).")
        self.main.model_panel.stage.setText(text)

    def show_failure(self, exc: Exception, after: str) -> QMessageBox | None:
        """Say why a load failed, under the prompt (with ``after``: what is still loaded, whether a
        prompt waited) and, unless it was cancelled, in a window-modal box (the app keeps running)."""
        prompt = self.main.prompt
        if type(exc).__name__ == "CancelledError":
            prompt.show_message(f"Loading was cancelled.{after}", "info")
            return None
        message = str(exc) or type(exc).__name__
        if type(exc).__name__ == "DownloadError" and self.main._loading_default:
            message += ("\n\nTo use a model already on this machine, choose Folder… (a Hugging Face folder) or "
                        "GGUF… (a .gguf file) in the Model panel.")
        prompt.show_message(f"Could not load the model: {message}{after}", "error")
        box = QMessageBox(QMessageBox.Warning, "Could not load the model", message, QMessageBox.Ok, self.main)
        box.setObjectName("loadErrorBox")
        box.open()
        return box
