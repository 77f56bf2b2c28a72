"""The comparison's summary table: one row per lane (engine.measure.compare.LaneSummary), every
figure formatted, none a quiet "nan"."""

from __future__ import annotations

import math

from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import QTableWidget, QTableWidgetItem

from app.glossary import link_headers
from engine.base.units import format_bytes, format_rate, format_seconds

COLUMNS = (
    ("lane", "Lane"), ("label", "Configuration"), ("load_s", "Load"), ("weights_bytes", "Weights"),
    ("model_memory_bytes", "Model memory"), ("peak_memory_bytes", "Process peak (all lanes)"), ("ttft_s", "TTFT"),
    ("decode_tokens_per_s", "Decode tok/s"),
    ("latency_mean_s", "Latency mean"), ("latency_p50_s", "p50"), ("latency_p95_s", "p95"), ("tokens", "Tokens"),
    ("kv_cache_bytes", "KV cache"), ("token_agreement", "Agreement"), ("first_divergence", "First divergence"),
    ("mean_abs_logprob_delta", "Mean |Δ logprob|"), ("finish_reason", "Stop"),
)

HEADER_TIPS = {
    "model_memory_bytes": "This lane's model alone: its weights and its KV cache at the end of the answer, "
                          "both read from their tensors.",
    "peak_memory_bytes": "The process's highest RSS during the lane's answer (on a GPU, the device's peak): "
                         "every lane's model is loaded in the one process, with Python, Qt and PyTorch.",
}


def cell_text(key: str, value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return "error: not finite"  # never a quiet "nan" in a measuring instrument
    if key in ("load_s", "ttft_s", "latency_mean_s", "latency_p50_s", "latency_p95_s"):
        return format_seconds(value)
    if key in ("weights_bytes", "model_memory_bytes", "peak_memory_bytes", "kv_cache_bytes"):
        return format_bytes(value)
    if key == "decode_tokens_per_s":
        return format_rate(value, "")
    if key == "token_agreement":
        return f"{100 * value:.1f}%"
    if key == "mean_abs_logprob_delta":
        return f"{value:.4f}"
    return str(value)


class SummaryTable(QTableWidget):
    def __init__(self) -> None:
        super().__init__(0, len(COLUMNS))
        self.setObjectName("summaryTable")
        self.setHorizontalHeaderLabels([title for _, title in COLUMNS])
        link_headers(self, {"Weights": "weights", "TTFT": "ttft", "Decode tok/s": "decode", "Latency mean": "tpot",
                            "KV cache": "kv-cache", "Tokens": "token", "Agreement": "quantization"})
        for column, (key, _) in enumerate(COLUMNS):
            if key in HEADER_TIPS:
                self.horizontalHeaderItem(column).setToolTip(HEADER_TIPS[key])
        self.verticalHeader().hide()
        self.setEditTriggers(QTableWidget.NoEditTriggers)
        self.resizeColumnsToContents()  # whole headers before the first run too
        rows = self.verticalHeader().defaultSectionSize()
        self.setMinimumHeight(self.horizontalHeader().sizeHint().height() + 4 * rows + 24)  # 4 lanes

    def show_rows(self, rows, colours: list[str]) -> None:
        """``rows``: LaneSummary, one per lane; each lane's label in its colour."""
        self.setRowCount(len(rows))
        for row, values in enumerate(rows):
            for column, (key, _) in enumerate(COLUMNS):
                item = QTableWidgetItem(cell_text(key, getattr(values, key)))
                if key == "label":
                    item.setForeground(QBrush(QColor(colours[row])))
                self.setItem(row, column, item)
        self.resizeColumnsToContents()
