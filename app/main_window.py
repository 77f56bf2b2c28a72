"""The main window: model and generation panels, the conversation, four live plots, a status bar."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QDockWidget,
    QFileDialog,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QWidget,
)

from app.frame_budget import FrameBudget
from app.load_feedback import LoadFeedback
from app.main_menus import build_menus
from app.screen import fit_screen, scrolling
from app.tool_windows import ToolWindows
from app.tour import offer, open_tour
from app.transcript import Transcript, ending
from app.widgets.generation_panel import GenerationPanel
from app.widgets.live_plots import LivePlots
from app.widgets.model_panel import ModelPanel
from app.widgets.output_view import OutputView
from app.widgets.prompt_box import PromptBox
from app.widgets.server_panel import ServerPanel
from app.widgets.status_line import StatusLine
from app.worker import ModelSession
from engine.base.events import Finished, Loaded
from engine.base.units import format_bytes, format_rate, format_seconds
from engine.endpoint.stream import served_line
from engine.runs import Run
from engine.storage import history

log = logging.getLogger(__name__)


REFRESH_MS = 50  # the plots and the text redraw at 20 Hz, never per token
SHUTDOWN_MS = 2000
NARROW_WIDTH = 1200
"""Below this many pixels the plots stand in one column, two at a time (MainWindow._default_sizes)."""
SERVER_SHUTDOWN_MS = 10000
DEFAULT_BUDGET = 0.02
PACES = (  # share of a CPU core the GUI thread may spend redrawing while the model generates
    (0.25, "Smooth (up to 20 redraws/s; slows generation on few cores)"),
    (DEFAULT_BUDGET, "Balanced (2% of a core)"),
    (0.005, "Fastest generation (0.5% of a core)"),
)


class MainWindow(QMainWindow):
    generation_finished = Signal(object)  # Finished: this window's answer ended (after the window updated)
    generation_failed = Signal(object)  # Exception: it failed (a partial run, if any, rides on it)

    def __init__(self, settings: QSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("mainWindow")
        self.setWindowTitle("Inference Workbench")
        self.settings = settings
        self.transcript = Transcript()
        self.run = Run()  # the answer being shown: the current turn's run, read by the plots and the status bar
        self.loaded: Loaded | None = None
        self.loading = False
        self.generating = False
        self._error_box: QMessageBox | None = None
        self.tools = ToolWindows(self)
        self.history_opened = self.tools.history_opened
        self.feedback = LoadFeedback(self)
        self._loading_default = False
        self._load_request = None  # what the load in progress was asked for
        self._generate_after_load: str | None = None  # a prompt waiting for the panel's choice to load
        self.job: int | None = None  # the session's id of this window's generation

        self.session = ModelSession("main", self)
        self.output = OutputView(self.transcript)
        self.prompt = PromptBox()
        self.model_panel = ModelPanel()
        self.generation_panel = GenerationPanel()
        self.plots = LivePlots()

        splitter = QSplitter(Qt.Vertical)
        splitter.addWidget(self.output)
        splitter.addWidget(self.prompt)
        splitter.setStretchFactor(0, 1)
        self.setCentralWidget(splitter)
        self.splitter = splitter
        self.prompt.message_shown.connect(self._fit_prompt)
        self._docks: dict[str, QDockWidget] = {}
        # the side panels scroll rather than force a window taller than a laptop screen
        self._add_dock("model", "Model", scrolling(self.model_panel), Qt.LeftDockWidgetArea)
        self._add_dock("generation", "Generation", scrolling(self.generation_panel), Qt.LeftDockWidgetArea)
        self.server_panel = ServerPanel(self.session)
        self.server_panel.traffic_open_clicked.connect(self.open_traffic)
        # it scrolls too: unscrolled, its height was the tab group's minimum, which left the Model
        # panel 119 px of a 700-px window
        self._add_dock("server", "Server", scrolling(self.server_panel), Qt.LeftDockWidgetArea)
        self.tabifyDockWidget(self._docks["generation"], self._docks["server"])
        self._docks["generation"].raise_()
        titles = {"speed": "Tokens / second", "latency": "Per-token latency", "kv": "KV cache", "memory": "Memory"}
        for key, panel in self.plots.panels.items():
            self._add_dock(key, titles[key], panel, Qt.RightDockWidgetArea)
        self.splitDockWidget(self._docks["speed"], self._docks["kv"], Qt.Horizontal)
        self.splitDockWidget(self._docks["speed"], self._docks["latency"], Qt.Vertical)
        self.splitDockWidget(self._docks["kv"], self._docks["memory"], Qt.Vertical)
        self._default_state = self.saveState()
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.budget = FrameBudget(DEFAULT_BUDGET)
        self._plot_turn = 0
        self.status = StatusLine(self.statusBar())
        build_menus(self, PACES)
        self.timer.timeout.connect(self._on_refresh)

        worker = self.session
        worker.devices_found.connect(self._on_devices_found)
        worker.models_found.connect(self._on_models_found)
        worker.load_progressed.connect(self.feedback.on_progress)
        worker.loaded.connect(self._on_loaded)
        worker.load_failed.connect(self._on_load_failed)
        worker.unloaded.connect(self._on_unloaded)
        worker.job_started.connect(self._on_job_started)
        worker.job_events.connect(self._on_job_events)
        worker.job_finished.connect(self._on_job_finished)
        worker.job_failed.connect(self._on_job_failed)
        worker.queue_changed.connect(self._on_queue_changed)
        worker.compile_started.connect(self.feedback.on_compile_started)
        worker.compile_finished.connect(self.feedback.on_compile_finished)
        self.model_panel.load_clicked.connect(self.load)
        self.model_panel.unload_clicked.connect(self.unload)
        self.model_panel.cancel_clicked.connect(self.session.cancel_load)
        self.prompt.generate_clicked.connect(self.generate)
        self.prompt.stop_clicked.connect(self.stop)
        self.prompt.clear_clicked.connect(self.clear_conversation)
        self.prompt.copy_clicked.connect(self.copy_answer)
        self.prompt.save_clicked.connect(self.save_transcript)
        self.prompt.message.linkActivated.connect(lambda link: self.open_tour() if link == "tour" else None)
        QShortcut(QKeySequence(Qt.Key_Escape), self, activated=self._escape)
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=self.prompt._submit)

        self._restore_settings()
        self._update_state()

    # -- construction ----------------------------------------------------------------
    def _add_dock(self, key: str, title: str, widget: QWidget, area) -> None:
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{key}")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        self._docks[key] = dock

    def reset_layout(self) -> None:
        """The docks as they start: for a screen this wide (View → Reset layout, and a first start)."""
        self.restoreState(self._default_state)
        self._default_sizes()

    def _default_sizes(self) -> None:
        """First start: plots get most of the width, the conversation the middle. On a narrow screen
        (under :data:`NARROW_WIDTH`: a 1024-px laptop) four plots side by side would be slivers: they stand in one
        column, two at a time (tokens/sec over the KV cache; latency and memory on the tabs behind)."""
        width = self.width()
        docks = self._docks
        # the Model panel's controls whole (down to Load and Unload), the Generation panel the rest
        side = docks["model"].height() + docks["generation"].height()
        want = self.model_panel.controls_height() + docks["model"].height() - docks["model"].widget().viewport().height()
        if side > 0:
            self.resizeDocks([docks["model"], docks["generation"]], [min(want, int(side * 0.6)), max(1, side - want)],
                             Qt.Vertical)
        if width < NARROW_WIDTH:
            self.splitDockWidget(docks["speed"], docks["kv"], Qt.Vertical)
            self.tabifyDockWidget(docks["speed"], docks["latency"])
            self.tabifyDockWidget(docks["kv"], docks["memory"])
            docks["speed"].raise_()
            docks["kv"].raise_()
            self.resizeDocks([docks["model"], docks["speed"]], [int(width * 0.28), int(width * 0.36)], Qt.Horizontal)
            return
        self.resizeDocks([docks["model"], docks["speed"], docks["kv"]],
                         [int(width * 0.26), int(width * 0.24), int(width * 0.24)], Qt.Horizontal)

    def resizeEvent(self, event) -> None:
        """The side docks keep their share of the width as the window grows or shrinks (Qt gives
        all of a change to the middle: shrunk to a laptop's width and back, the plots stayed slivers)."""
        super().resizeEvent(event)
        old, new = event.oldSize().width(), event.size().width()
        if old <= 0 or new == old or not self.isVisible():
            return
        docks = [d for d in self._docks.values() if d.isVisible() and not d.isFloating() and not d.visibleRegion().isEmpty()
                 and self.dockWidgetArea(d) in (Qt.LeftDockWidgetArea, Qt.RightDockWidgetArea)]
        widths = [max(1, round(d.width() * new / old)) for d in docks]
        QTimer.singleShot(0, lambda: self.resizeDocks(docks, widths, Qt.Horizontal))

    # -- the other windows -------------------------------------------------------------
    def open_compare(self):
        return self.tools.open_compare()

    def open_costs(self):
        return self.tools.open_costs()

    def open_history(self):
        return self.tools.open_history()

    def open_speedups(self):
        return self.tools.open_speedups()

    def open_traffic(self):
        return self.tools.open_traffic()

    def _escape(self) -> None:
        """Esc: leave the tour where its panel is the active window (a tool window shares this
        window's shortcuts, so this one took its Esc), else stop the generation."""
        tour = self.findChild(QDialog, "tour")
        focus = QApplication.focusWidget()
        if tour is not None and tour.isVisible() and (
                QApplication.activeWindow() is tour or (focus is not None and tour.isAncestorOf(focus))):
            tour.reject()
            return
        self.stop()

    def open_tour(self):
        return open_tour(self)

    @property
    def compare(self):
        return self.tools.compare

    @property
    def fetch_dialog(self):
        return self.feedback.fetch_dialog

    def request_for_tool(self, prompt: str):
        """A request with this window's generation settings, for the batching and speculative tools."""
        return self.generation_panel.request_for(prompt, ())

    def _on_queue_changed(self) -> None:
        """Another window's job (a sweep, speculative decoding) may hold the model: the model panel
        waits for the queue to empty; a prompt sent now waits its turn, and says so."""
        self._update_state()
        if self.job is not None and self.job in self.session.waiting():
            running = self.session.describe(self.session.running)
            self.statusBar().showMessage(f"Waiting for the {running or 'job before it'} to finish…")

    @Slot()
    def _fit_prompt(self) -> None:
        """Grow the prompt pane (taking from the answer above) until a message shows whole."""
        sizes = self.splitter.sizes()
        missing = self.prompt.needed_height() - sizes[1]
        if missing > 0 and sizes[0] > missing:
            self.splitter.setSizes([sizes[0] - missing, sizes[1] + missing])

    def set_redraw_budget(self, budget: float) -> None:
        self.budget.budget = budget
        for value, action in self.pace_actions.items():
            action.setChecked(value == budget)

    # -- settings --------------------------------------------------------------------
    def _restore_settings(self) -> None:
        s = self.settings
        geometry = s.value("window/geometry")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        else:
            self.resize(fit_screen(1600, 960))
        state = s.value("window/state")
        if isinstance(state, QByteArray):
            self.restoreState(state)
        else:
            QTimer.singleShot(0, self._default_sizes)
        self.model_panel.restore(s)
        self.generation_panel.restore(s)
        self.show_tokens_action.setChecked(s.value("view/show_tokens", False, type=bool))
        budget = s.value("view/redraw_budget", DEFAULT_BUDGET, type=float)
        self.set_redraw_budget(budget if budget in self.pace_actions else DEFAULT_BUDGET)

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("view/show_tokens", self.show_tokens_action.isChecked())
        s.setValue("view/redraw_budget", self.budget.budget)
        self.model_panel.save(s)
        self.generation_panel.save(s)
        s.sync()

    # -- commands --------------------------------------------------------------------
    def start(self, autoload: bool = True) -> None:
        """After the window is shown: find devices and cached models, then load the model."""
        self.session.probe_requested.emit()
        if autoload:
            self.load(self.model_panel.request())

    @Slot(object)
    def load(self, request) -> None:
        if self.loading or self.generating or self.session.busy:
            return
        self.loading = True
        self._loading_default = request.model == "default"
        self._load_request = request
        self.prompt.show_message("")
        self._update_state()
        self.session.load(request)

    @Slot()
    def unload(self) -> None:
        if not self.loading and not self.generating and not self.session.busy:
            self.session.unload()

    @Slot(str)
    def generate(self, text: str, max_new_tokens: int | None = None) -> None:
        """Answer ``text`` with the Generation panel's settings (``max_new_tokens``: a shorter cap
        for this answer alone, as the tour asks; the status bar and history show what ran)."""
        if self.loaded is None or self.loading or self.generating:
            return
        if not text.strip():
            self.prompt.show_message("The prompt is empty: type something for the model to answer.", "error")
            return
        if self.model_panel.pending():
            # never answer with the old model while the panel shows another: load the choice first
            if self.session.busy:
                running = self.session.describe(self.session.running) or "job"
                self.prompt.show_message(f"The Model panel shows another model than the one loaded, and the "
                                         f"{running} is using the loaded one: wait for it to end (or stop it), "
                                         "then Generate loads your choice.", "error")
                return
            self._generate_after_load = text
            request = self.model_panel.request()
            self.load(request)
            self.prompt.show_message(f"Loading {request.model} ({request.precision}) first, as the Model panel "
                                     "shows; the prompt runs once it is loaded.", "info")
            return
        request = self.generation_panel.request_for(text, self.transcript.history())
        if max_new_tokens is not None:
            request = replace(request, max_new_tokens=max_new_tokens)
        if request.mode == "chat" and request.history and self.transcript.mode == "chat" \
                and request.system_prompt == self.transcript.system_prompt:
            # the next turn continues from the tokens the model read and wrote, not their text again
            request = replace(request, continues=self.transcript.continues())
        if request.mode == "raw":
            self.transcript.clear()
        self.transcript.mode = request.mode
        self.transcript.system_prompt = request.system_prompt
        self.transcript.add_user(text)
        self.run = self.transcript.start_answer(self.loaded.weights_bytes).run
        self.generating = True
        self.prompt.show_message("")
        self.prompt.editor.clear()
        self._update_state()
        self.budget.reset()
        self.timer.start()
        self.job = self.session.ask(request)  # one route: the model's core, served or not
        self._on_queue_changed()  # it may wait behind another window's job

    @Slot()
    def stop(self) -> None:
        if self.generating:
            self.session.cancel(self.job)

    @Slot()
    def say(self, text: str, ms: int = 0) -> None:
        """A message in the status bar; where the figures beside it leave it too little room to be
        read whole (a narrow window), under the prompt too, where it wraps (until the next prompt)."""
        self.statusBar().showMessage(text, ms)
        if not self._message_fits(text):
            self.prompt.show_message(text, "info")
        else:  # the figures beside it are being updated too: look again once they are laid out
            QTimer.singleShot(100, lambda: self._message_fits(text) or self.statusBar().currentMessage() != text
                              or self.prompt.show_message(text, "info"))

    def _message_fits(self, text: str) -> bool:
        """Whether ``text`` has room in the status bar, left of the first figure beside it."""
        bar = self.statusBar()
        lefts = [label.mapTo(bar, label.rect().topLeft()).x() for label in self.status.labels.values()
                 if label.isVisible()]
        room = (min(lefts) if lefts else bar.width()) - 16  # the bar's margin and the message's own
        return bar.fontMetrics().horizontalAdvance(text) <= room

    def restore_conversation(self, turns: list, mode: str, system_prompt: str | None) -> None:
        """Put back an earlier conversation (the tour's turns leave when it ends); the plots show
        its last answer's run. Not while an answer streams: that answer's turn stays."""
        if self.generating:
            return
        self.transcript.clear()
        self.transcript.turns.extend(turns)
        self.transcript.mode, self.transcript.system_prompt = mode, system_prompt
        current = self.transcript.current
        self.run = current.run if current is not None else Run(self.loaded.weights_bytes if self.loaded else None)
        self.output.rerender()
        self._final_refresh()

    def clear_conversation(self) -> None:
        if self.generating:
            return
        self.transcript.clear()
        self.run = Run(self.loaded.weights_bytes if self.loaded else None)
        self.output.rerender()
        self._final_refresh()

    @Slot()
    def copy_answer(self) -> None:
        QGuiApplication.clipboard().setText(self.transcript.last_answer())

    @Slot()
    def save_transcript(self, path: str | None = None) -> Path | None:
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Save transcript", "transcript.md",
                                                  "Markdown (*.md);;JSON with every token (*.json)")
            if not path:
                return None
        target = Path(path)
        text = self.transcript.to_json() if target.suffix.lower() == ".json" else self.transcript.to_markdown()
        try:
            target.write_text(text, encoding="utf-8")
        except OSError as exc:
            self.prompt.show_message(f"Could not save the transcript: {exc}", "error")
            return None
        self.statusBar().showMessage(f"Saved {target}", 5000)
        return target

    # -- worker events (queued into this thread) -----------------------------------------
    @Slot(object)
    def _on_devices_found(self, devices: list) -> None:
        self.model_panel.set_devices(devices)

    @Slot(object)
    def _on_models_found(self, entries: list) -> None:
        self.model_panel.set_entries(entries)

    def _on_loaded(self, info: Loaded) -> None:
        self.feedback.close_fetch_dialog()
        self.loading = False
        self.loaded = info
        self.transcript.model = info
        self.model_panel.show_loaded(info)
        self.model_panel.set_loaded_request(self._load_request)
        self.plots.set_ceiling(None)  # measured for the model before
        self.server_panel.set_model(info.name)
        self.server_panel.model_request = self._load_request  # a load's prediction loads it again to time its steps
        self._update_state()
        self._update_status()
        self.say(f"Loaded {info.name} ({info.precision}) in {format_seconds(info.load_s)}", 5000)
        waiting, self._generate_after_load = self._generate_after_load, None
        if waiting is not None:
            self.generate(waiting)
        else:
            offer(self)  # the first start only

    @Slot(object)
    def _on_load_failed(self, exc: Exception) -> None:
        self.feedback.close_fetch_dialog()
        self.loading = False
        self.model_panel.stage.setText("")  # not the last step it reached: that step is over
        self._update_state()  # the model loaded before (if any) is still loaded and usable
        self.statusBar().clearMessage()
        kept = ""
        if self.loaded is not None and self.model_panel.loaded_request is not None:
            # the panel shows what runs again: the failed choice left in it would be loaded by the next Generate
            self.model_panel.choose(self.model_panel.loaded_request)
            kept = (f"\nStill loaded: {self.loaded.name} ({self.loaded.precision}), unchanged; the Model panel "
                    "shows it again.")
        not_run = ""
        if self._generate_after_load is not None:
            self.prompt.editor.setPlainText(self._generate_after_load)
            self._generate_after_load = None
            not_run = " Your prompt was not sent."
        self._error_box = self.feedback.show_failure(exc, kept + not_run)

    @Slot()
    def _on_unloaded(self) -> None:
        self.loaded = None
        self.plots.set_ceiling(None)
        self.model_panel.show_unloaded()
        self.model_panel.set_loaded_request(None)
        self.server_panel.set_model(None)
        self._update_state()
        self._update_status()

    @Slot(int)
    def _on_job_started(self, job_id: int) -> None:
        if job_id == self.job:
            self.statusBar().showMessage("Generating…")

    @Slot(object, object)
    def _on_job_events(self, job_id: int, events: tuple) -> None:
        if job_id != self.job:
            return
        self.run.extend(events)

    @Slot(object, object)
    def _on_job_finished(self, job_id: int, result) -> None:
        if job_id != self.job:
            self.tools.job_ended()
            return
        self.job = None
        self._on_generation_finished(result)

    @Slot(object, object)
    def _on_job_failed(self, job_id: int, exc: Exception) -> None:
        if job_id == self.job:
            self.job = None
            self._on_generation_failed(exc)

    def _on_generation_finished(self, event: Finished) -> None:
        self.run.finish(event)
        history.remember(self.loaded, event, "single", self.transcript.to_markdown(), self._answer_tokens())
        self._end_generation()
        rate = format_rate(event.decode_tokens_per_s)
        served = ""
        if self.run.answered is not None:  # what the server said, beside what was measured here
            from dataclasses import asdict

            served = f" · {served_line(asdict(self.run.answered))}"
        cached = ""
        if event.cached_tokens:  # the conversation so far was in the prefix cache: found, not computed
            cached = (f", {event.cached_tokens} of {event.prompt_tokens} prompt tokens from the cache; "
                      f"TTFT {format_seconds(event.ttft_s)}")
        if event.prefix_cache_bytes and event.cached_tokens:  # what keeping them costs, beside what it saved
            # (not on a first turn: the status bar has room for one clause, and nothing was saved yet)
            cached += f" (the prefix cache keeps {format_bytes(event.prefix_cache_bytes)})"
        if event.reason == "cancelled":
            said = f"Stopped: {event.tokens} tokens, {rate}{cached}{served}"
        else:
            said = f"Done: {event.tokens} tokens, {rate}{cached}, ended {ending(event.reason)}{served}"
        self.say(said, 15000)
        self.generation_finished.emit(event)

    def _on_generation_failed(self, exc: Exception) -> None:
        message = str(exc) or type(exc).__name__
        partial = getattr(exc, "finished", None)  # e.g. NaN scores: the run up to there is kept, marked failed
        self.run.fail(message, partial)
        if partial is not None:
            history.remember(self.loaded, partial, "single", self.transcript.to_markdown(), self._answer_tokens(),
                     error=message)
        self._end_generation()
        self.statusBar().showMessage("Generation failed (see the message under the prompt)", 8000)
        self.prompt.show_message(message, "error")
        self.generation_failed.emit(exc)

    def _answer_tokens(self) -> list:
        return list(self.run.tokens)

    def _end_generation(self) -> None:
        self.generating = False
        self.timer.stop()
        self._final_refresh()
        self._update_state()

    # -- redraw on a timer -------------------------------------------------------------
    @Slot()
    def _on_refresh(self) -> None:
        """Timer tick, as often as the frame budget allows: the text, the status bar and one plot
        (the next in turn, so a tick pays for a quarter of the plots)."""
        if self.budget.due():
            self.budget.begin()
            self.output.sync()
            self._plot_turn = (self._plot_turn + 1) % len(self.plots.panels)
            self.plots.refresh(self.run, only=list(self.plots.panels)[self._plot_turn])
            self._update_status()
            QTimer.singleShot(0, self.budget.end)  # runs after the paint events this redraw posted

    def _final_refresh(self) -> None:
        self.output.sync()
        self.plots.refresh(self.run)
        self._update_status()

    def _update_state(self) -> None:
        self.model_panel.set_loading(self.loading, loaded=self.loaded is not None, generating=self.generating)
        self.model_panel.setEnabled(not self.session.busy or self.generating)
        self.prompt.set_state(can_generate=self.loaded is not None and not self.loading, generating=self.generating)
        self.tools.set_loading(self.loading)

    def _update_status(self) -> None:
        self.status.show(self.loaded, self.run)

    # -- shutdown ------------------------------------------------------------------------
    def closeEvent(self, event) -> None:
        self.save_settings()
        self.timer.stop()
        tour = self.findChild(QDialog, "tour")
        if tour is not None:
            tour.close()  # it stops listening, and stops the server it started
        self.tools.close_all()
        serving = self.server_panel.serving
        self.server_panel.stop(now=True)  # every open stream ends with its last chunk before the port closes
        if not self.session.shutdown(SERVER_SHUTDOWN_MS if serving else SHUTDOWN_MS):
            # The worker is inside a step that can't be interrupted (e.g. converting a GGUF
            # tokenizer). Leave now rather than hang or abort on a running QThread.
            log.warning("engine thread still busy after %d ms; exiting", SHUTDOWN_MS)
            self.hard_exit(0)
        super().closeEvent(event)

    hard_exit = staticmethod(os._exit)  # tests replace it
