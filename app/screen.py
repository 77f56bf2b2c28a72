"""Window sizes that fit the screen they open on."""

from __future__ import annotations

from PySide6.QtCore import QSize
from PySide6.QtGui import QGuiApplication


def fit_screen(width: int, height: int) -> QSize:
    """A first window size: ``width`` × ``height``, or the screen's free area if that is smaller."""
    screen = QGuiApplication.primaryScreen()
    if screen is None:
        return QSize(width, height)
    free = screen.availableGeometry()
    return QSize(min(width, free.width()), min(height, free.height()))
