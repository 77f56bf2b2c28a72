from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings, QThread, QTimer


@pytest.fixture(autouse=True)
def _no_dangling_threads_or_timers(monkeypatch):
    """Fail a test that leaves a QThread running or a QTimer active (napari does the same)."""
    threads: list[QThread] = []
    timers: list[QTimer] = []
    thread_start, timer_start = QThread.start, QTimer.start

    def record_thread(self, *args):
        threads.append(self)
        return thread_start(self, *args)

    def record_timer(self, *args):
        timers.append(self)
        return timer_start(self, *args)

    monkeypatch.setattr(QThread, "start", record_thread)
    monkeypatch.setattr(QTimer, "start", record_timer)
    yield
    running = []
    for thread in threads:
        try:
            if thread.isRunning():
                running.append(f"QThread {thread.objectName() or thread!r}")
        except RuntimeError:  # already deleted: not running
            pass
    for timer in timers:
        try:
            if timer.isActive():
                running.append(f"QTimer {timer.objectName() or timer!r}")
        except RuntimeError:
            pass
    assert not running, f"left running: {running}"


@pytest.fixture
def settings(tmp_path):
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    return QSettings(str(tmp_path / "settings" / "test.ini"), QSettings.IniFormat)


@pytest.fixture
def app_factory(qtbot, settings, _no_dangling_threads_or_timers):
    """Make main windows; each is closed (and its worker thread ended) after the test."""
    from app.main import create_app
    from app.main_window import MainWindow

    create_app([])
    windows = []

    def make(**kwargs):
        window = MainWindow(settings)
        window.hard_exit = lambda code: pytest.fail("the engine thread did not stop in time")
        qtbot.addWidget(window)
        window.show()
        windows.append(window)
        return window

    yield make
    for window in windows:
        if window.isVisible() or window.session.thread.isRunning():
            window.close()


@pytest.fixture
def window(app_factory):
    return app_factory()


@pytest.fixture(scope="session")
def slow_tiny(tmp_path_factory, byte_tokenizer):
    """A random llama big enough that 200 tokens take a second or two (so the UI sees them arrive)."""
    from tests.tiny import build_model_folder

    return build_model_folder(tmp_path_factory.mktemp("slow") / "llama", "llama", byte_tokenizer,
                              hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)


def load(qtbot, window, source, precision="fp32", device="cpu"):
    panel = window.model_panel
    panel.set_source(str(source))
    panel._select(panel.precision, precision)
    panel.set_devices([device])
    panel._select(panel.device, device)
    with qtbot.waitSignal(window.session.loaded, timeout=120_000):
        panel.load_button.click()
    qtbot.waitUntil(lambda: window.loaded is not None)
    return window.loaded


def generate(qtbot, window, prompt, max_tokens=20, ignore_eos=True, wait=True):
    panel = window.generation_panel
    panel.max_tokens.setValue(max_tokens)
    panel.ignore_eos.setChecked(ignore_eos)
    window.prompt.editor.setPlainText(prompt)
    if not wait:
        window.prompt.generate_button.click()
        return None
    with qtbot.waitSignal(window.generation_finished, timeout=300_000) as blocker:
        window.prompt.generate_button.click()
    qtbot.waitUntil(lambda: not window.generating)
    return blocker.args[0]


def dismiss_load_error(qtbot, window) -> str:
    """Wait for the window's load-error box; close it and return its text."""
    from PySide6.QtWidgets import QMessageBox

    qtbot.waitUntil(lambda: window.findChild(QMessageBox, "loadErrorBox") is not None)
    box = window.findChild(QMessageBox, "loadErrorBox")
    text = box.text()
    box.accept()
    box.deleteLater()
    return text


@pytest.fixture
def compare(qtbot, _no_dangling_threads_or_timers):
    """A Compare window on its own (closed, its lanes' threads ended, after the test)."""
    from app.compare_window import CompareWindow
    from app.main import create_app

    create_app([])
    window = CompareWindow()
    qtbot.addWidget(window)
    window.show()
    yield window
    window.close()
