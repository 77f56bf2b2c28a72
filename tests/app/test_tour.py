"""Help → Tour: every step measures on the loaded model and shows that figure, the outlined
widget answers it, leaving stops what the tour started, and the tour is offered once."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from shiboken6 import isValid as shiboken_valid

from app.tour import STEPS, Tour
from app.tour_steps import EDIT_PROMPT
from engine.measure.compare import LaneSpec
from engine.base.units import format_bytes, format_rate, format_seconds
from tests.app.conftest import load


@pytest.fixture
def toured(qtbot, window, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    load(qtbot, window, tiny_llama)
    window.server_panel.port.setValue(0)  # any free port: the tour keeps the port it is given when free
    window.prompt.editor.setPlainText("my own question, half typed")
    tour = window.open_tour()
    yield window, tour
    if shiboken_valid(tour):  # a finished tour is deleted on close
        tour.close()
    window.tools.close_all()


def measure(qtbot, tour: Tour, index: int) -> str:
    """Show step ``index`` (unless shown) and wait for its figure; return it."""
    key = STEPS[index].key
    failures: list = []
    tour.step_failed.connect(lambda k, why: failures.append((k, why)))
    if tour.index != index:
        tour.show_step(index)
    qtbot.waitUntil(lambda: key in tour.figures or bool(failures), timeout=180_000)
    assert not failures, failures
    assert tour.figure.text().startswith("<b>Measured:</b>")
    return tour.figures[key]


def outlined(tour: Tour):
    return tour._highlight.target if tour._highlight is not None else None


def test_every_step_shows_the_figure_it_names(qtbot, toured):
    window, tour = toured
    qtbot.waitUntil(lambda: tour.index == 0)
    assert tour.isVisible() and "Step 1 of 10" in tour.heading.text()

    # 1 Tokens: as many chips as the count, the count the one the answer's prompt had
    figure = measure(qtbot, tour, 0)
    chips = tour.chips.text().count("<span")
    assert "context window" in figure
    # the words' own tokens, then what the chat template and system prompt make of them (a chat
    # request: the template wraps the words)
    assert f"model reads {chips}," in figure
    own = int(figure.split("words are ")[1].split(" tokens")[0])
    assert 0 < own < chips
    assert outlined(tour) is window.prompt and tour.chips_area.isVisible()
    # 2 One token at a time: the window's own answer, its TTFT and per-token time
    with qtbot.waitSignal(window.generation_finished, timeout=60_000) as answer:
        tour.next()
    figure = measure(qtbot, tour, 1)
    event = answer.args[0]
    assert event.prompt_tokens == chips  # step 1 counted what Generate sent
    assert format_seconds(event.ttft_s) in figure
    assert format_seconds(event.decode_s / (event.tokens - 1)) in figure
    assert outlined(tour) is window.plots.latency and window.run.finished is event
    # 3 Weights: predicted from the config, measured at load, and the essay's 16 GB
    figure = measure(qtbot, tour, 2)
    assert f"measured once loaded: {format_bytes(window.loaded.weights_bytes)}" in figure
    assert "(fp32)" in figure and "32.0 bits" in figure
    assert "Llama-3.1-8B: 8.0 B × 16 bits = 16.1 GB" in figure
    assert outlined(tour) is window.plots.memory
    # 4 KV cache: a follow-up turn's cache, measured against predicted
    with qtbot.waitSignal(window.generation_finished, timeout=60_000) as answer:
        tour.next()
    figure = measure(qtbot, tour, 3)
    event = answer.args[0]
    assert len(window.transcript.turns) >= 4  # a second turn of the same conversation
    assert f"{format_bytes(event.kv_cache_bytes)} measured" in figure
    assert f"{format_bytes(window.loaded.kv_bytes_per_token)} per token" in figure
    assert outlined(tour) is window.plots.kv
    # 5 Bandwidth: the ceiling drawn on the speed plot, the measured speed against it
    figure = measure(qtbot, tour, 4)
    ceiling = window.plots.ceiling
    assert ceiling and window.plots._ceiling.isVisible()
    assert f"at most {format_rate(ceiling)}" in figure
    # the tiny model's head is untied: a token reads less than the weights, and the step says why
    assert f"of the {format_bytes(window.loaded.weights_bytes)} of weights" in figure
    assert "only one row of the input embedding table" in figure
    assert f"The last answer: {format_rate(event.decode_tokens_per_s)}" in figure
    assert outlined(tour) is window.plots.speed
    # 6 Batching: the Batching window's own sweep, set visibly to the tour's sizes
    figure = measure(qtbot, tour, 5)
    batching = window.tools.speedups.batching
    assert batching.batches.text() == "1,4" and [p.batch for p in batching.points] == [1, 4]
    assert f"{format_rate(batching.points[1].aggregate_tokens_per_s)} in all" in figure
    assert outlined(tour) is batching.tradeoff_plot
    # 7 Quantization: Compare's ladder, four lanes of the model the main window runs
    compare = window.open_compare()
    compare.lanes[0].configure(LaneSpec("default", "bf16", "auto"))  # left on another model: the ladder uses the main's
    figure = measure(qtbot, tour, 6)
    assert {lane.spec().model for lane in compare.lanes} == {str(window.model_panel.loaded_request.model)}
    assert [lane.spec().precision for lane in compare.lanes] == ["fp32", "bf16", "int8", "nf4"]
    for lane, row in zip(compare.lanes, compare.summary):
        assert f"{lane.spec().precision} {format_bytes(row.weights_bytes)}" in figure
    assert outlined(tour) is compare.table
    # 8 Speculative decoding: prompt lookup, then early exit, on one edit prompt: kept against
    # drafted, the speed-up against plain decoding and the one predicted
    speculative = window.tools.speedups.speculative
    finished = []
    speculative.finished.connect(finished.append)
    figure = measure(qtbot, tour, 7)
    assert [r.draft for r in finished] == ["ngram:3", "early-exit:1"]
    assert speculative.spec_prompt.text() == EDIT_PROMPT
    for report in finished:
        assert f"{report.accepted_tokens} of {report.drafted_tokens} guesses kept" in figure
        assert f"{report.speedup_vs_plain:.2f}×" in figure and report.same_tokens_as_plain
        if report.drafted_tokens:  # (the tiny model's answer may never repeat three tokens)
            assert f"predicted {report.break_even.predicted:.2f}×" in figure
    assert finished[1].drafted_tokens > 0
    # the answer, its summary and both plots outlined, the splitter holding them given no pane
    splitter = outlined(tour)
    assert splitter.count() == 2 and speculative.acceptance_plot.parentWidget().parentWidget() is splitter
    assert tour._highlight.geometry().size() == splitter.size()
    # 9 Many users: the server started, a load against it, its requests in the traffic view
    figure = measure(qtbot, tour, 8)
    box = window.tools.traffic.load_box
    assert [r.label for r in box.results] == ["concurrency 1", "concurrency 4"]
    assert f"{box.results[1].summary.output_throughput:,.1f} tok/s" in figure
    # the prediction came first: each setting's, from the serving simulator, beside its measurement
    assert sorted(box.predictions) == ["concurrency 1", "concurrency 4"], box.prediction_error
    assert f"predicted {box.predictions['concurrency 4'].output_throughput:,.1f}, measured" in figure
    assert window.server_panel.started is not None and outlined(tour) is window.tools.traffic.plots.timeline
    # 10 Training vs inference: leaving step 9 stops the server the tour started
    figure = measure(qtbot, tour, 9)
    qtbot.waitUntil(lambda: window.server_panel.job is None, timeout=60_000)
    estimate = window.tools.costs.estimate
    assert f"{estimate.training_breakeven_tokens:.2e} tokens" in figure
    assert "20 training tokens per parameter" in figure
    assert window.tools.costs.training.text() == f"{20 * window.loaded.parameters:.3g}"
    # the explorer's KV cache is the one the loaded model runs with (fp32 here), as step 4 measured it
    assert window.tools.costs.kv_dtype.currentData() == "fp32" and window.loaded.kv_dtype == "float32"
    assert estimate.kv_bytes_per_token == window.loaded.kv_bytes_per_token
    assert tour.next_button.text() == "Finish"
    assert len(window.transcript.turns) >= 4  # the tour's two turns, until it ends
    tour.next()
    assert not tour.isVisible()
    # the tour's turns leave the chat: the user's first question will be turn 1, not turn 3
    assert window.transcript.turns == [] and window.output.toPlainText() == ""


def test_leaving_mid_step_stops_listening_and_the_tour_server(qtbot, toured):
    window, tour = toured
    qtbot.waitUntil(lambda: tour.index == 0)
    assert window.prompt.editor.toPlainText() == "In two sentences: what does a GPU do?"
    tour.show_step(8)  # Many users: starts the server
    qtbot.waitUntil(lambda: window.server_panel.started is not None, timeout=60_000)
    qtbot.keyClick(tour, Qt.Key_Escape)  # mid-step: the load may be running
    assert not tour.isVisible()
    qtbot.waitUntil(lambda: window.server_panel.job is None, timeout=60_000)
    box = window.tools.traffic.load_box
    qtbot.waitUntil(lambda: box.runner is None, timeout=60_000)
    assert "serving" not in tour.figures and tour._listening == []
    assert window.prompt.editor.toPlainText() == "my own question, half typed"  # the user's draft, back
    assert outlined(tour) is None and window.tools.traffic.plots.timeline.findChildren(type(tour._highlight)) == []


def test_without_a_local_model_each_step_says_what_it_needs(qtbot, window):
    tour = window.open_tour()
    failed = []
    tour.step_failed.connect(lambda key, why: failed.append((key, why)))
    qtbot.waitUntil(lambda: tour.index == 0)
    assert failed and failed[0][0] == "tokens" and "Load a model first" in failed[0][1]
    assert "Load a model first" in tour.figure.text()
    tour.next()  # nothing measured, but the tour goes on
    assert tour.index == 1 and failed[-1][0] == "decode"
    tour.close()


def test_the_first_start_offers_the_tour_once(qtbot, app_factory, tiny_llama):
    window = app_factory()
    load(qtbot, window, tiny_llama)
    message = window.prompt.message
    assert message.isVisible() and "Take the tour" in message.text()
    message.linkActivated.emit("tour")
    tour = window.findChild(Tour, "tour")
    assert tour is not None
    qtbot.waitUntil(lambda: tour.index == 0)
    tour.close()
    window.close()
    again = app_factory()  # same settings: offered already
    load(qtbot, again, tiny_llama)
    assert "Take the tour" not in again.prompt.message.text()
    assert any(a.text().startswith("&Tour") for a in again.help_menu.actions())


def test_esc_leaves_the_tour_where_its_panel_is_active(qtbot, toured):
    """The main window's Esc (stop the generation) is shared with its tool windows: where the
    tour's panel is the active window, Esc leaves the tour instead."""
    from PySide6.QtGui import QKeySequence, QShortcut
    from PySide6.QtWidgets import QApplication

    window, tour = toured
    qtbot.waitUntil(lambda: tour.index == 0)
    tour.activateWindow()
    tour.setFocus()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is tour or tour.isAncestorOf(QApplication.focusWidget()))
    escape = next(s for s in window.findChildren(QShortcut) if s.key() == QKeySequence(Qt.Key_Escape))
    escape.activated.emit()
    assert not tour.isVisible()
    assert window.prompt.editor.toPlainText() == "my own question, half typed"


def test_the_tour_says_a_faster_token_is_shorter_not_slower():
    from app.tour_steps import _times

    assert _times(1.8) == "1.8× as long" and _times(1 / 1.25) == "1.2× shorter" and _times(1.01) == "about the same"


def _placed_beside(qtbot, window, left: int, fixed: bool = False):
    """A window over the screen but ``left`` pixels at its left (``fixed``: too wide to narrow),
    a label filling it, and the tour's panel placed for that label: (window, its geometry
    before, the label, the tour)."""
    from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

    screen = window.screen().availableGeometry()
    other = QWidget()
    qtbot.addWidget(other)
    layout = QVBoxLayout(other)
    layout.setContentsMargins(0, 0, 0, 0)
    target = QLabel("what the step explains")
    target.setMinimumSize(200, 200)
    layout.addWidget(target)
    other.setGeometry(screen.adjusted(left, 40, 0, -10))
    if fixed:
        other.setMinimumWidth(other.width())
    other.show()
    qtbot.waitExposed(other)
    before = other.geometry()
    tour = Tour(window)
    qtbot.addWidget(tour)
    tour.show()
    tour._place(target)
    return other, before, target, tour


def _covered(target):
    return target.rect().translated(target.mapToGlobal(target.rect().topLeft()))


def test_the_panel_makes_room_beside_what_it_explains_and_gives_it_back(qtbot, window):
    """Where every corner of the screen would cover the outlined widget, the window it is in is
    narrowed to leave the panel a strip of its own; the window's size comes back when the tour ends."""
    other, before, target, tour = _placed_beside(qtbot, window, 0)  # every corner covers part of it
    qtbot.waitUntil(lambda: other.width() < before.width())
    assert not tour.frameGeometry().intersects(_covered(target))
    tour.close()
    assert other.geometry() == before


def test_the_panel_narrows_to_fit_beside_what_it_explains(qtbot, window):
    """Where the space beside the outlined widget is narrower than the panel but wide enough for a
    narrower one, the panel narrows into it rather than cover the widget (no window is moved)."""
    from app.tour import NARROWEST, WIDEST

    other, before, target, tour = _placed_beside(qtbot, window, (NARROWEST + WIDEST) // 2 + 16, fixed=True)
    assert not tour.frameGeometry().intersects(_covered(target))
    assert NARROWEST <= tour.width() < WIDEST and other.geometry() == before
    tour.close()
