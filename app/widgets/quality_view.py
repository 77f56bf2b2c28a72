"""Compare's Quality tab: each lane's perplexity and KL divergence from lane 1 beside its bytes
and speed, the trade-off as a chart with its Pareto front (bytes: the weights and the KV cache at
a context the user picks, so a lane is a precision × KV-cache dtype), and the text coloured by one
lane's per-token divergence, so a user sees where a precision bends the model."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.glossary import link_headers
from app.widgets.live_plots import PlotPanel
from engine.base.units import format_bytes, format_rate

COLUMNS = ("Lane", "Configuration", "Weights", "KV / token", "Decode tok/s", "Perplexity", "Mean KLD", "KLD p99",
           "Same top",
           "Time")
SHOWN_TOKENS = 3000
"""Scored tokens drawn in the coloured text (the rest are counted, not drawn)."""
RED_AT = 1.0
"""KL divergence (nats) drawn full red."""


@dataclass(frozen=True)
class LaneQuality:
    lane: int
    label: str
    colour: str
    precision: str
    decode_tokens_per_s: float | None
    report: object  # engine.measure.quality.QualityReport
    pieces: tuple[str, ...]
    weights_from: str = ""
    """Where the lane's weights came from (engine.models.sources.reference_weights): lane 1's is
    what every divergence is read against."""
    kv_bytes_per_token: int | None = None
    """A token's keys and values in the lane's KV-cache dtype (None: a served lane's, unknown)."""

    def bytes_at(self, context: int) -> int | None:
        """The weights and ``context`` tokens of KV cache (one sequence): what the chart plots."""
        weights = self.report.weights_bytes
        if not weights:
            return None
        return weights + context * (self.kv_bytes_per_token or 0)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other beats on both (fewer bytes and lower divergence), by bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def coloured_text(pieces, klds, limit: int = SHOWN_TOKENS) -> str:
    """The scored tokens as HTML, each on a background from white (the reference's distribution)
    to red (KL ≥ :data:`RED_AT` nats)."""
    out = []
    for piece, kld in zip(pieces[:limit], klds[:limit]):
        level = min(1.0, max(0.0, kld) / RED_AT) ** 0.5 if math.isfinite(kld) else 1.0
        green = int(255 - 150 * level)
        text = html.escape(piece).replace("\n", "↵<br>")
        out.append(f"<span style='background:rgb(255,{green},{green}); color:#1b2631' "
                   f"title='KL {kld:.4f}'>{text}</span>")
    more = (f"<p><i>… and {len(pieces) - limit:,} more scored tokens (the figures count them all).</i></p>"
            if len(pieces) > limit else "")
    return "<div style='white-space:pre-wrap'>" + "".join(out) + "</div>" + more


def worst_tokens(pieces, klds, count: int = 8) -> str:
    """The tokens the precision bends most, with their divergence."""
    if not len(klds):
        return ""
    order = np.argsort(np.asarray(klds))[::-1][:count]
    return ", ".join(f"“{html.escape(pieces[i].strip() or repr(pieces[i]))}” {klds[i]:.2f}" for i in order)


class QualityView(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[LaneQuality] = []
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("qualityTable")
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        link_headers(self.table, {"Weights": "weights", "KV / token": "kv-dtype", "Decode tok/s": "decode",
                                  "Perplexity": "perplexity",
                                  "Mean KLD": "kl-divergence", "KLD p99": "kl-divergence", "Same top": "kl-divergence"})
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.resizeColumnsToContents()
        self.chart = PlotPanel(
            "quality-tradeoff", "Each lane's mean KL divergence from lane 1 against its bytes: its weights and one "
            "sequence's KV cache at the context below (a lane's KV-cache dtype sets that part): lower left is "
            "better; the dashed line joins the lanes no other beats on both (the Pareto front).",
            "mean KLD (nats)", "weights + KV cache (MiB)")
        self.context = QSpinBox()
        self.context.setObjectName("qualityContext")
        self.context.setRange(0, 1_048_576)
        self.context.setSingleStep(1024)
        self.context.setValue(4096)
        self.context.setSuffix(" tokens")
        self.context.setToolTip("The KV cache counted in each lane's bytes: one sequence this long.")
        self.context.valueChanged.connect(lambda *_: self._draw_chart())
        self.points = pg.ScatterPlotItem(size=11, pen=None)
        self.chart.plot.addItem(self.points)
        self.front = self.chart.curve("Pareto front", "muted", Qt.DashLine)
        self.labels: list[pg.TextItem] = []
        self.lane_pick = QComboBox()
        self.lane_pick.setObjectName("qualityLane")
        self.lane_pick.currentIndexChanged.connect(self._show_text)
        self.worst = QLabel()
        self.worst.setWordWrap(True)
        self.worst.setTextFormat(Qt.RichText)
        self.text = QTextBrowser()
        self.text.setObjectName("qualityText")
        self.note = QLabel("Run <b>Quality</b> (beside the quantization ladder): every lane reads the same text, "
                           "lane 1 first as the reference; a lane's tokens are coloured by how far its "
                           "distribution moved from lane 1's (white: not at all, red: a KL divergence of 1 nat "
                           "or more). A served lane is sent lane 1's tokens and scored from the prompt "
                           "log-probabilities its server returns (vLLM, this workbench's server): its KL is a lower "
                           "bound (≥).")
        self.note.setWordWrap(True)
        self.reference = QLabel("")
        self.reference.setObjectName("qualityReference")
        self.reference.setWordWrap(True)
        self.table.setMinimumHeight(120)
        self.chart.setMinimumHeight(200)  # readable in the tab's scroll area on a short screen
        self.text.setMinimumHeight(200)
        chart_box = QWidget()
        chart_layout = QVBoxLayout(chart_box)
        chart_layout.setContentsMargins(0, 0, 0, 0)
        context_row = QHBoxLayout()
        context_row.addWidget(QLabel("Bytes at a context of"))
        context_row.addWidget(self.context)
        context_row.addStretch(1)
        chart_layout.addLayout(context_row)
        chart_layout.addWidget(self.chart, 1)
        left = QSplitter(Qt.Vertical)
        left.addWidget(self.table)
        left.addWidget(chart_box)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        pick_row = QHBoxLayout()
        pick_row.addWidget(QLabel("Colour the text by"))
        pick_row.addWidget(self.lane_pick, 1)
        right_layout.addLayout(pick_row)
        right_layout.addWidget(self.worst)
        right_layout.addWidget(self.text, 1)
        split = QSplitter(Qt.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.note)
        layout.addWidget(self.reference)
        layout.addWidget(split, 1)

    def show_rows(self, rows: list[LaneQuality]) -> None:
        self.rows = rows
        first = next((row for row in rows if row.report.divergence is None), None)
        self.reference.setText(f"<b>Reference, lane {first.lane}:</b> {first.weights_from}"
                               if first is not None and first.weights_from else "")
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            report, d = row.report, row.report.divergence
            bound = "≥ " if d is not None and d.served_top_k is not None else ""
            cells = [str(row.lane), row.label, format_bytes(report.weights_bytes) if report.weights_bytes else "—",
                     format_bytes(row.kv_bytes_per_token) + (f" ({report.kv_dtype})" if report.kv_dtype else "")
                     if row.kv_bytes_per_token else "—",
                     format_rate(row.decode_tokens_per_s, "") if row.decode_tokens_per_s else "—",
                     _finite(report.perplexity, f"{report.perplexity:.3f} ± {report.perplexity_err:.3f}"),
                     "reference" if d is None else _finite(d.kld_mean, f"{bound}{d.kld_mean:.5f}"),
                     "—" if d is None else _finite(d.kld_p99, f"{bound}{d.kld_p99:.4f}"),
                     "—" if d is None else f"{100 * d.same_top:.2f}%",
                     f"{report.seconds:.1f} s"]
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c == 1:
                    item.setForeground(pg.mkColor(row.colour))
                if bound and COLUMNS[c] in ("Mean KLD", "KLD p99"):
                    item.setToolTip(f"A served model sends its top {d.served_top_k} tokens per position, not its whole "
                                    "distribution: the KL divergence is summed over those the reference's list holds, "
                                    "the rest as one bucket, which can only read low (a lower bound). Perplexity and "
                                    "same-top are exact.")
                self.table.setItem(r, c, item)
        self.table.resizeColumnsToContents()
        self._draw_chart()
        self.lane_pick.blockSignals(True)
        self.lane_pick.clear()
        for row in rows:
            if row.report.divergence is not None:
                self.lane_pick.addItem(f"lane {row.lane}: {row.label}", row.lane)
        self.lane_pick.setCurrentIndex(self.lane_pick.count() - 1)  # the smallest rung, where it bends most
        self.lane_pick.blockSignals(False)
        self._show_text()

    def _draw_chart(self) -> None:
        for label in self.labels:
            self.chart.plot.removeItem(label)
        self.labels = []
        context = self.context.value()
        shown = [row for row in self.rows if row.bytes_at(context)]
        xs = [row.bytes_at(context) / 2**20 for row in shown]
        ys = [0.0 if row.report.divergence is None else row.report.divergence.kld_mean for row in shown]
        self.points.setData(x=xs, y=ys, brush=[pg.mkBrush(row.colour) for row in shown])
        front = pareto(list(zip(xs, ys)))
        self.front.setData([xs[i] for i in front], [ys[i] for i in front])
        for row, x, y in zip(shown, xs, ys):
            label = pg.TextItem(row.precision, anchor=(0, 1), color=row.colour)
            label.setPos(x, y)
            self.chart.plot.addItem(label)
            self.labels.append(label)
        if xs:
            self.chart.reset_view()
            self.chart.fit(max(xs) * 1.15, max(ys) if max(ys) > 0 else 1e-3)

    def _show_text(self) -> None:
        lane = self.lane_pick.currentData()
        row = next((r for r in self.rows if r.lane == lane), None)
        if row is None:
            self.text.clear()
            self.worst.clear()
            return
        klds = row.report.token_kld
        self.worst.setText(f"Where lane {row.lane} ({html.escape(row.precision)}) bends most: "
                           + worst_tokens(row.pieces, klds))
        self.text.setHtml(coloured_text(row.pieces, klds))


def _finite(value: float, text: str) -> str:
    return text if math.isfinite(value) else "error: not finite"
