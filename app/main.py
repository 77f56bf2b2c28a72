"""``inference-workbench``: the window, or a command-line subcommand (bench, serve, … :data:`CLI_COMMANDS`).

The window appears before torch is imported: torch and transformers load in the worker
thread, after the first paint.
"""

from __future__ import annotations

import argparse
import sys

from engine.models.precision import PRECISIONS

CLI_COMMANDS = ("bench", "compare", "sweep", "estimate", "hardware", "models", "serve", "load", "simulate",
                "perplexity")


SWITCH_INTERVAL_S = 0.001
"""How long a thread running Python keeps the GIL when another asks for it (Python's default: 5 ms)."""


class _WindowParser(argparse.ArgumentParser):
    """The window's options; its --help lists the commands too (read from the command line's own
    parser only when help is asked for: the window's start imports none of it)."""

    def format_help(self) -> str:
        from engine.cli import command_lines  # lazy: only for --help

        lines = "\n".join(f"  {name:<11} {line}" for name, line in command_lines())
        return super().format_help() + f"\ncommands (inference-workbench COMMAND --help):\n{lines}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _WindowParser(
        prog="inference-workbench",
        description="Open the Inference Workbench window, or run a command (inference-workbench COMMAND --help).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="load this model at start ('default', a folder, a .gguf file or a hub id)")
    parser.add_argument("--precision", choices=list(PRECISIONS), help="precision for --model")
    parser.add_argument("--device", help="device for --model: auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--no-autoload", action="store_true", help="don't load a model at start")
    parser.add_argument("--self-check", metavar="PNG",
                        help="load the model, answer one short prompt, save a screenshot of the window to PNG, "
                             "print what happened and exit (0 if it all worked): checks an install or a bundle")
    parser.add_argument("--tour-check", metavar="DIR",
                        help="load the model, take the tour (Help → Tour), pressing Next as each step's figure "
                             "arrives; save a picture of the screen at each step in DIR, print each figure and "
                             "its time, and exit (0 if every step measured)")
    return parser


def self_check(window, app, path: str) -> None:
    """Wire ``window`` to load, generate a few tokens, save a screenshot and quit (exit code 0/1)."""
    import time

    from PySide6.QtCore import QTimer

    started = time.perf_counter()
    prompt = "Say hello in five words."

    def fail(exc) -> None:
        print(f"self-check: failed: {exc}", file=sys.stderr, flush=True)
        window.close()
        app.exit(1)

    def on_loaded(info) -> None:
        print(f"self-check: loaded {info.name} ({info.precision}) in {info.load_s:.2f} s, "
              f"{time.perf_counter() - started:.1f} s after start", flush=True)
        window.generation_panel.max_tokens.setValue(16)
        window.prompt.editor.setPlainText(prompt)
        window.generate(prompt)

    def on_finished(event) -> None:
        QTimer.singleShot(300, lambda: finish(event))

    def finish(event) -> None:
        window.grab().save(path)
        print(f"self-check: {event.tokens} tokens at {event.decode_tokens_per_s or 0:.1f} tok/s; "
              f"screenshot {path}; {time.perf_counter() - started:.1f} s in all", flush=True)
        window.close()
        app.exit(0)

    window.session.loaded.connect(on_loaded)
    window.session.load_failed.connect(fail)
    window.generation_finished.connect(on_finished)
    window.generation_failed.connect(fail)


def tour_check(window, app, folder: str) -> None:
    """Wire ``window`` to load, take the whole tour (Next as each figure arrives), save the screen
    at each step, print the figures and times, and quit (exit code 0/1)."""
    import time
    from pathlib import Path

    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QGuiApplication

    from app.tour import STEPS  # lazy: the command line never imports Qt

    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    times = {"step": started}

    def quit_with(code: int) -> None:
        window.close()
        app.exit(code)

    def on_loaded(info) -> None:
        print(f"tour-check: loaded {info.name} ({info.precision}) in {info.load_s:.2f} s", flush=True)
        window.session.loaded.disconnect(on_loaded)
        tour = window.open_tour()
        tour.step_measured.connect(lambda key, figure: QTimer.singleShot(500, lambda: measured(tour, key, figure)))
        tour.step_failed.connect(lambda key, why: failed(key, why))
        times["tour"] = times["step"] = time.perf_counter()

    def measured(tour, key: str, figure: str) -> None:
        now = time.perf_counter()
        QGuiApplication.primaryScreen().grabWindow(0).save(str(target / f"tour-{tour.index + 1:02d}-{key}.png"))
        print(f"tour-check: step {tour.index + 1} {key} ({now - times['step']:.1f} s): {figure}", flush=True)
        if tour.index + 1 == len(STEPS):
            print(f"tour-check: the whole tour took {now - times['tour']:.1f} s "
                  f"({now - started:.1f} s after start)", flush=True)
            tour.close()
            QTimer.singleShot(0, lambda: quit_with(0))
            return
        times["step"] = time.perf_counter()
        tour.next()

    def failed(key: str, why: str) -> None:
        print(f"tour-check: step {key} failed: {why}", file=sys.stderr, flush=True)
        quit_with(1)

    window.session.loaded.connect(on_loaded)
    window.session.load_failed.connect(lambda exc: failed("load", str(exc)))


def settings():
    """The user's settings: in ``$INFERENCE_WORKBENCH_CONFIG/inference-workbench.ini`` where that
    folder is named (the bundle's self-check, scripts: a private folder, the user's own untouched,
    as for the hardware profile beside it), else where Qt keeps them (QSettings.defaultFormat(), so
    tests can redirect them too)."""
    import os
    from pathlib import Path

    from PySide6.QtCore import QSettings

    folder = os.environ.get("INFERENCE_WORKBENCH_CONFIG")
    if folder:
        Path(folder).expanduser().mkdir(parents=True, exist_ok=True)
        return QSettings(str(Path(folder).expanduser() / "inference-workbench.ini"), QSettings.IniFormat)
    return QSettings(QSettings.defaultFormat(), QSettings.UserScope, "InferenceWorkbench", "inference-workbench")


def settle_process() -> None:
    """Once the window exists: Qt's and our modules live as long as the app, so garbage collections
    skip them (engine/base/heap.py); and the GIL changes hands after SWITCH_INTERVAL_S, not Python's
    default (five times that): painting calls into Python dozens of times a frame, and each call
    waits for the GIL while another thread runs Python (reading the history, loading a
    tokenizer)."""
    from engine.base import heap  # lazy: the window's alone

    heap.settle()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def collect_on_gui_thread(app) -> None:
    """engine/base/heap.py's full collections (a model dropped) run on the GUI thread: a collection
    destroys what sits in garbage cycles, a closed window's widgets among them, and Qt widgets
    destroyed on the model's worker thread crashed the app (a local model dropped for an endpoint)."""
    from PySide6.QtCore import QObject, Qt, Signal

    from engine.base import heap  # lazy: the window's alone

    class Collector(QObject):
        requested = Signal()

    if app.findChild(QObject, "garbageCollector") is not None:
        return
    collector = Collector(app)  # lives on the GUI thread: a request from another thread is queued to it
    collector.setObjectName("garbageCollector")
    collector.requested.connect(heap.collect, Qt.QueuedConnection)
    heap.collect_on(collector.requested.emit)


def create_app(argv: list[str]):
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.resources import icon_path, stylesheet  # lazy: the command line never imports Qt

    app = QApplication.instance() or QApplication([sys.argv[0], *argv])
    collect_on_gui_thread(app)
    app.setApplicationName("Inference Workbench")
    app.setOrganizationName("InferenceWorkbench")
    app.setDesktopFileName("inference-workbench")
    app.setStyle("Fusion")
    icon = QIcon(str(icon_path()))
    for size in (16, 32, 48, 64, 128, 256):
        icon.addFile(str(icon_path(size)))
    app.setWindowIcon(icon)
    app.setStyleSheet(stylesheet())
    return app


# Debian/Ubuntu packages Qt's xcb platform plugin needs beyond a bare X server
XCB_PACKAGES = ("libxcb-cursor0", "libxcb-icccm4", "libxcb-keysyms1", "libxcb-image0", "libxcb-render-util0",
                "libxkbcommon-x11-0", "libxcb-xinerama0", "libxcb-randr0", "libxcb-shape0", "libxcb-xkb1")


def display_problem() -> str | None:
    """Why the window can't open here, in one sentence, or None. Qt itself would abort."""
    import ctypes.util
    import os

    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM"):
        return None
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return ("no display found (DISPLAY is not set): run it on a desktop or under xvfb-run, "
                "or use the command line: inference-workbench bench --help")
    if os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        missing = [lib for lib in ("xcb-cursor", "xcb-icccm", "xcb-keysyms", "xkbcommon-x11")
                   if ctypes.util.find_library(lib) is None]
        if missing:
            return (f"Qt's X11 plugin needs libraries this system lacks ({', '.join(missing)}); on Debian/Ubuntu: "
                    f"sudo apt install {' '.join(XCB_PACKAGES)}")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (argv[0] in CLI_COMMANDS or argv[0] == "--debug"):
        from engine.cli import main as cli_main  # lazy: the window's launch never loads the command line

        return cli_main(argv)
    args = build_parser().parse_args(argv)
    problem = display_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    app = create_app(argv)

    from PySide6.QtCore import QTimer

    from app.main_window import MainWindow  # lazy: the command line never imports Qt

    window = MainWindow(settings())
    if args.model:
        window.model_panel.set_source(args.model)
    if args.precision:
        window.model_panel._select(window.model_panel.precision, args.precision)
    if args.device:
        window.model_panel.set_devices([args.device])
        window.model_panel._select(window.model_panel.device, args.device)
    window.show()
    settle_process()
    app.aboutToQuit.connect(lambda: window.session.shutdown(0))
    if args.self_check:
        self_check(window, app, args.self_check)
    if args.tour_check:
        tour_check(window, app, args.tour_check)
    checking = bool(args.self_check or args.tour_check)
    QTimer.singleShot(0, lambda: window.start(autoload=not args.no_autoload or checking))
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
