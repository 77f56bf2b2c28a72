"""File → Run history…: every finished run, newest first, reopened read-only from its record."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.history import RunRecord, history_dir, load_all
from engine.units import format_bytes, format_rate, format_seconds

COLUMNS = ("when", "kind", "model", "precision", "device", "batch", "tokens", "decode tok/s", "TTFT")


class HistoryDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("historyDialog")
        self.setWindowTitle("Run history")
        self.records: list[RunRecord] = list(reversed(load_all()))
        self.table = QTableWidget(len(self.records), len(COLUMNS))
        self.table.setObjectName("historyTable")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        for row, r in enumerate(self.records):
            values = (r.when.replace("T", " "), r.kind, r.model, r.precision, r.device, str(r.batch), str(r.tokens),
                      format_rate(r.decode_tokens_per_s), format_seconds(r.ttft_s))
            for column, text in enumerate(values):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self.details = QTextBrowser()
        self.details.setObjectName("historyDetails")
        self.details.setOpenExternalLinks(False)
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.details)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(split, 1)
        layout.addWidget(buttons)
        self.table.currentCellChanged.connect(lambda row, *_: self.show_record(row))
        self.resize(1000, 700)
        if self.records:
            self.table.selectRow(0)
            self.show_record(0)
        else:
            self.details.setPlainText(f"No runs yet. Finished generations, comparisons and sweep points are kept "
                                      f"in {history_dir()}.")

    def show_record(self, row: int) -> None:
        if not 0 <= row < len(self.records):
            return
        r = self.records[row]
        lines = [f"# {r.model} · {r.precision} · {r.device_name or r.device}",
                 f"{r.kind} run, {r.when.replace('T', ' ')}; batch {r.batch}",
                 "",
                 f"- prompt {r.prompt_tokens} tokens, answer {r.tokens} tokens",
                 f"- TTFT {format_seconds(r.ttft_s)}, decode {format_rate(r.decode_tokens_per_s)}",
                 f"- weights {format_bytes(r.weights_bytes)}, KV cache {format_bytes(r.kv_cache_bytes)}, "
                 f"peak memory {format_bytes(r.peak_memory_bytes)}",
                 ""]
        transcript = r.extra.get("transcript_markdown")
        if transcript:
            lines += ["---", "", transcript]
        self.details.setMarkdown("\n".join(lines))
