import pytest

from engine.base.events import TokenGenerated
from tests.app.conftest import generate, load


@pytest.fixture
def speedups(qtbot, window, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    load(qtbot, window, tiny_llama)
    view = window.open_speedups()
    qtbot.addWidget(view)
    return view


def test_sweep_fills_the_table_and_plots_and_lands_in_history(qtbot, window, speedups):
    speedups.batching.batches.setText("1,2,4")
    speedups.batching.sweep_tokens.setValue(6)
    with qtbot.waitSignal(window.session.job_finished, timeout=120_000) as blocker:
        speedups.batching.controls.run.click()
        # while it runs, the main window can't load another model (a prompt would wait its turn)
        assert window.session.busy and not window.model_panel.isEnabled()
    points, skipped = blocker.args[1].points, blocker.args[1].skipped
    assert [p.batch for p in points] == [1, 2, 4] and not skipped
    qtbot.waitUntil(lambda: not window.session.busy)
    assert window.prompt.generate_button.isEnabled() and window.model_panel.isEnabled()
    # the panel was disabled during the sweep; its choices open again with it (they stayed grey)
    assert window.model_panel.precision.isEnabled() and window.model_panel.device.isEnabled()
    assert speedups.batching.sweep_table.rowCount() == 3
    assert speedups.batching.sweep_table.item(2, 0).text() == "4"
    x, y = speedups.batching.speed_curve.getData()
    assert list(x) == [1, 2, 4] and list(y) == [p.aggregate_tokens_per_s for p in points]
    x, _ = speedups.batching.tradeoff_curve.getData()
    assert len(x) == 3 and [label.textItem.toPlainText() for label in speedups.batching._labels] == ["B=1", "B=2", "B=4"]
    _, kv = speedups.batching.kv_curve.getData()
    assert kv[-1] == pytest.approx(points[-1].kv_cache_bytes / 2**20)
    # the memory chart is the model's: its weights, the KV and a step's activations it measured,
    # growing with the batch
    # (the process's peak, flat at every batch, stays in the table)
    _, model = speedups.batching.peak_curve.getData()
    weights = window.loaded.weights_bytes
    assert all(p.activation_bytes for p in points)
    assert list(model) == pytest.approx([(weights + p.kv_cache_bytes + p.activation_bytes) / 2**20 for p in points])
    assert model[0] < model[1] < model[2]
    assert "tokens/sec of batch 1" in speedups.batching.controls.status.text()
    from engine.storage.history import load_all

    assert sorted(r.batch for r in load_all() if r.kind == "sweep") == [1, 2, 4]


def test_speculative_run_marks_tokens_and_reports_the_speedup(qtbot, window, speedups):
    speedups.tabs.setCurrentIndex(1)
    assert speedups.speculative.draft_text() == "ngram:3"  # prompt lookup first: it needs no model
    speedups.speculative.draft_kind.setCurrentIndex(speedups.speculative.draft_kind.findData("early-exit"))
    assert speedups.speculative.draft_text() == "early-exit:1"  # the tiny llama has 2 layers
    speedups.speculative.spec_tokens.setValue(16)
    speedups.speculative.draft_tokens.setValue(3)
    with qtbot.waitSignal(window.session.job_finished, timeout=120_000) as blocker:
        speedups.speculative.controls.run.click()
    result = blocker.args[1]
    qtbot.waitUntil(lambda: not speedups.speculative.running)
    assert result.draft == "early-exit:1" and result.same_tokens_as_plain is True
    assert result.plain is not None and result.speedup_vs_plain is not None
    summary = speedups.speculative.spec_summary.text()
    assert f"{result.accepted_tokens} of {result.drafted_tokens} drafted tokens accepted" in summary
    assert "against plain" in summary
    # the acceptance plot has one dot per verification step
    x, y = speedups.speculative.step_curve.getData()
    assert len(x) == len(speedups.speculative._steps) > 0 and all(0 <= v <= 100 for v in y)
    # accepted tokens are shaded, rejected guesses struck through, in the text
    document = speedups.speculative.spec_output.document()
    struck = shaded = 0
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            struck += fragment.charFormat().fontStrikeOut()
            shaded += fragment.charFormat().background().style() != 0
            it += 1
        block = block.next()
    rejected = result.drafted_tokens - result.accepted_tokens
    assert (struck > 0) == (rejected > 0) and (shaded > 0) == (result.accepted_tokens > 0)
    # each step's speed-up over a plain step (its tokens over its time) beside the prediction
    tool = speedups.speculative
    tool.draw()
    x, measured = tool.measured_curve.getData()
    steps = tool._steps
    emit = result.emit_s  # a plain token's events after its scores, read from the plain run's clocks
    assert len(x) == len(steps) and list(measured) == pytest.approx(
        [(s.accepted + 1) / result.plain_decode_tokens_per_s / (s.step_s + (s.accepted + 1) * emit) for s in steps])
    assert len(tool.predicted_curve.getData()[0]) == len(steps)
    assert f"expected {result.break_even.predicted:.2f}×" in summary
    # prompt lookup: no model, the same answer
    tool.draft_kind.setCurrentIndex(tool.draft_kind.findData("ngram"))
    tool.draft_ngram.setValue(1)
    with qtbot.waitSignal(window.session.job_finished, timeout=120_000) as blocker:
        tool.controls.run.click()
    qtbot.waitUntil(lambda: not tool.running)
    assert blocker.args[1].draft == "ngram:1" and blocker.args[1].same_tokens_as_plain is True
    assert not tool.draft_layers.isEnabled() and not tool.draft_precision.isEnabled()


def test_busy_model_and_bad_input_are_refused_with_a_message(qtbot, window, speedups, slow_tiny):
    speedups.batching.batches.setText("1,x")
    speedups.batching.controls.run.click()
    assert "whole numbers" in speedups.batching.controls.status.text() and not speedups.batching.running
    speedups.tabs.setCurrentIndex(1)
    speedups.speculative.draft_kind.setCurrentIndex(speedups.speculative.draft_kind.findData("model"))
    speedups.speculative.draft_model.setText("")
    speedups.speculative.controls.run.click()
    assert "Name the draft model" in speedups.speculative.controls.status.text()
    speedups.speculative.draft_model.setText("/no/such/model")
    with qtbot.waitSignal(window.session.job_failed, timeout=60_000):
        speedups.speculative.controls.run.click()
    assert "no/such/model" in speedups.speculative.controls.status.text()
    assert speedups.speculative.controls.run.isEnabled()
    # a run asked for while the main window generates waits its turn, and says so
    generate(qtbot, window, "fox", max_tokens=100_000, wait=False)
    qtbot.waitUntil(lambda: window.session.running == window.job)
    speedups.speculative.draft_kind.setCurrentIndex(0)
    speedups.speculative.spec_tokens.setValue(4)
    speedups.speculative.controls.run.click()
    waiting = speedups.speculative.job
    assert waiting in window.session.waiting()
    assert speedups.speculative.controls.status.text() == "Waiting for the generation to finish …"
    with qtbot.waitSignal(window.session.job_finished, timeout=60_000,
                          check_params_cb=lambda job, result: job == waiting):
        window.stop()
    qtbot.waitUntil(lambda: speedups.speculative.controls.run.isEnabled())
    assert speedups.speculative.result.draft == "ngram:3"


def test_stop_ends_a_sweep(qtbot, window, speedups):
    speedups.batching.batches.setText("1,2")
    speedups.batching.sweep_tokens.setValue(4000)
    stepped = []
    window.session.job_events.connect(lambda job, events: stepped.extend(events))
    with qtbot.waitSignal(window.session.job_finished, timeout=120_000) as blocker:
        speedups.batching.controls.run.click()
        qtbot.waitUntil(lambda: len(stepped) >= 2, timeout=60_000)
        speedups.batching.controls.stop.click()
    points = blocker.args[1].points
    assert points == ()  # the cancelled batch is no measurement
    qtbot.waitUntil(lambda: speedups.batching.controls.run.isEnabled())
    assert window.prompt.generate_button.isEnabled()


def test_rejected_guesses_render_even_when_events_arrive_in_separate_batches(qtbot, window, speedups):
    from engine.base.events import DraftVerified, MemorySample

    def token(index, text, drafted):
        return TokenGenerated(index=index, token_id=index, text=text, logprob=0.0, top_alternatives=(),
                              latency_s=0.01, elapsed_s=0.01, kv_cache_bytes=0, kv_cache_bytes_predicted=0,
                              memory=MemorySample(None, "cpu"), drafted=drafted)

    speedups.speculative.running = True
    batches = [(token(0, "In", False), DraftVerified(0, (1, 2, 3), (" a", " big", " cat"), 1, 0.01, 0.01, 0.02)),
               (token(1, " a", True),), (token(2, " small", False),)]
    for events in batches:  # the worker cuts batches by time: a verification and its tokens may part
        speedups.speculative._on_speculation_events("speculative", events)
        speedups.speculative.refresh()
    speedups.speculative.running = False
    assert speedups.speculative.spec_output.toPlainText() == "In a big cat small"
    fragments = []
    block = speedups.speculative.spec_output.document().begin()
    it = block.begin()
    while not it.atEnd():
        fragment = it.fragment()
        fragments.append((fragment.text(), fragment.charFormat().fontStrikeOut()))
        it += 1
    assert (" big cat", True) in fragments
    assert not any(struck for text, struck in fragments if text != " big cat")
