"""Compare: one prompt through 2–4 lanes side by side, overlaid plots, and a summary of where
they differ. Runs can be exported (JSON with every event, CSV, a PNG per plot) and reopened
read-only without loading any model."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QDockWidget,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.frame_budget import FrameBudget
from app.quality_run import QualityRun
from app.screen import fit_screen, scrolling
from app.widgets.compare_plots import ComparePlots
from app.widgets.compare_summary import SummaryTable
from app.widgets.lane_widget import LaneWidget
from app.widgets.quality_view import QualityView
from engine.base.errors import EngineError
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.measure import compare
from engine.measure.compare import LaneSpec
from engine.models.sources import reference_weights
from engine.storage import history

LADDER = ("fp32", "bf16", "int8", "nf4")
LANES_MIN_HEIGHT = 190
PLOTS_MIN_HEIGHT = 230
SHORT_SCREEN = 900
"""On a screen less tall than this the plots and the summary share the bottom area as tabs."""


class CompareWindow(QMainWindow):
    """The Compare view (View → Compare… in the main window)."""

    run_finished = Signal()
    quality_finished = Signal()  # a quality run ended (done, stopped or failed)
    closed = Signal()  # its lanes' models are freed and their threads ended: the window is done

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("compareWindow")
        self.setWindowTitle("Inference Workbench — Compare")
        self.lanes: list[LaneWidget] = []
        self.running = False
        self.read_only = False
        self.request: GenerationRequest | None = None
        self.schedule = "fair"
        self._queue: list[LaneWidget] = []
        self._scores_pending: set[int] = set()
        self.summary: list[compare.LaneSummary] = []
        self._run_after_load: GenerationRequest | None = None  # a run waiting for lanes to (re)load

        self.prompt = QPlainTextEdit()
        self.prompt.setObjectName("comparePrompt")
        self.prompt.setPlaceholderText("One prompt for every lane…")
        self.prompt.setMaximumHeight(56)
        self.mode = QComboBox()
        self.mode.addItem("chat", "chat")
        self.mode.addItem("raw", "raw")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 100_000)
        self.max_tokens.setValue(64)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2_147_483_647)
        self.seed.setValue(0)
        self.seed.setToolTip("The same seed for every lane that samples")
        self.schedule_box = QComboBox()
        self.schedule_box.setObjectName("schedule")
        self.schedule_box.addItem("fair (one lane after another)", "fair")
        self.schedule_box.addItem("concurrent (all at once: contention)", "concurrent")
        self.run_button = QPushButton("Run")
        self.run_button.setObjectName("runButton")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.ladder_button = QPushButton("Quantization ladder")
        self.ladder_button.setToolTip("Lane 1's model at fp32, bf16, int8 and nf4")
        self.ladder_button.clicked.connect(self.ladder)
        self.quality_button = QPushButton("Quality")
        self.quality_button.setObjectName("qualityButton")
        self.quality_button.setToolTip("Every lane reads the same text (about 30,000 tokens): its perplexity, and its "
                                       "KL divergence from lane 1, as llama.cpp's perplexity tool measures them. "
                                       "About 1-2 minutes a lane on two cores for the default model.")
        self.quality_button.clicked.connect(self.quality)
        self.quality_run = None
        self.quality_settings = {"text": None, "ctx": 512, "chunks": None}  # the shipped text, llama.cpp's ctx, all
        self._quality_after_load = False
        self.add_button = QPushButton("+ lane")
        self.add_button.clicked.connect(lambda: self.add_lane())
        self.remove_button = QPushButton("− lane")
        self.remove_button.clicked.connect(self.remove_lane)
        self.export_button = QPushButton("Export…")
        self.export_button.clicked.connect(lambda: self.export())
        self.open_button = QPushButton("Open run…")
        self.open_button.clicked.connect(lambda: self.open_run())
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setObjectName("compareMessage")

        # settings, then actions: two rows, so the window fits a 1280-pixel screen
        settings_row, actions = QHBoxLayout(), QHBoxLayout()
        for label, widget in (("mode", self.mode), ("max tokens", self.max_tokens), ("seed", self.seed),
                              ("schedule", self.schedule_box)):
            settings_row.addWidget(QLabel(label))
            settings_row.addWidget(widget)
        settings_row.addStretch(1)
        for button in (self.run_button, self.stop_button, self.ladder_button, self.quality_button, self.add_button,
                       self.remove_button):
            actions.addWidget(button)
        actions.addStretch(1)
        for button in (self.export_button, self.open_button):
            actions.addWidget(button)
        lanes = QWidget()
        self.lane_row = QHBoxLayout(lanes)
        self.lane_row.setContentsMargins(0, 0, 0, 0)
        lane_area = QScrollArea()  # the lanes scroll (sideways with four on a narrow screen) rather than squeeze
        lane_area.setWidget(lanes)
        lane_area.setWidgetResizable(True)
        lane_area.setFrameShape(QFrame.NoFrame)
        lane_area.setMinimumHeight(LANES_MIN_HEIGHT)
        top = QWidget()
        layout = QVBoxLayout(top)
        layout.addWidget(self.prompt)
        layout.addLayout(settings_row)
        layout.addLayout(actions)
        layout.addWidget(self.message)
        layout.addWidget(lane_area, 1)
        self.setCentralWidget(top)

        self.plots = ComparePlots()
        self._plot_turn = 0
        plot_strip = QWidget()
        strip = QHBoxLayout(plot_strip)
        for panel in self.plots.panels.values():
            strip.addWidget(panel)
        plot_strip.setMinimumHeight(PLOTS_MIN_HEIGHT)  # readable axes on a short screen: the lanes scroll instead
        self.table = SummaryTable()
        self.reference_note = QLabel("")
        self.reference_note.setObjectName("compareReference")
        self.reference_note.setWordWrap(True)
        summary = QWidget()
        summary_layout = QVBoxLayout(summary)
        summary_layout.setContentsMargins(0, 0, 0, 0)
        summary_layout.addWidget(self.reference_note)
        summary_layout.addWidget(self.table, 1)
        self.quality_view = QualityView()
        docks = []
        # the quality tab scrolls rather than make the window taller than a laptop's screen
        for title, widget in (("Plots", plot_strip), ("Summary", summary), ("Quality", scrolling(self.quality_view))):
            dock = QDockWidget(title, self)
            dock.setObjectName(f"compare_dock_{title.lower()}")
            dock.setWidget(widget)
            self.addDockWidget(Qt.BottomDockWidgetArea, dock)
            docks.append(dock)
        self._docks = docks
        screen = QGuiApplication.primaryScreen()
        if screen is not None and screen.availableGeometry().height() < SHORT_SCREEN:
            # plots above the summary need more height than a laptop has: tabs, the plots first (one
            # tab bar: tabifying docks already split and tabbed left a second, stale one over the plots)
            self.tabifyDockWidget(docks[0], docks[1])
            self.tabifyDockWidget(docks[0], docks[2])
            docks[0].raise_()
            # and the lanes get the rest: their answers in view, not only their controls
            QTimer.singleShot(0, lambda: self.resizeDocks([docks[0]], [PLOTS_MIN_HEIGHT + 40], Qt.Vertical))
        else:
            self.splitDockWidget(docks[0], docks[1], Qt.Vertical)
            self.tabifyDockWidget(docks[1], docks[2])  # the quality run's tab behind the summary
            docks[1].raise_()

        self.timer = QTimer(self)
        self.timer.setInterval(50)
        self.timer.timeout.connect(self._on_tick)
        self.budget = FrameBudget(0.02)
        for _ in range(2):
            self.add_lane()
        self.resize(fit_screen(1500, 950))
        # again once the docks have their tabs: before that, three bottom docks' minimum heights
        # add up and the first resize came out taller than a laptop's screen
        QTimer.singleShot(0, lambda: self.resize(fit_screen(1500, 950)))
        self._update_state()

    # -- lanes -------------------------------------------------------------------------
    def add_lane(self, spec: LaneSpec | None = None) -> LaneWidget | None:
        if len(self.lanes) >= 4 or self.running or self.read_only:
            return None
        lane = LaneWidget(len(self.lanes), self)
        if spec is not None:
            lane.configure(spec)
        elif self.lanes:
            lane.configure(self.lanes[0].spec())
        lane.finished.connect(self._on_lane_finished)
        lane.load_ended.connect(self._on_lane_load_ended)
        lane.scored.connect(self._on_scored)
        lane.state_changed.connect(self._update_state)
        self.lanes.append(lane)
        self.lane_row.addWidget(lane, 1)
        self._update_state()
        return lane

    def remove_lane(self) -> None:
        if len(self.lanes) <= 2 or self.running or self.read_only:
            return
        lane = self.lanes.pop()
        lane.shutdown()
        lane.setParent(None)
        lane.deleteLater()
        self._redraw()  # its curves leave the plots now, not at the next run
        self._update_state()

    def ladder(self) -> None:
        """Fill four lanes with lane 1's model at fp32, bf16, int8 and nf4."""
        if self.running or self.read_only:
            return
        base = self.lanes[0].spec()
        while len(self.lanes) < len(LADDER):
            self.add_lane()
        for lane, precision in zip(self.lanes, LADDER):
            lane.configure(LaneSpec(base.model, precision, base.device, base.sampling))

    # -- running -----------------------------------------------------------------------
    def _request(self) -> GenerationRequest:
        # every lane computes the whole prompt: a rerun's TTFT is measured cold, never the prefix cache's
        return GenerationRequest(prompt=self.prompt.toPlainText(), mode=self.mode.currentData(),
                                 max_new_tokens=self.max_tokens.value(),
                                 sampling=SamplingParams(seed=self.seed.value()), reuse_prefix=False).validated()

    def run(self) -> None:
        if self.running or self.read_only:
            return
        try:
            request = self._request()
        except EngineError as exc:
            self.show_message(str(exc), error=True)
            return
        stale = [lane for lane in self.lanes if lane.needs_load()]
        if stale:
            # a lane runs what it shows: load what is missing or changed, then run
            self._run_after_load = request
            for lane in stale:
                lane.load()
            names = ", ".join(str(lane.index + 1) for lane in stale)
            self.show_message(f"Loading lane{'s' if len(stale) > 1 else ''} {names} first (not loaded, or set to "
                              "another configuration than the one loaded); the run starts when every lane is ready.")
            self._update_state()
            return
        self._start(request)

    # -- quality (perplexity and KL divergence) ---------------------------------------------
    def quality(self) -> None:
        """Every lane reads the text, lane 1 first (loading what isn't loaded as shown, first)."""
        if self.running or self.read_only:
            return
        stale = [lane for lane in self.lanes if lane.needs_load()]
        if stale:
            self._quality_after_load = True
            for lane in stale:
                lane.load()
            self.show_message("Loading the lanes first; the quality run starts when every lane is ready.")
            self._update_state()
            return
        self._start_quality()

    def _start_quality(self) -> None:
        self.running = True
        self.quality_run = run = QualityRun(self.lanes, parent=self, **self.quality_settings)
        run.progressed.connect(lambda lane, text: lane._set_status(text))
        run.overall.connect(self.show_message)
        run.finished.connect(self._on_quality_finished)
        run.failed.connect(self._on_quality_failed)
        self.show_message("Quality: every lane reads the same text, lane 1 first (the reference).")
        self._docks[2].raise_()
        self._update_state()
        run.start()

    def _on_quality_finished(self, rows) -> None:
        self.running = False
        self.quality_view.show_rows(rows)
        self._docks[2].raise_()
        self.show_message("Quality: done. The Quality tab has each lane's perplexity and KL divergence from lane 1.")
        self._update_state()
        self.quality_finished.emit()

    def _on_quality_failed(self, message: str) -> None:
        self.running = False
        if self.quality_run is not None and self.quality_run.rows:
            self.quality_view.show_rows(self.quality_run.rows)
        self.show_message(message, error=True)
        self._update_state()
        self.quality_finished.emit()

    @Slot(object)
    def _on_lane_load_ended(self, lane: LaneWidget) -> None:
        if self._quality_after_load and not any(l.loading for l in self.lanes):
            self._quality_after_load = False
            failed = [l for l in self.lanes if l.needs_load()]
            if failed:
                self.show_message("Quality not run: lane(s) " + ", ".join(str(l.index + 1) for l in failed)
                                  + " did not load the configuration shown.", error=True)
                self._update_state()
            else:
                self._start_quality()
            return
        request = self._run_after_load
        if request is None or any(l.loading for l in self.lanes):
            return
        self._run_after_load = None
        failed = [l for l in self.lanes if l.needs_load()]
        if failed:
            names = ", ".join(str(l.index + 1) for l in failed)
            self.show_message(f"Not run: lane{'s' if len(failed) > 1 else ''} {names} did not load the "
                              "configuration shown (see the lane's status).", error=True)
            self._update_state()
            return
        self._start(request)

    def _start(self, request: GenerationRequest) -> None:
        self.request = request
        self.schedule = self.schedule_box.currentData()
        self.summary = []
        self.table.setRowCount(0)
        self.running = True
        self.show_message("")
        self.budget.reset()
        self.timer.start()
        if self.schedule == "fair":
            self._queue = list(self.lanes[1:])
            self.lanes[0].start(request)
        else:
            self._queue = []
            for lane in self.lanes:
                lane.start(request)
        self._update_state()

    def stop(self) -> None:
        self._queue = []
        if self.quality_run is not None and self.quality_run.running:
            self.quality_run.stop()
        if self._run_after_load is not None:
            self._run_after_load = None
            for lane in self.lanes:
                if lane.loading:
                    lane.session.cancel_load()
            self.show_message("Run cancelled before it started.")
        for lane in self.lanes:
            if lane.generating:
                lane.stop()

    @Slot(object)
    def _on_lane_finished(self, lane: LaneWidget) -> None:
        if not self.running:
            return
        if self._queue:
            self._queue.pop(0).start(self.request)
            return
        if any(l.generating for l in self.lanes):
            return
        self._score()

    def _score(self) -> None:
        """Every lane's model scores lane 1's answer (teacher forcing); the summary follows."""
        reference = self.lanes[0].run.finished
        if reference is None:
            self._finish_run()
            return
        self._scores_pending = {lane.index for lane in self.lanes if lane.loaded is not None}
        for lane in self.lanes:
            if lane.loaded is not None:
                lane.score(self.request, reference.token_ids)
        if not self._scores_pending:
            self._finish_run()

    def _on_scored(self, lane: LaneWidget, prompt_ids, scores) -> None:
        lane.run.prompt_ids = None if prompt_ids is None else list(prompt_ids)
        lane.run.reference_scores = scores
        self._scores_pending.discard(lane.index)
        if not self._scores_pending and self.running:
            self._finish_run()

    def _finish_run(self) -> None:
        for lane in self.lanes:
            if lane.run.finished is not None:
                history.remember(lane.loaded, lane.run.finished, "compare", tokens=lane.run.tokens, error=lane.run.error)
        self.running = False
        self.timer.stop()
        self._redraw()
        self._show_summary()
        self._update_state()
        self.run_finished.emit()

    def _show_summary(self) -> None:
        runs = [lane.run for lane in self.lanes]
        self.summary = compare.summary_rows(runs)
        self.table.show_rows(self.summary, [lane.colour for lane in self.lanes])
        info = self.lanes[0].loaded if self.lanes else None
        self.reference_note.setText("" if info is None or not self.summary else
                                    "Agreement and Δ logprob are read against lane 1: " + reference_weights(
                                        info.original_format, info.precision, served=info.source == "endpoint"))
        reference = runs[0].finished
        for lane, values in zip(self.lanes, self.summary):
            same_tokens = values.token_agreement is not None
            lane.show_divergence(list(reference.token_ids) if reference is not None and same_tokens else None)

    # -- redraw ------------------------------------------------------------------------
    @Slot()
    def _on_tick(self) -> None:
        if self.budget.due():
            self.budget.begin()
            # one plot a tick, the next in turn: a tick pays for a quarter of the plots
            self._plot_turn = (self._plot_turn + 1) % len(self.plots.panels)
            self._redraw(only=list(self.plots.panels)[self._plot_turn])
            QTimer.singleShot(0, self.budget.end)

    def _redraw(self, only: str | None = None) -> None:
        for lane in self.lanes:
            lane.sync()
        self.plots.refresh(self.lanes, only)

    # -- export and reopen ---------------------------------------------------------------
    def record(self) -> dict:
        if self.request is None:
            raise EngineError("Nothing to export yet: run a comparison first.")
        return compare.to_record([lane.run for lane in self.lanes], self.request, self.schedule)

    def export(self, path: str | Path | None = None) -> list[Path]:
        """``NAME.json`` (settings and every event), ``NAME.csv`` (the summary), ``NAME-PLOT.png``."""
        if path is None:
            chosen, _ = QFileDialog.getSaveFileName(self, "Export comparison", "comparison.json", "JSON (*.json)")
            if not chosen:
                return []
            path = chosen
        target = Path(path).with_suffix(".json")
        try:
            data = self.record()
            target.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
            compare.write_csv(target.with_suffix(".csv"), self.summary)
            written = [target, target.with_suffix(".csv")]
            for name, panel in self.plots.panels.items():
                png = target.with_name(f"{target.stem}-{name}.png")
                panel.grab().save(str(png))
                written.append(png)
        except (OSError, EngineError) as exc:
            self.show_message(f"Could not export: {exc}", error=True)
            return []
        self.show_message(f"Exported {len(written)} files next to {target}.")
        return written

    def open_run(self, path: str | Path | None = None) -> bool:
        """Show a saved comparison exactly as it was, read-only, without loading any model."""
        if path is None:
            chosen, _ = QFileDialog.getOpenFileName(self, "Open a saved comparison", filter="JSON (*.json)")
            if not chosen:
                return False
            path = chosen
        try:
            runs, request, schedule = compare.from_record(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, EngineError) as exc:
            self.show_message(f"Could not open {path}: {exc}", error=True)
            return False
        if self.running:
            return False
        while len(self.lanes) < len(runs):
            self.add_lane()
        while len(self.lanes) > len(runs):
            lane = self.lanes.pop()
            lane.shutdown()
            lane.setParent(None)
        self.read_only = True
        self.request, self.schedule = request, schedule
        self.prompt.setPlainText(request.prompt)
        self.mode.setCurrentIndex(self.mode.findData(request.mode))
        self.max_tokens.setValue(request.max_new_tokens)
        self.seed.setValue(request.sampling.seed or 0)
        self.schedule_box.setCurrentIndex(self.schedule_box.findData(schedule))
        for lane, run in zip(self.lanes, runs):
            lane.show_saved(run)
        self._redraw()
        self._show_summary()
        self.setWindowTitle(f"Inference Workbench — Compare — {Path(path).name} (saved run, read-only)")
        self.show_message(f"Showing the saved run {path} (read-only: no model is loaded).")
        self._update_state()
        return True

    # -- state -------------------------------------------------------------------------
    def show_message(self, text: str, error: bool = False) -> None:
        self.message.setText(text)
        self.message.setStyleSheet("color: #c0392b;" if error else "")

    def _update_state(self) -> None:
        idle = not self.running and not self.read_only
        busy_lanes = any(lane.loading or lane.generating for lane in self.lanes)
        self.run_button.setEnabled(idle and not busy_lanes)
        self.stop_button.setEnabled(self.running or self._run_after_load is not None)
        self.quality_button.setEnabled(idle and not busy_lanes)
        for widget in (self.ladder_button, self.add_button, self.remove_button, self.prompt, self.mode,
                       self.max_tokens, self.seed, self.schedule_box):
            widget.setEnabled(idle)
        self.add_button.setEnabled(idle and len(self.lanes) < 4)
        self.remove_button.setEnabled(idle and len(self.lanes) > 2)
        self.export_button.setEnabled(not self.running and self.request is not None)
        self.open_button.setEnabled(not self.running)

    def shutdown(self) -> bool:
        self.timer.stop()
        return all([lane.shutdown() for lane in self.lanes])

    def closeEvent(self, event) -> None:
        """Closing frees every lane's model (a closed window must not keep gigabytes loaded)."""
        self.stop()
        self.shutdown()
        super().closeEvent(event)
        self.closed.emit()
