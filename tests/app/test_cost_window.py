import json

import pytest

from app.cost_window import BATCHES, CONTEXTS, CostWindow
from engine.estimates import costs
from engine.generation.generate import generate


@pytest.fixture
def costs_window(qtbot, tmp_path, monkeypatch, isolated_cache, _no_dangling_threads_or_timers):
    from app.main import create_app
    from engine.estimates import hardware

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("INFERENCE_WORKBENCH_CONFIG", str(tmp_path / "config"))
    monkeypatch.setattr(hardware, "measure_cpu", lambda: {"bandwidth_bytes_per_s": 3e10, "bf16_flops": 2e11})
    create_app([])
    window = CostWindow()
    qtbot.addWidget(window)
    window.show()
    # its charts are made, this machine measured and the default model's config read, off the GUI thread
    qtbot.waitUntil(lambda: window.estimate is not None, timeout=120_000)
    yield window
    window.close()


def settle(qtbot, window):
    # a 70B model's parameters are counted on the meta device off the GUI thread: 21 s on a busy
    # 2-core machine, past 30 s on a busier one (a CI run timed out here)
    with qtbot.waitSignal(window.updated, timeout=120_000):
        window.schedule_update()


def test_charts_change_when_sliders_move(qtbot, costs_window):
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.context.setValue(CONTEXTS.index(1024))
    settle(qtbot, w)
    before_kv, before_rate = w.charts.memory_bars[1], w.estimate.decode_tokens_per_s_ceiling
    w.context.setValue(CONTEXTS.index(32768))
    settle(qtbot, w)
    assert w.charts.memory_bars[1] == pytest.approx(before_kv * 32)  # the KV part of the stacked bar
    assert w.estimate.decode_tokens_per_s_ceiling < before_rate
    w.batch.setValue(BATCHES.index(16))
    settle(qtbot, w)
    assert w.estimate.batch == 16 and "16 ×" in w.numbers.text()
    marker_x, _ = w.charts._curves["batch-marker"].getData()
    assert marker_x[0] == 4  # log2(16)
    assert "fits" in w.numbers.text()
    # at 32k tokens an H100 holds the KV of only so many requests: the ceiling ends at the last that fits
    x, _ = w.charts._curves["ceiling"].getData()
    largest = max(b for b in BATCHES if costs_fit(w, b))
    assert largest < BATCHES[-1] and 2 ** x[-1] == pytest.approx(largest)


def costs_fit(window, batch: int) -> bool:
    from engine.estimates import costs

    e = window.estimate
    return costs.estimate(window._config, window.profiles[window.hardware.currentData()], e.precision, e.kv_dtype, e.context, batch, None, "",
                          window._count).fits


def test_compute_region_appears_at_short_context(qtbot, costs_window):
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.context.setValue(0)  # 128 tokens
    settle(qtbot, w)
    assert w.charts.ridge_log2 is not None
    low, high = w.charts._regions[1].getRegion()
    assert high > low  # a compute-bound region is drawn


def test_measured_runs_land_on_the_charts(qtbot, costs_window, loaded_llama, tiny_llama):
    from engine.storage import history
    from engine.base.request import GenerationRequest

    finished = list(generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)))[-1]
    history.save(history.record_from(loaded_llama.info, finished))
    w = costs_window
    w.reload_history()
    w.set_model(str(tiny_llama), "fp32")
    w.kv_dtype.setCurrentIndex(w.kv_dtype.findData("fp32"))
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    settle(qtbot, w)
    xs, _ = w.charts._curves["speed-runs"].getData()
    assert len(xs) == 1
    assert "% of ceiling" in w.charts._run_labels[0].toPlainText()
    import re

    error = re.search(r"predicted [^(]*\(([-+][0-9.]+)%\)", w.numbers.text())
    assert error and abs(float(error.group(1))) < 1.0  # the issue asks for 10%


def test_an_unknown_model_says_so(qtbot, costs_window):
    costs_window.set_model("nobody/nothing")
    settle(qtbot, costs_window)
    assert "No config" in costs_window.numbers.text()


def test_a_config_read_that_fails_is_said_and_read_again(qtbot, costs_window, monkeypatch):
    """A read that raises (transformers half-imported by another thread did) is not a config this
    machine lacks: the window says what failed, keeps nothing, and the next update reads again."""
    import app.cost_window as cost_window

    read = cost_window._read_config
    calls = []

    def failing_once(ref):
        calls.append(ref)
        if len(calls) == 1:
            raise ImportError("cannot import name 'AutoConfig' from 'transformers'")
        return read(ref)

    monkeypatch.setattr(cost_window, "_read_config", failing_once)
    costs_window.set_model("meta-llama/Llama-3.1-8B", "bf16")
    qtbot.waitUntil(lambda: "Could not read" in costs_window.numbers.text(), timeout=60_000)
    assert "cannot import name" in costs_window.numbers.text() and costs_window.estimate is None
    settle(qtbot, costs_window)  # any change: read again, and this time it works
    qtbot.waitUntil(lambda: costs_window.estimate is not None, timeout=120_000)
    assert calls == ["meta-llama/Llama-3.1-8B"] * 2 and costs_window.estimate.parameters == 8_030_261_248
    assert "Could not read" not in costs_window.numbers.text()


def test_the_window_shows_before_its_charts_are_made(qtbot, tmp_path, monkeypatch, isolated_cache):
    """Each chart takes a frame or more to make: they are made one per event-loop turn after the window opens."""
    from app.main import create_app

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    create_app([])
    window = CostWindow()
    qtbot.addWidget(window)
    assert not window.charts.built and all(cell.count() == 1 for cell in window.charts._cells)  # placeholders
    with qtbot.waitSignal(window.charts.ready, timeout=10_000):
        window.show()
    cells = window.charts._cells
    assert window.charts.built and all(cell.currentWidget() is not None and cell.count() == 2 for cell in cells[:4])
    assert all(cell.count() == 1 for cell in cells[4:])  # the serving charts come with the first simulation
    window.close()


def test_a_model_past_one_gpu_gets_a_plan_and_the_vllm_command(qtbot, costs_window):
    from PySide6.QtGui import QGuiApplication

    w = costs_window
    w.set_model("meta-llama/Llama-3.1-70B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.context.setValue(CONTEXTS.index(32768))
    w.batch.setValue(BATCHES.index(1))
    settle(qtbot, w)
    assert not w.estimate.fits and w.plan.chosen.gpus == 4
    text = w.numbers.text()
    assert "<b>4 GPUs</b>" in text and "--tensor-parallel-size 4" in text and "--tp 4" in text
    w.copy_command.click()
    assert QGuiApplication.clipboard().text() == w.plan.vllm_command
    w.copy_sglang.click()
    assert QGuiApplication.clipboard().text() == w.plan.sglang_command and "--tp 4" in w.plan.sglang_command
    assert "over the link" in text  # four GPUs all-reduce over it
    # the $ chart prices the plan's 4 GPUs, as the numbers do (it said "does not fit at any batch")
    price = w.plan.usd_per_million_tokens
    assert price and f"${price:,.2f} per 1M tokens" in text
    assert not w.charts._money_note.isVisible() and "4 GPUs" in w.charts.money_plot.full_title
    x, y = w.charts._curves["usd"].getData()
    assert x[0] == 0 and 10 ** y[0] == pytest.approx(price, rel=1e-6)  # batch 1, as the plan
    # context ticks read as context lengths are said: 2k, 8k, 32k (not 2.05k, 8.19k, 32.8k)
    labels = [label for _, label in w.charts.kv_plot.item.getAxis("bottom")._tickLevels[0]]
    assert {"2k", "8k", "32k", "128k"} <= set(labels)
    # a model one GPU holds: no link to cross, said so, not "0 B per token over the link"
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.context.setValue(CONTEXTS.index(2048))
    settle(qtbot, w)
    assert w.plan.chosen.gpus == 1 and "no link traffic" in w.numbers.text() and "0 B per token" not in w.numbers.text()
    w.hardware.setCurrentIndex(w.hardware.findData("ddr5-desktop"))
    settle(qtbot, w)
    assert w.plan is None and not w.copy_command.isEnabled() and "Past one GPU" not in w.numbers.text()
    # greyed, and saying why
    assert not w.copy_sglang.isEnabled() and "not a GPU" in w.copy_command.toolTip()


def test_load_sweeps_against_a_server_land_on_the_plan_as_shares_of_its_ceiling(qtbot, costs_window):
    from engine.estimates import hardware
    from engine.estimates.estimate import config_for
    from engine.estimates.parallel import ceiling_for
    from engine.storage.history import RunRecord, save

    def load_record(model, batch, rate):
        return RunRecord(kind="load", when="2026-12-01T10:00:00", model=model, model_ref="http://gpu-box:8000/v1",
                         precision="served", device="remote", device_name="vllm at gpu-box:8000", hardware="remote",
                         parameters=None, weights_bytes=None, kv_cache_bytes=None, kv_bytes_per_token=None,
                         prompt_tokens=1000, tokens=1048, batch=batch, decode_tokens_per_s=rate / batch, ttft_s=0.2,
                         peak_memory_bytes=None, extra={"url": "http://gpu-box:8000/v1", "aggregate_tokens_per_s": rate})

    for batch, rate in ((1, 40.0), (16, 500.0)):
        save(load_record("meta-llama/Llama-3.1-70B-Instruct", batch, rate))
    save(load_record("Qwen/Qwen2.5-7B-Instruct", 4, 300.0))  # another model: not on this chart
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-70B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.context.setValue(CONTEXTS.index(32768))
    with qtbot.waitSignal(w.updated, timeout=30_000):
        w.reload_history()
    settle(qtbot, w)
    assert w.plan.chosen.gpus == 4
    config, h100 = config_for("meta-llama/Llama-3.1-70B"), hardware.get("h100-sxm")
    expected = [100 * rate / ceiling_for(config, h100, "bf16", "bf16", 2048, batch, gpus=4)
                for batch, rate in ((1, 40.0), (16, 500.0))]
    assert w.charts.load_shares == pytest.approx(expected)
    assert [t.textItem.toPlainText() for t in w.charts._load_labels][0].endswith("% of its 4-GPU ceiling")


def test_a_shared_prefix_shows_what_sharing_its_blocks_saves_at_this_batch(qtbot, costs_window):
    from engine.estimates import costs

    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.context.setValue(CONTEXTS.index(4096))
    w.batch.setValue(BATCHES.index(16))
    settle(qtbot, w)
    assert "Shared prefix" not in w.numbers.text()
    assert not len(w.charts._curves["kv-shared"].getData()[0] or [])
    per_token = w.estimate.kv_bytes_per_token  # Llama 3.1 8B: 128 KiB a token in bf16, no window
    w.prefix.setValue(1024)
    settle(qtbot, w)
    unshared, shared = costs.shared_prefix_kv(lambda n: n * per_token, 4096, 16, 1024)
    assert unshared - shared == 15 * 1024 * per_token  # held once instead of sixteen times
    text = w.numbers.text()
    assert "1,024 tokens held once instead of 16×" in text
    assert f"{(unshared - shared) / unshared:.0%}" in text  # 15/64 = 23%
    xs, ys = w.charts._curves["kv-shared"].getData()
    _, batch_ys = w.charts._curves["kv-batch"].getData()
    assert len(xs) == len(CONTEXTS) and all(s <= b for s, b in zip(ys, batch_ys))
    assert "*-fast precisions" in text and "reference precisions copy a cached prefix" in text


def test_the_precision_list_says_the_measured_quality(qtbot, costs_window, loaded_llama, tiny_llama):
    """A quality run of this model in the history names its perplexity and KLD in the list (and is
    not drawn as a speed point: it measured no decoding)."""
    from engine.measure import quality

    tokens = quality.text_tokens(loaded_llama, "The quick brown fox jumps over the lazy dog. " * 10)
    report, kept = quality.measure(loaded_llama, tokens, "fox", 32, 4)
    quality.record(loaded_llama.info, report)
    w = costs_window
    w.reload_history()
    w.set_model(str(tiny_llama), "fp32")
    qtbot.waitUntil(lambda: "measured" in w.precision.itemText(w.precision.findData("fp32")), timeout=30_000)
    assert w.precision.itemText(w.precision.findData("fp32")) == (
        f"fp32 · measured: perplexity {report.perplexity:.2f}")
    assert w.precision.itemText(w.precision.findData("bf16")) == "bf16"
    assert not [r for r in w._points(w._config, w.profiles[w.hardware.currentData()]) if r.kind == "quality"]
    again, _ = quality.measure(loaded_llama, tokens, "fox", 32, 4, reference=kept)  # the latest counts
    quality.record(loaded_llama.info, again)
    w.reload_history()
    qtbot.waitUntil(lambda: "KLD" in w.precision.itemText(w.precision.findData("fp32")), timeout=30_000)
    assert w.precision.itemText(w.precision.findData("fp32")).endswith("KLD 0.0000 vs fp32")


def test_run_labels_at_neighbouring_batches_never_print_over_each_other(qtbot, costs_window):
    """Several runs at each of batches 1…32 (long labels: median, range and count): each label keeps
    out of the others' way, on the other side of the dots or shortened, or is left out."""
    from engine.storage.history import RunRecord, save

    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    settle(qtbot, w)
    count = w._count.total
    for batch in (1, 2, 4, 8, 16, 32):
        for rate in (0.5, 0.6, 0.8):
            save(RunRecord(kind="sweep", when="2026-12-01T10:00:00", model="Llama-3.1-8B", model_ref="x",
                           precision="bf16", device="cpu", device_name="cpu", hardware="this-machine",
                           parameters=count, weights_bytes=16 * 10**9, kv_cache_bytes=10**6, kv_bytes_per_token=None,
                           prompt_tokens=100, tokens=28, batch=batch, decode_tokens_per_s=rate, ttft_s=0.2,
                           peak_memory_bytes=None))
    w.resize(1000, 700)
    w.show()
    qtbot.waitExposed(w)
    with qtbot.waitSignal(w.updated, timeout=120_000):
        w.reload_history()
    labels = w.charts._run_labels
    assert len(labels) >= 3 and labels[0].toPlainText().endswith("of ceiling")
    boxes = [label.sceneBoundingRect() for label in labels]
    for i, box in enumerate(boxes):
        for other in boxes[i + 1:]:
            assert not box.intersects(other), [label.toPlainText() for label in labels]


def test_the_last_run_is_predicted_at_its_own_batch(qtbot, costs_window, loaded_llama, tiny_llama):
    """A batch sweep's point holds every sequence's KV: its prediction is for that many sequences,
    not one (which read 2.45% off for batch 4 of the default model, and more as the batch grows)."""
    import re

    from engine.base.request import GenerationRequest
    from engine.measure.sweep import record_points, run_sweep

    request = GenerationRequest("fox", mode="raw", max_new_tokens=40, ignore_eos=True)
    points, _ = run_sweep(loaded_llama, request, [16], with_ceiling=False)
    record_points(loaded_llama, points, len(loaded_llama.encode(request)))
    w = costs_window
    w.reload_history()
    w.set_model(str(tiny_llama), "fp32", "float32")
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    settle(qtbot, w)
    assert "of 16 sequences measured" in w.numbers.text()
    error = re.search(r"predicted [^(]*\(([-+][0-9.]+)%\)", w.numbers.text())
    assert error and abs(float(error.group(1))) < 1.0


def test_measured_runs_are_drawn_against_their_own_kv_cache_dtype(qtbot, costs_window):
    """A run whose KV cache kept another dtype's bytes a token is not a measurement of the chosen
    one: with the box at bf16 only the bf16 cache's run is drawn, at int8 only the int8 cache's."""
    from engine.storage.history import RunRecord, save

    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    settle(qtbot, w)
    count, config, profile = w._count.total, w._config, w.profiles["this-machine"]
    per_token = {kv: costs.estimate(config, profile, "bf16", kv, 1, 1, None, "", w._count).kv_bytes_per_token
                 for kv in ("bf16", "int8")}
    assert per_token["int8"] * 32 == per_token["bf16"] * 17  # 34 bytes a 32 values, against 64
    for kv, rate in (("bf16", 0.5), ("int8", 0.7)):
        save(RunRecord(kind="single", when="2026-12-01T10:00:00", model="Llama-3.1-8B", model_ref="x",
                       precision="bf16", device="cpu", device_name="cpu", hardware="this-machine", parameters=count,
                       weights_bytes=16 * 10**9, kv_cache_bytes=100 * per_token[kv], kv_bytes_per_token=per_token[kv],
                       prompt_tokens=100, tokens=28, batch=1, decode_tokens_per_s=rate, ttft_s=0.2,
                       peak_memory_bytes=None))
    with qtbot.waitSignal(w.updated, timeout=120_000):
        w.reload_history()
    for kv in ("bf16", "int8"):
        w.kv_dtype.setCurrentIndex(w.kv_dtype.findData(kv))
        settle(qtbot, w)
        assert [r.kv_bytes_per_token for r in w._points(config, profile)] == [per_token[kv]]


def test_measure_here_runs_what_the_explorer_shows_and_draws_it_beside_the_prediction(qtbot, costs_window, tmp_path,
                                                                                        byte_tokenizer):
    """*Measure here* loads the model shown at its precision and KV-cache dtype (an int8 cache on
    a fast precision) in a worker of its own, reads a prompt of the chosen context and decodes:
    the run joins the history, and the explorer draws it and says its measured bytes beside the
    prediction; a GGUF format or another machine can't be measured here, and says why."""
    import re

    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "heads-of-32", "llama", byte_tokenizer, head_dim=32,
                                max_position_embeddings=512)
    w = costs_window
    w.set_model(str(folder), "fp32-fast")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    settle(qtbot, w)
    assert w.measure_request()[0] is None and "this machine" in w.measure_request()[1]
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    w.precision.setCurrentIndex(w.precision.findData("q4_k"))
    assert w.measure_request()[0] is None and "GGUF" in w.measure_request()[1]
    w.precision.setCurrentIndex(w.precision.findData("fp32-fast"))
    w.kv_dtype.setCurrentIndex(w.kv_dtype.findData("int8"))
    w.context.setValue(CONTEXTS.index(256))
    settle(qtbot, w)
    request = w.measure_request()[0]
    assert (request.precision, request.kv_dtype) == ("fp32-fast", "int8")
    w.measure_button.click()
    assert not w.measure_button.isEnabled()  # one measured run at a time
    qtbot.waitUntil(lambda: w.measure_button.isEnabled(), timeout=300_000)
    assert "Measured" in w.measure_status.text(), w.measure_status.text()
    qtbot.waitUntil(lambda: len(w._points(w._config, w.profiles["this-machine"])) == 1, timeout=60_000)
    settle(qtbot, w)
    [run] = w._points(w._config, w.profiles["this-machine"])
    assert run.kv_bytes_per_token == w.estimate.kv_bytes_per_token
    assert abs(run.prompt_tokens + run.tokens - 256) <= 2  # the context chosen (a token either way: the BOS)
    error = re.search(r"measured [^,]*, predicted [^(]*\(([-+][0-9.]+)%\)", w.numbers.text())
    assert error is not None, w.numbers.text()
    w.close()  # its model goes with it
    assert w.session is None


def test_serving_is_simulated_for_the_model_and_hardware_shown(qtbot, costs_window):
    """Latency against load for Llama-3.1-8B on an H100, off the GUI thread: a row per load up to
    four times the batch, and the most users a p90 TTFT target allows (more for a looser target,
    read from the same simulation); the latency curves and the KV cache over time drawn beside the
    explorer's charts, and the commands carry the tokens a step simulated."""
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.batch.setValue(BATCHES.index(64))
    settle(qtbot, w)
    label = w.serving.label
    qtbot.waitUntil(lambda: "simulated" in label.text() and "at most 64" in label.text(), timeout=120_000)
    text = label.text()
    assert text.count("<tr>") == 1 + 9 and "H100" in text and "from its specifications" in text
    tight = int(text.split("<b>")[2].split("</b>")[0]) if "users keep" in text else 0
    latency = [item for item in w.serving.latency_plot.plot.getPlotItem().listDataItems() if item.xData is not None]
    assert [len(item.xData) for item in latency] == [9, 9, 9, 2]  # TTFT p50, p90, TPOT p50 at 9 loads; the target
    p50, p90 = latency[0].yData, latency[1].yData
    assert all(a <= b for a, b in zip(p50, p90)) and p90[-1] > p90[0]  # queueing shows at the largest load
    kv = w.serving.usage_plot.plot.getPlotItem().listDataItems()[0].yData
    assert 0 < max(kv) <= 100  # blocks held, a share of the pool
    assert "--max-num-batched-tokens 8192" in w.plan.vllm_command
    assert "--chunked-prefill-size 8192" in w.plan.sglang_command
    done = w.serving._done
    w.serving.target.setValue(60.0)
    assert w.serving._done is done and "≤ 60 s" in label.text()  # no new simulation for a new target
    assert "all the loads simulated" in label.text() or int(label.text().split("<b>")[2].split("</b>")[0]) > tight


def test_serving_by_request_rate(qtbot, costs_window):
    """Requests arriving a second instead of users: the rates are shares of what the server
    completes when never idle, and past it the time to first token grows (the queue never empties)."""
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    w.batch.setValue(BATCHES.index(16))
    w.serving.load.setCurrentIndex(w.serving.load.findData("rate"))
    settle(qtbot, w)
    label = w.serving.label
    qtbot.waitUntil(lambda: "arriving at random" in label.text(), timeout=120_000)
    text = label.text()
    assert text.count("<tr>") == 1 + 8 and "a second it completes when never idle" in text
    p90 = [item for item in w.serving.latency_plot.plot.getPlotItem().listDataItems()][1].yData
    assert p90[-1] > p90[0] + 0.3  # 120% of the capacity waits at least twice as long as 10%
    w.context.setValue(CONTEXTS.index(1024))  # shorter than a 1,024-token prompt and its answer
    settle(qtbot, w)
    assert "don't fit the 1,024-token Context" in label.text()
    assert not w.serving.latency_plot.plot.getPlotItem().listDataItems()  # no curve for another setup
    assert w.serving.usage_plot.full_title is None  # nor the load it was drawn at


def test_this_machines_serving_runs_on_the_steps_timed_here(qtbot, costs_window, tiny_llama, monkeypatch):
    """On this machine, *Time its steps here* loads the model shown and times its engine's steps;
    the simulation then runs on them, and they are kept for the next time (until then it ran on
    the machine's measured bandwidth and FLOP/s)."""
    import engine.estimates.step_cost as step_cost
    from engine.base.errors import InvalidRequestError

    calibrate = step_cost.calibrate
    w = costs_window
    w.set_model(str(tiny_llama), "fp32", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("this-machine"))
    w.batch.setValue(BATCHES.index(4))
    settle(qtbot, w)
    assert not w.serving.time_button.isEnabled()  # fp32 keeps its cache in fp32: a bf16 one isn't run here
    assert "Choose a fast precision" in w.serving.time_button.toolTip()
    w.kv_dtype.setCurrentIndex(w.kv_dtype.findData("fp32"))
    w.serving.prompt.setValue(48)
    w.serving.answer.setValue(16)
    settle(qtbot, w)
    label, button = w.serving.label, w.serving.time_button
    qtbot.waitUntil(lambda: "from its specifications" in label.text(), timeout=120_000)
    assert button.isEnabled()

    def refused(loaded, settings, seconds=30.0):
        raise InvalidRequestError("no steps today")
    monkeypatch.setattr(step_cost, "calibrate", refused)
    button.click()
    assert not button.isEnabled() and "Timing" in label.text() and "<table" in label.text()
    qtbot.waitUntil(lambda: "couldn't be timed" in label.text(), timeout=120_000)
    assert "no steps today" in label.text() and "from its specifications" in label.text()  # the figures stay
    assert button.isEnabled()
    monkeypatch.setattr(step_cost, "calibrate", lambda loaded, settings, seconds=30.0: calibrate(loaded, settings, 2.0))
    button.click()
    qtbot.waitUntil(lambda: "fitted to steps timed here" in label.text() or "couldn't" in label.text(), timeout=300_000)
    assert "fitted to steps timed here" in label.text(), label.text()
    assert "at most 4 at once" in label.text() and button.isEnabled()  # again: another batch, other steps
    assert any(key.startswith("cost explorer|") for key in json.loads(step_cost.cost_path().read_text()))
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))  # a GPU: predicted, and nothing to time here
    settle(qtbot, w)
    qtbot.waitUntil(lambda: "from its specifications" in label.text(), timeout=120_000)
    assert not button.isEnabled() and "this machine" in button.toolTip()


def test_closing_the_explorer_ends_a_serving_simulation_under_way(qtbot, costs_window, monkeypatch):
    """A simulation still running when the window closes is stopped at its next step and waited
    for: no thread of it outlives the window (one that did crashed a test worker as the window
    was collected)."""
    import threading

    import app.widgets.cost_serving as cost_serving

    started, ended = threading.Event(), threading.Event()

    def until_cancelled(*args, cancelled, **kwargs):
        started.set()
        try:
            while not cancelled():  # a simulation's steps, each asking whether to go on
                ended.wait(0.001)
            return []
        finally:
            ended.set()
    monkeypatch.setattr(cost_serving, "serving_curve", until_cancelled)
    w = costs_window
    w.set_model("meta-llama/Llama-3.1-8B", "bf16")
    w.hardware.setCurrentIndex(w.hardware.findData("h100-sxm"))
    settle(qtbot, w)
    assert started.wait(60) and not ended.is_set()
    w.close()
    assert ended.is_set()
