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


SIZES = [(1280, 800), (1000, 700), (640, 400)]
"""Two laptop screens every window must fit, and one smaller than the smallest windows shrink to."""


def start_probe(folder: Path, width: int, height: int) -> tuple[subprocess.Popen, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    screen = folder / "screen.json"
    screen.write_text(json.dumps({"synthesizedFrames": True, "screens": [
        {"name": "laptop", "x": 0, "y": 0, "width": width, "height": height, "logicalDpi": 96,
         "logicalBaseDpi": 96, "dpr": 1}]}))
    out = folder / "problems.json"
    env = {**os.environ, "QT_QPA_PLATFORM": f"offscreen:configfile={screen}",
           "INFERENCE_WORKBENCH_DATA": str(folder / "data"), "INFERENCE_WORKBENCH_CONFIG": str(folder / "config")}
    process = subprocess.Popen([sys.executable, "-m", "tests.app.layout_probe", str(width), str(height), str(out)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return process, out


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> dict[tuple[int, int], list[str]]:
    """Each screen size's problems, the probes run side by side (each mostly one core's work)."""
    root = tmp_path_factory.mktemp("layout")
    probes = {size: start_probe(root / f"{size[0]}x{size[1]}", *size) for size in SIZES}
    found = {}
    for size, (process, out) in probes.items():
        try:
            log, _ = process.communicate(timeout=300)
        finally:
            process.kill()
        assert process.returncode == 0, log.decode(errors="replace")[-3000:]
        found[size] = json.loads(out.read_text())
    return found


@pytest.mark.parametrize("width,height", SIZES[:2])
def test_every_window_fits_a_laptop_screen(problems, width, height):
    assert problems[width, height] == []


def test_the_probe_sees_a_window_that_does_not_fit(problems):
    """The check above can fail: on a screen smaller than the smallest windows can shrink to,
    the probe reports them."""
    assert any("larger than the screen" in p for p in problems[640, 400])
