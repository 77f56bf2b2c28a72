"""Open every window of the app on a screen of a given size and list what doesn't fit.

Run in a process of its own (the screen's size is fixed when Qt starts): ``python -m
tests.app.layout_probe WIDTH HEIGHT OUT.json [SHOTS_DIR]``, with ``QT_QPA_PLATFORM`` set to the
offscreen platform with a screen of that size (tests/app/test_layout.py does this). Each problem is
a line: a window outside the screen (its title bar counted), a button, check box or label without
room for its text, an input crushed to a sliver, a plot too short to read, a widget cut off by its
window's edge. ``SHOTS_DIR``: a PNG of every window there."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

TITLE_BAR = 32
"""What a window manager adds above a window (the offscreen screen draws none)."""
MIN_INPUT_WIDTH = 48
MIN_PLOT_HEIGHT = 110


def problems_in(window, name: str) -> list[str]:
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import (QAbstractButton, QAbstractScrollArea, QAbstractSpinBox, QCheckBox, QComboBox,
                                   QLabel, QLineEdit, QPushButton, QRadioButton)

    from app.widgets.live_plots import PlotPanel

    out = []
    screen = window.screen().availableGeometry()
    frame = window.frameGeometry()  # where it lies is the window manager's to choose; its size is ours
    if frame.height() + TITLE_BAR > screen.height() or frame.width() > screen.width():
        out.append(f"{name}: the window ({frame.width()}×{frame.height() + TITLE_BAR} with its title bar) is "
                   f"larger than the screen ({screen.width()}×{screen.height()})")
    inside = window.rect()

    def scroller(widget):
        parent = widget.parentWidget()
        while parent is not None and parent is not window:
            if isinstance(parent, QAbstractScrollArea):
                return parent
            parent = parent.parentWidget()
        return None

    for widget in window.findChildren(QAbstractButton) + window.findChildren(QLabel) + \
            window.findChildren(QLineEdit) + window.findChildren(QComboBox) + \
            window.findChildren(QAbstractSpinBox) + window.findChildren(PlotPanel):
        if not widget.isVisible() or widget.window() is not window or widget.visibleRegion().isEmpty():
            continue  # (a dock behind another's tab counts as visible, with nothing of it on screen)
        what = f"{name}: {type(widget).__name__} {widget.objectName() or ''}".rstrip()
        text = getattr(widget, "text", lambda: "")() if isinstance(widget, (QAbstractButton, QLabel)) else ""
        text = text if isinstance(text, str) else ""
        if text:
            what += f" {text[:40]!r}"
        if isinstance(widget, (QPushButton, QCheckBox, QRadioButton)) and text:
            need = widget.minimumSizeHint()
            if isinstance(widget, QPushButton):  # its text and some padding (not the style's 80-px habit)
                widget.ensurePolished()
                need.setWidth(widget.fontMetrics().horizontalAdvance(text.replace("&", "")) + 12)
            if widget.width() + 1 < need.width() or widget.height() + 1 < need.height():
                out.append(f"{what} is {widget.width()}×{widget.height()}, its text needs {need.width()}×{need.height()}")
        elif isinstance(widget, QLabel) and text.strip() and not widget.pixmap():
            if widget.wordWrap():
                need = widget.heightForWidth(widget.width())
                if need > 0 and widget.height() + 2 < need:
                    out.append(f"{what} is {widget.height()} px tall, its text needs {need} at this width")
            else:
                need = widget.minimumSizeHint().width()
                if widget.width() + 1 < need:
                    out.append(f"{what} is {widget.width()} px wide, its text needs {need}")
        elif isinstance(widget, (QLineEdit, QComboBox, QAbstractSpinBox)):
            if widget.width() < MIN_INPUT_WIDTH:
                out.append(f"{what} is crushed to {widget.width()} px")
        elif isinstance(widget, PlotPanel):
            if widget.plot.height() < MIN_PLOT_HEIGHT:
                out.append(f"{what} {widget.objectName() or ''}: its plot is {widget.plot.height()} px tall")
        area = scroller(widget)
        if area is None:
            box = widget.rect().translated(widget.mapTo(window, widget.rect().topLeft()))
            if not inside.contains(box):
                out.append(f"{what} is cut off by the window's edge ({box.x()},{box.y()} "
                           f"{box.width()}×{box.height()} in {inside.width()}×{inside.height()})")
        elif area.horizontalScrollBarPolicy() == Qt.ScrollBarAlwaysOff and not isinstance(widget, PlotPanel):
            viewport = area.viewport()  # it scrolls up and down only: nothing may run past its right edge
            right = widget.mapTo(viewport, widget.rect().topRight()).x()
            if right > viewport.width() + 1:
                out.append(f"{what} runs {right - viewport.width()} px past the right edge of its scroll area")
    out += _tab_bars_over_docks(window, name)
    out += _cut_headers(window, name)
    return out


def _cut_headers(window, name: str) -> list[str]:
    """A table's column header narrower than its text where the table doesn't scroll sideways to
    show it (its columns squeezed into the width it has)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QTableView

    out = []
    for table in window.findChildren(QTableView):
        if not table.isVisible() or table.window() is not window or table.visibleRegion().isEmpty():
            continue
        header = table.horizontalHeader()
        if header.length() > table.viewport().width() + 1:
            continue  # it scrolls: every column has its width
        metrics = header.fontMetrics()
        for column in range(header.count()):
            if header.isSectionHidden(column):
                continue
            text = str(table.model().headerData(column, Qt.Horizontal) or "")
            need = max((metrics.horizontalAdvance(line) for line in text.split("\n")), default=0) + 8
            if header.sectionSize(column) < need:
                out.append(f"{name}: table {table.objectName() or ''} column {text.replace(chr(10), ' ')!r} is "
                           f"{header.sectionSize(column)} px wide, its header needs {need}")
    return out


def _tab_bars_over_docks(window, name: str) -> list[str]:
    """A dock tab bar drawn over a dock's content (a stale one left by re-tabifying docks)."""
    from PySide6.QtWidgets import QDockWidget, QMainWindow, QTabBar

    if not isinstance(window, QMainWindow):
        return []
    docks = [d for d in window.findChildren(QDockWidget) if d.isVisible() and not d.visibleRegion().isEmpty()]
    out = []
    for bar in window.findChildren(QTabBar):
        if bar.parentWidget() is not window or not bar.isVisible():
            continue
        for dock in docks:
            if bar.geometry().intersects(dock.geometry()):
                out.append(f"{name}: a tab bar ({', '.join(bar.tabText(i) for i in range(bar.count()))}) is drawn "
                           f"over the {dock.windowTitle()!r} dock")
    return out


SPECULATIVE_SUMMARY = (
    "<b>early-exit:20</b>, N = 4: 6 of 93 drafted tokens accepted (6%), 1.29 tokens per target pass.<br>"
    "Time per step: draft 167.3 ms, target check 93.0 ms.<br>"
    "Speculative 4.9 tok/s against plain 15.5 tok/s → <b>0.32×</b> (same tokens as plain decoding)")


def speculative_problems(app, window) -> list[str]:
    """The speculative tab with a run's summary in it (the longest it writes)."""
    window.tabs.setCurrentWidget(window.speculative)
    window.speculative.spec_summary.setText(SPECULATIVE_SUMMARY)
    app.processEvents()
    return problems_in(window, "speculative decoding")


def tour_problems(app, tour) -> list[str]:
    """Every step of the tour's panel (each says what it needs: no model is loaded), inside the
    screen where it placed itself, with room for its text."""
    from app.tour import STEPS

    out = []
    for index in range(len(STEPS)):
        tour.show_step(index)
        app.processEvents()
        name = f"tour step {index + 1}"
        out += problems_in(tour, name)
        frame, screen = tour.frameGeometry(), tour.screen().availableGeometry()
        if not screen.contains(frame):
            out.append(f"{name}: the panel ({frame.x()},{frame.y()} {frame.width()}×{frame.height()}) is not "
                       f"inside the screen ({screen.width()}×{screen.height()})")
    return out


STATUS_MESSAGES = (
    "Loaded SmolLM2-135M-Instruct (fp32) in 36.2 s: 134.5 M parameters, 513.1 MiB of weights, on cpu",
    "Done: 16 tokens, 11.6 tok/s, 96 of 129 prompt tokens from the cache (earlier turns, not computed again)",
)


def status_problems(app, window) -> list[str]:
    """The status bar's longest messages: read whole in the bar, or under the prompt where the bar
    has no room for them."""
    out = []
    for text in STATUS_MESSAGES:
        window.say(text)
        deadline = time.monotonic() + 0.3  # (it looks again once the figures beside it are laid out)
        while time.monotonic() < deadline:
            app.processEvents()
            time.sleep(0.01)
        bar = window.statusBar()
        first = min((label.mapTo(bar, label.rect().topLeft()).x() for label in window.status.labels.values()
                     if label.isVisible()), default=bar.width())
        in_bar = bar.fontMetrics().horizontalAdvance(text) + 12 <= first
        message = window.prompt.message
        below = message.isVisible() and message.text() == text and not message.visibleRegion().isEmpty()
        if not (in_bar or below):
            out.append(f"main window: the status message {text[:40]!r}… is cut in the bar and not shown under "
                       "the prompt")
        out += [p for p in problems_in(window, "main window") if "message" in p.lower()]
    return out


def main() -> None:
    width, height, out_path = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    shots = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    from PySide6.QtCore import QSettings

    from app.main import create_app
    from app.main_window import MainWindow
    from engine.estimates import hardware

    hardware.measure_cpu = lambda: {"bandwidth_bytes_per_s": 3e10, "bf16_flops": 2e11}  # not seconds of measuring

    folder = Path(tempfile.mkdtemp())
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(folder / "settings"))
    app = create_app([])
    main_window = MainWindow(QSettings(str(folder / "settings" / "probe.ini"), QSettings.IniFormat))
    main_window.show()
    windows = {"main window": main_window}
    windows["compare"] = main_window.open_compare()
    windows["cost explorer"] = main_window.open_costs()
    windows["batching and speculative decoding"] = main_window.open_speedups()
    windows["traffic"] = main_window.open_traffic()
    windows["history"] = main_window.open_history()  # (no runs yet: its filters, search and buttons)
    windows["tour"] = main_window.open_tour()  # on its first step (no model: it says what it needs)
    deadline = time.monotonic() + 60
    while windows["cost explorer"].estimate is None and time.monotonic() < deadline:  # its numbers shown
        app.processEvents()
        time.sleep(0.02)
    costs, drawn = windows["cost explorer"], []
    costs.updated.connect(lambda: drawn.append(True))
    costs.set_model("meta-llama/Llama-3.1-70B", "bf16")  # a plan past one GPU: the longest numbers
    gpu = costs.hardware.findData("h100-sxm")
    if gpu >= 0:
        costs.hardware.setCurrentIndex(gpu)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (drawn and costs.plan is not None):
        app.processEvents()
        time.sleep(0.01)
    for _ in range(20):
        app.processEvents()
    problems = []
    for name, window in windows.items():
        app.processEvents()
        problems += problems_in(window, name)
        if shots is not None:
            shots.mkdir(parents=True, exist_ok=True)
            window.grab().save(str(shots / f"{name.replace(' ', '-')}-{width}x{height}.png"))
    problems += speculative_problems(app, windows["batching and speculative decoding"])
    problems += tour_problems(app, windows["tour"])
    problems += status_problems(app, main_window)
    out_path.write_text(json.dumps(problems, indent=1))
    for window in windows.values():
        window.close()
    main_window.close()
    os._exit(0)  # the windows' threads are ended; skip the interpreter's slow teardown


if __name__ == "__main__":
    main()
