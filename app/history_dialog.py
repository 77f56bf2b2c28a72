"""File → Run history…: every finished run, newest first, a server run's requests as one row;
filter by kind and model, search, delete; Open (double-click, Enter) reopens a run's figures,
plots and transcript read-only. The records are read off the GUI thread and the table formats
only the rows on screen, so a history of thousands of runs opens at once."""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QHeaderView,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSplitter,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.background import Background
from app.run_window import RunWindow, describe
from app.screen import fit_screen
from engine.base.units import format_rate, format_seconds
from engine.storage.history import RunRecord, ServedRun, delete, entries, history_dir, load_all

COLUMNS = ("when", "kind", "model", "precision", "device", "batch", "tokens", "decode tok/s (each)",
           "aggregate tok/s", "TTFT", "result")


def row_values(r: RunRecord) -> tuple[str, ...]:
    """One row: a batch's aggregate beside each request's speed (the batching window shows both)."""
    aggregate = r.extra.get("aggregate_tokens_per_s", r.decode_tokens_per_s if r.batch == 1 else None)
    result = "failed" if r.extra.get("error") else "ok"
    return (r.when.replace("T", " "), r.kind, r.model, r.precision, r.device, str(r.batch), str(r.tokens),
            format_rate(r.decode_tokens_per_s), format_rate(aggregate), format_seconds(r.ttft_s), result)


def group_values(run: ServedRun) -> tuple[str, ...]:
    """A server run's row: its requests together (when the newest ended, their tokens, their mean
    speed and TTFT, how many)."""
    requests = run.requests
    latest = run.latest
    rates = [r.decode_tokens_per_s for r in requests if r.decode_tokens_per_s]
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    failed = sum(1 for r in requests if r.extra.get("error"))
    result = f"{len(requests)} requests" + (f", {failed} failed" if failed else "")
    return (latest.when.replace("T", " "), "served", latest.model, latest.precision, latest.device, "—",
            str(sum(r.tokens for r in requests)), format_rate(sum(rates) / len(rates) if rates else None), "—",
            format_seconds(sum(ttfts) / len(ttfts) if ttfts else None), result)


def record_of(entry: "RunRecord | ServedRun") -> RunRecord:
    """The record an entry stands for: itself, or a server run's newest request."""
    return entry.latest if isinstance(entry, ServedRun) else entry


def entry_values(entry: "RunRecord | ServedRun") -> tuple[str, ...]:
    """An entry's row: a run's, or a server run's requests together."""
    return group_values(entry) if isinstance(entry, ServedRun) else row_values(entry)


def matches(entry: "RunRecord | ServedRun", kind: str | None, model: str | None, text: str) -> bool:
    """Whether an entry passes the filters: its kind, its model, and ``text`` anywhere in its row
    or its transcript (case ignored)."""
    record = record_of(entry)
    if kind and record.kind != kind or model and record.model != model:
        return False
    if not text:
        return True
    haystack = " ".join(entry_values(entry)) + " " + str(record.extra.get("transcript_markdown", ""))
    return text.lower() in haystack.lower()


class HistoryModel(QAbstractTableModel):
    """The entries as table rows, each formatted when first shown."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.records: list["RunRecord | ServedRun"] = []
        self._rows: dict[int, tuple[str, ...]] = {}

    def set_records(self, records: list["RunRecord | ServedRun"]) -> None:
        self.beginResetModel()
        self.records, self._rows = records, {}
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.records)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def text(self, row: int, column: int) -> str:
        if row not in self._rows:
            entry = self.records[row]
            self._rows[row] = entry_values(entry)
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
        self.all: list = []  # every entry, newest first; the table shows those the filters pass
        self.kind = QComboBox()
        self.kind.setObjectName("historyKind")
        self.model_pick = QComboBox()
        self.model_pick.setObjectName("historyModel")
        self.search = QLineEdit()
        self.search.setObjectName("historySearch")
        self.search.setPlaceholderText("Search: model, precision, kind, the transcript's text…")
        self.search.setClearButtonEnabled(True)
        self.delete_button = QPushButton("Delete…")
        self.delete_button.setToolTip("Remove the selected run from the history (a server run: all its requests)")
        self.delete_button.setEnabled(False)
        self.delete_button.setAutoDefault(False)  # Enter opens the selected run, never deletes it
        self.delete_button.clicked.connect(lambda: self.delete_selected())
        filters = QHBoxLayout()
        filters.addWidget(self.kind)
        filters.addWidget(self.model_pick)
        filters.addWidget(self.search, 1)
        filters.addWidget(self.delete_button)
        for box in (self.kind, self.model_pick):
            box.currentIndexChanged.connect(self._filter)
        self.search.textChanged.connect(self._filter)
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
        layout.addLayout(filters)
        layout.addWidget(split, 1)
        layout.addWidget(buttons)
        self.table.selectionModel().currentRowChanged.connect(lambda current, _: self.show_record(current.row()))
        self.table.doubleClicked.connect(lambda index: self.open_record(index.row()))
        self.resize(fit_screen(1100, 700))
        self.background = Background(self, workers=1)
        self.background.submit(lambda: entries(load_all()), self._show, self._show_failure)

    @property
    def records(self) -> list["RunRecord | ServedRun"]:
        """The entries the table shows, newest first."""
        return self.model.records

    def cell(self, row: int, column: int) -> str:
        return self.model.text(row, column)

    def _show(self, listed: list) -> None:
        self.all = listed
        for box, label, values in ((self.kind, "All kinds", sorted({record_of(e).kind for e in listed})),
                                   (self.model_pick, "All models", sorted({record_of(e).model for e in listed}))):
            chosen = box.currentData()
            box.blockSignals(True)
            box.clear()
            box.addItem(label, None)
            for value in values:
                box.addItem(value, value)
            box.setCurrentIndex(max(0, box.findData(chosen)) if chosen else 0)
            box.blockSignals(False)
        self._filter()
        self.table.resizeColumnsToContents()
        self.ready.emit()

    def _filter(self) -> None:
        shown = [e for e in self.all if matches(e, self.kind.currentData(), self.model_pick.currentData(),
                                                 self.search.text().strip())]
        self.model.set_records(shown)
        self.open_button.setEnabled(bool(shown))
        self.delete_button.setEnabled(bool(shown))
        if shown:
            self.table.selectRow(0)
            self.show_record(0)
        elif self.all:
            self.details.setPlainText("No run matches these filters.")
        else:
            self.details.setPlainText(f"No runs yet. Finished generations, comparison lanes, sweep points and "
                                      f"speculative runs are kept in {history_dir()}.")

    def delete_selected(self, confirm: bool = True) -> int:
        """Remove the selected entry's records (after asking); the list stays where it was."""
        row = self.table.currentIndex().row()
        if not 0 <= row < len(self.records):
            return 0
        entry = self.records[row]
        records = list(entry.requests) if isinstance(entry, ServedRun) else [entry]
        what = f"this server run's {len(records)} requests" if len(records) > 1 else "this run"
        if confirm and QMessageBox.question(self, "Delete from the history",
                                            f"Delete {what} from the history? Its figures can't be reopened after.",
                                            QMessageBox.Yes | QMessageBox.Cancel) != QMessageBox.Yes:
            return 0
        gone = delete(records)
        self.all = [e for e in self.all if e is not entry]
        self._filter()
        if self.records:
            self.table.selectRow(min(row, len(self.records) - 1))
            self.show_record(min(row, len(self.records) - 1))
        return gone

    def _show_failure(self, exc: BaseException) -> None:
        self.details.setPlainText(f"Could not read the history in {history_dir()}: {exc}")
        self.ready.emit()

    def done(self, result: int) -> None:
        self.background.close()
        super().done(result)

    def show_record(self, row: int) -> None:
        if not 0 <= row < len(self.records):
            return
        entry = self.records[row]
        if isinstance(entry, ServedRun):
            first, latest = entry.requests[0], entry.latest
            clients = sorted({r.extra.get("client", "") for r in entry.requests} - {""})
            self.details.setMarkdown(
                f"**A server run: {len(entry.requests)} requests** to {latest.model} ({latest.precision}), "
                f"{first.when.replace('T', ' ')} to {latest.when.replace('T', ' ')}, from "
                f"{', '.join(clients) or 'its clients'}.\n\n" + " · ".join(group_values(entry)[6:]) +
                "\n\nOpen shows its latest request; Delete removes them all.\n\n" + describe(latest))
        else:
            self.details.setMarkdown(describe(entry))

    def open_selected(self) -> None:
        """The Open button (and Enter): reopen the selected run; the list stays open."""
        self.open_record(self.table.currentIndex().row())

    def open_record(self, row: int) -> RunWindow | None:
        if not 0 <= row < len(self.records):
            return None
        # parented to the main window (a window of its own): it outlives this dialog
        window = RunWindow(record_of(self.records[row]), self.parentWidget() or self)
        self.opened.append(window)
        window.show()
        window.raise_()
        return window
