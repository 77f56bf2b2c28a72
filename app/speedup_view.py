"""View → Batching and speculative decoding: the two speed-ups, measured on the loaded model.

It drives the main window's engine worker (the model is loaded once); while it runs, the
main window can't generate, load or unload, and the reverse. Plots redraw from buffers on
the window's ~20 Hz timer, never per event.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtGui import QColor, QPalette, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.widgets.live_plots import PlotPanel
from app.screen import fit_screen
from engine.events import BatchStep, DraftVerified, Loaded, Prefilled, TokenGenerated
from engine.jobs import SpeculateJob, SweepJob, Tagged
from engine.units import format_bytes, format_rate, format_seconds

if TYPE_CHECKING:
    from engine.generation.speculative import SpeculativeReport

REFRESH_MS = 50
DEFAULT_PROMPT = "Explain microservices in simple terms."
ACCEPTED = "#27ae60"
REJECTED = "#c0392b"
OWN = "#2d7dd2"


def _parse_batches(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    if not sizes or sizes[0] < 1 or sizes[-1] > 4096:
        raise ValueError
    return sizes


class _Controls(QWidget):
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


class SpeedupWindow(QMainWindow):
    """Batching sweep and speculative decoding on the main window's loaded model."""

    updated = Signal()  # after a redraw (tests wait on it)

    def __init__(self, session, request_for, parent: QWidget | None = None) -> None:
        """``request_for(prompt)`` gives a GenerationRequest with the main window's settings."""
        super().__init__(parent)
        self.setObjectName("speedupWindow")
        self.setWindowTitle("Inference Workbench — Batching and speculative decoding")
        self.session = session
        self.request_for = request_for
        self.info: Loaded | None = None
        self.loading = False  # the main window is loading a model into the session
        self.running: str | None = None  # "sweep" | "speculative", from submitted until it ends
        self.job: int | None = None  # its id in the session's queue
        self._dirty = False
        self._step_text = ""
        self._plain_tokens = 0
        self.result: SpeculativeReport | None = None

        self.tabs = QTabWidget()
        self.tabs.addTab(self._build_batching(), "Batching")
        self.tabs.addTab(self._build_speculative(), "Speculative decoding")
        self.setCentralWidget(self.tabs)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)

        session.loaded.connect(self.set_model)
        session.unloaded.connect(lambda: self.set_model(None))
        session.job_started.connect(self._on_job_started)
        session.job_events.connect(self._on_job_events)
        session.job_finished.connect(self._on_job_finished)
        session.job_failed.connect(self._on_job_failed)
        session.queue_changed.connect(self._on_queue_changed)
        self.resize(fit_screen(1200, 780))
        self._update_state()

    # -- batching ---------------------------------------------------------------------
    def _build_batching(self) -> QWidget:
        self.sweep_controls = c = _Controls()
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
        c.run.clicked.connect(self.start_sweep)
        c.stop.clicked.connect(self.stop)

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
            "sweep-memory", "Memory against batch size: every sequence has its own KV cache, so it grows "
            "with the batch (measured KV equals the prediction from the config).", "memory", "batch")
        self.peak_curve = self.memory_sweep_plot.curve("peak memory", "main", symbol="o", symbolSize=7)
        self.kv_curve = self.memory_sweep_plot.curve("KV cache (measured)", "second", symbol="s", symbolSize=7)
        self.kv_predicted_curve = self.memory_sweep_plot.curve("KV cache (predicted)", "second", Qt.DashLine)
        self.sweep_table = QTableWidget(0, 8)
        self.sweep_table.setObjectName("sweepTable")
        self.sweep_table.setHorizontalHeaderLabels(
            ["batch", "tok/s (all)", "tok/s each", "TTFT", "per token", "KV cache", "peak memory", "% of ceiling"])
        self.sweep_table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
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
        page = QSplitter(Qt.Horizontal)
        page.addWidget(c)
        page.addWidget(right)
        page.setStretchFactor(1, 1)
        page.setSizes([280, 920])
        return page

    @Slot()
    def start_sweep(self) -> None:
        if not self._can_start():
            return
        try:
            sizes = _parse_batches(self.batches.text())
        except ValueError:
            self.sweep_controls.status.setText("Batch sizes: whole numbers from 1 to 4096, separated by commas.")
            return
        prompt = self.sweep_prompt.text().strip() or DEFAULT_PROMPT
        request = replace(self.request_for(prompt), max_new_tokens=self.sweep_tokens.value(), ignore_eos=True)
        self.points = []
        self._step_text = ""
        self.sweep_table.setRowCount(0)
        for label in self._labels:
            self.tradeoff_plot.plot.removeItem(label)
        self._labels = []
        for panel in (self.tradeoff_plot, self.speed_plot, self.memory_sweep_plot):
            panel.reset_view()
        self._set_running("sweep")
        self.sweep_controls.status.setText(f"Running batch {sizes[0]} …")
        self.job = self.session.submit(SweepJob(request, tuple(sizes)))
        self._on_queue_changed()

    def _on_sweep_step(self, batch: int, step: BatchStep) -> None:
        self._step_text = (f"Batch {batch}: step {step.step + 1}, {step.active} sequences active, "
                           f"{format_seconds(step.latency_s)} per step, KV {format_bytes(step.kv_cache_bytes)}")
        self._dirty = True

    def _on_sweep_point(self, point) -> None:
        self.points.append(point)
        self._step_text = ""
        row = self.sweep_table.rowCount()
        self.sweep_table.insertRow(row)
        each = point.aggregate_tokens_per_s / point.batch if point.aggregate_tokens_per_s else None
        ceiling = point.predicted_tokens_per_s_ceiling
        share = (f"{100 * point.aggregate_tokens_per_s / ceiling:.0f}%"
                 if ceiling and point.aggregate_tokens_per_s else "n/a")
        for column, text in enumerate((
                str(point.batch), format_rate(point.aggregate_tokens_per_s), format_rate(each),
                format_seconds(point.mean_ttft_s), format_seconds(point.mean_per_token_latency_s),
                format_bytes(point.kv_cache_bytes), format_bytes(point.peak_memory_bytes), share)):
            item = QTableWidgetItem(text)
            item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            self.sweep_table.setItem(row, column, item)
        self._dirty = True

    def _on_sweep_finished(self, points, skipped) -> None:
        self._set_running(None)
        lines = []
        if len(points) >= 2 and points[0].aggregate_tokens_per_s and points[-1].aggregate_tokens_per_s:
            gain = points[-1].aggregate_tokens_per_s / points[0].aggregate_tokens_per_s
            slower = ((points[-1].mean_per_token_latency_s or 0) / (points[0].mean_per_token_latency_s or 1))
            lines.append(f"Batch {points[-1].batch} makes {gain:.1f}× the tokens/sec of batch {points[0].batch}; "
                         f"each request's tokens come {slower:.1f}× slower.")
        lines += [f"Skipped: {s.reason}." for s in skipped]
        if not points and not skipped:
            lines.append("Stopped.")
        self.sweep_controls.status.setText(" ".join(lines))
        self.refresh()

    def _draw_sweep(self) -> None:
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
        batches = [p.batch for p in self.points]
        self.speed_curve.setData(batches, [p.aggregate_tokens_per_s or 0 for p in self.points])
        ceilings = [(p.batch, p.predicted_tokens_per_s_ceiling) for p in self.points if p.predicted_tokens_per_s_ceiling]
        self.ceiling_curve.setData([b for b, _ in ceilings], [c for _, c in ceilings])
        top = max([p.aggregate_tokens_per_s or 0 for p in self.points] + [c for _, c in ceilings] + [1])
        if self.points:
            self.speed_plot.fit(max(batches), top, "tok/s")
            self.speed_plot.item.setXRange(0, max(batches) * 1.05, padding=0)
        mib = 2 ** 20
        self.peak_curve.setData(batches, [(p.peak_memory_bytes or 0) / mib for p in self.points])
        self.kv_curve.setData(batches, [p.kv_cache_bytes / mib for p in self.points])
        self.kv_predicted_curve.setData(batches, [(p.kv_cache_bytes_predicted or 0) / mib for p in self.points])
        if self.points:
            self.memory_sweep_plot.set_label("left", "memory (MiB)")
            self.memory_sweep_plot.fit(max(batches), max((p.peak_memory_bytes or 0) / mib for p in self.points),
                                       "MiB")
            self.memory_sweep_plot.item.setXRange(0, max(batches) * 1.05, padding=0)
        if self.running == "sweep" and self._step_text:
            self.sweep_controls.status.setText(self._step_text)

    # -- speculative decoding --------------------------------------------------------
    def _build_speculative(self) -> QWidget:
        self.spec_controls = c = _Controls()
        self.draft_kind = QComboBox()
        self.draft_kind.setObjectName("draftKind")
        self.draft_kind.addItem("Early exit: the model's own first K layers", "early-exit")
        self.draft_kind.addItem("The same model at another precision", "precision")
        self.draft_kind.addItem("Another model with the same tokenizer", "model")
        self.draft_layers = QSpinBox()
        self.draft_layers.setObjectName("draftLayers")
        self.draft_layers.setRange(1, 1)
        self.draft_precision = QComboBox()
        for name in ("bf16", "fp16", "int8", "nf4", "fp4", "fp32"):
            self.draft_precision.addItem(name, name)
        self.draft_model = QLineEdit()
        self.draft_model.setPlaceholderText("folder, .gguf file or hub id")
        self.draft_tokens = QSpinBox()
        self.draft_tokens.setObjectName("draftTokens")
        self.draft_tokens.setRange(1, 16)
        self.draft_tokens.setValue(4)
        self.compare_plain = QCheckBox("Also decode plainly first, to measure the speed-up")
        self.compare_plain.setChecked(True)
        self.spec_tokens = QSpinBox()
        self.spec_tokens.setRange(1, 4096)
        self.spec_tokens.setValue(64)
        self.spec_prompt = QLineEdit(DEFAULT_PROMPT)
        self.spec_prompt.setCursorPosition(0)
        c.form.addRow("Draft", self.draft_kind)
        c.form.addRow("Layers K", self.draft_layers)
        c.form.addRow("Draft precision", self.draft_precision)
        c.form.addRow("Draft model", self.draft_model)
        c.form.addRow("Drafted per step N", self.draft_tokens)
        c.form.addRow(self.compare_plain)
        c.form.addRow("Max new tokens", self.spec_tokens)
        c.form.addRow("Prompt", self.spec_prompt)
        c.run.setText("Run")
        c.run.clicked.connect(self.start_speculation)
        c.stop.clicked.connect(self.stop)
        self.draft_kind.currentIndexChanged.connect(self._update_state)

        self.spec_output = QPlainTextEdit()
        self.spec_output.setObjectName("speculativeOutput")
        self.spec_output.setReadOnly(True)
        legend = QLabel(f"<span style='background:{ACCEPTED}33'>&nbsp;drafted, accepted&nbsp;</span> "
                        f"<span style='color:{REJECTED}'><s>&nbsp;drafted, rejected&nbsp;</s></span> "
                        f"<span style='color:{OWN}'>&nbsp;the target's own token&nbsp;</span>")
        self.acceptance_plot = PlotPanel(
            "spec-acceptance", "Share of drafted tokens the target accepted, per verification step (dots) and "
            "overall so far (line). Each step costs N draft passes plus one target pass over N+1 tokens.",
            "accepted (%)", "step")
        self.step_curve = self.acceptance_plot.curve("this step (dots)", "second", symbol="o", symbolSize=5,
                                                  symbolBrush="#f39c12")
        self.step_curve.setPen(None)
        self.running_curve = self.acceptance_plot.curve("so far", "main")
        self.spec_summary = QLabel()
        self.spec_summary.setObjectName("speculativeSummary")
        self.spec_summary.setWordWrap(True)
        self.spec_summary.setTextFormat(Qt.RichText)
        self.spec_summary.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self._steps: list[DraftVerified] = []
        self._pending: list = []
        self._awaiting_rejects: tuple[str, ...] = ()

        text_side = QWidget()
        text_layout = QVBoxLayout(text_side)
        text_layout.setContentsMargins(0, 0, 0, 0)
        text_layout.addWidget(legend)
        text_layout.addWidget(self.spec_output, 1)
        text_layout.addWidget(self.spec_summary)
        right = QSplitter(Qt.Horizontal)
        right.addWidget(text_side)
        right.addWidget(self.acceptance_plot)
        page = QSplitter(Qt.Horizontal)
        page.addWidget(c)
        page.addWidget(right)
        page.setStretchFactor(1, 1)
        page.setSizes([300, 900])
        return page

    def draft_text(self) -> str:
        kind = self.draft_kind.currentData()
        if kind == "early-exit":
            return f"early-exit:{self.draft_layers.value()}"
        if kind == "precision":
            ref = "default" if self.info is not None and self.info.source == "default" else (
                self.info.path if self.info is not None else "default")
            return f"{ref}:{self.draft_precision.currentData()}"
        return f"{self.draft_model.text().strip()}:{self.draft_precision.currentData()}"

    @Slot()
    def start_speculation(self) -> None:
        if not self._can_start():
            return
        if self.draft_kind.currentData() == "model" and not self.draft_model.text().strip():
            self.spec_controls.status.setText("Name the draft model: a folder, a .gguf file or a hub id.")
            return
        prompt = self.spec_prompt.text().strip() or DEFAULT_PROMPT
        request = replace(self.request_for(prompt), max_new_tokens=self.spec_tokens.value())
        self.spec_output.clear()
        self.spec_summary.setText("")
        self._steps = []
        self._pending = []
        self._awaiting_rejects = ()
        self._plain_tokens = 0
        self.acceptance_plot.reset_view()
        self._set_running("speculative")
        compare = self.compare_plain.isChecked()
        self.spec_controls.status.setText("Decoding plainly first …" if compare else "Loading the draft …")
        self.job = self.session.submit(SpeculateJob(request, self.draft_text(), self.draft_tokens.value(), compare))
        self._on_queue_changed()  # it may wait behind another job

    def _on_speculation_events(self, run: str, events) -> None:
        if run == "plain":
            self._plain_tokens += sum(isinstance(e, TokenGenerated) for e in events)
            self.spec_controls.status.setText(f"Decoding plainly first … {self._plain_tokens} tokens")
            return
        self._pending.extend(events)
        self._steps.extend(e for e in events if isinstance(e, DraftVerified))
        self._dirty = True

    def _flush_output(self) -> None:
        """Write the pending events into the text: rejected guesses struck through in place."""
        if not self._pending:
            return
        cursor = self.spec_output.textCursor()
        cursor.movePosition(QTextCursor.End)
        plain, accepted, own, rejected = (QTextCharFormat() for _ in range(4))
        accepted.setBackground(QColor(ACCEPTED + "33"))
        own.setForeground(QColor(OWN))
        rejected.setForeground(QColor(REJECTED))
        rejected.setFontStrikeOut(True)
        for event in self._pending:
            # a verification's rejected guesses go before the target's own token that follows it,
            # which may arrive in a later batch of events
            if isinstance(event, DraftVerified):
                self._awaiting_rejects = event.drafted_text[event.accepted:]
            elif isinstance(event, TokenGenerated):
                if event.drafted is False and self._awaiting_rejects:
                    # a rejected line break shows as ↵, so a wrong guess can't reflow the answer
                    cursor.insertText("".join(self._awaiting_rejects).replace("\n", "↵"), rejected)
                self._awaiting_rejects = () if event.drafted is False else self._awaiting_rejects
                cursor.insertText(event.text, accepted if event.drafted else own if event.index else plain)
            elif isinstance(event, Prefilled):
                self.spec_controls.status.setText("Speculating …")
        self._pending = []
        self.spec_output.setTextCursor(cursor)
        self.spec_output.ensureCursorVisible()

    def _draw_acceptance(self) -> None:
        steps = [s for s in self._steps if s.drafted_ids]
        if not steps:
            self.step_curve.setData([], [])
            self.running_curve.setData([], [])
            return
        x = list(range(1, len(steps) + 1))
        per_step = [100 * s.accepted / len(s.drafted_ids) for s in steps]
        so_far, drafted, accepted = [], 0, 0
        for s in steps:
            drafted += len(s.drafted_ids)
            accepted += s.accepted
            so_far.append(100 * accepted / drafted)
        self.step_curve.setData(x, per_step)
        self.running_curve.setData(x, so_far)
        self.acceptance_plot.fit(len(steps), 0, "%")
        self.acceptance_plot.item.setYRange(0, 105, padding=0)

    def _on_speculation_finished(self, result: SpeculativeReport) -> None:
        self._set_running(None)
        self.refresh()
        self.result = result
        rate = result.acceptance_rate
        steps = [s for s in self._steps if s.drafted_ids]
        draft_s = sum(s.draft_s for s in steps)
        verify_s = sum(s.verify_s for s in steps)
        lines = [f"<b>{result.draft}</b>, N = {result.draft_tokens_per_step}: "
                 f"{result.accepted_tokens} of {result.drafted_tokens} drafted tokens accepted "
                 f"({'n/a' if rate is None else f'{100 * rate:.0f}%'}), "
                 f"{(len(result.finished.token_ids) - 1) / len(steps) if steps else 0:.2f} tokens per target pass."]
        if steps:
            lines.append(f"Time per step: draft {format_seconds(draft_s / len(steps))}, "
                         f"target check {format_seconds(verify_s / len(steps))}.")
        speed = result.finished.decode_tokens_per_s
        if result.plain is not None:
            speedup = result.speedup_vs_plain
            lines.append(f"Speculative {format_rate(speed)} against plain {format_rate(result.plain_decode_tokens_per_s)}"
                         f" → <b>{'n/a' if speedup is None else f'{speedup:.2f}×'}</b>"
                         + (" (same tokens as plain decoding)" if result.same_tokens_as_plain else
                            " (sampled, so the tokens differ from the plain run)"))
        else:
            lines.append(f"Speculative decoding: {format_rate(speed)}.")
        if result.draft_weights_bytes:
            lines.append(f"The draft's weights take {format_bytes(result.draft_weights_bytes)} more memory.")
        self.spec_summary.setText("<br>".join(lines))
        self.spec_controls.status.setText(f"Finished ({result.finished.reason}).")

    # -- the session's jobs ----------------------------------------------------------
    def _on_job_started(self, job_id: int) -> None:
        if job_id == self.job:
            controls = self.sweep_controls if self.running == "sweep" else self.spec_controls
            if controls.status.text().startswith("Waiting"):
                controls.status.setText("Running …")

    def _on_job_events(self, job_id: int, events: tuple) -> None:
        if job_id != self.job:
            return
        if self.running == "sweep":
            for event in events:
                if isinstance(event, Tagged):
                    self._on_sweep_step(event.tag, event.event)
                else:
                    self._on_sweep_point(event)
            return
        run, batch = None, []
        for event in events:  # runs of the same part ("plain", "speculative") together
            if event.tag != run and batch:
                self._on_speculation_events(run, batch)
                batch = []
            run = event.tag
            batch.append(event.event)
        if batch:
            self._on_speculation_events(run, batch)

    def _on_job_finished(self, job_id: int, result) -> None:
        if job_id != self.job:
            return
        self.job = None
        if self.running == "sweep":
            self._on_sweep_finished(list(result.points), list(result.skipped))
        else:
            self._on_speculation_finished(result)

    def _on_job_failed(self, job_id: int, exc) -> None:
        if job_id == self.job:
            self.job = None
            self._on_failed(exc)

    def _on_queue_changed(self) -> None:
        if self.job is not None and self.job in self.session.waiting():
            controls = self.sweep_controls if self.running == "sweep" else self.spec_controls
            running = self.session.describe(self.session.running) or "job before it"
            controls.status.setText(f"Waiting for the {running} to finish …")

    # -- shared -----------------------------------------------------------------------
    @Slot()
    def refresh(self) -> None:
        if not self._dirty and self.running:
            return
        self._dirty = False
        self._draw_sweep()
        self._flush_output()
        self._draw_acceptance()
        self.updated.emit()

    def _can_start(self) -> bool:
        status = (self.sweep_controls if self.tabs.currentIndex() == 0 else self.spec_controls).status
        if self.info is None:
            status.setText("Load a model in the main window first.")
            return False
        if self.loading:
            status.setText("The model is loading: wait for it to be ready.")
            return False
        if self.running:
            status.setText("This window's run is still going: stop it or wait for it to end.")
            return False
        return True

    def _on_failed(self, exc) -> None:
        from engine.errors import CancelledError

        controls = self.sweep_controls if self.running == "sweep" else self.spec_controls
        self._set_running(None)
        self.refresh()
        if isinstance(exc, CancelledError):
            controls.status.setText("Stopped.")
            return
        message = str(exc) or type(exc).__name__
        controls.status.setText(f"<span style='color:{REJECTED}'>{message}</span>")

    def _set_running(self, what: str | None) -> None:
        self.running = what
        if what:
            self.timer.start()
        else:
            self.timer.stop()
        self._update_state()

    @Slot()
    def stop(self) -> None:
        if self.running:
            self.session.cancel(self.job)

    def set_model(self, info: Loaded | None) -> None:
        self.info = info
        if info is not None:
            self.draft_layers.setRange(1, max(1, info.num_layers - 1))
            if self.draft_layers.value() == 1:
                self.draft_layers.setValue(max(1, (2 * info.num_layers) // 3))
        title = "no model loaded" if info is None else f"{info.name} · {info.precision} · {info.device}"
        self.setWindowTitle(f"Inference Workbench — Batching and speculative decoding — {title}")
        self._update_state()

    def set_loading(self, loading: bool) -> None:
        self.loading = loading
        self._update_state()

    def _update_state(self) -> None:
        idle = self.info is not None and not self.loading and self.running is None
        self.sweep_controls.run.setEnabled(idle)
        self.spec_controls.run.setEnabled(idle)
        self.sweep_controls.stop.setEnabled(self.running == "sweep")
        self.spec_controls.stop.setEnabled(self.running == "speculative")
        kind = self.draft_kind.currentData()
        self.draft_layers.setEnabled(kind == "early-exit")
        self.draft_precision.setEnabled(kind != "early-exit")
        self.draft_model.setEnabled(kind == "model")

    def closeEvent(self, event) -> None:
        self.stop()  # the main window's model stays loaded; a run in progress ends at its next token
        self.session.drop_draft_requested.emit()  # after that run, in the worker's order: the draft is freed
        super().closeEvent(event)
