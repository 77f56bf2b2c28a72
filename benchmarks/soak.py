"""Soak: many generations back to back in the real window; does memory or the thread count grow?

Offscreen main window, the default model, N short generations one after another (the next
starts when the previous one's Finished arrives, as a user pressing Generate would). RSS and
the number of threads are read after a warm-up of 10 generations and at the end.
Target: RSS growth < 5 %, no new threads.

    python benchmarks/soak.py --runs 200 --tokens 16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
WARMUP = 10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    import psutil
    from PySide6.QtCore import QSettings, QTimer

    from app.main import create_app
    from app.main_window import MainWindow
    from engine.models.loading import LoadRequest

    app = create_app([])
    settings = QSettings(str(Path(tempfile.mkdtemp()) / "soak.ini"), QSettings.IniFormat)
    window = MainWindow(settings)
    window.show()
    from app.main import settle_process

    settle_process()  # as the app does once its window shows
    process = psutil.Process()
    state = {"done": 0, "start": None}
    prompts = ("Explain microservices in simple terms.", "What is a KV cache?", "Name three colours.",
               "Count to five.", "你好，请介绍一下你自己。", "مرحبا! كيف حالك؟ 😀")

    def next_generation() -> None:
        if state["done"] == WARMUP:
            state["start"] = (process.memory_info().rss, len(process.threads()), time.perf_counter())
        if state["done"] >= args.runs + WARMUP:
            finish()
            return
        prompt = prompts[state["done"] % len(prompts)]
        window.clear_conversation()  # each run a fresh one-turn chat, as a benchmark user would
        window.prompt.editor.setPlainText(prompt)
        window.generate(prompt)

    def on_finished(event) -> None:
        state["done"] += 1
        if state["done"] % 50 == 0:
            print(f"{state['done']} generations, RSS {process.memory_info().rss / 2**20:.1f} MiB, "
                  f"{len(process.threads())} threads", flush=True)
        QTimer.singleShot(0, next_generation)

    def finish() -> None:
        rss0, threads0, t0 = state["start"]
        rss1, threads1 = process.memory_info().rss, len(process.threads())
        print(f"\n{args.runs} generations of {args.tokens} tokens in {time.perf_counter() - t0:.0f} s "
              f"(after {WARMUP} warm-up runs)")
        print(f"RSS     {rss0 / 2**20:.1f} MiB → {rss1 / 2**20:.1f} MiB: {100 * (rss1 - rss0) / rss0:+.2f}% "
              f"(target < 5%)")
        print(f"threads {threads0} → {threads1} (target: no growth)")
        window.close()
        app.quit()

    def on_loaded(info) -> None:
        window.generation_panel.max_tokens.setValue(args.tokens)
        window.generation_panel.ignore_eos.setChecked(True)
        next_generation()

    def on_failed(exc) -> None:
        print(f"error: {exc}", file=sys.stderr)
        app.exit(1)

    window.session.loaded.connect(on_loaded)
    window.generation_finished.connect(on_finished)
    window.session.load_failed.connect(on_failed)
    window.generation_failed.connect(on_failed)
    window.model_panel.choose(LoadRequest("default", args.precision, "cpu"))  # as a user would: the panel shows what runs
    window.load(window.model_panel.request())
    return app.exec()


if __name__ == "__main__":
    raise SystemExit(main())
