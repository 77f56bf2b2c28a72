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
