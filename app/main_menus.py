"""The main window's menus: File (save, history, quit), View (the other windows, token chips,
the panels, the layout, the redraw pace) and Help (the tour, the glossary)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence

from app.glossary import open_glossary


def build_menus(window, paces) -> None:
    """Build the menu bar; sets ``window.show_tokens_action`` and ``window.pace_actions``."""
    file_menu = window.menuBar().addMenu("&File")
    save = QAction("&Save transcript…", window, shortcut=QKeySequence.Save, triggered=window.save_transcript)
    file_menu.addAction(save)
    file_menu.addAction(QAction("Run &history…", window, shortcut="Ctrl+H", triggered=window.open_history))
    file_menu.addSeparator()
    file_menu.addAction(QAction("&Quit", window, shortcut=QKeySequence.Quit, triggered=window.close))
    view = window.menuBar().addMenu("&View")
    window.help_menu = help_menu = window.menuBar().addMenu("&Help")
    view.addAction(QAction("&Compare models and precisions…", window, shortcut="Ctrl+K",
                           triggered=window.open_compare))
    view.addAction(QAction("Cost &explorer…", window, shortcut="Ctrl+E", triggered=window.open_costs))
    view.addAction(QAction("&Batching and speculative decoding…", window, shortcut="Ctrl+B",
                           triggered=window.open_speedups))
    view.addAction(QAction("&Traffic (the server's requests, live)…", window, shortcut="Ctrl+Shift+T",
                           triggered=window.open_traffic))
    view.addSeparator()
    window.show_tokens_action = QAction("Show &tokens", window, checkable=True, shortcut="Ctrl+T")
    window.show_tokens_action.toggled.connect(window.output.set_show_tokens)
    view.addAction(window.show_tokens_action)
    view.addSeparator()
    for dock in window._docks.values():
        view.addAction(dock.toggleViewAction())
    view.addSeparator()
    view.addAction(QAction("&Reset layout", window, triggered=window.reset_layout))
    view.addSeparator()
    pace = view.addMenu("Redraw while &generating")
    window.pace_actions: dict[float, QAction] = {}
    group = QActionGroup(window)
    for budget, label in paces:
        action = QAction(label, window, checkable=True)
        action.triggered.connect(lambda checked, b=budget: window.set_redraw_budget(b))
        group.addAction(action)
        pace.addAction(action)
        window.pace_actions[budget] = action
    help_menu.addAction(QAction("&Tour: ten questions, measured on this model…", window, triggered=window.open_tour))
    help_menu.addAction(QAction("&Glossary: tokens, TTFT, KV cache…", window, shortcut=QKeySequence.HelpContents,
                                triggered=lambda: open_glossary(parent=window)))
