"""A served model in the main window and as a compare lane: chosen from the Endpoint dialog (models
listed from the server), streamed token by token, what the server doesn't say greyed out, its key
never saved; a wrong key shown as such and the loaded model kept."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtWidgets import QDialogButtonBox

from engine.base.events import Finished, TokenGenerated
from engine.base.request import GenerationRequest
from engine.serve.server import Server, ServeSettings
from tests.app.conftest import dismiss_load_error, generate, load
from engine.generation.generate import generate as engine_generate

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(loaded_llama):
    server = Server(loaded_llama, ServeSettings(port=0, max_batch=4, history=False, kv_budget_bytes=1 << 30,
                                                api_key="the-key")).start()
    yield server
    assert server.stop(drain=False, timeout=30)


def choose_endpoint(qtbot, window, url, key):
    panel = window.model_panel
    panel.open_endpoint_dialog()
    dialog = panel.endpoint_dialog
    dialog.url.setText(url)
    dialog.key.setText(key)
    dialog.list_button.click()
    qtbot.waitUntil(lambda: dialog.list_button.isEnabled(), timeout=30_000)
    return dialog


def test_a_served_model_in_the_main_window(qtbot, window, served, loaded_llama, settings, tiny_llama):
    dialog = choose_endpoint(qtbot, window, served.url, "wrong")
    assert "401" in dialog.status.text() and "API key is wrong or missing" in dialog.status.text()
    dialog.key.setText("the-key")
    dialog.list_button.click()
    qtbot.waitUntil(lambda: dialog.model.count() == 1, timeout=30_000)
    assert dialog.model.currentText() == served.model_name and served.model_name in dialog.status.text()
    dialog.buttons.button(QDialogButtonBox.Ok).click()
    panel = window.model_panel
    request = panel.request()
    assert request.model == f"endpoint:{served.url}#{served.model_name}" and request.api_key == "the-key"
    assert not panel.precision.isEnabled() and not panel.device.isEnabled()  # the server's, not ours to pick
    assert panel.precision.currentText() == panel.device.currentText() == "the server's"  # never a local choice
    with qtbot.waitSignal(window.session.loaded, timeout=60_000):
        panel.load_button.click()
    qtbot.waitUntil(lambda: window.loaded is not None)
    assert window.loaded.source == "endpoint"
    assert panel.facts["Format"].text() == "served by Inference Workbench"
    assert "the server" in panel.facts["Weights"].text()

    finished = generate(qtbot, window, PROMPT, max_tokens=10)
    local = [e for e in engine_generate(loaded_llama, GenerationRequest(PROMPT, max_new_tokens=10, ignore_eos=True))
             if isinstance(e, (TokenGenerated, Finished))]
    assert [t.token_id for t in window.run.tokens] == [t.token_id for t in local[:-1]]
    assert finished.tokens == 10 and finished.text == local[-1].text
    assert window.run.served and window.run.answered.counted_by == "logprobs"
    kv, memory = window.plots.kv, window.plots.memory
    if window.run.server_samples:  # the server's /metrics, drawn where the local figures go
        assert kv.unavailable is None and "server's KV cache in use" in kv.caption.text()
    else:
        assert kv.unavailable is not None
    assert window.plots.point_counts()["kv_measured_dots"] == 0  # no local bytes drawn as if measured
    assert memory.unavailable is not None or window.run.server_samples
    assert window.status["device"].text() == "device: server"
    assert window.status["peak"].text() == "peak: server's"
    tooltip = window.output.tooltip_for(len(window.transcript.turns) - 1, 1)
    assert "as its chunk arrived" in tooltip and "logprob" in tooltip

    window.close()
    settings.sync()
    saved = open(settings.fileName(), encoding="utf-8").read()
    assert served.url in saved and "the-key" not in saved  # the URL is remembered, never the key


def test_a_wrong_key_is_said_and_the_loaded_model_kept(qtbot, window, served, tiny_llama):
    load(qtbot, window, tiny_llama)
    panel = window.model_panel
    panel.set_source(f"endpoint:{served.url}")
    panel.load_button.click()
    text = dismiss_load_error(qtbot, window)
    assert "401" in text and "API key" in text
    assert window.loaded is not None and window.loaded.source != "endpoint"  # still the local model
    # the panel shows what runs again, its own precision and device (a Generate now answers locally)
    assert not panel.pending() and (panel.precision.currentData(), panel.device.currentData()) == ("fp32", "cpu")
    assert panel.precision.findData("served") < 0
    assert generate(qtbot, window, PROMPT, max_tokens=3).tokens == 3
    panel.open_endpoint_dialog()  # the endpoint is one click away to try again with the right key
    assert panel.endpoint_dialog.url.text() == served.url
    panel.endpoint_dialog.reject()


def test_a_local_lane_and_an_endpoint_lane_agree_token_for_token(qtbot, compare, served, tiny_llama, tmp_path):
    from tests.app.test_compare_window import configure, load_all, run, table_text
    from engine.measure.compare import LaneSpec

    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(tiny_llama), "fp32", "cpu")])
    lane = compare.lanes[1]
    lane.open_endpoint_dialog()
    dialog = lane.endpoint_dialog
    dialog.url.setText(served.url)
    dialog.key.setText("the-key")
    dialog.buttons.button(QDialogButtonBox.Ok).click()
    assert lane.spec().model == f"endpoint:{served.url}" and not lane.precision.isEnabled()
    assert lane.precision.currentText() == "the server's"
    load_all(qtbot, compare)
    assert "served by Inference Workbench" in lane.status.text()
    run(qtbot, compare, tokens=12)
    local, endpoint = compare.summary
    assert endpoint.token_agreement == 1.0 and endpoint.first_divergence is None  # greedy: the same tokens
    assert local.decode_tokens_per_s > 0 and endpoint.decode_tokens_per_s > 0  # both speeds in the summary
    assert endpoint.weights_bytes == local.weights_bytes and endpoint.kv_cache_bytes is None  # as its server says
    assert endpoint.mean_abs_logprob_delta is None  # the server's weights can't score lane 1's answer here
    rows = table_text(compare)
    assert any("served at" in cell for cell in rows[1]) and "100.0%" in rows[1]
    assert lane.output.toPlainText() == compare.lanes[0].output.toPlainText()
    assert "lane 2: served" in compare.plots.kv.full_title
    written = compare.export(tmp_path / "run.json")
    saved = (tmp_path / "run.json").read_text()
    assert "the-key" not in saved and tmp_path / "run.json" in written


def test_the_load_generator_against_another_server_lands_beside_earlier_loads(qtbot, window, served, tmp_path):
    import csv

    traffic = window.open_traffic()
    box = traffic.load_box
    assert not box.run_button.isEnabled()  # this app's server isn't started
    box.target.setEditText(served.url)
    box.key.setText("the-key")
    assert box.run_button.isEnabled() and box.key.isEnabled()
    box.values.setText("1,2")
    box.requests.setValue(2)
    box.max_tokens.setValue(3)
    for round_ in (1, 2):
        with qtbot.waitSignal(box._ended, timeout=120_000):
            box.run_button.click()
        assert box.table.rowCount() == 2 and box.table.item(1, 1).text() == "2/2"
        qtbot.waitUntil(lambda: len(box.history) == 2 * round_, timeout=30_000)  # every load joins the history
    assert len(box.points.data) == 2  # this load, in blue
    (earlier,) = box.history_points  # the first load: one series for this server and model
    assert len(earlier.data) == 2
    assert served.url.split("//")[-1] in box.chart.caption.text()
    assert box.ceiling.getData()[0] is None or len(box.ceiling.getData()[0]) == 0  # no ceiling of this machine
    out = tmp_path / "load.csv"
    box.save(str(out))
    assert [row["setting"] for row in csv.DictReader(out.open())] == ["concurrency 1", "concurrency 2"]
    assert all("the-key" not in r.extra.__repr__() for r in box.history)
    box.show_history.setChecked(False)
    assert box.history_points == []
    traffic.close()


def test_the_load_generator_says_which_requests_errored(qtbot, window):
    from app.run_window import describe
    from tests.serving import ThirdPartyServer

    traffic = window.open_traffic()
    box = traffic.load_box
    with ThirdPartyServer(error_on=(1,)) as fake:  # the second request broken off mid-stream by the server
        box.target.setEditText(fake.url)
        box.values.setText("1")
        box.requests.setValue(3)
        box.max_tokens.setValue(4)
        with qtbot.waitSignal(box._ended, timeout=120_000):
            box.run_button.click()
    counts = "failed 1: errored 1, cut by the deadline 0"
    assert box.table.item(0, 1).text() == "2/3"
    not_done = [box.table.horizontalHeaderItem(i).text() for i in range(box.table.columnCount())].index("not done")
    assert box.table.item(0, not_done).text() == counts
    assert box.status.text().startswith(f"Done: 1 settings ({counts}).")
    qtbot.waitUntil(lambda: len(box.history) == 1, timeout=30_000)  # the history's record says the same
    assert f"- 2 of 3 requests completed ({counts})" in describe(box.history[0])
    traffic.close()


def use_endpoint(qtbot, window, served):
    dialog = choose_endpoint(qtbot, window, served.url, "the-key")
    qtbot.waitUntil(lambda: dialog.model.count() == 1, timeout=30_000)
    dialog.buttons.button(QDialogButtonBox.Ok).click()
    with qtbot.waitSignal(window.session.loaded, timeout=60_000):
        window.model_panel.load_button.click()
    qtbot.waitUntil(lambda: window.loaded is not None and window.loaded.source == "endpoint")


def test_an_endpoint_leaves_the_tools_and_the_next_launch_true(qtbot, app_factory, served, tiny_llama):
    window = app_factory()
    load(qtbot, window, tiny_llama, precision="bf16")
    speedups = window.open_speedups()
    qtbot.addWidget(speedups)
    assert speedups.batching.controls.run.isEnabled()
    use_endpoint(qtbot, window, served)
    # the tools follow the model (their title too) and say what they need instead of failing
    assert served.model_name in speedups.windowTitle()
    for tool in (speedups.batching, speedups.speculative):
        assert not tool.controls.run.isEnabled() and tool.controls.status.text() == tool.needs
    assert "load generator" in speedups.batching.needs
    window.close()

    again = app_factory()  # the next launch: the last local model and its precision, not an endpoint without its key
    panel = again.model_panel
    assert (panel.request().model, panel.request().precision) == (str(tiny_llama), "bf16")
    panel.set_source("default")
    assert panel.request().precision == "bf16"
    panel.open_endpoint_dialog()  # the endpoint is one click away, its URL remembered
    assert panel.endpoint_dialog.url.text() == served.url and not panel.endpoint_dialog.key.text()
    panel.endpoint_dialog.reject()


def test_a_servers_slots_leave_the_memory_plot_with_it(qtbot, window, tiny_llama):
    """llama.cpp's /slots line titles the memory plot over a served answer; a local run after it
    shows its own memory with no server's title left over."""
    from engine.base.events import ServerSampled
    from engine.runs import Run

    load(qtbot, window, tiny_llama)
    local = generate(qtbot, window, PROMPT, max_tokens=3)
    assert local.tokens == 3
    served = Run()
    served.extend([ServerSampled(at_s=0.1, kind="llama.cpp", running=1, waiting=0, kv_usage=0.2, preemptions=None,
                                 slots_busy=1, slots_total=2)])
    served.extend([replace(t, memory=replace(t.memory, device="remote")) for t in window.run.tokens])
    title = window.plots.memory.plot.getPlotItem().titleLabel
    window.plots.refresh(served)
    assert title.isVisible() and window.plots.memory.full_title == "its slots: 1 of 2 busy (/slots)"
    generate(qtbot, window, PROMPT, max_tokens=4)  # a later local run
    assert not title.isVisible() and window.plots.point_counts()["memory"] == 4


def test_quality_scores_a_served_lane_against_lane_1(qtbot, compare, served, tiny_llama, tmp_path, monkeypatch):
    """Compare → Quality with lane 2 served (the same weights): the server's prompt
    log-probabilities give lane 2 lane 1's perplexity and no divergence, its KL marked as a lower
    bound; a served lane 1 can't be the reference, and says so."""
    from tests.app.test_compare_window import configure
    from engine.measure.compare import LaneSpec

    monkeypatch.setenv("INFERENCE_WORKBENCH_API_KEY", "the-key")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    configure(compare, [LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(f"endpoint:{served.url}", "", "cpu")])
    compare.quality_settings = {"text": str(text), "ctx": 64, "chunks": 3}
    with qtbot.waitSignal(compare.quality_finished, timeout=180_000):
        compare.quality_button.click()
    here, remote = (row.report for row in compare.quality_view.rows)
    assert remote.precision == "served" and remote.tokens_scored == here.tokens_scored == 3 * 31
    assert remote.perplexity == pytest.approx(here.perplexity, rel=1e-5)
    assert remote.divergence.kld_max == pytest.approx(0, abs=1e-5) and remote.divergence.same_top == 1.0
    cell = compare.quality_view.table.item(1, 6)
    assert cell.text().startswith("≥ ") and "lower bound" in cell.toolTip()
    configure(compare, [LaneSpec(f"endpoint:{served.url}", "", "cpu"), LaneSpec(str(tiny_llama), "fp32", "cpu")])
    with qtbot.waitSignal(compare.quality_finished, timeout=180_000):
        compare.quality_button.click()
    assert "put it in lane 1" in compare.message.text()
