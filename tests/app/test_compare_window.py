import json

import pytest

from app.compare_window import CompareWindow
from app.widgets.compare_summary import COLUMNS
from engine.measure.compare import LaneSpec


def configure(compare, specs):
    while len(compare.lanes) < len(specs):
        compare.add_lane()
    for lane, spec in zip(compare.lanes, specs):
        lane.configure(spec)


def load_all(qtbot, compare):
    for lane in compare.lanes:
        lane.load()
    qtbot.waitUntil(lambda: all(lane.loaded is not None for lane in compare.lanes), timeout=120_000)


def run(qtbot, compare, prompt="The quick brown fox", tokens=10, schedule="fair"):
    compare.prompt.setPlainText(prompt)
    compare.mode.setCurrentIndex(compare.mode.findData("raw"))
    compare.max_tokens.setValue(tokens)
    compare.schedule_box.setCurrentIndex(compare.schedule_box.findData(schedule))
    with qtbot.waitSignal(compare.run_finished, timeout=120_000):
        compare.run_button.click()


def table_text(compare):
    return [[compare.table.item(r, c).text() for c in range(compare.table.columnCount())]
            for r in range(compare.table.rowCount())]


@pytest.mark.parametrize("schedule", ["fair", "concurrent"])
def test_identical_lanes_agree_completely(qtbot, compare, tiny_llama, schedule):
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu")] * 3)
    load_all(qtbot, compare)
    run(qtbot, compare, schedule=schedule)
    assert [row.token_agreement for row in compare.summary] == [1.0, 1.0, 1.0]
    assert [row.first_divergence for row in compare.summary] == [None, None, None]
    assert [row.mean_abs_logprob_delta for row in compare.summary] == [0.0, 0.0, 0.0]
    agreement = [title for _, title in COLUMNS].index("Agreement")
    assert [row[agreement] for row in table_text(compare)] == ["100.0%"] * 3
    # what the agreement is read against: lane 1's weights, a folder of safetensors as published
    assert "read against lane 1: fp32 here is the model's safetensors weights" in compare.reference_note.text()
    for lane in compare.lanes:
        assert lane.run.finished.tokens == 10
        assert compare.plots.point_counts(lane)["kv"] == 10
        assert lane.output.toPlainText() == compare.lanes[0].output.toPlainText()
    # the plots redraw only when a lane's run changed
    redraws = compare.plots.redraws
    compare._redraw()
    assert compare.plots.redraws == redraws
    run(qtbot, compare, schedule=schedule)  # again: each lane measures the whole prompt, no prefix cache's help
    assert all(lane.run.prefilled.cached_tokens == 0 for lane in compare.lanes)
    # "− lane": the third lane's curves and legend leave every plot at once, and stay gone after a run
    compare.remove_button.click()
    for _ in range(2):
        for panel in compare.plots.panels.values():
            assert "lane 3" not in panel.caption.text() and "lane 2" in panel.caption.text()
        assert {index for _, index in compare.plots._curves} == {0, 1}
        if len(compare.summary) == 2:
            break
        run(qtbot, compare, schedule=schedule)


def test_divergent_lane_is_highlighted(qtbot, compare, tiny_llama):
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(tiny_llama), "nf4", "cpu")])
    load_all(qtbot, compare)
    run(qtbot, compare, tokens=16)
    row = compare.summary[1]
    assert row.mean_abs_logprob_delta > 0
    if row.first_divergence is not None:
        from PySide6.QtGui import QTextCursor

        doc = compare.lanes[1].output.document()
        cursor = QTextCursor(doc)
        cursor.setPosition(doc.characterCount() - 1)
        assert cursor.charFormat().background().color().alpha() > 0


def test_export_and_reopen_shows_the_run_exactly(qtbot, compare, tiny_llama, tmp_path):
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(tiny_llama), "bf16", "cpu")])
    load_all(qtbot, compare)
    run(qtbot, compare)
    written = compare.export(tmp_path / "run.json")
    assert sorted(p.name for p in written) == ["run-kv.png", "run-latency.png", "run-memory.png", "run-speed.png",
                                               "run.csv", "run.json"]
    original = json.loads((tmp_path / "run.json").read_text())
    shown = (table_text(compare), [lane.output.toPlainText() for lane in compare.lanes])

    again = CompareWindow()
    qtbot.addWidget(again)
    try:
        assert again.open_run(tmp_path / "run.json")
        assert all(lane.loaded is None for lane in again.lanes)  # no model behind a saved run
        assert (table_text(again), [lane.output.toPlainText() for lane in again.lanes]) == shown
        assert json.loads(json.dumps(again.record())) == original  # saving it again gives the same file
        assert not again.run_button.isEnabled()
        assert [again.plots.point_counts(lane) for lane in again.lanes] == \
               [compare.plots.point_counts(lane) for lane in compare.lanes]
    finally:
        again.close()


def test_open_run_rejects_other_files(qtbot, compare, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert not compare.open_run(bad)
    assert "not a saved comparison" in compare.message.text()
    assert compare.run_button.isEnabled()


def test_quantization_ladder(compare, tiny_llama):
    compare.lanes[0].configure(LaneSpec(str(tiny_llama), "bf16", "cpu"))
    compare.ladder()
    assert [lane.spec().precision for lane in compare.lanes] == ["fp32", "bf16", "int8", "nf4"]
    assert {lane.spec().model for lane in compare.lanes} == {str(tiny_llama)}


def test_memory_guard_asks_before_loading(qtbot, compare, tiny_llama, monkeypatch):
    import engine.estimates.estimate

    monkeypatch.setattr(engine.estimates.estimate, "available_bytes", lambda device: 1024)
    lane = compare.lanes[0]
    lane.configure(LaneSpec(str(tiny_llama), "fp32", "cpu"))
    lane.load()
    qtbot.waitUntil(lambda: lane.insist_button.isVisible(), timeout=60_000)
    assert "is free" in lane.status.text() and lane.loaded is None
    lane.insist_button.click()
    qtbot.waitUntil(lambda: lane.loaded is not None, timeout=60_000)
    lane.unload()
    qtbot.waitUntil(lambda: lane.loaded is None, timeout=60_000)


def test_main_window_opens_compare_with_its_model(qtbot, window, tiny_llama):
    window.model_panel.set_source(str(tiny_llama))
    compare = window.open_compare()
    assert compare.lanes[0].spec().model == str(tiny_llama)
    assert compare.isVisible()


def test_two_lanes_loading_at_once_one_failing(qtbot, compare, slow_tiny, tmp_path):
    """Both lanes load at once (the engine serialises the loads: tests/engine/test_loading.py
    checks the 'queued' stage); then one lane's bad path fails while the other loads: it says
    why, the other is unaffected, and both work afterwards."""
    configure(compare, [LaneSpec(str(slow_tiny), "fp32", "cpu"), LaneSpec(str(slow_tiny), "fp32", "cpu")])
    load_all(qtbot, compare)
    compare.lanes[1].configure(LaneSpec(str(tmp_path / "missing"), "fp32", "cpu"))
    compare.lanes[0].unload()
    qtbot.waitUntil(lambda: compare.lanes[0].loaded is None, timeout=30_000)
    compare.lanes[0].load()
    compare.lanes[1].load()
    qtbot.waitUntil(lambda: compare.lanes[1].status.text().startswith("Could not load"), timeout=60_000)
    assert "No such" in compare.lanes[1].status.text()
    # the failed load kept the lane's working model, and says so
    assert compare.lanes[1].loaded is not None and "Still loaded" in compare.lanes[1].status.text()
    qtbot.waitUntil(lambda: compare.lanes[0].loaded is not None, timeout=120_000)
    compare.lanes[1].configure(LaneSpec(str(slow_tiny), "fp32", "cpu"))
    with qtbot.waitSignal(compare.lanes[1].load_ended, timeout=120_000):
        compare.lanes[1].load()
    assert not compare.lanes[1].needs_load()
    run(qtbot, compare, tokens=4)
    assert [lane.run.finished.tokens for lane in compare.lanes] == [4, 4]


def test_quality_run_measures_every_lane_against_lane_1(qtbot, compare, tiny_llama, tmp_path, monkeypatch):
    """Compare → Quality: lane 1 is the reference (KLD 0 against itself is not shown: it is the
    reference), lane 2's KL divergence and perplexity come from the same text; the table, the
    chart and the coloured text show them, and the Cost explorer's precision list says them."""
    from app.widgets.quality_view import pareto
    from engine.storage.history import load_all

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    compare.lanes[0].configure(LaneSpec(str(tiny_llama), "fp32", "cpu"))
    compare.lanes[1].configure(LaneSpec(str(tiny_llama), "bf16", "cpu"))
    compare.quality_settings = {"text": str(text), "ctx": 64, "chunks": 4}
    said, show = [], compare.show_message  # the window's message line carries the whole run's progress
    monkeypatch.setattr(compare, "show_message", lambda text, error=False: (said.append(text), show(text, error)))
    with qtbot.waitSignal(compare.quality_finished, timeout=180_000):
        compare.quality_button.click()  # loads both lanes first
    rows = compare.quality_view.rows
    # the whole run's progress: each lane in turn, and the time left in all once a chunk was timed
    assert any(s.startswith("Quality: lane 1 of 2") for s in said) and any("lane 2 of 2" in s for s in said)
    assert any("s left in all" in s for s in said)
    assert [r.precision for r in rows] == ["fp32", "bf16"]
    reference, other = rows[0].report, rows[1].report
    assert reference.divergence is None and other.divergence is not None
    assert other.divergence.reference == "fp32" and 0 <= other.divergence.kld_mean < 0.1
    assert other.chunks == 4 and other.tokens_scored == 4 * 31
    table = compare.quality_view.table
    assert table.item(0, 6).text() == "reference" and table.item(1, 6).text() == f"{other.divergence.kld_mean:.5f}"
    assert table.item(1, 5).text().startswith(f"{other.perplexity:.3f}")
    assert table.item(1, 3).text().endswith("(bfloat16)")  # the lane's KV per token, in its dtype
    # the chart's bytes: the weights and one sequence's KV cache at the chosen context
    view = compare.quality_view
    kv = compare.lanes[1].loaded.kv_bytes_per_token
    view.context.setValue(8192)
    expected = sorted((r.report.weights_bytes + 8192 * r.kv_bytes_per_token) / 2**20 for r in rows)
    assert sorted(view.points.getData()[0]) == pytest.approx(expected)
    assert rows[1].kv_bytes_per_token == kv and kv == compare.lanes[0].loaded.kv_bytes_per_token // 2
    xs, ys = compare.quality_view.front.getData()
    assert len(xs) >= 1 and pareto([(2.0, 0.0), (1.0, 0.5), (1.5, 0.6)]) == [1, 0]
    assert compare.quality_view.text.toPlainText().strip() != ""
    assert "bends most" in compare.quality_view.worst.text()
    # where the reference's weights came from: a folder of safetensors, as published
    assert "Reference, lane 1:" in compare.quality_view.reference.text()
    assert "safetensors weights, as published" in compare.quality_view.reference.text()
    kinds = sorted(r.precision for r in load_all() if r.kind == "quality")
    assert kinds == ["bf16", "fp32"]
    # Stop ends the run at its next chunk: the lanes measured so far stay, the message says so
    with qtbot.waitSignal(compare.quality_finished, timeout=60_000):
        compare.quality_button.click()
        assert compare.running and compare.stop_button.isEnabled()
        compare.stop_button.click()
    assert not compare.running and "stopped" in compare.message.text().lower()
    assert compare.quality_button.isEnabled()
