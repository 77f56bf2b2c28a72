"""Render the window after a real generation on the default model to docs/screenshot.png.

    python docs/make_screenshot.py [--out docs/screenshot.png] [--show-tokens]

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
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="iw-shot-"))
    if "QT_QPA_PLATFORM" not in os.environ:
        config = scratch / "offscreen.json"
        config.write_text(json.dumps({"screens": [{"name": "shot", "x": 0, "y": 0, "width": 1920, "height": 1080,
                                                    "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
        os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={config}"
    sys.path.insert(0, str(ROOT))

    from PySide6.QtCore import QSettings, QTimer

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(scratch))

    from app.main import create_app, settings
    from app.main_window import MainWindow

    app = create_app([])
    window = MainWindow(settings())
    window.resize(1600, 960)
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
    window.session.generation_finished.connect(on_finished)
    window.session.load_failed.connect(on_failed)
    window.session.generation_failed.connect(on_failed)
    QTimer.singleShot(0, window.start)
    app.exec()
    if "error" in outcome:
        print(f"error: {outcome['error']}", file=sys.stderr)
        return 1
    print(f"saved {outcome['saved']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
