"""Render the window after a real generation on the default model to docs/screenshot.png.

    python docs/make_screenshot.py [--out docs/screenshot.png] [--show-tokens]
    python docs/make_screenshot.py --compare [--out docs/compare.png]   # the quantization ladder
    python docs/make_screenshot.py --costs [--out docs/costs.png]       # the cost explorer
    python docs/make_screenshot.py --speedups   # docs/batching.png and docs/speculative.png
    python docs/make_screenshot.py --endpoint http://127.0.0.1:8089/v1   # docs/endpoint.png: a local lane beside
                                                     # a lane served by that server (llama-server, vLLM…)
    python docs/make_screenshot.py --size 1280x800 --out docs/shots/main-1280x800.png   # any of them, on a
                                                     # screen of that size with the window filling it

Runs offscreen (no display needed) on a virtual 1920×1080 screen, with its own settings
file so your saved layout doesn't leak in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Explain microservices in simple terms."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshot.png")
    parser.add_argument("--show-tokens", action="store_true", help="render the answer as token chips")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--compare", action="store_true",
                        help="the Compare window after a quantization ladder (fp32/bf16/int8/nf4) run")
    parser.add_argument("--quality", type=int, metavar="CHUNKS",
                        help="with --compare: then the Quality run over the text's first CHUNKS chunks of 512 "
                             "tokens, its tab shown (docs/quality.png)")
    parser.add_argument("--costs", action="store_true", help="the Cost explorer: Llama-3.1-8B on an H100")
    parser.add_argument("--traffic", action="store_true",
                        help="the traffic view under a 16-stream load from its load generator (docs/traffic.png)")
    parser.add_argument("--speedups", action="store_true",
                        help="a batch sweep and a speculative run on the default model (two PNGs in docs/)")
    parser.add_argument("--draft", default="early-exit:24", help="the draft for --speedups")
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="the model for --costs")
    parser.add_argument("--hardware", default="h100-sxm", help="the hardware profile for --costs")
    parser.add_argument("--endpoint", metavar="URL[#MODEL]",
                        help="the Compare window: the default model here (bf16) beside the model served at URL")
    parser.add_argument("--size", help="WIDTHxHEIGHT: a screen of this size, the window filling it")
    parser.add_argument("--precision", help="the precision the window (and --traffic's) loads the default model at "
                        "(e.g. bf16-fast)")
    args = parser.parse_args()
    args.screen = tuple(int(v) for v in args.size.lower().split("x")) if args.size else None
    if args.out == ROOT / "docs" / "screenshot.png" and (args.compare or args.costs or args.endpoint):
        args.out = ROOT / "docs" / ("quality.png" if args.quality else "compare.png" if args.compare else
                                    "endpoint.png" if args.endpoint else "costs.png")

    scratch = Path(tempfile.mkdtemp(prefix="iw-shot-"))
    if "QT_QPA_PLATFORM" not in os.environ:
        config = scratch / "offscreen.json"
        width, height = args.screen or (1920, 1080)
        config.write_text(json.dumps({"screens": [{"name": "shot", "x": 0, "y": 0, "width": width, "height": height,
                                                    "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
        os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={config}"
    sys.path.insert(0, str(ROOT))

    from PySide6.QtCore import QSettings, QTimer

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(scratch))

    from app.main import create_app, settings
    from app.main_window import MainWindow

    app = create_app([])
    if args.compare or args.endpoint:
        return compare_shot(app, args)
    if args.costs:
        return costs_shot(app, args)
    if args.speedups:
        return speedups_shot(app, args, MainWindow(settings()))
    if args.traffic:
        window = MainWindow(settings())
        window.shot_precision = args.precision
        return traffic_shot(app, args, window)
    window = MainWindow(settings())
    window.shot_precision = args.precision
    window.resize(*(args.screen or (1600, 960)))
    window.show()
    window.show_tokens_action.setChecked(args.show_tokens)
    window.generation_panel.max_tokens.setValue(args.max_tokens)
    outcome = {}

    def on_loaded(info) -> None:
        window.prompt.editor.setPlainText(PROMPT)
        window.generate(PROMPT)

    def on_finished(event) -> None:
        QTimer.singleShot(300, finish)  # let the last frame paint

    def on_failed(exc) -> None:
        outcome["error"] = str(exc)
        app.quit()

    def finish() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        window.grab().save(str(args.out))
        outcome["saved"] = str(args.out)
        window.close()
        app.quit()

    window.session.loaded.connect(on_loaded)
    window.generation_finished.connect(on_finished)
    window.session.load_failed.connect(on_failed)
    window.generation_failed.connect(on_failed)
    return _run(app, window, outcome)


def _failing(app, window, outcome: dict):
    """A callback that records an error, closes the window and ends the run."""
    def on_failed(exc) -> None:
        outcome["error"] = str(exc)
        window.close()
        app.quit()
    return on_failed


def _run(app, window, outcome: dict) -> int:
    """Show ``window``, load the default model, run until a shot saved (``outcome["saved"]``,
    a path or a list of them) or failed (``outcome["error"]``)."""
    from PySide6.QtCore import QTimer

    window.show()
    precision = getattr(window, "shot_precision", None)
    if precision:
        combo = window.model_panel.precision
        combo.setCurrentIndex(combo.findData(precision))
    QTimer.singleShot(0, window.start)
    app.exec()
    if "error" in outcome:
        print(f"error: {outcome['error']}", file=sys.stderr)
        return 1
    saved = outcome["saved"]
    print("saved " + (", ".join(saved) if isinstance(saved, list) else saved))
    return 0


def traffic_shot(app, args, window) -> int:
    """Serve the default model, open the traffic view and load it with 16 concurrent streams; the
    shot is taken mid-load, once 24 requests have finished (the distributions have data) and 16
    are in flight."""
    from PySide6.QtCore import QTimer

    outcome, ui = {}, {}
    out = args.out if args.out != ROOT / "docs" / "screenshot.png" else ROOT / "docs" / "traffic.png"

    def on_loaded(info) -> None:
        panel = window.server_panel
        panel.port.setValue(0)
        panel.start_button.click()

    def on_state() -> None:
        panel = window.server_panel
        if panel.started is None or "view" in ui:
            return
        view = ui["view"] = window.open_traffic()
        view.resize(*(args.screen or (1900, 1060)))
        box = view.load_box
        box.values.setText("16")
        box.requests.setValue(64)
        box.max_tokens.setValue(64)
        box.run_button.click()
        ui["poll"] = QTimer(interval=250, timeout=check)
        ui["poll"].start()

    def check() -> None:
        panel = window.server_panel
        running, _ = panel.log.in_core()
        if panel.log.finished >= 24 and running >= 16:
            ui["poll"].stop()
            view = ui["view"]
            view.refresh(everything=True)
            QTimer.singleShot(200, finish)

    def finish() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        ui["view"].grab().save(str(out))
        outcome["saved"] = str(out)
        ui["view"].load_box.stop()
        ui["view"].close()
        window.close()
        app.quit()

    on_failed = _failing(app, window, outcome)
    window.session.loaded.connect(on_loaded)
    window.server_panel.state_changed.connect(on_state)
    window.session.load_failed.connect(on_failed)
    return _run(app, window, outcome)


def speedups_shot(app, args, window) -> int:
    from PySide6.QtCore import QTimer

    outcome = {}
    ui = {}
    window.generation_panel.max_tokens.setValue(48)

    def save(name: str) -> None:
        path = ROOT / "docs" / name
        if args.size:
            path = args.out.parent / f"{name.removesuffix('.png')}-{args.size}.png"
        ui['view'].grab().save(str(path))
        outcome.setdefault("saved", []).append(str(path))

    def on_loaded(info) -> None:
        view = ui['view'] = window.open_speedups()
        view.resize(*(args.screen or (1700, 900)))
        view.batching.batches.setText("1,2,4,8,16")
        view.batching.sweep_tokens.setValue(32)
        view.batching.controls.run.click()

    def on_job_finished(job_id, result) -> None:
        view = ui['view']
        if job_id == getattr(view.batching, "last_job", None):
            QTimer.singleShot(300, after_sweep)
        elif job_id == getattr(view.speculative, "last_job", None):
            QTimer.singleShot(300, finish)

    def on_job_started(job_id) -> None:  # which tool's job it is, for on_job_finished
        view = ui.get('view')
        for tool in (view.batching, view.speculative) if view else ():
            if tool.job == job_id:
                tool.last_job = job_id

    def after_sweep() -> None:
        save("batching.png")
        view = ui['view']
        view.tabs.setCurrentIndex(1)
        view = view.speculative
        kind, _, value = args.draft.partition(":")
        if kind == "early-exit":
            view.draft_kind.setCurrentIndex(0)
            view.draft_layers.setValue(int(value))
        else:
            view.draft_kind.setCurrentIndex(1)
            view.draft_precision.setCurrentIndex(view.draft_precision.findData(value))
        view.spec_tokens.setValue(64)
        view.draft_tokens.setValue(3)
        view.controls.run.click()

    def finish() -> None:
        save("speculative.png")
        ui['view'].close()
        window.close()
        app.quit()

    on_failed = _failing(app, window, outcome)
    window.session.loaded.connect(on_loaded)
    window.session.job_started.connect(on_job_started)
    window.session.job_finished.connect(on_job_finished)
    window.session.load_failed.connect(on_failed)
    window.session.job_failed.connect(lambda job_id, exc: on_failed(exc))
    return _run(app, window, outcome)


def costs_shot(app, args) -> int:
    from PySide6.QtCore import QTimer

    from app.cost_window import BATCHES, CONTEXTS, CostWindow

    window = CostWindow()
    window.resize(*(args.screen or (1700, 1000)))
    window.show()
    window.set_model(args.model, "bf16")
    window.context.setValue(CONTEXTS.index(2048))
    window.batch.setValue(BATCHES.index(64 if args.hardware != "this-machine" else 4))
    window.training.setText("15e12")

    def choose() -> None:  # the hardware list fills once this machine's profile is read
        if window.hardware.findData(args.hardware) < 0:
            QTimer.singleShot(100, choose)
            return
        window.hardware.setCurrentIndex(window.hardware.findData(args.hardware))
        window.updated.connect(lambda: QTimer.singleShot(300, finish))
        window.schedule_update()

    def finish() -> None:
        if "simulated" not in window.serving.label.text():  # the serving charts come after the others
            QTimer.singleShot(100, finish)
            return
        args.out.parent.mkdir(parents=True, exist_ok=True)
        window.grab().save(str(args.out))
        window.close()
        app.quit()

    choose()
    app.exec()
    print(f"saved {args.out}")
    return 0


def compare_shot(app, args) -> int:
    from PySide6.QtCore import QTimer

    from app.compare_window import CompareWindow
    from engine.measure.compare import LaneSpec

    window = CompareWindow()
    window.resize(*(args.screen or (1800, 1050)))
    window.show()
    if args.endpoint:
        from engine.endpoint import parse_endpoint

        window.lanes[0].configure(LaneSpec("default", "bf16", "cpu"))
        window.lanes[1].configure(LaneSpec(parse_endpoint(args.endpoint).text, "served", "remote"))
    else:
        window.lanes[0].configure(LaneSpec("default", "fp32", "cpu"))
        window.ladder()
    window.prompt.setPlainText("In two sentences: why do language models need so much memory?")
    window.max_tokens.setValue(48)
    outcome = {}

    def start_when_loaded() -> None:
        if any(lane.loading for lane in window.lanes):
            QTimer.singleShot(200, start_when_loaded)
        elif any(lane.loaded is None for lane in window.lanes):
            outcome["error"] = "a lane did not load"
            app.quit()
        else:
            window.run()

    def finish() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        window.grab().save(str(args.out))
        outcome["saved"] = str(args.out)
        window.close()
        app.quit()

    if args.quality:
        def quality() -> None:
            window.quality_settings["chunks"] = args.quality
            window.quality()

        window.run_finished.connect(quality)
        window.quality_finished.connect(lambda: QTimer.singleShot(300, finish))
    else:
        window.run_finished.connect(lambda: QTimer.singleShot(300, finish))
    for lane in window.lanes:
        lane.load()
    QTimer.singleShot(500, start_when_loaded)
    app.exec()
    if "error" in outcome:
        print(f"error: {outcome['error']}", file=sys.stderr)
        return 1
    print(f"saved {outcome['saved']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
