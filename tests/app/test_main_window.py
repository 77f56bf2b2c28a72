import json
import subprocess
import sys

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetrics, QGuiApplication, QTextCursor
from PySide6.QtWidgets import QMessageBox

from engine.base.events import TokenGenerated
from tests.app.conftest import dismiss_load_error, generate, load


def visible(text: str) -> str:
    """Text without what a document shows differently (controls, whitespace, U+FFFD): random
    tiny models emit plenty of those."""
    import unicodedata

    return "".join(c for c in text if not c.isspace() and c != "\ufffd"
                   and unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"))


def test_load_shows_the_facts(qtbot, window, tiny_llama):
    info = load(qtbot, window, tiny_llama)
    facts = window.model_panel.facts
    assert facts["Parameters"].text().endswith(f"({info.parameters:,})")
    assert facts["Architecture"].toolTip() == "LlamaForCausalLM (llama)"
    assert "tokens" in facts["Context"].text() and facts["Precision"].text().startswith("fp32")
    # its bytes, what the cache keeps, and how (the reference precisions: a cache per request)
    assert facts["KV per token"].toolTip().endswith(" (float32); a cache per request, cached prefixes copied in")
    assert window.prompt.generate_button.isEnabled()
    assert window.status["device"].text() == "device: cpu"


def test_text_grows_token_by_token_and_plots_hold_a_point_per_token(qtbot, window, slow_tiny):
    load(qtbot, window, slow_tiny)
    window.set_redraw_budget(0.25)  # "smooth": redraw on most ticks, so the growth is visible
    lengths, tokens_seen = [], []
    batches = []
    window.session.job_events.connect(lambda job, events: batches.append(len(events)))
    window.session.job_events.connect(
        lambda job, events: tokens_seen.extend(e.index for e in events if isinstance(e, TokenGenerated)))
    window.timer.timeout.connect(lambda: lengths.append(len(window.output.toPlainText())))
    redraws_before = window.plots.redraws
    finished = generate(qtbot, window, "The quick brown fox", max_tokens=200)
    assert finished.tokens == 200 and tokens_seen == list(range(200))
    assert len(batches) < 200  # tokens cross threads in batches, not one signal each
    # the text appeared in several steps, never shrinking, while tokens arrived
    steps = sorted(set(lengths))
    assert lengths == sorted(lengths) and len(steps) >= 3, lengths
    answer = window.transcript.turns[-1]
    assert len(answer.tokens) == 200
    # one store: the transcript's answer is the run the plots and the status bar read, each token kept once
    assert answer.run is window.run and window.run.events.count(window.run.tokens[5]) == 1
    assert visible(answer.answer_text()) in visible(window.output.toPlainText())
    counts = window.plots.point_counts()
    # every token is a point; speed and latency plot the 199 decode steps, the TTFT is their title;
    # measured KV shows as dots over the predicted line, at most ~48, the newest token included
    assert counts == {"speed": 199, "latency": 199, "kv_predicted": 200, "kv_measured_dots": 40, "memory": 200}
    dots_x, _ = window.plots._kv_measured.getOriginalDataset()
    assert dots_x[-1] == 199
    # the memory plot draws the model's own memory beside the process's RSS: its weights, its KV and a
    # decode step's activations (read once for the model, before the answer)
    _, model = window.plots._model.getOriginalDataset()
    _, rss = window.plots._rss.getOriginalDataset()
    assert len(model) == 200 and model[-1] > model[0] and model[-1] < rss[-1]
    activations = window.run.prefilled.activation_bytes
    assert activations and activations == window.run.finished.activation_bytes
    own = window.loaded.weights_bytes + activations
    assert model[-1] / model[0] == pytest.approx((own + window.run.kv_bytes()) / (own + window.run.column("kv_bytes")[0]))
    assert window.plots.speed.full_title.startswith("time to first token")
    # redraws came from the timer: at most one a tick (and the final one), not one per token
    # (a busy machine slows the tokens, not the timer: ticks may outnumber tokens there)
    assert window.plots.redraws - redraws_before <= len(lengths) + 1
    assert window.status["tokens"].text() == "200 tokens"
    assert "tok/s" in window.status["speed"].text()


def test_stop_mid_generation(qtbot, window, slow_tiny):
    load(qtbot, window, slow_tiny)
    generate(qtbot, window, "fox", max_tokens=100_000, wait=False)
    qtbot.waitUntil(lambda: window.run.count >= 5, timeout=60_000)
    panel = window.model_panel  # Load and Unload would do nothing now: they say so instead of looking clickable
    assert not panel.load_button.isEnabled() and not panel.unload_button.isEnabled()
    assert "Stop first" in panel.load_button.toolTip() and panel.precision.isEnabled()
    with qtbot.waitSignal(window.generation_finished, timeout=30_000) as blocker:
        qtbot.keyClick(window.prompt.editor, Qt.Key_Escape)
    finished = blocker.args[0]
    assert finished.reason == "cancelled" and 5 <= finished.tokens < 100_000
    # the cut answer says so where it ends, and the status bar says it was stopped, in words
    assert window.output.toPlainText().endswith(" [stopped]")
    assert window.statusBar().currentMessage().startswith(f"Stopped: {finished.tokens} tokens")
    assert "cancelled" not in window.statusBar().currentMessage()
    assert "ended by you (stopped)" in window.transcript.to_markdown()
    qtbot.waitUntil(lambda: window.prompt.generate_button.isEnabled())
    assert not window.prompt.stop_button.isEnabled()
    assert panel.load_button.isEnabled() and panel.unload_button.isEnabled() and not panel.load_button.toolTip()
    # and the app keeps working
    assert generate(qtbot, window, "again", max_tokens=3).tokens == 3


def test_bad_path_shows_an_error_and_the_app_stays_usable(qtbot, window, tmp_path, tiny_llama):
    window.model_panel.set_source(str(tmp_path / "no-such-model"))
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        window.model_panel.load_button.click()
    qtbot.waitUntil(lambda: window.findChild(QMessageBox, "loadErrorBox") is not None)
    box = window.findChild(QMessageBox, "loadErrorBox")
    assert "No such" in box.text() and "no-such-model" in box.text()
    assert "No such" in window.prompt.message.text()
    assert not window.prompt.generate_button.isEnabled()
    box.accept()
    box.deleteLater()
    load(qtbot, window, tiny_llama)
    assert generate(qtbot, window, "fox", max_tokens=4).tokens == 4
    # a mistyped path with a model loaded: the panel goes back to what runs (else Generate would try it again)
    qtbot.waitUntil(lambda: window.findChild(QMessageBox, "loadErrorBox") is None)
    window.model_panel.set_source(str(tmp_path / "no-such-model-either"))
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        window.model_panel.load_button.click()
    assert "no-such-model-either" in dismiss_load_error(qtbot, window)
    assert "shows it again" in window.prompt.message.text()
    assert window.model_panel.request().model == str(tiny_llama) and not window.model_panel.pending()
    with qtbot.assertNotEmitted(window.session.load_failed):
        assert generate(qtbot, window, "fox", max_tokens=2).tokens == 2


def hold_worker_at_weights(window):
    """Make the worker thread wait at the first 'weights' progress step until the load is
    cancelled (by Cancel or by closing), so the test acts while the load is surely running.
    Runs in the worker thread and touches nothing but thread-safe flags."""
    import threading

    reached = threading.Event()

    def on_progress(event):
        if event.stage == "weights" and not reached.is_set():
            reached.set()
            token = window.session._load_cancel
            for _ in range(1000):
                if token.cancelled:
                    return
                threading.Event().wait(0.01)

    window.session.worker.load_progressed.connect(on_progress, Qt.DirectConnection)
    return reached


def test_cancel_load(qtbot, window, slow_tiny):
    reached = hold_worker_at_weights(window)
    window.model_panel.set_source(str(slow_tiny))
    window.model_panel.load_button.click()
    qtbot.waitUntil(reached.is_set, timeout=60_000)
    assert window.model_panel.cancel_button.isVisible() and not window.model_panel.load_button.isEnabled()
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        window.model_panel.cancel_button.click()
    qtbot.waitUntil(lambda: not window.loading)
    assert "cancelled" in window.prompt.message.text()
    assert window.findChild(QMessageBox, "loadErrorBox") is None
    assert window.model_panel.load_button.isEnabled() and window.loaded is None


def test_generation_error_shows_in_the_message_area(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    window.generation_panel.mode.setCurrentIndex(window.generation_panel.mode.findData("raw"))
    window.prompt.editor.setPlainText("fox " * 400)  # longer than the 256-token context
    with qtbot.waitSignal(window.generation_failed, timeout=60_000):
        window.prompt.generate_button.click()
    qtbot.waitUntil(lambda: not window.generating)
    assert "context window" in window.prompt.message.text()
    assert generate(qtbot, window, "fox", max_tokens=2).tokens == 2


def test_chat_history_and_clear(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    generate(qtbot, window, "first question", max_tokens=3)
    first_answer = window.transcript.last_answer()
    sent = []
    window.session.job_requested.connect(lambda job_id, job, cancel: sent.append(job.request))
    generate(qtbot, window, "second question", max_tokens=3)
    history = sent[0].history
    assert [(m.role, m.content) for m in history] == [("user", "first question"), ("assistant", first_answer)]
    assert window.output.toPlainText().count("You") == 2
    window.prompt.clear_button.click()
    assert window.transcript.turns == [] and window.output.toPlainText() == ""


def test_raw_mode_shows_each_prompt_and_its_answer_alone(qtbot, window, tiny_llama):
    """Raw completion has no history: each run replaces the last (it was glued onto it, the new
    prompt never shown, when the turn count stayed the same)."""
    load(qtbot, window, tiny_llama)
    window.generation_panel.mode.setCurrentIndex(window.generation_panel.mode.findData("raw"))
    generate(qtbot, window, "first prompt", max_tokens=3)
    first = window.transcript.last_answer()
    generate(qtbot, window, "second prompt", max_tokens=3)
    shown = window.output.toPlainText()
    assert "second prompt" in shown and "first prompt" not in shown
    assert shown.count("You") == 1 and shown.rstrip().endswith(window.transcript.last_answer().rstrip())
    assert len(window.transcript.turns) == 2 and first is not None


def test_show_tokens_chips_and_hover(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    generate(qtbot, window, "fox", max_tokens=6)
    window.show_tokens_action.setChecked(True)
    doc = window.output.document()
    backgrounds = set()
    cursor = QTextCursor(doc)
    for position in range(1, doc.characterCount()):
        cursor.setPosition(position)
        fmt = cursor.charFormat()
        if fmt.background().style() != Qt.NoBrush:
            backgrounds.add(fmt.background().color().name())
    assert len(backgrounds) == 2  # alternating shades
    # hover: find a position inside the answer and ask what token is there
    answer = window.transcript.turns[-1]
    found = None
    for position in range(doc.characterCount() - 1, 0, -1):
        rect = window.output.cursorRect(_cursor_at(doc, position))
        found = window.output.token_at(rect.center())
        if found is not None:
            break
    assert found is not None and found[0] == len(window.transcript.turns) - 1
    tip = window.output.tooltip_for(*found)
    token = answer.tokens[found[1]]
    assert f"id {token.token_id}" in tip and f"{token.logprob:.3f}" in tip and "top 5" in tip
    assert "latency" in tip


def _cursor_at(doc, position):
    cursor = QTextCursor(doc)
    cursor.setPosition(position)
    return cursor


def test_copy_and_save_transcript(qtbot, window, tiny_llama, tmp_path):
    load(qtbot, window, tiny_llama)
    generate(qtbot, window, "fox", max_tokens=5)
    window.prompt.copy_button.click()
    assert QGuiApplication.clipboard().text() == window.transcript.last_answer()
    markdown = window.save_transcript(str(tmp_path / "t.md"))
    assert "**You:**" in markdown.read_text() and "5 tokens" in markdown.read_text()
    data = json.loads(window.save_transcript(str(tmp_path / "t.json")).read_text())
    tokens = data["turns"][-1]["tokens"]
    assert len(tokens) == 5 and all(len(t["top_alternatives"]) == 5 for t in tokens)
    assert data["model"]["name"] == window.loaded.name


def test_settings_persist(qtbot, app_factory, settings):
    first = app_factory()
    first.pace_actions[0.005].trigger()
    first.model_panel._select(first.model_panel.precision, "bf16")
    first.generation_panel.max_tokens.setValue(77)
    first.generation_panel.greedy.setChecked(False)
    first.generation_panel.temperature.setValue(1.25)
    first.show_tokens_action.setChecked(True)
    first.close()
    second = app_factory()
    assert second.model_panel.precision.currentData() == "bf16"
    assert second.generation_panel.max_tokens.value() == 77
    assert not second.generation_panel.greedy.isChecked()
    assert second.generation_panel.temperature.value() == pytest.approx(1.25)
    assert second.show_tokens_action.isChecked()
    assert second.budget.budget == 0.005 and second.pace_actions[0.005].isChecked()


def test_close_during_generation_stops_the_worker(qtbot, app_factory, slow_tiny):
    window = app_factory()
    load(qtbot, window, slow_tiny)
    generate(qtbot, window, "fox", max_tokens=100_000, wait=False)
    qtbot.waitUntil(lambda: window.run.count >= 3, timeout=60_000)
    window.close()
    assert window.session.thread.isFinished()


def test_close_during_load_stops_the_worker(qtbot, app_factory, slow_tiny):
    window = app_factory()
    reached = hold_worker_at_weights(window)
    window.model_panel.set_source(str(slow_tiny))
    window.model_panel.load_button.click()
    qtbot.waitUntil(reached.is_set, timeout=60_000)
    window.close()
    assert window.session.thread.isFinished()


def test_the_window_appears_without_importing_torch(tmp_path):
    code = (
        "import os, sys\n"
        "os.environ['QT_QPA_PLATFORM'] = 'offscreen'\n"
        "from PySide6.QtCore import QSettings\n"
        f"QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, {str(tmp_path)!r})\n"
        "QSettings.setDefaultFormat(QSettings.IniFormat)\n"
        "from app.main import create_app, settings\n"
        "from app.main_window import MainWindow\n"
        "app = create_app([])\n"
        "w = MainWindow(settings()); w.show(); app.processEvents()\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
        "w.session.shutdown(5000)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["False", "False"]


def test_no_display_is_a_clear_message(monkeypatch):
    from app.main import display_problem

    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if sys.platform.startswith("linux"):
        assert "no display" in display_problem()
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert display_problem() is None


def test_subcommands_run_the_cli_without_qt(isolated_cache):
    code = ("import sys\nfrom app.main import main\nrc = main(['models'])\n"
            "print(rc, any(m.startswith('PySide6') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["0", "False"]
    assert result.stdout.startswith("default")


def test_a_chats_next_turn_reads_its_history_from_the_prefix_cache(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    first = generate(qtbot, window, "Tell me what a key-value cache holds, please.", max_tokens=12)
    assert first.cached_tokens == 0
    assert "prefix cache" not in window.statusBar().currentMessage()  # nothing saved: no clause about it
    second = generate(qtbot, window, "And then?", max_tokens=6)
    # the system prompt, the first question and its answer were kept: the turn continues from
    # their tokens, so every whole block of them comes back (all but the answer's last token)
    earlier = first.prompt_ids + first.token_ids
    assert second.continued and second.prompt_ids[:len(earlier)] == earlier
    assert second.cached_tokens == (len(earlier) - 1) // 16 * 16 and second.cached_tokens >= 16
    assert window.status["prompt"].text() == f"prompt {second.prompt_tokens} ({second.cached_tokens} cached)"
    assert f"{second.cached_tokens} of {second.prompt_tokens} prompt tokens from the cache" \
        in window.statusBar().currentMessage()
    per_token = window.loaded.kv_bytes_per_token  # what keeping them costs is said too, measured
    assert second.prefix_cache_bytes >= second.cached_tokens * per_token and second.prefix_cache_bytes % (16 * per_token) == 0
    assert "the prefix cache keeps" in window.statusBar().currentMessage()
    assert f"{second.cached_tokens} of them found in the prefix cache" in window.status["prompt"].toolTip()
    assert "The prefix cache keeps" in window.status["prompt"].toolTip()
    assert f"{second.cached_tokens} of {second.prompt_tokens} prompt tokens from the cache" \
        in window.transcript.to_markdown()
    window.generation_panel.reuse_prefix.setChecked(False)  # a cold prompt, to compare
    third = generate(qtbot, window, "Once more?", max_tokens=4)
    assert third.cached_tokens == 0 and window.status["prompt"].text() == f"prompt {third.prompt_tokens}"


def test_a_new_model_answers_with_its_own_core_not_the_last_ones(qtbot, window, tiny_models):
    from engine.base.events import Finished
    from engine.base.request import GenerationRequest
    from engine.generation.generate import generate as engine_generate
    from engine.models.loading import LoadRequest, load_model

    load(qtbot, window, tiny_models["llama"])
    generate(qtbot, window, "The quick brown fox", max_tokens=5)  # the llama's core, kept
    load(qtbot, window, tiny_models["qwen2"])
    window.clear_conversation()  # the same prompt, not a second turn
    answer = generate(qtbot, window, "The quick brown fox", max_tokens=5)
    qwen = load_model(LoadRequest(str(tiny_models["qwen2"]), "fp32", "cpu"))
    request = window.generation_panel.request_for("The quick brown fox", ())
    alone = next(e for e in engine_generate(qwen, request) if isinstance(e, Finished))
    assert answer.token_ids == alone.token_ids and answer.cached_tokens == 0


def test_a_message_the_status_bar_cannot_show_whole_is_shown_under_the_prompt(qtbot, window):
    """At 1000 px the status bar's figures leave its message ~100 px:
    "Done: … prompt tokens from the cache" was cut to "Done: 16 tokens, 11.6 tok/s, 96 of 129 promp". Such a message is
    shown under the prompt too, where it wraps; a short one, or in a wide window, is not."""
    window.resize(1000, 700)
    window.show()
    qtbot.waitExposed(window)
    text = "Done: 16 tokens, 11.6 tok/s, 96 of 129 prompt tokens from the cache; TTFT 120 ms, ended at the token limit"
    window.say(text)
    assert window.statusBar().currentMessage() == text
    assert window.prompt.message.isVisible() and window.prompt.message.text() == text
    window.prompt.show_message("")
    window.resize(3000, 700)  # room beside the figures: the status bar alone says it
    qtbot.waitUntil(lambda: window.statusBar().width() >= 2900)
    window.say("Saved")
    assert window.statusBar().currentMessage() == "Saved" and not window.prompt.message.isVisible()


@pytest.mark.parametrize("size", [(1280, 800), (1000, 700)])
def test_the_model_panel_shows_its_controls_down_to_load_at_laptop_sizes(qtbot, window, size):
    """The Model panel's controls, down to Load and Unload, are in view at the start (or after
    View → Reset layout); the Generation panel below scrolls for the rest. At 1000×700 the Server
    tab's unscrolled height had left the Model panel 119 px, Device and Load out of view."""
    window.resize(*size)
    qtbot.waitUntil(lambda: window.width() == size[0])
    window.reset_layout()
    button = window.model_panel.load_button
    qtbot.waitUntil(lambda: button.visibleRegion().boundingRect().height() == button.height(), timeout=10_000)
    assert window.model_panel.device.visibleRegion().boundingRect().height() == window.model_panel.device.height()


def test_a_plots_top_tick_label_has_room_above_the_plot(qtbot, window):
    """pyqtgraph centres the top tick's label on the view's top edge: with no room above it, "1.0"
    showed its lower half only. Every plot keeps half a line free above its view."""
    window.resize(1000, 700)
    qtbot.waitUntil(lambda: window.width() == 1000)
    for panel in window.plots.panels.values():
        box = panel.item.getViewBox()
        top = panel.plot.mapFromScene(box.mapRectToScene(box.boundingRect()).topLeft()).y()
        axis = panel.item.getAxis("left")
        half_line = QFontMetrics(axis.style.get("tickFont") or axis.font()).height() / 2
        assert top >= half_line, panel.plot.objectName()


def test_a_message_is_read_whole_beside_the_figures_as_laid_out(qtbot, window):
    """At 1280 px, with a run's figures beside it, "Done: 31 tokens, 17.1 tok/s, ended by the model"
    was cut at "ended by the m": the room left for it was reckoned from the figures' widths without
    the gaps between them. It is read whole: in the bar, left of the first figure, or under the prompt."""
    window.resize(1280, 800)
    window.show()
    qtbot.waitExposed(window)
    figures = {"device": "device: cpu", "ttft": "TTFT 116.0 ms", "prompt": "prompt 40", "decode": "decode 17.1 tok/s",
               "tokens": "31 tokens", "kv": "KV 3.1 MiB", "peak": "peak 1.1 GiB"}
    for key, text in figures.items():
        if key in window.status.labels:
            window.status.labels[key].setText(text)
    qtbot.wait(50)  # laid out
    text = "Done: 31 tokens, 17.1 tok/s, ended by the model"
    window.say(text)
    bar = window.statusBar()
    first = min(label.mapTo(bar, label.rect().topLeft()).x() for label in window.status.labels.values()
                if label.isVisible())
    if bar.fontMetrics().horizontalAdvance(text) + 12 > first:
        qtbot.waitUntil(lambda: window.prompt.message.isVisible() and window.prompt.message.text() == text)


def test_a_named_config_folder_holds_the_window_settings_too(tmp_path, monkeypatch):
    """The bundle's self-check names a private INFERENCE_WORKBENCH_CONFIG for the hardware profile;
    the window's own settings (its last prompt length, precision…) went to the user's
    ~/.config/InferenceWorkbench all the same. They go into the named folder."""
    from app.main import settings

    monkeypatch.setenv("INFERENCE_WORKBENCH_CONFIG", str(tmp_path / "private"))
    stored = settings()
    stored.setValue("generation/max_new_tokens", 16)
    stored.sync()
    assert stored.fileName() == str(tmp_path / "private" / "inference-workbench.ini")
    assert "max_new_tokens=16" in (tmp_path / "private" / "inference-workbench.ini").read_text()
