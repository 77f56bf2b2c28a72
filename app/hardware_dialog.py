"""Cost explorer → Edit hardware…: the hardware profiles as a table; the user's edits are kept
in their config folder (the shipped table stays as it is)."""

from __future__ import annotations

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout

from app.screen import fit_screen


class HardwareDialog(QDialog):
    FIELDS = (("name", "Name", str), ("memory_bytes", "Memory (GiB)", float), ("bandwidth_bytes_per_s", "Bandwidth (GB/s)", float),
              ("bf16_flops", "bf16 TFLOP/s", float), ("usd_per_hour", "$ / hour", float), ("watts", "Watts", float))
    SCALE = {"memory_bytes": 2 ** 30, "bandwidth_bytes_per_s": 1e9, "bf16_flops": 1e12}

    def __init__(self, profiles, parent=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Hardware profiles")
        self.profiles = profiles
        self.table = QTableWidget(len(profiles), len(self.FIELDS))
        self.table.setHorizontalHeaderLabels([title for _, title, _ in self.FIELDS])
        self.table.setVerticalHeaderLabels([p.id for p in profiles])
        for row, profile in enumerate(profiles):
            for column, (key, _, _) in enumerate(self.FIELDS):
                value = getattr(profile, key)
                scale = self.SCALE.get(key, 1)
                text = "" if value is None else (value if isinstance(value, str) else f"{value / scale:g}")
                item = QTableWidgetItem(text)
                item.setToolTip((profile.sources or {}).get(key, ""))
                self.table.setItem(row, column, item)
        self.table.resizeColumnsToContents()
        buttons = QDialogButtonBox(QDialogButtonBox.Save | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Hover a cell for its source. Your edits are kept in your config folder."))
        layout.addWidget(self.table)
        layout.addWidget(buttons)
        self.resize(fit_screen(1000, 420))

    def changes(self) -> dict[str, dict]:
        result = {}
        for row, profile in enumerate(self.profiles):
            for column, (key, _, kind) in enumerate(self.FIELDS):
                text = self.table.item(row, column).text().strip()
                try:
                    value = kind(text) * self.SCALE.get(key, 1) if kind is float and text else (text or None)
                except ValueError:
                    continue
                if value != getattr(profile, key) and value is not None:
                    result.setdefault(profile.id, {})[key] = int(value) if key == "memory_bytes" else value
        return result
