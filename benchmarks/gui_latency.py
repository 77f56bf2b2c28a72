"""Is the GUI event loop ever blocked while the app does its heavy things?

The real windows, offscreen, on the default model (or ``--model``). A 5 ms timer records how late
the event loop serves it (what a click or a repaint would wait) during each scenario, in one run:

- idle: nothing happening (the floor of this machine);
- cost explorer opens, new machine: a first open (this machine's bandwidth and FLOP/s are
  measured, the model's config read and its parameters counted); then a second open;
- sweep runs: the batching window's sweep at batch 1, 4, 8;
- comparison: its two lanes (fp32, int8) load, then the comparison runs and is scored;
- history with 1,000 runs: File → Run history and the cost explorer's history reload, with
  1,000 saved runs in the data folder.

The target is a maximum under 50 ms in each.

    python benchmarks/gui_latency.py [--model default] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TICK_MS = 5


class Watchdog:
    """Samples the GUI thread's stack every 5 ms while it has not ticked for > 20 ms; a stall over
    50 ms is printed with where the GUI thread was most often. Few samples in a long stall mean the
    watchdog itself could not run: another thread held the GIL (its stack is printed too)."""

    def __init__(self) -> None:
        import threading

        self.main = threading.main_thread().ident
        self.last = time.perf_counter()
        self.samples: list[tuple[str, str]] = []
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def alive(self, now: float) -> None:
        stalled = now - self.last
        samples, self.samples = self.samples, []
        self.last = now
        if stalled > 0.05 and samples:
            from collections import Counter

            gui = Counter(g for g, _ in samples).most_common(2)
            print(f"--- stall {1000 * stalled:.0f} ms, {len(samples)} samples (a free watchdog takes "
                  f"{int((stalled - 0.02) / 0.005)}); GUI thread:", flush=True)
            for stack, count in gui:
                print(f"  {count}×\n{stack}", flush=True)
            others = Counter(o for _, o in samples).most_common(1)
            if others and others[0][0]:
                print(f"  other threads, most often:\n{others[0][0]}", flush=True)

    def _watch(self) -> None:
        import threading

        def stack(frame, depth: int) -> str:  # no linecache: reading source files here could take import locks
            lines = []
            while frame is not None and len(lines) < depth:
                lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
                frame = frame.f_back
            return "".join(lines)

        me = threading.get_ident()
        while True:
            time.sleep(0.005)
            if time.perf_counter() - self.last < 0.02:
                continue
            frames = sys._current_frames()
            gui = stack(frames.get(self.main), 5)
            others = "".join(stack(frame, 4) for ident, frame in frames.items()
                             if ident not in (me, self.main) and frame.f_code.co_name not in ("wait", "_worker", "get"))
            self.samples.append((gui, others))


def _log_collections() -> None:
    """Print every garbage collection over 20 ms (it holds the GIL: every thread waits)."""
    import gc

    started = {}

    def collecting(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif time.perf_counter() - started.get("t", time.perf_counter()) > 0.02:
            print(f"--- garbage collection of generation {info['generation']} took "
                  f"{1000 * (time.perf_counter() - started['t']):.0f} ms", flush=True)

    gc.callbacks.append(collecting)


def _slow_calls(scenario: str):
    """A profile hook for the GUI thread: the calls the event loop makes into Python (their caller is
    the frame that called ``loop.exec()``) that take over 30 ms."""
    started: dict = {}

    def hook(frame, event, arg) -> None:
        if event not in ("call", "return") or frame.f_back is None or frame.f_back.f_code.co_name != "measure":
            return
        if event == "call":
            started[frame] = time.perf_counter()
        else:
            began = started.pop(frame, None)
            if began is not None and time.perf_counter() - began > 0.03:
                code = frame.f_code
                print(f"  [{scenario}] {1000 * (time.perf_counter() - began):.0f} ms in {code.co_qualname} "
                      f"({code.co_filename.split('/main/')[-1]}:{code.co_firstlineno})", flush=True)

    return hook


def _done_type():
    from PySide6.QtCore import QObject, Signal

    class Done(QObject):
        fired = Signal()

    return Done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request in the sweep and the comparison")
    parser.add_argument("--runs", type=int, default=1000, help="saved runs in the history scenario")
    parser.add_argument("--profile", metavar="SCENARIO", help="profile the GUI thread during this scenario "
                        "(cProfile, top 25 by cumulative time)")
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for this run (seconds; default: the app's)")
    parser.add_argument("--gc", action="store_true", help="print each garbage collection over 20 ms")
    parser.add_argument("--slow", action="store_true",
                        help="print each Python call the event loop made on the GUI thread that took > 30 ms")
    parser.add_argument("--explain", action="store_true",
                        help="when the event loop is late by > 40 ms, print where every thread was (a watchdog thread "
                             "samples the stacks; a stack seen late in another thread points at who held the GIL)")
    args = parser.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    scratch = Path(tempfile.mkdtemp(prefix="iw-gui-latency-"))
    os.environ["INFERENCE_WORKBENCH_DATA"] = str(scratch / "data")  # a history of this run only
    os.environ["INFERENCE_WORKBENCH_CONFIG"] = str(scratch / "config")

    from PySide6.QtCore import QEventLoop, QSettings, QTimer

    from app.main import create_app
    from app.main_window import MainWindow
    from engine.estimates import hardware
    from engine.measure.compare import LaneSpec
    from engine.models.loading import LoadRequest

    Done = _done_type()
    measured_once = hardware.this_machine
    hardware.this_machine = lambda measure=False: measured_once(measure=True)  # as on a new machine

    app = create_app([])
    window = MainWindow(QSettings(str(scratch / "s.ini"), QSettings.IniFormat))
    window.resize(1400, 900)
    window.show()
    from app.main import settle_process

    settle_process()  # as the app does once its window shows
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    results: dict[str, dict] = {}

    watchdog = Watchdog() if args.explain else None
    if args.gc or args.explain:
        _log_collections()

    def measure(name: str, start, done_signal, timeout_s: float = 600) -> None:
        """Run ``start()`` and the event loop until ``done_signal``; record the ticks' lateness."""
        late: list[float] = []
        last = [time.perf_counter()]
        probe = QTimer()
        probe.setInterval(TICK_MS)

        def tick() -> None:
            now = time.perf_counter()
            late.append(max(0.0, (now - last[0]) * 1000 - TICK_MS))
            last[0] = now
            if watchdog is not None:
                watchdog.alive(now)

        probe.timeout.connect(tick)
        loop = QEventLoop()
        done_signal.connect(loop.quit)
        guard = QTimer()
        guard.setSingleShot(True)
        guard.timeout.connect(loop.quit)
        guard.start(int(timeout_s * 1000))
        began = time.perf_counter()
        last[0] = began
        probe.start()
        QTimer.singleShot(0, start)
        if args.slow:
            sys.setprofile(_slow_calls(name))
        profiler = None
        if args.profile and args.profile in name:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        loop.exec()
        probe.stop()
        sys.setprofile(None)
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        finished = guard.isActive()
        guard.stop()
        done_signal.disconnect(loop.quit)
        late.sort()
        results[name] = {
            "seconds": time.perf_counter() - began, "ticks": len(late), "completed": finished,
            "p50_ms": late[len(late) // 2] if late else None,
            "p99_ms": late[int(0.99 * (len(late) - 1))] if late else None,
            "max_ms": late[-1] if late else None,
        }
        print(f"{name:<26} {results[name]['seconds']:7.1f} s  p50 {results[name]['p50_ms']:6.1f} ms  "
              f"p99 {results[name]['p99_ms']:6.1f} ms  max {results[name]['max_ms']:6.1f} ms"
              + ("" if finished else "  (timed out)"), flush=True)

    # load the model in the main window first (loading is not a scenario: its own benchmark covers it)
    loop = QEventLoop()
    window.session.loaded.connect(lambda *_: loop.quit())
    window.session.load_failed.connect(lambda exc: (print(f"could not load: {exc}"), loop.quit()))
    window.load(LoadRequest(args.model, "fp32", "cpu"))
    loop.exec()
    if window.loaded is None:
        return 1

    idle = QTimer()
    idle.setSingleShot(True)
    measure("idle", lambda: idle.start(3000), idle.timeout)

    shown = Done()  # fires once the cost explorer shows an estimate (not just "measuring…")

    def open_costs() -> None:
        view = window.open_costs()
        view.updated.connect(lambda: shown.fired.emit() if view.estimate is not None else None)

    measure("cost explorer opens, new machine", open_costs, shown.fired)
    window.tools.costs.close()
    window.tools.costs.deleteLater()
    window.tools.costs = None
    shown_again = Done()

    def open_costs_again() -> None:
        view = window.open_costs()
        view.updated.connect(lambda: shown_again.fired.emit() if view.estimate is not None else None)

    measure("cost explorer opens", open_costs_again, shown_again.fired)

    def settle(seconds: float = 1.0) -> None:
        """Let a window just opened lay out and paint before a scenario starts (opening it is not the scenario)."""
        pause = QEventLoop()
        QTimer.singleShot(int(seconds * 1000), pause.quit)
        pause.exec()

    speedups = window.open_speedups()
    settle()
    speedups.batching.batches.setText("1,4,8")
    speedups.batching.sweep_tokens.setValue(args.tokens)
    measure("sweep runs", speedups.batching.controls.run.click, window.session.job_finished)

    compare = window.open_compare()
    while len(compare.lanes) < 2:
        compare.add_lane()
    compare.lanes[0].configure(LaneSpec(args.model, "fp32", "cpu"))
    compare.lanes[1].configure(LaneSpec(args.model, "int8", "cpu"))
    compare.prompt.setPlainText("Explain what a KV cache is.")
    compare.max_tokens.setValue(args.tokens)
    settle()
    both_loaded = Done()

    def load_lanes() -> None:
        for lane in compare.lanes:
            lane.load_ended.connect(lambda _: both_loaded.fired.emit()
                                    if all(lane.loaded is not None for lane in compare.lanes) else None)
            lane.load()

    measure("comparison loads 2 lanes", load_lanes, both_loaded.fired)
    measure("comparison runs", compare.run_button.click, compare.run_finished)

    # a history of ``--runs`` saved runs: the runs above, copied
    history = scratch / "data" / "history"
    saved = sorted(history.glob("*.json"))
    for i in range(args.runs - len(saved)):
        source = saved[i % len(saved)]
        shutil.copy(source, history / f"{source.stem}-copy{i:05d}.json")
    print(f"(history: {len(list(history.glob('*.json')))} saved runs)")
    opened = []
    measure("history with 1,000 runs", lambda: opened.append(window.open_history()), window.history_opened)
    reloaded = window.open_costs()
    measure("cost explorer reloads it", reloaded.reload_history, reloaded.updated)

    worst = max(r["max_ms"] for name, r in results.items() if name != "idle")
    print(f"\nworst lateness outside idle: {worst:.1f} ms (target < 50 ms)")
    (scratch / "gui_latency.json").write_text(json.dumps(results, indent=2))
    for dialog in opened:
        dialog.close()
    window.close()
    app.processEvents()
    return 0 if worst < 50 else 2


if __name__ == "__main__":
    sys.exit(main())
