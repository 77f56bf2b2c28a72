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

from app.background import Background
from app.frame_budget import FrameBudget
from app.glossary import link_headers
from app.screen import fit_screen, scrolling
from app.transcript import Transcript, Turn
from app.widgets.live_plots import PlotPanel
from app.widgets.output_view import OutputView
from app.widgets.traffic_plots import TrafficPlots
from engine.base.errors import EngineError
from engine.base.units import format_bytes, format_rate, parse_numbers
from engine.endpoint import api_key_from_env, parse_endpoint
from engine.load.generator import LoadPlan, LoadRunner, setting_label
from engine.load.metrics import not_completed
from engine.load.prompts import read_prompts
from engine.load.report import ms, remember, ttft_split, write_csv, write_json
from engine.models.precision import dtype_bytes
from engine.storage.history import load_all

REFRESH_MS = 50
GROUPS = 4
FRAME_BUDGET = 0.1
"""Share of a core the view's redraws may take while the server runs."""
"""The plots redraw a group per tick, in turn (each group about 5 times a second)."""
RESULT_COLUMNS = ("setting", "done", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "TPOT p99", "E2E p50",
                  "not done", "predicted out tok/s", "predicted TTFT p50", "predicted TPOT p50",
                  "server's own TTFT", "predicted server's own TTFT")
OWN_TTFT_TIP = ("The server's own mean time to first token, read from its /metrics (vLLM's and SGLang's histogram, "
                "and this app's): from the request's arrival at the server. The client's mean TTFT less it is "
                "what lies between them (the network, the HTTP side waiting for a core). Beside it, the "
                "prediction's: where a predicted TTFT is off, this says whether the engine's steps or the "
                "front end are.")
PREDICT_TIP = ("Before the load runs, the serving simulator predicts each setting (hollow points, dashed): the "
               "engine's scheduler on a simulated clock, each step timed from this model's steps measured here (the "
               "model loaded again for it, its steps timed for about half a minute the first time), and the "
               "server's front end fitted to short loads of 1 user, a full batch and an open loop. Then the load "
               "measures each setting (filled points). This app's server, exact answer lengths.")


THIS_SERVER = "this app's server"
SERIES_COLOURS = ("#e67e22", "#27ae60", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d")
"""Earlier loads in the history, one colour per server and model (this load's points are blue)."""


class LoadBox(QGroupBox):
    """The load generator (engine/load) pointed at this server or any OpenAI-compatible one:
    closed-loop concurrency or Poisson arrivals, bounded in requests and time, each setting a row
    and a point on the chart, beside the loads of the history (other servers, other days), which
    every finished load joins."""

    _request_done = Signal(str, object)  # setting label, RequestResult (from the load's thread)
    _setting_done = Signal(object)  # SettingResult
    _ended = Signal(object, object)  # results, error
    _predicted = Signal(str, object)  # setting label, what the serving simulator predicts for it (Simulated)
    _said = Signal(str)  # a line for the status, from the load's thread
    load_ended = Signal(object, object)  # results, error: after the box shows them

    def __init__(self, panel, parent: QWidget | None = None) -> None:
        super().__init__("Load generator", parent)
        self.panel = panel
        self.runner = None
        self.results: list = []
        self._plan = None
        self._load_id: str | None = None
        self.history: list = []  # earlier loads (history records of kind "load")
        self.background = Background(self)
        self.target = QComboBox()
        self.target.setObjectName("loadTarget")
        self.target.setEditable(True)
        self.target.setInsertPolicy(QComboBox.NoInsert)
        self.target.addItem(THIS_SERVER, None)
        self.target.setToolTip("This app's server (Server panel), or any OpenAI-compatible API: "
                               "http://HOST:PORT/v1 (vLLM, SGLang, llama.cpp, Ollama…)")
        self.key = QLineEdit()
        self.key.setObjectName("loadKey")
        self.key.setEchoMode(QLineEdit.Password)
        self.key.setPlaceholderText("none, or from $INFERENCE_WORKBENCH_API_KEY / $OPENAI_API_KEY")
        self.key.setToolTip("For another server. Never saved.")
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
        self.predict = QCheckBox("predict each setting first (serving simulator)")
        self.predict.setObjectName("loadPredict")
        self.predict.setToolTip(PREDICT_TIP)
        self.exact.toggled.connect(lambda *_: self.update_state())
        self.max_duration = QSpinBox()
        self.max_duration.setRange(5, 3600)
        self.max_duration.setValue(300)
        self.max_duration.setSuffix(" s per setting")
        form = QFormLayout()
        form.addRow("Server", self.target)
        form.addRow("API key", self.key)
        form.addRow("Mode", self.mode)
        form.addRow("Values", self.values)
        form.addRow("Requests", self.requests)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("", self.exact)
        form.addRow("", self.predict)
        form.addRow("Bound", self.max_duration)
        self.run_button = QPushButton("Run load")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.save_button = QPushButton("Save JSON/CSV…")
        self.save_button.clicked.connect(self.save)
        buttons = QHBoxLayout()
        for b in (self.run_button, self.stop_button, self.save_button):
            buttons.addWidget(b)
        self.status = QLabel("Start the server, or name another one, then run a load against it.")
        self.status.setWordWrap(True)
        self.table = QTableWidget(0, len(RESULT_COLUMNS))
        self.table.setHorizontalHeaderLabels(RESULT_COLUMNS)
        link_headers(self.table, {"out tok/s": "throughput", "TTFT p50": "ttft", "TPOT p50": "tpot",
                                  "TPOT p99": "tpot", "E2E p50": "latency"})
        for column in (RESULT_COLUMNS.index("server's own TTFT"), RESULT_COLUMNS.index("predicted server's own TTFT")):
            self.table.horizontalHeaderItem(column).setToolTip(OWN_TTFT_TIP)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.chart = PlotPanel("Throughput vs latency", "One point per setting: output tok/s of all requests "
                               "against each request's time per output token (p50), this load's and the history's "
                               "(other servers, other days). The dashed line is the cost model's ceiling on this "
                               "machine (weights and KV read once per step); hollow points, the serving "
                               "simulator's prediction of each setting, drawn before the load measures it.",
                               "tok/s", "TPOT p50 (ms)")
        self.show_history = QCheckBox("earlier loads from the history")
        self.show_history.setObjectName("showHistory")
        self.show_history.setChecked(True)
        self.show_history.toggled.connect(lambda *_: self._draw_points())
        self.history_points: list = []
        self.points = pg.ScatterPlotItem(size=9, brush=pg.mkBrush("#2d7dd2"), pen=None)
        self.chart.plot.addItem(self.points)
        self.predictions: dict[str, object] = {}  # setting label → the simulator's Summary
        self.simulations: dict[str, object] = {}  # setting label → the simulator's run (its requests)
        self.prediction_error: str | None = None  # why the last load asked to predict got no prediction
        self.predicted = self.chart.plot.plot([], [], pen=pg.mkPen("#2d7dd2", style=Qt.DashLine), symbol="o",
                                              symbolSize=11, symbolBrush=None, symbolPen=pg.mkPen("#2d7dd2", width=1.5))
        self.ceiling = self.chart.plot.plot([], [], pen=pg.mkPen("#7f8c8d", style=Qt.DashLine), symbol="o",
                                            symbolSize=4)
        self.labels: list = []
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        self.table.setMinimumHeight(110)
        self.chart.setMinimumHeight(260)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.show_history)
        layout.addWidget(self.chart, 2)
        self._request_done.connect(self._on_request)
        self._setting_done.connect(self._on_setting)
        self._ended.connect(self._on_ended)
        self._predicted.connect(self._on_predicted)
        self._said.connect(self.status.setText)
        self._done = 0
        self.target.currentTextChanged.connect(lambda *_: self.update_state())
        self.update_state()
        self.reload_history()

    def targets_this_server(self) -> bool:
        return self.target.currentText().strip() in (THIS_SERVER, "")

    def update_state(self) -> None:
        serving = self.panel.started is not None or not self.targets_this_server()
        running = self.runner is not None
        self.run_button.setEnabled(serving and not running)
        self.run_button.setToolTip("" if serving else "Start the server first (Server panel), or name another.")
        self.key.setEnabled(not self.targets_this_server())
        can_predict = self.targets_this_server() and self.exact.isChecked()
        self.predict.setEnabled(can_predict and not running)
        self.predict.setToolTip(PREDICT_TIP if can_predict else
                                "Predicts this app's server with exact answer lengths: choose both to predict.")
        self.stop_button.setEnabled(running)
        self.save_button.setEnabled(bool(self.results) and not running)
        self._draw_ceiling()
        self._draw_points()  # the legend names the ceiling only where it is drawn

    def plan(self):
        values = tuple(parse_numbers(self.values.text(), int if self.mode.currentData() == "concurrency" else float))
        if self.targets_this_server():
            started = self.panel.started
            url, model, key = started.url, started.model_name, self.panel.api_key.text() or None
        else:
            spec = parse_endpoint(self.target.currentText())
            url, model, key = spec.url, spec.model, self.key.text() or api_key_from_env()
        return LoadPlan(url=url, model=model, api_key=key,
                        concurrency=values if self.mode.currentData() == "concurrency" else (),
                        rates=values if self.mode.currentData() == "rate" else (), requests=self.requests.value(),
                        max_tokens=self.max_tokens.value(), ignore_eos=self.exact.isChecked(),
                        max_duration_s=float(self.max_duration.value())).validated()

    @Slot()
    def run(self) -> None:
        if self.runner is not None or self.panel.started is None and self.targets_this_server():
            return
        try:
            plan = self._plan = self.plan()
            prompts = read_prompts()
        except EngineError as exc:
            self.status.setText(str(exc))
            return
        self.results = []
        self.predictions, self.simulations = {}, {}
        self.prediction_error = None
        self.table.setRowCount(0)
        self._done = 0
        self.runner = LoadRunner(plan, prompts, on_request=lambda label, r: self._request_done.emit(label, r),
                                 on_result=self._setting_done.emit)
        runner = self.runner
        predicting = self.predict.isEnabled() and self.predict.isChecked()
        model = getattr(self.panel, "model_request", None)

        import uuid

        self._load_id = load_id = uuid.uuid4().hex

        def work() -> None:
            try:
                if predicting:
                    self._predict(plan, prompts, model)
                results, error = runner.run(), None
                remember(plan, results, load_id)  # every load joins the history: one chart across servers and days
            except Exception as exc:  # shown in the box, never lost
                results, error = [], exc
            try:
                self._ended.emit(results, error)
            except RuntimeError:  # the window was deleted meanwhile
                pass

        threading.Thread(target=work, name="load-generator", daemon=True).start()
        self.status.setText(f"Running {len(plan.settings())} settings × {plan.requests} requests…")
        self.update_state()

    def _predict(self, plan, prompts, model) -> None:
        """Each setting's prediction, before the load runs it (on the load's thread)."""
        from engine.estimates.predict_load import predictor_for, server_meta  # lazy: loads a model to time its steps

        runner = self.runner
        try:
            meta, served = server_meta(plan.url, plan.api_key, plan.model)
            predictor = predictor_for(meta, model if model is not None else "default", prompts, plan.endpoint,
                                      progress=lambda line: self._said.emit(line.removeprefix("predict  ")),
                                      url=plan.url, api_key=plan.api_key, served=served,
                                      cancelled=lambda: runner is None or runner._stopped)
        except EngineError as exc:  # the load is measured all the same
            self.prediction_error = str(exc)
            self._said.emit(f"No prediction: {exc} Measuring the load…")
            return
        for mode, value in plan.settings():
            self._predicted.emit(setting_label(mode, value), predictor.predict_setting(plan, mode, value))
        self._said.emit(f"Predicted {len(plan.settings())} settings; measuring them now…")

    @Slot(str, object)
    def _on_predicted(self, label: str, simulated) -> None:
        self.predictions[label], self.simulations[label] = simulated.summary, simulated
        self._draw_points()

    @Slot()
    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
            self.status.setText("Stopping the load…")

    @Slot(str, object)
    def _on_request(self, label: str, result) -> None:
        self._done += 1
        self.status.setText(f"{label}: {self._done} requests done" + ("" if result.ok else f" (last errored: "
                                                                       f"{result.error})"))

    @Slot(object)
    def _on_setting(self, setting) -> None:
        self.results.append(setting)
        self._done = 0
        s = setting.summary
        row = self.table.rowCount()
        self.table.insertRow(row)
        p = self.predictions.get(setting.label)
        own = setting.server.own_ttft_s() if setting.server is not None else None
        simulated = self.simulations.get(setting.label)
        split = ttft_split(setting, simulated) if simulated is not None else None
        cells = (setting.label, f"{s.completed}/{s.requests}", f"{s.request_throughput:.2f}",
                 f"{s.output_throughput:.1f}" + ("" if s.counted_by == "usage" else "*"), ms(s.ttft, "median"),
                 ms(s.tpot, "median"), ms(s.tpot, "p99"), ms(s.e2e, "median"), s.not_completed(),
                 *((f"{p.output_throughput:.1f}", ms(p.ttft, "median"), ms(p.tpot, "median")) if p is not None
                   else ("", "", "")),
                 f"{own * 1e3:.0f} ms" if own is not None else "—",
                 f"{split.predicted_server_s * 1e3:.0f} ms" if split is not None else "")
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
            summaries = [r.summary for r in results]
            rest = not_completed(sum(s.not_sent for s in summaries), sum(s.errored for s in summaries),
                                 sum(s.cut for s in summaries),
                                 " or ".join(dict.fromkeys(s.cut_by for s in summaries if s.cut)) or None)
            self.status.setText(f"Done: {len(results)} settings" + (f" ({rest})" if rest else "")
                                + ". Tokens counted from the server's usage (* where from chunks).")
        self.update_state()
        self.reload_history()
        self.load_ended.emit(results, error)

    def reload_history(self) -> None:
        """Read the history's loads off the GUI thread; the chart redraws when they arrive."""
        def loads():
            return [r for r in load_all() if r.kind == "load" and r.extra.get("summary", {}).get("tpot")]

        self.background.submit(loads, self._show_history)

    def _show_history(self, records: list) -> None:
        self.history = records
        for record in records:  # the servers loaded before, offered as targets
            url = record.extra.get("url")
            if url and self.target.findText(url) < 0 and (self.panel.started is None or url != self.panel.started.url):
                self.target.addItem(url, url)
        self._draw_points()

    def _history_series(self) -> dict[tuple[str, str], list]:
        """Earlier loads by (server URL, model), this load's settings left out (they are drawn in blue)."""
        series: dict[tuple[str, str], list] = {}
        for record in self.history:
            if record.extra.get("load_id") != self._load_id or not self.results:
                series.setdefault((record.extra.get("url", ""), record.model), []).append(record)
        return series

    def _draw_points(self) -> None:
        xs, ys = [], []
        for label in self.labels:
            self.chart.plot.removeItem(label)
        self.labels = []
        for item in self.history_points:
            self.chart.plot.removeItem(item)
        self.history_points = []
        legend = [("this load", "main", "●")]
        if self.show_history.isChecked():
            for i, ((url, model), records) in enumerate(sorted(self._history_series().items())):
                colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
                points = sorted((r.extra["summary"]["tpot"]["median"] * 1000, r.extra["aggregate_tokens_per_s"])
                                for r in records)
                item = pg.ScatterPlotItem([p[0] for p in points], [p[1] for p in points], size=7,
                                          brush=pg.mkBrush(colour), pen=None, symbol="d")
                self.chart.plot.addItem(item)
                self.history_points.append(item)
                legend.append((f"{model} at {url.split('//')[-1]} ({len(records)})", colour, "◆"))
        if self.targets_this_server() and self.panel.started is not None:
            legend.append(("ceiling", "muted", "╍╍"))  # this machine's: drawn only for this app's server
        self.chart.set_legend(legend)
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
        predicted = [(p.tpot["median"] * 1000, p.output_throughput) for p in self.predictions.values() if p.tpot]
        self.predicted.setData([x for x, _ in predicted], [y for _, y in predicted])
        if predicted:
            legend.insert(1, ("predicted", "main", "○"))
            self.chart.set_legend(legend)
        self._fit()

    def _draw_ceiling(self) -> None:
        started = self.panel.started
        ceilings = started.ceilings if started is not None and self.targets_this_server() else ()
        self.ceiling.setData([1000 * b / c for b, c in ceilings], [c for _, c in ceilings])
        self._fit()

    def _fit(self) -> None:
        """The view around what is drawn: the measured points, the predicted and the ceiling (all
        of each: ``getData`` gives only what the view shows now)."""
        xs, ys = [], []
        for item in (self.points, self.ceiling, self.predicted, *self.history_points):
            x, y = (item.xData, item.yData) if isinstance(item, pg.PlotDataItem) else item.getData()
            if x is not None:
                xs += list(x)
                ys += list(y)
        if xs:
            self.chart.item.setXRange(0, max(xs) * 1.15, padding=0)
            self.chart.item.setYRange(0, max(ys) * 1.15, padding=0)

    @Slot()
    def save(self, path: str | None = None) -> None:
        from pathlib import Path

        if not self.results:
            return
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Save the load's results", "load.json",
                                                  "JSON (*.json);;CSV, a row per setting (*.csv)")
            if not path:
                return
        if str(path).endswith(".csv"):
            write_csv(Path(path), self.results)
        else:
            write_json(Path(path), self._plan, self.results)
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
        self.request_view.setMinimumHeight(140)
        # the request and the load generator keep their room and scroll on a short screen (they were
        # crushed to slivers, the chart to 15 px, even maximised on a laptop)
        splitter = QSplitter(Qt.Horizontal)
        splitter.addWidget(self.plots)
        splitter.addWidget(scrolling(side))
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
                                 f"of {format_bytes(budget)}" + budget_tokens(panel.started))
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
        self.load_box.background.close()
        super().closeEvent(event)


def budget_tokens(started) -> str:
    """What the KV budget holds, in tokens of the cache's dtype (and, for a cache of fewer bits, how
    many times a 16-bit cache's): the requests that fit grow with it."""
    per_token, budget = started.kv_bytes_per_token, started.kv_budget_bytes
    if not per_token or not budget:
        return ""
    tokens = budget // per_token
    text = f" ({tokens:,} tokens in {started.kv_dtype}"
    if started.kv_dtype == "int8":  # the one dtype of fewer bits than 16 a cache keeps here
        text += f": {2 / dtype_bytes('int8'):.2f}× the tokens a 16-bit cache holds"
    return text + ")"
