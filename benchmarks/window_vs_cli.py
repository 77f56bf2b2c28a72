"""Generation speed inside the window against the headless CLI, same model and precision.

Interleaved: A runs ``inference-workbench bench`` in a subprocess (the window's process sits
idle meanwhile), B makes the window generate (worker thread, queued signals, the 20 Hz
redraw of text and plots). Both make exactly N tokens of the same greedy answer. Three
figures: the median per-token decode latency over all rounds (robust to bursts of noise),
the medians of each run's decode tok/s, and the median of paired ratios (each window run
against the CLI run just before it: robust to the slow drifts of a shared machine).

    python benchmarks/window_vs_cli.py --precisions fp32,bf16 --tokens 128 --rounds 4
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
from pathlib import Path

PROMPT = "Explain microservices in simple terms."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="iw-bench-"))
    if "QT_QPA_PLATFORM" not in os.environ:
        config = scratch / "offscreen.json"
        config.write_text(json.dumps({"screens": [{"name": "b", "x": 0, "y": 0, "width": 1920, "height": 1080,
                                                    "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
        os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={config}"
    from PySide6.QtCore import QEventLoop, QSettings

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(scratch))
    from app.main import create_app, settings
    from app.main_window import MainWindow
    from engine.models.loading import LoadRequest

    app = create_app([])
    window = MainWindow(settings())
    window.resize(1600, 960)
    window.show()
    from app.main import settle_process

    settle_process()  # as the app does once its window shows
    window.generation_panel.max_tokens.setValue(args.tokens)
    window.generation_panel.ignore_eos.setChecked(True)

    def wait_for(signal) -> object:
        loop, got = QEventLoop(), []
        signal.connect(lambda *a: (got.append(a), loop.quit()))
        loop.exec()
        return got[0][0] if got and got[0] else None

    gui_cpu: list[float] = []
    frame_rate: list[float] = []

    def in_window() -> tuple[float, list[float]]:
        window.clear_conversation()
        window.prompt.editor.setPlainText(PROMPT)
        cpu, wall, frames = time.thread_time(), time.perf_counter(), window.plots.redraws
        window.generate(PROMPT)
        finished = wait_for(window.generation_finished)
        seconds = time.perf_counter() - wall
        gui_cpu.append((time.thread_time() - cpu) / seconds)
        frame_rate.append((window.plots.redraws - frames) / seconds)
        return finished.decode_tokens_per_s, list(window.run.column("latency_s")[1:])

    def headless(precision: str) -> tuple[float, list[float]]:
        out = scratch / "bench.json"
        subprocess.run([sys.executable, "-m", "engine.cli", "bench", "--model", args.model, "--precision", precision,
                        "--device", "cpu", "--prompt", PROMPT, "--max-new-tokens", str(args.tokens), "--ignore-eos",
                        "--quiet", "--json", str(out)], check=True, capture_output=True)
        report = json.loads(out.read_text())
        return report["decode_tokens_per_s"], report["per_token_latency_s"][1:]

    print(f"{args.model}; {args.tokens} tokens; {args.rounds} interleaved rounds; window {window.width()}×{window.height()}")
    for precision in args.precisions.split(","):
        window.model_panel.choose(LoadRequest(args.model, precision, "cpu"))  # as a user would: the panel shows what runs
        window.load(window.model_panel.request())
        wait_for(window.session.loaded)
        in_window()  # warm up
        gui_cpu.clear()
        frame_rate.clear()
        a, b, a_steps, b_steps = [], [], [], []
        for _ in range(args.rounds):
            rate, steps = headless(precision)
            a.append(rate)
            a_steps += steps
            rate, steps = in_window()
            b.append(rate)
            b_steps += steps
        step_ratio = statistics.median(a_steps) / statistics.median(b_steps)
        ratio = statistics.median(b) / statistics.median(a)
        paired = statistics.median(y / x for x, y in zip(a, b))
        print(f"{precision:>5}: per-token median {1 / statistics.median(a_steps):5.1f} (CLI) vs "
              f"{1 / statistics.median(b_steps):5.1f} (window) tok/s -> window/CLI {step_ratio:.3f}")
        print(f"{'':>5}  runs: CLI {' '.join(f'{x:5.1f}' for x in a)} | window {' '.join(f'{x:5.1f}' for x in b)}"
              f" -> medians {statistics.median(a):5.1f} vs {statistics.median(b):5.1f}, window/CLI {ratio:.3f}")
        print(f"{'':>5}  paired: median of (window run ÷ the CLI run just before it) = {paired:.3f}")
        print(f"{'':>5}  GUI thread while generating: {100 * statistics.median(gui_cpu):.1f}% of a core, "
              f"{statistics.median(frame_rate):.1f} redraws/s (one plot each, the text and status every time)")
    window.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
