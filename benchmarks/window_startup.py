"""Time from launching the app to its window on screen, and whether torch was needed for it.

Each run is a fresh process (offscreen, private settings, no model load); the clock starts
before the interpreter does, so Python's own start-up counts too.

    python benchmarks/window_startup.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, os, sys, time
from PySide6.QtCore import QSettings
QSettings.setDefaultFormat(QSettings.IniFormat)
QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, os.environ["IW_SETTINGS"])
from app.main import create_app, settings
from app.main_window import MainWindow
app = create_app([])
window = MainWindow(settings())
window.show()
window.repaint()
app.processEvents()
shown = time.time()
print(json.dumps({"shown": shown, "torch_imported": "torch" in sys.modules}))
window.session.shutdown(5000)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, QT_QPA_PLATFORM=os.environ.get("QT_QPA_PLATFORM", "offscreen"),
               IW_SETTINGS=tempfile.mkdtemp(prefix="iw-startup-"))
    times, torch_flags = [], []
    for _ in range(args.runs):
        start = time.time()
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        times.append(report["shown"] - start)
        torch_flags.append(report["torch_imported"])
    print("window shown after: " + " ".join(f"{t:.2f}" for t in times) + f" s   median {statistics.median(times):.2f} s")
    print(f"torch imported before the window showed: {any(torch_flags)}")
    print(f"target < 1.5 s: {'met' if statistics.median(times) < 1.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
