"""The Server panel and the traffic view: no port until Start, the real server behind the panel,
its traffic drawn live, the load generator in the view, Stop and Quit during traffic."""

from __future__ import annotations

import json
import threading

import httpx
import psutil
import pytest

from tests.app.conftest import generate, load


def listening() -> list:
    return [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def start(qtbot, window, **fields):
    panel = window.server_panel
    panel.port.setValue(fields.pop("port", 0))
    for name, value in fields.items():
        getattr(panel, name).setText(value) if hasattr(getattr(panel, name), "setText") else \
            getattr(panel, name).setValue(value)
    panel.start_button.click()
    qtbot.waitUntil(lambda: panel.started is not None or panel.job is None, timeout=60_000)
    return panel


def chat(panel, content="The quick brown fox", **more):
    return {"model": panel.started.model_name, "messages": [{"role": "user", "content": content}],
            "temperature": 0, **more}


def test_no_port_until_started_then_served_and_drawn(qtbot, window, tiny_llama):
    assert listening() == []  # the app opens no port by itself
    load(qtbot, window, tiny_llama)
    assert listening() == []
    panel = window.server_panel
    assert panel.stop_button.isEnabled() is False and panel.start_button.isEnabled()
    start(qtbot, window)
    assert panel.started is not None
    (socket,) = listening()
    assert socket.laddr.ip == "127.0.0.1" and panel.started.url.endswith(f":{socket.laddr.port}/v1")
    qtbot.waitUntil(lambda: not window.model_panel.isEnabled())  # no other model loads while this one serves

    assert "blocks of 16 tokens" in panel.defaults.text() and "prefix caching on" in panel.defaults.text()
    assert not panel.prefix_caching.isEnabled()  # what runs can't be changed under it
    examples = {panel.examples.tabText(i): panel.examples.widget(i).toPlainText()
                for i in range(panel.examples.count())}
    assert all(panel.started.url in text and panel.started.model_name in text for text in examples.values())
    compile(examples["Python (openai)"], "example", "exec")  # it is Python that runs

    traffic = window.open_traffic()
    answers = [httpx.post(f"{panel.started.url}/chat/completions", json=chat(panel, p, max_tokens=6,
                                                                            ignore_eos=True), timeout=60).json()
               for p in ("The quick brown fox", "Memory bandwidth")]
    qtbot.waitUntil(lambda: panel.log.finished == 2, timeout=30_000)
    assert "2 served" in panel.status.text()
    traffic.refresh(everything=True)
    drawn = traffic.plots.bars["done"].opts["x0"]
    assert len(drawn) == 2  # a finished row per request
    first = next(iter(panel.log.requests))
    traffic.open_request(first)
    assert answers[0]["choices"][0]["message"]["content"] in traffic.request_view.toPlainText()
    assert "127.0.0.1" in traffic.request_title.text()
    assert traffic.plots.ttft.caption.text().startswith("<b>TTFT</b> (2)")

    with qtbot.waitSignal(panel.state_changed, timeout=60_000):
        panel.stop_button.click()
    assert panel.started is None and "Stopped after 2 requests" in panel.status.text()
    assert listening() == []
    qtbot.waitUntil(window.model_panel.isEnabled)  # the session's queue, told after the job's end


def test_load_generator_in_the_traffic_view(qtbot, window, tiny_llama, tmp_path):
    load(qtbot, window, tiny_llama)
    panel = start(qtbot, window)
    traffic = window.open_traffic()
    box = traffic.load_box
    box.values.setText("1,2")
    box.requests.setValue(3)
    box.max_tokens.setValue(4)
    with qtbot.waitSignal(box._ended, timeout=120_000):
        box.run_button.click()
    assert box.table.rowCount() == 2 and box.table.item(1, 0).text() == "concurrency 2"
    assert box.table.item(0, 1).text() == "3/3"
    assert len(box.points.data) == 2
    out = tmp_path / "load.json"
    box.save(str(out))
    assert [s["value"] for s in json.loads(out.read_text())["settings"]] == [1, 2]
    qtbot.waitUntil(lambda: panel.log.finished == 6, timeout=30_000)
    with qtbot.waitSignal(panel.state_changed, timeout=60_000):
        panel.stop_now_button.click()


def test_the_traffic_view_predicts_each_setting_before_measuring_it(qtbot, window, tiny_llama, tmp_path,
                                                                     monkeypatch):
    """With *predict* on, each setting's prediction (hollow) is drawn before the load measures it
    (filled), and the table puts them side by side."""
    import engine.estimates.step_cost as step_cost

    monkeypatch.setenv("INFERENCE_WORKBENCH_HARDWARE_PROFILE", str(tmp_path / "this-machine.json"))
    calibrate = step_cost.calibrate
    monkeypatch.setattr(step_cost, "calibrate", lambda loaded, settings, seconds=30.0: calibrate(loaded, settings, 2.0))
    load(qtbot, window, tiny_llama)
    start(qtbot, window)
    box = window.open_traffic().load_box
    box.values.setText("1,2")
    box.requests.setValue(3)
    box.max_tokens.setValue(4)
    assert box.predict.isEnabled()
    box.predict.setChecked(True)
    order = []
    box._predicted.connect(lambda label, summary: order.append(("predicted", label)))
    box._setting_done.connect(lambda setting: order.append(("measured", setting.label)))
    with qtbot.waitSignal(box._ended, timeout=300_000) as ended:
        box.run_button.click()
    assert ended.args[1] is None, ended.args[1]
    assert order == [("predicted", "concurrency 1"), ("predicted", "concurrency 2"),
                     ("measured", "concurrency 1"), ("measured", "concurrency 2")]
    xs, ys = box.predicted.xData, box.predicted.yData  # (getData: what the view shows, thinned to its pixels)
    assert len(xs) == 2 and all(x > 0 for x in xs) and all(y > 0 for y in ys)
    headers = [box.table.horizontalHeaderItem(i).text() for i in range(box.table.columnCount())]
    predicted = headers.index("predicted out tok/s")
    assert all(float(box.table.item(row, predicted).text()) > 0 for row in range(2))
    # the server's own TTFT (its /metrics, from arrival) beside the prediction's: below the client's
    own, own_predicted = headers.index("server's own TTFT"), headers.index("predicted server's own TTFT")
    for row, setting in enumerate(box.results):
        assert box.table.item(row, own).text() == f"{setting.server.own_ttft_s() * 1e3:.0f} ms"
        assert setting.server.own_ttft_s() < setting.summary.ttft["mean"]
        assert box.table.item(row, own_predicted).text().endswith(" ms")
    box.exact.setChecked(False)  # answers of unknown length: no prediction first
    assert not box.predict.isEnabled()


def test_bad_settings_and_a_busy_port_are_said_and_change_nothing(qtbot, window, tiny_llama):
    import socket

    load(qtbot, window, tiny_llama)
    panel = window.server_panel
    panel.host.setText("0.0.0.0")
    panel.start_button.click()
    assert panel.job is None and "API key" in panel.status.text()
    panel.host.setText("127.0.0.1")
    panel.kv_budget.setText("lots")
    panel.start_button.click()
    assert panel.job is None and "not a size" in panel.status.text()
    panel.kv_budget.setText("auto")
    assert panel._settings().prefix_caching is True
    panel.prefix_caching.setChecked(False)  # serve --no-prefix-caching
    assert panel._settings().prefix_caching is False
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start(qtbot, window, port=taken.getsockname()[1])
        assert panel.job is None and "Can't serve on 127.0.0.1" in panel.status.text()
    assert panel.start_button.isEnabled() and panel.host.isEnabled()
    # the model is still there and still answers
    assert generate(qtbot, window, "fox", max_tokens=3).tokens == 3


def test_quit_with_streams_in_flight_ends_each_cleanly(qtbot, app_factory, slow_tiny):
    window = app_factory()
    load(qtbot, window, slow_tiny)
    panel = start(qtbot, window)
    url = panel.started.url
    body = chat(panel, max_tokens=2000, ignore_eos=True, stream=True)
    received: dict[int, list] = {}
    first_tokens = threading.Barrier(3)

    def stream(n):
        lines = received[n] = []
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 2:
                        first_tokens.wait(30)

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    first_tokens.wait(60)
    window.close()  # File → Quit
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    for lines in received.values():
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert not window.session.thread.isRunning() and listening() == []


def test_the_window_generates_through_the_serving_core_beside_the_clients(qtbot, window, tiny_llama):
    load(qtbot, window, tiny_llama)
    alone = generate(qtbot, window, "fox", max_tokens=6)
    panel = start(qtbot, window)
    window.clear_conversation()  # the same prompt, not a second turn
    served = generate(qtbot, window, "fox", max_tokens=6)
    assert served.token_ids == alone.token_ids  # same greedy answer, through the server's core
    # one core per model: the server serves through the window's, whose prefix cache kept the prompt
    assert alone.cached_tokens == 0 and served.cached_tokens == (alone.prompt_tokens - 1) // 16 * 16 > 0
    (track,) = [t for t in panel.log.requests.values() if t.client == "window"]
    qtbot.waitUntil(lambda: track.finished is not None)  # the traffic view sees it as a request
    assert track.run.count == 6
    assert not window.session.waiting()
    generate(qtbot, window, "fox", max_tokens=2000, wait=False)  # Stop works on a served answer too
    qtbot.waitUntil(lambda: window.run.count >= 2, timeout=30_000)
    with qtbot.waitSignal(window.generation_finished, timeout=30_000) as stopped:
        window.prompt.stop_button.click()
    assert stopped.args[0].reason == "cancelled"
    with qtbot.waitSignal(panel.state_changed, timeout=60_000):
        panel.stop_button.click()
    from engine.storage import history

    kinds = sorted(r.kind for r in history.load_all())
    assert kinds == ["single"] * 3  # the window's answers once each, not again as served requests
    window.clear_conversation()  # served no more: the window's core again, what it kept still there
    again = generate(qtbot, window, "fox", max_tokens=6)
    assert again.token_ids == alone.token_ids and again.cached_tokens == served.cached_tokens


@pytest.fixture(autouse=True)
def _private_data(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))


def test_the_block_map_colours_each_block_by_its_state():
    from app.widgets.traffic_plots import BLOCK_COLOURS, block_image

    flat = block_image((1, 2, 5, -1, 0), 3).reshape(-1, 4)
    assert block_image((1, 2, 5, -1, 0), 3).shape == (2, 3, 4)
    assert tuple(flat[0]) == BLOCK_COLOURS["held"] and tuple(flat[3]) == BLOCK_COLOURS["cached"]
    assert tuple(flat[4]) == BLOCK_COLOURS["empty"] and flat[5][3] == 0  # past the pool: nothing drawn
    assert flat[1][1] > flat[2][1] and flat[1][0] < flat[1][1]  # shared: green, darker the more hold it


def test_the_traffic_summary_says_what_the_kv_budget_holds():
    """In tokens of the cache's dtype; an int8 cache's budget holds 1.88× a 16-bit one's."""
    from app.traffic_window import budget_tokens
    from engine.jobs import ServerStarted

    def started(dtype: str, per_token: int | None):
        return ServerStarted("http://127.0.0.1:1/v1", "m", 8, 1 << 20, False, kv_dtype=dtype,
                             kv_bytes_per_token=per_token)

    assert budget_tokens(started("bfloat16", 1024)) == " (1,024 tokens in bfloat16)"
    assert budget_tokens(started("int8", 544)) == " (1,927 tokens in int8: 1.88× the tokens a 16-bit cache holds)"
    assert budget_tokens(started("", None)) == ""
