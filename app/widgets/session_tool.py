"""A tool that runs one kind of job on the main window's loaded model: its Run/Stop controls,
its job in the session's queue (a run asked for while another job runs waits, and says so),
and its redraw on a ~20 Hz timer, never per event. The batching sweep and speculative decoding
are two of them (app/batching_tool.py, app/speculative_tool.py)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QPushButton, QSplitter, QVBoxLayout, QWidget

from engine.base.errors import CancelledError
from engine.base.events import Loaded

REFRESH_MS = 50
DEFAULT_PROMPT = "Explain microservices in simple terms."
REJECTED = "#c0392b"


class ToolControls(QWidget):
    """A form with Run / Stop and a one-line status."""

    def __init__(self) -> None:
        super().__init__()
        self.form = QFormLayout()
        self.run = QPushButton("Run")
        self.stop = QPushButton("Stop")
        self.stop.setEnabled(False)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setObjectName("speedupStatus")
        self.status.setTextInteractionFlags(Qt.TextSelectableByMouse)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run)
        buttons.addWidget(self.stop)
        layout = QVBoxLayout(self)
        layout.addLayout(self.form)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        layout.addStretch(1)


class SessionTool(QWidget):
    """Subclasses build their page around :attr:`controls`, submit with :meth:`submit`, and
    implement ``on_events``, ``on_finished`` and ``draw``."""

    updated = Signal()  # after a redraw (tests wait on it)
    finished = Signal(object)  # the run's result, once the page shows it
    failed = Signal(str)  # what stopped it ("Stopped." for a cancel)
    needs = ""
    """What it measures, said when a model served elsewhere is loaded (these tools run the
    model's own engine, which an endpoint doesn't lend)."""

    def __init__(self, session, request_for) -> None:
        """``request_for(prompt)`` gives a GenerationRequest with the main window's settings."""
        super().__init__()
        self.session = session
        self.request_for = request_for
        self.info: Loaded | None = None
        self.loading = False  # the main window is loading a model into the session
        self.running = False  # from submitted until its job ends
        self.job: int | None = None  # its id in the session's queue
        self._dirty = False
        self.controls = ToolControls()
        self.controls.run.clicked.connect(self.start)
        self.controls.stop.clicked.connect(self.stop)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        session.job_started.connect(self._on_job_started)
        session.job_events.connect(self._on_job_events)
        session.job_finished.connect(self._on_job_finished)
        session.job_failed.connect(self._on_job_failed)
        session.queue_changed.connect(self._on_queue_changed)

    # -- for subclasses --------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def on_events(self, events: tuple) -> None:
        raise NotImplementedError

    def on_finished(self, result) -> None:
        raise NotImplementedError

    def draw(self) -> None:
        raise NotImplementedError

    def set_page(self, content: QWidget, controls_width: int) -> None:
        """The tool's page: its controls on the left, ``content`` taking the rest."""
        page = QSplitter(Qt.Horizontal)
        page.addWidget(self.controls)
        page.addWidget(content)
        page.setStretchFactor(1, 1)
        page.setSizes([controls_width, 1200 - controls_width])
        QVBoxLayout(self).addWidget(page)

    def submit(self, job, status: str) -> None:
        self._set_running(True)
        self.controls.status.setText(status)
        self.job = self.session.submit(job)
        self._on_queue_changed()  # it may wait behind another job

    @property
    def served_elsewhere(self) -> bool:
        return self.info is not None and self.info.source == "endpoint"

    def can_start(self) -> bool:
        if self.info is None:
            self.controls.status.setText("Load a model in the main window first.")
            return False
        if self.served_elsewhere:
            self.controls.status.setText(self.needs)
            return False
        if self.loading:
            self.controls.status.setText("The model is loading: wait for it to be ready.")
            return False
        if self.running:
            self.controls.status.setText("This run is still going: stop it or wait for it to end.")
            return False
        return True

    def mark_dirty(self) -> None:
        self._dirty = True

    # -- the session's jobs ----------------------------------------------------------------
    def _on_job_started(self, job_id: int) -> None:
        if job_id == self.job and self.controls.status.text().startswith("Waiting"):
            self.controls.status.setText("Running …")

    def _on_job_events(self, job_id: int, events: tuple) -> None:
        if job_id == self.job:
            self.on_events(events)

    def _on_job_finished(self, job_id: int, result) -> None:
        if job_id == self.job:
            self.job = None
            self._set_running(False)
            self.on_finished(result)
            self.refresh()
            self.finished.emit(result)

    def _on_job_failed(self, job_id: int, exc) -> None:
        if job_id != self.job:
            return

        self.job = None
        self._set_running(False)
        self.refresh()
        if isinstance(exc, CancelledError):
            self.controls.status.setText("Stopped.")
            self.failed.emit("Stopped.")
            return
        message = str(exc) or type(exc).__name__
        self.controls.status.setText(f"<span style='color:{REJECTED}'>{message}</span>")
        self.failed.emit(message)

    def _on_queue_changed(self) -> None:
        if self.job is not None and self.job in self.session.waiting():
            running = self.session.describe(self.session.running) or "job before it"
            self.controls.status.setText(f"Waiting for the {running} to finish …")

    # -- state -----------------------------------------------------------------------------
    @Slot()
    def refresh(self) -> None:
        if not self._dirty and self.running:
            return
        self._dirty = False
        self.draw()
        self.updated.emit()

    def _set_running(self, running: bool) -> None:
        self.running = running
        if running:
            self.timer.start()
        else:
            self.timer.stop()
        self.update_state()

    @Slot()
    def stop(self) -> None:
        if self.running:
            self.session.cancel(self.job)

    def set_model(self, info: Loaded | None) -> None:
        self.info = info
        if self.served_elsewhere and not self.running:
            self.controls.status.setText(self.needs)
        elif self.controls.status.text() == self.needs:
            self.controls.status.setText("")
        self.update_state()

    def set_loading(self, loading: bool) -> None:
        self.loading = loading
        self.update_state()

    def update_state(self) -> None:
        self.controls.run.setEnabled(self.info is not None and not self.served_elsewhere and not self.loading
                                     and not self.running)
        self.controls.stop.setEnabled(self.running)
