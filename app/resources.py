"""Where the icons, stylesheets and .desktop file are, in a checkout or in a bundle."""

from __future__ import annotations

from pathlib import Path

from engine.storage.paths import resource_dir


def icon_path(size: int | None = None) -> Path:
    name = "inference-workbench.svg" if size is None else f"inference-workbench-{size}.png"
    return resource_dir() / "icons" / name


def stylesheet() -> str:
    """The numbered .qss files, concatenated in order."""
    styles = sorted((resource_dir() / "styles").glob("*.qss"))
    return "\n".join(path.read_text(encoding="utf-8") for path in styles)
