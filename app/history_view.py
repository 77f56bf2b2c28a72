"""File → Run history…: every finished run, newest first; Open (double-click, Enter) reopens its
figures, plots and transcript read-only."""

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

from app.run_window import RunWindow, describe
from app.screen import fit_screen
from engine.history import RunRecord, history_dir, load_all
from engine.units import format_rate, format_seconds

COLUMNS = ("when", "kind", "model", "precision", "device", "batch", "tokens", "decode tok/s (each)",
           "aggregate tok/s", "TTFT", "result")


def row_values(r: RunRecord) -> tuple[str, ...]:
    """One row: a batch's aggregate beside each request's speed (the batching window shows both)."""
    aggregate = r.extra.get("aggregate_tokens_per_s", r.decode_tokens_per_s if r.batch == 1 else None)
    result = "failed" if r.extra.get("error") else "ok"
    return (r.when.replace("T", " "), r.kind, r.model, r.precision, r.device, str(r.batch), str(r.tokens),
            format_rate(r.decode_tokens_per_s), format_rate(aggregate), format_seconds(r.ttft_s), result)


class HistoryDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("historyDialog")
        self.setWindowTitle("Run history")
        self.records: list[RunRecord] = list(reversed(load_all()))
        self.opened: list[RunWindow] = []
        self.table = QTableWidget(len(self.records), len(COLUMNS))
        self.table.setObjectName("historyTable")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        for row, r in enumerate(self.records):
            for column, text in enumerate(row_values(r)):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self.details = QTextBrowser()
        self.details.setObjectName("historyDetails")
        self.details.setOpenExternalLinks(False)
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.details)
        buttons = QDialogButtonBox(QDialogButtonBox.Open | QDialogButtonBox.Close)
        self.open_button = buttons.button(QDialogButtonBox.Open)
        self.open_button.setText("Open plots and transcript")
        self.open_button.setDefault(True)  # Enter opens the selected run
        self.open_button.setEnabled(bool(self.records))
        buttons.accepted.connect(self.open_selected)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(split, 1)
        layout.addWidget(buttons)
        self.table.currentCellChanged.connect(lambda row, *_: self.show_record(row))
        self.table.cellDoubleClicked.connect(lambda row, _column: self.open_record(row))
        self.resize(fit_screen(1100, 700))
        if self.records:
            self.table.selectRow(0)
            self.show_record(0)
        else:
            self.details.setPlainText(f"No runs yet. Finished generations, comparison lanes, sweep points and "
                                      f"speculative runs are kept in {history_dir()}.")

    def show_record(self, row: int) -> None:
        if 0 <= row < len(self.records):
            self.details.setMarkdown(describe(self.records[row]))

    def open_selected(self) -> None:
        """The Open button (and Enter): reopen the selected run; the list stays open."""
        self.open_record(self.table.currentRow())

    def open_record(self, row: int) -> RunWindow | None:
        if not 0 <= row < len(self.records):
            return None
        # parented to the main window (a window of its own): it outlives this dialog
        window = RunWindow(self.records[row], self.parentWidget() or self)
        self.opened.append(window)
        window.show()
        window.raise_()
        return window
