"""A 20,000-token answer in the window: does the UI stay responsive all the way?

A small random-weight llama (fast, so tokens arrive as quickly as the window can take them)
generates N tokens in the real main window, offscreen. A 5 ms timer records how late the GUI
event loop serves it (the time a click or a repaint would wait); the figures are printed for
the first and the last thousand tokens too, to show whether a growing answer slows the UI.

    python benchmarks/long_output.py --tokens 20000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--show-tokens", action="store_true", help="with token chips on")
    args = parser.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6.QtCore import QSettings, QTimer

    from app.main import create_app
    from app.main_window import MainWindow
    from engine.models.loading import LoadRequest
    from tests.tiny import build_model_folder, byte_level_tokenizer

    scratch = Path(tempfile.mkdtemp(prefix="iw-long-"))
    folder = build_model_folder(scratch / "llama", "llama", byte_level_tokenizer(), hidden_size=128,
                                intermediate_size=256, num_hidden_layers=2, max_position_embeddings=args.tokens + 64)
    app = create_app([])
    window = MainWindow(QSettings(str(scratch / "s.ini"), QSettings.IniFormat))
    window.resize(1600, 960)
    window.show()
    from app.main import settle_process

    settle_process()  # as the app does once its window shows
    window.show_tokens_action.setChecked(args.show_tokens)
    gaps: list[tuple[int, float]] = []  # (tokens so far, lateness of the 5 ms tick in ms)
    last = [time.perf_counter()]
    probe = QTimer()
    probe.setInterval(5)

    def tick() -> None:
        now = time.perf_counter()
        gaps.append((window.run.count, (now - last[0]) * 1000 - 5))
        last[0] = now

    probe.timeout.connect(tick)
    started = [0.0]

    def on_loaded(info) -> None:
        window.generation_panel.max_tokens.setValue(args.tokens)
        window.generation_panel.ignore_eos.setChecked(True)
        window.generation_panel.mode.setCurrentIndex(window.generation_panel.mode.findData("raw"))
        window.prompt.editor.setPlainText("Once upon a time")
        started[0] = time.perf_counter()
        last[0] = started[0]
        probe.start()
        window.generate("Once upon a time")

    def on_finished(event) -> None:
        probe.stop()
        elapsed = time.perf_counter() - started[0]
        late = [g for _, g in gaps]

        def summary(values: list[float]) -> str:
            values = sorted(values)
            return (f"median {statistics.median(values):.1f} ms, p99 {values[int(0.99 * (len(values) - 1))]:.1f} ms, "
                    f"max {values[-1]:.1f} ms over {len(values)} ticks")

        print(f"{event.tokens} tokens in {elapsed:.1f} s ({event.decode_tokens_per_s:.0f} tok/s), "
              f"{len(window.output.toPlainText()):,} characters shown")
        print(f"event-loop lateness, whole run: {summary(late)}")
        first = [g for n, g in gaps if n <= 1000]
        final = [g for n, g in gaps if n >= event.tokens - 1000]
        if first and final:
            print(f"  first 1,000 tokens: {summary(first)}")
            print(f"  last 1,000 tokens:  {summary(final)}")
        window.close()
        app.quit()

    window.session.loaded.connect(on_loaded)
    window.generation_finished.connect(on_finished)
    window.session.load_failed.connect(lambda exc: (print(f"error: {exc}"), app.exit(1)))
    window.model_panel.choose(LoadRequest(str(folder), "fp32", "cpu"))  # as a user would: the panel shows what runs
    window.load(window.model_panel.request())
    return app.exec()


if __name__ == "__main__":
    raise SystemExit(main())
