"""View → Traffic: the server's requests live (app/widgets/traffic_plots.py), one request opened as
token chips, and a load generator aimed at the server, its settings plotted as throughput against
latency beside the cost model's ceiling."""

from __future__ import annotations

import threading

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.frame_budget import FrameBudget
from app.screen import fit_screen
from app.transcript import Transcript, Turn
from app.widgets.live_plots import PlotPanel
from app.widgets.output_view import OutputView
from app.widgets.traffic_plots import TrafficPlots
from engine.errors import EngineError
from engine.load.report import ms
from engine.units import format_bytes, format_rate

REFRESH_MS = 50
GROUPS = 4
FRAME_BUDGET = 0.1
"""Share of a core the view's redraws may take while the server runs."""
"""The plots redraw a group per tick, in turn (each group about 5 times a second)."""
RESULT_COLUMNS = ("setting", "done", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "TPOT p99", "E2E p50")


class LoadBox(QGroupBox):
    """The load generator (engine/load) pointed at this server: closed-loop concurrency or Poisson
    arrivals, bounded in requests and time, each setting a row and a point on the chart."""

    _request_done = Signal(str, object)  # setting label, RequestResult (from the load's thread)
    _setting_done = Signal(object)  # SettingResult
    _ended = Signal(object, object)  # results, error

    def __init__(self, panel, parent: QWidget | None = None) -> None:
        super().__init__("Load generator", parent)
        self.panel = panel
        self.runner = None
        self.results: list = []
        self.mode = QComboBox()
        self.mode.addItem("Concurrency (closed loop)", "concurrency")
        self.mode.addItem("Rate, requests/s (Poisson arrivals)", "rate")
        self.values = QLineEdit("1,4,16")
        self.values.setToolTip("One setting per value, run one after another.")
        self.mode.currentIndexChanged.connect(
            lambda: self.values.setText("1,4,16" if self.mode.currentData() == "concurrency" else "0.5,1,2"))
        self.requests = QSpinBox()
        self.requests.setRange(1, 10000)
        self.requests.setValue(32)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 100000)
        self.max_tokens.setValue(64)
        self.exact = QCheckBox("exactly this many (ignore end of sequence)")
        self.exact.setChecked(True)
        self.max_duration = QSpinBox()
        self.max_duration.setRange(5, 3600)
        self.max_duration.setValue(300)
        self.max_duration.setSuffix(" s per setting")
        form = QFormLayout()
        form.addRow("Mode", self.mode)
        form.addRow("Values", self.values)
        form.addRow("Requests", self.requests)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("", self.exact)
        form.addRow("Bound", self.max_duration)
        self.run_button = QPushButton("Run load")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.save_button = QPushButton("Save JSON…")
        self.save_button.clicked.connect(self.save)
        buttons = QHBoxLayout()
        for b in (self.run_button, self.stop_button, self.save_button):
            buttons.addWidget(b)
        self.status = QLabel("Start the server, then run a load against it.")
        self.status.setWordWrap(True)
        self.table = QTableWidget(0, len(RESULT_COLUMNS))
        self.table.setHorizontalHeaderLabels(RESULT_COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.chart = PlotPanel("Throughput vs latency", "One point per setting: output tok/s of all requests "
                               "against each request's time per output token (p50). The dashed line is the cost "
                               "model's ceiling on this machine (weights and KV read once per step).",
                               "tok/s", "TPOT p50 (ms)")
        self.chart.add_legend("measured", "main", "●")
        self.chart.add_legend("ceiling", "muted", "╍╍")
        self.points = pg.ScatterPlotItem(size=9, brush=pg.mkBrush("#2d7dd2"), pen=None)
        self.chart.plot.addItem(self.points)
        self.ceiling = self.chart.plot.plot([], [], pen=pg.mkPen("#7f8c8d", style=Qt.DashLine), symbol="o",
                                            symbolSize=4)
        self.labels: list = []
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.chart, 2)
        self._request_done.connect(self._on_request)
        self._setting_done.connect(self._on_setting)
        self._ended.connect(self._on_ended)
        self._done = 0
        self.update_state()

    def update_state(self) -> None:
        serving = self.panel.started is not None
        running = self.runner is not None
        self.run_button.setEnabled(serving and not running)
        self.run_button.setToolTip("" if serving else "Start the server first (Server panel).")
        self.stop_button.setEnabled(running)
        self.save_button.setEnabled(bool(self.results) and not running)
        self._draw_ceiling()

    def plan(self):
        from engine.cli_serve import parse_numbers
        from engine.load.generator import LoadPlan

        started = self.panel.started
        values = tuple(parse_numbers(self.values.text(), int if self.mode.currentData() == "concurrency" else float))
        return LoadPlan(url=started.url, model=started.model_name, api_key=self.panel.api_key.text() or None,
                        concurrency=values if self.mode.currentData() == "concurrency" else (),
                        rates=values if self.mode.currentData() == "rate" else (), requests=self.requests.value(),
                        max_tokens=self.max_tokens.value(), ignore_eos=self.exact.isChecked(),
                        max_duration_s=float(self.max_duration.value())).validated()

    @Slot()
    def run(self) -> None:
        from engine.load.generator import LoadRunner
        from engine.load.prompts import read_prompts

        if self.runner is not None or self.panel.started is None:
            return
        try:
            plan = self.plan()
            prompts = read_prompts()
        except EngineError as exc:
            self.status.setText(str(exc))
            return
        self.results = []
        self.table.setRowCount(0)
        self._done = 0
        self.runner = LoadRunner(plan, prompts, on_request=lambda label, r: self._request_done.emit(label, r),
                                 on_result=self._setting_done.emit)
        runner = self.runner

        def work() -> None:
            try:
                results, error = runner.run(), None
            except Exception as exc:  # shown in the box, never lost
                results, error = [], exc
            try:
                self._ended.emit(results, error)
            except RuntimeError:  # the window was deleted meanwhile
                pass

        threading.Thread(target=work, name="load-generator", daemon=True).start()
        self.status.setText(f"Running {len(plan.settings())} settings × {plan.requests} requests…")
        self.update_state()

    @Slot()
    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
            self.status.setText("Stopping the load…")

    @Slot(str, object)
    def _on_request(self, label: str, result) -> None:
        self._done += 1
        self.status.setText(f"{label}: {self._done} requests done" + ("" if result.ok else f" (last failed: "
                                                                       f"{result.error})"))

    @Slot(object)
    def _on_setting(self, setting) -> None:
        self.results.append(setting)
        self._done = 0
        s = setting.summary
        row = self.table.rowCount()
        self.table.insertRow(row)
        cells = (setting.label, f"{s.completed}/{s.requests}", f"{s.request_throughput:.2f}",
                 f"{s.output_throughput:.1f}" + ("" if s.counted_by == "usage" else "*"), ms(s.ttft, "median"),
                 ms(s.tpot, "median"), ms(s.tpot, "p99"), ms(s.e2e, "median"))
        for column, text in enumerate(cells):
            self.table.setItem(row, column, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
        self._draw_points()

    @Slot(object, object)
    def _on_ended(self, results, error) -> None:
        self.runner = None
        if error is not None:
            self.status.setText(f"The load failed: {error}")
        else:
            failed = sum(r.summary.failed for r in results)
            self.status.setText(f"Done: {len(results)} settings" + (f", {failed} requests failed" if failed else "")
                                + ". Tokens counted from the server's usage (* where from chunks).")
        self.update_state()

    def _draw_points(self) -> None:
        xs, ys = [], []
        for label in self.labels:
            self.chart.plot.removeItem(label)
        self.labels = []
        for setting in self.results:
            s = setting.summary
            if s.tpot is None:
                continue
            xs.append(s.tpot["median"] * 1000)
            ys.append(s.output_throughput)
            text = pg.TextItem(setting.label, anchor=(0, 1), color="#2d7dd2")
            text.setPos(xs[-1], ys[-1])
            self.chart.plot.addItem(text)
            self.labels.append(text)
        self.points.setData(xs, ys)
        self._fit()

    def _draw_ceiling(self) -> None:
        started = self.panel.started
        ceilings = started.ceilings if started is not None else ()
        self.ceiling.setData([1000 * b / c for b, c in ceilings], [c for _, c in ceilings])
        self._fit()

    def _fit(self) -> None:
        """The view around what is drawn: the measured points and the ceiling."""
        xs, ys = [], []
        for item in (self.points, self.ceiling):
            x, y = item.getData()
            if x is not None:
                xs += list(x)
                ys += list(y)
        if xs:
            self.chart.item.setXRange(0, max(xs) * 1.15, padding=0)
            self.chart.item.setYRange(0, max(ys) * 1.15, padding=0)

    @Slot()
    def save(self, path: str | None = None) -> None:
        from pathlib import Path

        from engine.load.report import write_json

        if not self.results:
            return
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Save the load's results", "load.json", "JSON (*.json)")
            if not path:
                return
        write_json(Path(path), self.plan(), self.results)
        self.status.setText(f"Saved {path}")


class TrafficWindow(QWidget):
    def __init__(self, panel, parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.Window)
        self.setWindowTitle("Traffic — Inference Workbench")
        self.setObjectName("trafficWindow")
        self.panel = panel
        self.summary = QLabel()
        self.summary.setObjectName("messageArea")
        self.summary.setWordWrap(True)
        self.plots = TrafficPlots()
        self.plots.request_clicked.connect(self.open_request)
        self.request_title = QLabel("Click a request on the timeline to see its prompt and its answer as tokens.")
        self.request_title.setWordWrap(True)
        self.transcript = Transcript()
        self.request_view = OutputView(self.transcript)
        self.request_view.set_show_tokens(True)
        self.shown_request: int | None = None
        self._turn = 0
        self.load_box = LoadBox(panel)
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        request_box = QGroupBox("Request")
        request_layout = QVBoxLayout(request_box)
        request_layout.addWidget(self.request_title)
        request_layout.addWidget(self.request_view, 1)
        side_layout.addWidget(request_box, 2)
        side_layout.addWidget(self.load_box, 3)
        splitter = QSplitter(Qt.Horizontal)
        splitter.addWidget(self.plots)
        splitter.addWidget(side)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([1100, 560])
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(splitter, 1)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self._on_tick)
        self.budget = FrameBudget(FRAME_BUDGET)
        panel.state_changed.connect(self._on_state)
        self.resize(fit_screen(1700, 960))
        self._on_state()

    @Slot()
    def _on_state(self) -> None:
        self.load_box.update_state()
        if self.panel.started is not None:
            self.timer.start()
        self.refresh()

    @Slot()
    def _on_tick(self) -> None:
        """Timer tick, as often as the frame budget allows: the GUI shares the machine with the
        server it draws (and on two cores every ms here is taken from the model)."""
        if self.budget.due():
            self.budget.begin()
            self.refresh()
            QTimer.singleShot(0, self.budget.end)  # after the paint events this redraw posted

    @Slot()
    def refresh(self, everything: bool = False) -> None:
        """The summary line, and the next group of plots in turn (``everything``: all of them)."""
        panel = self.panel
        if panel.started is not None:
            now_rate, kv = panel.log.now_figures()
            budget = panel.started.kv_budget_bytes
            self.summary.setText(f"{panel.summary()} · output {format_rate(now_rate)} · KV cache {format_bytes(kv)} "
                                 f"of {format_bytes(budget)}")
        else:
            self.summary.setText(panel.status.text())
            if self.panel.job is None:
                self.timer.stop()
        self._turn = (self._turn + 1) % GROUPS
        only = None if everything else self._turn
        if self.isVisible() and self.plots.refresh(panel.log, only=only) and self.shown_request is not None:
            self.request_view.sync()
            track = panel.log.requests.get(self.shown_request)
            if track is not None:
                self.request_title.setText(track.describe())

    @Slot(int)
    def open_request(self, request_id: int) -> None:
        track = self.panel.log.requests.get(request_id)
        if track is None:
            return
        self.shown_request = request_id
        self.transcript.clear()
        self.transcript.add_user(track.prompt)
        self.transcript.turns.append(Turn("assistant", run=track.run))
        self.request_view.rerender()
        self.request_title.setText(track.describe())

    def closeEvent(self, event) -> None:
        self.timer.stop()
        self.load_box.stop()
        super().closeEvent(event)
