"""Where the workbench keeps files of its own."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "inference-workbench"


def cache_dir() -> Path:
    """The user cache folder (``INFERENCE_WORKBENCH_CACHE`` overrides it)."""
    override = os.environ.get("INFERENCE_WORKBENCH_CACHE")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def resource_dir() -> Path:
    """The repository's ``resources/`` folder (icons, styles, shipped model configs), or its
    copy inside a PyInstaller bundle."""
    import sys

    bundled = getattr(sys, "_MEIPASS", None)
    if bundled:
        return Path(bundled) / "resources"
    return Path(__file__).resolve().parents[2] / "resources"
