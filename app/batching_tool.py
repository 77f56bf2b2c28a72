"""View → Batching and speculative decoding, first tab: a batching sweep on the loaded model.

Batch sizes run one after another (every sequence the same prompt and the same number of
tokens, as llama-bench does); the table and plots show throughput against each request's
latency, against the cost model's ceiling, and the memory the batch takes.
"""

from __future__ import annotations

from dataclasses import replace

import pyqtgraph as pg
from PySide6.QtCore import Qt, Slot
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QHeaderView,
    QLabel,
    QLineEdit,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
)

from app.frame_budget import in_turns
from app.glossary import link_headers
from app.widgets.live_plots import PlotPanel
from app.widgets.session_tool import DEFAULT_PROMPT, SessionTool
from engine.base.events import BatchStep
from engine.base.units import format_bytes, format_rate, format_seconds
from engine.jobs import SweepJob, Tagged


def parse_batches(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    if not sizes or sizes[0] < 1 or sizes[-1] > 4096:
        raise ValueError
    return sizes


SWEEP_COLUMNS = ("batch", "tok/s\n(all)", "tok/s\neach", "TTFT", "per\ntoken", "KV\ncache", "activ-\nations",
                 "model's\nmemory", "process\npeak", "% of\nceiling")
"""The sweep table's columns: the model's memory is its weights + KV + activations, the process's
peak holds Python, Qt, PyTorch and every model loaded too."""

class BatchingTool(SessionTool):
    """The sweep's controls, table and three plots."""
    needs = ("Batching sweeps a model loaded here; an endpoint is measured with the load generator "
             "(View → Traffic), which sends it concurrent requests.")

    def __init__(self, session, request_for) -> None:
        super().__init__(session, request_for)
        self._step_text = ""
        self._drawn_points = 0
        c = self.controls
        self.batches = QLineEdit("1,2,4,8,16")
        self.batches.setObjectName("batchSizes")
        self.batches.setToolTip("Batch sizes to run, in order; the sweep stops before one predicted not to fit")
        self.sweep_tokens = QSpinBox()
        self.sweep_tokens.setRange(1, 4096)
        self.sweep_tokens.setValue(64)
        self.sweep_prompt = QLineEdit(DEFAULT_PROMPT)
        self.sweep_prompt.setCursorPosition(0)  # the start of the prompt, not its end
        c.form.addRow("Batch sizes", self.batches)
        c.form.addRow("Tokens per sequence", self.sweep_tokens)
        c.form.addRow("Prompt", self.sweep_prompt)
        note = QLabel("Every sequence in a batch gets the same prompt and makes exactly this many tokens "
                      "(as llama-bench does). The points also appear on the Cost explorer's tok/s-vs-batch chart.")
        note.setWordWrap(True)
        c.form.addRow(note)
        c.run.setText("Run sweep")

        self.tradeoff_plot = PlotPanel(
            "sweep-tradeoff", "Throughput of the whole batch against each request's time per token: batching "
            "buys throughput with a little latency, until compute runs out.", "tokens / s (all requests)",
            "per-token latency (ms)")
        self.tradeoff_curve = self.tradeoff_plot.curve("measured, labelled with the batch size", "main",
                                                       symbol="o", symbolSize=8)
        self.speed_plot = PlotPanel(
            "sweep-speed", "Aggregate decode tok/s against batch size: measured, and the cost model's ceiling for "
            "this hardware (it assumes perfect kernels: the gap is what a faster engine could win).",
            "tokens / s (all requests)", "batch")
        self.speed_curve = self.speed_plot.curve("measured", "main", symbol="o", symbolSize=7)
        self.ceiling_curve = self.speed_plot.curve("predicted ceiling", "third", Qt.DashLine, symbol="t",
                                                   symbolSize=7)
        self.memory_sweep_plot = PlotPanel(
            "sweep-memory", "The model's memory against batch size: its weights (measured from its tensors), "
            "every sequence's KV cache (measured from the cache) and a decode step's activations (read from "
            "PyTorch's allocator during the batch's first decode step, whose time is then left out: the "
            "reading slows it), so it grows with the batch; measured KV against the prediction from the "
            "config. The process's peak, in the table, holds Python, Qt and PyTorch too.",
            "memory", "batch")
        self.peak_curve = self.memory_sweep_plot.curve("weights + KV + activations (measured)", "main",
                                                       symbol="o", symbolSize=7)
        self.kv_curve = self.memory_sweep_plot.curve("KV cache (measured)", "second", symbol="s", symbolSize=7)
        self.kv_predicted_curve = self.memory_sweep_plot.curve("KV cache (predicted)", "second", Qt.DashLine)
        self.sweep_table = QTableWidget(0, len(SWEEP_COLUMNS))
        self.sweep_table.setObjectName("sweepTable")
        self.sweep_table.setHorizontalHeaderLabels(list(SWEEP_COLUMNS))
        self.sweep_table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        link_headers(self.sweep_table, {"batch": "batch", "tok/s\n(all)": "throughput", "TTFT": "ttft",
                                        "per\ntoken": "tpot", "KV\ncache": "kv-cache", "% of\nceiling": "bandwidth"})
        self.sweep_table.verticalHeader().setVisible(False)
        self.sweep_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self._labels: list[pg.TextItem] = []
        self.points: list = []

        plots = QSplitter(Qt.Horizontal)
        for panel in (self.tradeoff_plot, self.speed_plot, self.memory_sweep_plot):
            plots.addWidget(panel)
        right = QSplitter(Qt.Vertical)
        right.addWidget(plots)
        right.addWidget(self.sweep_table)
        right.setStretchFactor(0, 3)
        right.setStretchFactor(1, 1)
        # room for a header and five batch sizes, however short the screen (the plots give way)
        rows = self.sweep_table.verticalHeader().defaultSectionSize()
        self.sweep_table.setMinimumHeight(self.sweep_table.horizontalHeader().sizeHint().height() + 5 * rows + 6)
        self.set_page(right, 280)

    @Slot()
    def start(self) -> None:
        if not self.can_start():
            return
        try:
            sizes = parse_batches(self.batches.text())
        except ValueError:
            self.controls.status.setText("Batch sizes: whole numbers from 1 to 4096, separated by commas.")
            return
        prompt = self.sweep_prompt.text().strip() or DEFAULT_PROMPT
        request = replace(self.request_for(prompt), max_new_tokens=self.sweep_tokens.value(), ignore_eos=True)
        self.points = []
        self._step_text = ""
        self._drawn_points = -1
        self.sweep_table.setRowCount(0)
        for label in self._labels:
            self.tradeoff_plot.plot.removeItem(label)
        self._labels = []
        for panel in (self.tradeoff_plot, self.speed_plot, self.memory_sweep_plot):
            panel.reset_view()
        self.submit(SweepJob(request, tuple(sizes)), f"Running batch {sizes[0]} …")

    def _on_sweep_step(self, batch: int, step: BatchStep) -> None:
        self._step_text = (f"Batch {batch}: step {step.step + 1}, {step.active} sequences active, "
                           f"{format_seconds(step.latency_s)} per step, KV {format_bytes(step.kv_cache_bytes)}")
        self.mark_dirty()

    def _on_sweep_point(self, point) -> None:
        self.points.append(point)
        self._step_text = ""
        row = self.sweep_table.rowCount()
        self.sweep_table.insertRow(row)
        each = point.aggregate_tokens_per_s / point.batch if point.aggregate_tokens_per_s else None
        ceiling = point.predicted_tokens_per_s_ceiling
        share = (f"{100 * point.aggregate_tokens_per_s / ceiling:.0f}%"
                 if ceiling and point.aggregate_tokens_per_s else "n/a")
        if point.ceiling_note:  # beaten even after measuring the bandwidth again: said, not drawn as 112%
            share = "above it (why: hover)"
        for column, text in enumerate((
                str(point.batch), format_rate(point.aggregate_tokens_per_s), format_rate(each),
                format_seconds(point.mean_ttft_s), format_seconds(point.mean_per_token_latency_s),
                format_bytes(point.kv_cache_bytes), format_bytes(point.activation_bytes),
                format_bytes(model_bytes(point)), format_bytes(point.peak_memory_bytes), share)):
            item = QTableWidgetItem(text)
            item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            if column == SWEEP_COLUMNS.index("% of\nceiling") and point.ceiling_note:
                item.setToolTip(point.ceiling_note)
            self.sweep_table.setItem(row, column, item)
        self.mark_dirty()

    def on_events(self, events: tuple) -> None:
        for event in events:
            if isinstance(event, Tagged):
                self._on_sweep_step(event.tag, event.event)
            else:
                self._on_sweep_point(event)

    def on_finished(self, result) -> None:
        points, skipped = list(result.points), list(result.skipped)
        lines = []
        if len(points) >= 2 and points[0].aggregate_tokens_per_s and points[-1].aggregate_tokens_per_s:
            gain = points[-1].aggregate_tokens_per_s / points[0].aggregate_tokens_per_s
            slower = ((points[-1].mean_per_token_latency_s or 0) / (points[0].mean_per_token_latency_s or 1))
            lines.append(f"Batch {points[-1].batch} makes {gain:.1f}× the tokens/sec of batch {points[0].batch}; "
                         f"each request's tokens come {slower:.1f}× slower.")
        lines += [f"Skipped: {s.reason}." for s in skipped]
        if not points and not skipped:
            lines.append("Stopped.")
        self.controls.status.setText(" ".join(lines))

    def draw(self) -> None:
        if self._drawn_points != len(self.points) or not self.running:
            self._drawn_points = len(self.points)
            plots = [self._draw_tradeoff, self._draw_speed, self._draw_memory]
            if self.running:  # one plot per turn of the event loop (each ~10-20 ms with its repaint)
                in_turns(plots, owner=self)
            else:
                for draw in plots:
                    draw()
        if self.running and self._step_text:
            self.controls.status.setText(self._step_text)

    # the three plots change only when a batch size ends (a point): a step changes the status line
    def _draw_tradeoff(self) -> None:
        points = [p for p in self.points if p.aggregate_tokens_per_s and p.mean_per_token_latency_s]
        latency = [1000 * p.mean_per_token_latency_s for p in points]
        speed = [p.aggregate_tokens_per_s for p in points]
        self.tradeoff_curve.setData(latency, speed)
        for label in self._labels[len(points):]:
            self.tradeoff_plot.plot.removeItem(label)
        self._labels = self._labels[:len(points)]
        for i, point in enumerate(points):
            if i == len(self._labels):
                label = pg.TextItem(f"B={point.batch}", anchor=(0, 1), color=self.palette().color(QPalette.WindowText))
                self.tradeoff_plot.plot.addItem(label)
                self._labels.append(label)
            self._labels[i].setPos(latency[i], speed[i])
        if points:
            self.tradeoff_plot.fit(max(latency), max(speed), "tok/s")

    def _draw_speed(self) -> None:
        batches = [p.batch for p in self.points]
        self.speed_curve.setData(batches, [p.aggregate_tokens_per_s or 0 for p in self.points])
        ceilings = [(p.batch, p.predicted_tokens_per_s_ceiling) for p in self.points if p.predicted_tokens_per_s_ceiling]
        self.ceiling_curve.setData([b for b, _ in ceilings], [c for _, c in ceilings])
        top = max([p.aggregate_tokens_per_s or 0 for p in self.points] + [c for _, c in ceilings] + [1])
        if self.points:
            self.speed_plot.fit(max(batches), top, "tok/s")
            self.speed_plot.item.setXRange(0, max(batches) * 1.05, padding=0)

    def _draw_memory(self) -> None:
        batches = [p.batch for p in self.points]
        mib = 2 ** 20
        model = [model_bytes(p) / mib for p in self.points]
        self.peak_curve.setData(batches, model)
        self.kv_curve.setData(batches, [p.kv_cache_bytes / mib for p in self.points])
        self.kv_predicted_curve.setData(batches, [(p.kv_cache_bytes_predicted or 0) / mib for p in self.points])
        if self.points:
            self.memory_sweep_plot.set_label("left", "memory (MiB)")
            self.memory_sweep_plot.fit(max(batches), max(model), "MiB")
            self.memory_sweep_plot.item.setXRange(0, max(batches) * 1.05, padding=0)


def model_bytes(point) -> int:
    """A sweep point's memory that is the model's: weights + KV + a step's activations (measured)."""
    return (point.weights_bytes or 0) + point.kv_cache_bytes + (point.activation_bytes or 0)
