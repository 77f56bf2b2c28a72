"""Every window on a laptop's screen: inside it, title bar included, and every label, button and
check box with room for its text, no input crushed, no plot too short to read (the probe:
tests/app/layout_probe.py, one process per screen size, the size Qt's offscreen screen has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def probe(tmp_path: Path, width: int, height: int) -> list[str]:
    screen = tmp_path / "screen.json"
    screen.write_text(json.dumps({"synthesizedFrames": True, "screens": [
        {"name": "laptop", "x": 0, "y": 0, "width": width, "height": height, "logicalDpi": 96,
         "logicalBaseDpi": 96, "dpr": 1}]}))
    out = tmp_path / "problems.json"
    env = {**os.environ, "QT_QPA_PLATFORM": f"offscreen:configfile={screen}",
           "INFERENCE_WORKBENCH_DATA": str(tmp_path / "data"), "INFERENCE_WORKBENCH_CONFIG": str(tmp_path / "config")}
    subprocess.run([sys.executable, "-m", "tests.app.layout_probe", str(width), str(height), str(out)], cwd=ROOT,
                   env=env, timeout=300, check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("width,height", [(1280, 800), (1000, 700)])
def test_every_window_fits_a_laptop_screen(tmp_path, width, height):
    assert probe(tmp_path, width, height) == []


def test_the_probe_sees_a_window_that_does_not_fit(tmp_path):
    """The check above can fail: on a screen smaller than the smallest windows can shrink to,
    the probe reports them."""
    problems = probe(tmp_path, 640, 400)
    assert any("larger than the screen" in p for p in problems)
