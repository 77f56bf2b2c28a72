"""Does closing a window that loaded models give the memory back?

The main window loads the default model (as a user's would), then: process RSS before the
Compare window opens; with its lanes loaded and after one comparison; and after it is closed.
The issue's target: RSS after closing within 10% of before.

    python benchmarks/window_memory.py [--lanes default:fp32,default:bf16] [--tokens 16]

Runs offscreen (no display needed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", default="default:fp32,default:bf16")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    sys.path.insert(0, str(ROOT))

    import tempfile

    import psutil
    from PySide6.QtCore import QSettings, QTimer

    scratch = tempfile.mkdtemp(prefix="iw-memory-")
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, scratch)
    os.environ.setdefault("INFERENCE_WORKBENCH_DATA", scratch)

    from app.main import create_app, settings
    from app.main_window import MainWindow
    from engine.measure.compare import parse_lane

    app = create_app([])
    window = MainWindow(settings())
    window.show()
    from app.main import settle_process

    settle_process()  # as the app does once its window shows
    process = psutil.Process()
    figures: dict[str, float] = {}
    state: dict = {}

    def rss() -> float:
        return process.memory_info().rss / 2**20

    def on_loaded(_info) -> None:
        if "before" in figures:
            return
        figures["before"] = rss()
        compare = state["compare"] = window.open_compare()
        specs = [parse_lane(text) for text in args.lanes.split(",")]
        while len(compare.lanes) < len(specs):
            compare.add_lane()
        for lane, spec in zip(compare.lanes, specs):
            lane.configure(spec)
        compare.prompt.setPlainText("Explain microservices in simple terms.")
        compare.max_tokens.setValue(args.tokens)
        compare.run_finished.connect(after_run)
        compare.run()  # loads every lane, then runs

    def after_run() -> None:
        figures["with Compare open"] = rss()
        state["compare"].close()
        QTimer.singleShot(500, after_close)  # the window's deferred deletion runs first

    def after_close() -> None:
        figures["after closing Compare"] = rss()
        window.close()
        app.quit()

    window.session.loaded.connect(on_loaded)
    window.session.load_failed.connect(lambda exc: (print(f"error: {exc}"), app.quit()))
    QTimer.singleShot(0, window.start)
    app.exec()
    if len(figures) < 3:
        print("did not finish", figures)
        return 1
    before = figures["before"]
    print(f"lanes {args.lanes}, {args.tokens} tokens; main window holding the default model (fp32)")
    for name, value in figures.items():
        print(f"  RSS {name:<24} {value:8.1f} MiB  ({(value - before) / before:+.1%} of before)")
    change = (figures["after closing Compare"] - before) / before
    print(f"after closing: {change:+.1%} of before (target within ±10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
