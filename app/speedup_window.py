"""View → Batching and speculative decoding: the two speed-ups, measured on the loaded model.

Each tab is a tool (app/batching_tool.py, app/speculative_tool.py) that submits its runs to
the main window's session, so the model is loaded once; a run asked for while another job
uses the model waits its turn and says so.
"""

from __future__ import annotations

from PySide6.QtWidgets import QMainWindow, QTabWidget, QWidget

from app.batching_tool import BatchingTool
from app.screen import fit_screen
from app.speculative_tool import SpeculativeTool
from engine.base.events import Loaded


class SpeedupWindow(QMainWindow):
    """Batching sweep and speculative decoding on the main window's loaded model."""

    def __init__(self, session, request_for, parent: QWidget | None = None) -> None:
        """``request_for(prompt)`` gives a GenerationRequest with the main window's settings."""
        super().__init__(parent)
        self.setObjectName("speedupWindow")
        self.session = session
        self.batching = BatchingTool(session, request_for)
        self.speculative = SpeculativeTool(session, request_for)
        self.tools = (self.batching, self.speculative)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.batching, "Batching")
        self.tabs.addTab(self.speculative, "Speculative decoding")
        self.setCentralWidget(self.tabs)
        session.loaded.connect(self.set_model)
        session.unloaded.connect(lambda: self.set_model(None))
        self.resize(fit_screen(1200, 780))
        self.set_model(None)

    def set_model(self, info: Loaded | None) -> None:
        for tool in self.tools:
            tool.set_model(info)
        title = "no model loaded" if info is None else f"{info.name} · {info.precision} · {info.device}"
        self.setWindowTitle(f"Inference Workbench — Batching and speculative decoding — {title}")

    def set_loading(self, loading: bool) -> None:
        for tool in self.tools:
            tool.set_loading(loading)

    def closeEvent(self, event) -> None:
        for tool in self.tools:
            tool.stop()  # the main window's model stays loaded; a run in progress ends at its next token
        self.session.drop_draft_requested.emit()  # after that run, in the worker's order: the draft is freed
        super().closeEvent(event)
