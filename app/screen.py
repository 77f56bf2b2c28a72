"""Window sizes that fit the screen they open on."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFrame, QScrollArea, QWidget


DECORATION = QSize(16, 48)
"""Room a window manager's frame and title bar take around a window (a size set with ``resize``
is the inside's): kept free so the whole window fits the screen."""


def fit_screen(width: int, height: int) -> QSize:
    """A first window size: ``width`` × ``height``, or the screen's free area less a window's frame
    and title bar if that is smaller."""
    screen = QGuiApplication.primaryScreen()
    if screen is None:
        return QSize(width, height)
    free = screen.availableGeometry()
    return QSize(min(width, free.width() - DECORATION.width()), min(height, free.height() - DECORATION.height()))


def compact(*buttons) -> None:
    """Buttons that may shrink to their text and a little padding (a style's default minimum is
    about 80 px each: five in a row kept a laptop-wide window from fitting)."""
    for button in buttons:
        button.ensurePolished()  # the style sheet's font (a bold Generate) first
        button.setMinimumWidth(button.fontMetrics().horizontalAdvance(button.text()) + 32)


def scrolling(panel: QWidget) -> QScrollArea:
    """``panel`` in a vertical scroll area as wide as the panel needs (never cut on the right): a
    short screen scrolls it instead of squeezing it."""
    area = QScrollArea()
    area.setWidget(panel)
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.NoFrame)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
    area.setMinimumWidth(panel.minimumSizeHint().width() + area.verticalScrollBar().sizeHint().width())
    return area
