"""File → Run history…: every finished run, newest first; Open (double-click, Enter) reopens its
figures, plots and transcript read-only. The records are read off the GUI thread and the table
formats only the rows on screen, so a history of thousands of runs opens at once."""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QSplitter,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.background import Background
from app.run_window import RunWindow, describe
from app.screen import fit_screen
from engine.storage.history import RunRecord, history_dir, load_all
from engine.units import format_rate, format_seconds

COLUMNS = ("when", "kind", "model", "precision", "device", "batch", "tokens", "decode tok/s (each)",
           "aggregate tok/s", "TTFT", "result")


def row_values(r: RunRecord) -> tuple[str, ...]:
    """One row: a batch's aggregate beside each request's speed (the batching window shows both)."""
    aggregate = r.extra.get("aggregate_tokens_per_s", r.decode_tokens_per_s if r.batch == 1 else None)
    result = "failed" if r.extra.get("error") else "ok"
    return (r.when.replace("T", " "), r.kind, r.model, r.precision, r.device, str(r.batch), str(r.tokens),
            format_rate(r.decode_tokens_per_s), format_rate(aggregate), format_seconds(r.ttft_s), result)


class HistoryModel(QAbstractTableModel):
    """The records as table rows, each formatted when first shown."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.records: list[RunRecord] = []
        self._rows: dict[int, tuple[str, ...]] = {}

    def set_records(self, records: list[RunRecord]) -> None:
        self.beginResetModel()
        self.records, self._rows = records, {}
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.records)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def text(self, row: int, column: int) -> str:
        if row not in self._rows:
            self._rows[row] = row_values(self.records[row])
        return self._rows[row][column]

    def data(self, index, role=Qt.DisplayRole):
        if role == Qt.DisplayRole and index.isValid():
            return self.text(index.row(), index.column())
        return None

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if role == Qt.DisplayRole and orientation == Qt.Horizontal:
            return COLUMNS[section]
        return None


class HistoryDialog(QDialog):
    """``ready`` is emitted once the records are in the table."""

    ready = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("historyDialog")
        self.setWindowTitle("Run history")
        self.opened: list[RunWindow] = []
        self.model = HistoryModel(self)
        self.table = QTableView()
        self.table.setObjectName("historyTable")
        self.table.setModel(self.model)
        # columns sized from the rows on screen, not by measuring every row
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Interactive)
        self.table.horizontalHeader().setResizeContentsPrecision(40)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.details = QTextBrowser()
        self.details.setObjectName("historyDetails")
        self.details.setOpenExternalLinks(False)
        self.details.setPlainText("Reading the history…")
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.details)
        buttons = QDialogButtonBox(QDialogButtonBox.Open | QDialogButtonBox.Close)
        self.open_button = buttons.button(QDialogButtonBox.Open)
        self.open_button.setText("Open plots and transcript")
        self.open_button.setDefault(True)  # Enter opens the selected run
        self.open_button.setEnabled(False)
        buttons.accepted.connect(self.open_selected)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(split, 1)
        layout.addWidget(buttons)
        self.table.selectionModel().currentRowChanged.connect(lambda current, _: self.show_record(current.row()))
        self.table.doubleClicked.connect(lambda index: self.open_record(index.row()))
        self.resize(fit_screen(1100, 700))
        self.background = Background(self, workers=1)
        self.background.submit(lambda: list(reversed(load_all())), self._show, self._show_failure)

    @property
    def records(self) -> list[RunRecord]:
        return self.model.records

    def cell(self, row: int, column: int) -> str:
        return self.model.text(row, column)

    def _show(self, records: list[RunRecord]) -> None:
        self.model.set_records(records)
        self.table.resizeColumnsToContents()
        self.open_button.setEnabled(bool(records))
        if records:
            self.table.selectRow(0)
            self.show_record(0)
        else:
            self.details.setPlainText(f"No runs yet. Finished generations, comparison lanes, sweep points and "
                                      f"speculative runs are kept in {history_dir()}.")
        self.ready.emit()

    def _show_failure(self, exc: BaseException) -> None:
        self.details.setPlainText(f"Could not read the history in {history_dir()}: {exc}")
        self.ready.emit()

    def done(self, result: int) -> None:
        self.background.close()
        super().done(result)

    def show_record(self, row: int) -> None:
        if 0 <= row < len(self.records):
            self.details.setMarkdown(describe(self.records[row]))

    def open_selected(self) -> None:
        """The Open button (and Enter): reopen the selected run; the list stays open."""
        self.open_record(self.table.currentIndex().row())

    def open_record(self, row: int) -> RunWindow | None:
        if not 0 <= row < len(self.records):
            return None
        # parented to the main window (a window of its own): it outlives this dialog
        window = RunWindow(self.records[row], self.parentWidget() or self)
        self.opened.append(window)
        window.show()
        window.raise_()
        return window
