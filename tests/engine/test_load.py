"""The load generator: vLLM's metric definitions on hand-made figures, and real loads sent to the
real server on a free loopback port."""

from __future__ import annotations

import json

import pytest

from engine.base.errors import InvalidRequestError
from engine.load.generator import LoadPlan, LoadRunner
from engine.load.metrics import RequestResult, parse_slo, summarize
from engine.load.prompts import Prompt, read_prompts
from engine.serve.server import Server, ServeSettings


def _result(index, start, ttft, gaps, tokens, counted_by="usage"):
    e2e = ttft + sum(gaps)
    return RequestResult(index, ok=True, start_s=start, ttft_s=ttft, e2e_s=e2e, itl_s=list(gaps),
                         output_tokens=tokens, counted_by=counted_by, prompt_tokens=10)


def test_definitions_by_hand():
    a = _result(0, 0.0, 0.5, [0.1, 0.1, 0.1], 4)  # TPOT (0.8 - 0.5) / 3 = 0.1
    b = _result(1, 0.2, 1.0, [0.3], 3)  # several tokens in a chunk: TPOT (1.3 - 1.0) / 2 = 0.15
    failed = RequestResult(2, error="HTTP 500: boom", start_s=0.1, sent=True)
    cut = RequestResult(3, error="cut by the deadline: in flight at 2 s", start_s=0.3, sent=True, cut=True)
    unsent = RequestResult(4)
    summary = summarize([a, b, failed, cut, unsent], duration_s=2.0, slo={"ttft": 0.6, "tpot": 0.12},
                        cut_by="the deadline")
    assert a.tpot_s == pytest.approx(0.1) and b.tpot_s == pytest.approx(0.15)
    assert [r.outcome for r in (a, failed, cut, unsent)] == ["completed", "errored", "cut", "not sent"]
    assert (summary.completed, summary.failed, summary.errored, summary.cut, summary.not_sent) == (2, 2, 1, 1, 1)
    assert summary.errors == ["HTTP 500: boom"]  # what went wrong; the cut one is counted, not an error
    assert summary.not_completed() == "not sent 1 · failed 2: errored 1, cut by the deadline 1"
    assert summary.output_throughput == pytest.approx(7 / 2.0)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.total_token_throughput == pytest.approx((7 + 20) / 2.0)
    assert summary.itl["mean"] == pytest.approx(0.6 / 4)  # pooled over every gap, not per request
    assert summary.ttft["median"] == pytest.approx(0.75)
    assert summary.goodput == pytest.approx(0.5)  # only a meets both
    assert summary.max_concurrency == 2 and summary.counted_by == "usage"
    mixed = summarize([a, _result(3, 0.0, 0.1, [], 1, counted_by="chunks")], 1.0)
    assert mixed.counted_by == "mixed" and mixed.tpot["mean"] == pytest.approx(0.1)


def test_slo_and_plan_checks():
    assert parse_slo("ttft:500, tpot:50") == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttft", "latency:5", "ttft:-1", "tpot:abc"):
        with pytest.raises(InvalidRequestError):
            parse_slo(bad)
    with pytest.raises(InvalidRequestError, match="http"):
        LoadPlan(url="localhost:8000", concurrency=(1,)).validated()
    with pytest.raises(InvalidRequestError, match="concurrency"):
        LoadPlan(url="http://x/v1").validated()


def test_prompts(tmp_path):
    shipped = read_prompts()
    assert {p.kind for p in shipped} == {"short", "long"} and len(shipped) >= 30
    assert max(len(p.text) for p in shipped) > 1500
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\nsecond\n")
    assert read_prompts(plain) == [Prompt("first"), Prompt("second")]
    plain.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(InvalidRequestError, match="line 1"):
        read_prompts(plain)
    with pytest.raises(InvalidRequestError, match="Can't read"):
        read_prompts(tmp_path / "missing.jsonl")


@pytest.fixture(scope="module")
def server(loaded_llama):
    server = Server(loaded_llama, ServeSettings(port=0, max_batch=8, history=False, kv_budget_bytes=1 << 30)).start()
    yield server
    server.stop(drain=False, timeout=30)


PROMPTS = [Prompt("The quick brown fox", "short"), Prompt("Memory bandwidth limits " * 8, "long")]


def test_closed_loop_counts_from_usage(server):
    seen = []
    plan = LoadPlan(url=server.url, concurrency=(1, 3), requests=6, max_tokens=5, ignore_eos=True).validated()
    results = LoadRunner(plan, PROMPTS, on_request=lambda label, r: seen.append(label)).run()
    assert [r.label for r in results] == ["concurrency 1", "concurrency 3"]
    assert seen == ["concurrency 1"] * 6 + ["concurrency 3"] * 6
    for setting in results:
        s = setting.summary
        assert (s.completed, s.failed, s.counted_by, s.output_tokens) == (6, 0, "usage", 30)
        # a token that ends half-way through a character sends no chunk: the next chunk's running usage
        # counts it, and the gap is shared by both (ITL per token, not per chunk)
        assert all(len(r.itl_s) == r.output_tokens - 1 and 1 <= len(r.chunk_times_s) <= 5
                   for r in setting.results)
        assert setting.model == server.model_name
    assert results[0].summary.max_concurrency == 1 and results[1].summary.max_concurrency == 3


def test_open_loop_and_completions(server):
    plan = LoadPlan(url=server.url, rates=(50.0,), requests=5, max_tokens=3, ignore_eos=True, endpoint="completions",
                    seed=3).validated()
    (setting,) = LoadRunner(plan, PROMPTS).run()
    starts = sorted(r.start_s for r in setting.results)
    assert setting.summary.completed == 5 and setting.summary.output_tokens == 15
    assert starts[-1] > starts[0]  # arrivals spread over time, not all at once


def test_a_setting_cut_by_its_deadline_counts_the_requests_never_sent_apart(server, tmp_path, capsys):
    """`load --concurrency 8 --requests 5000 --max-duration 300` said "failed 4790" with no server error:
    the requests never sent are not failures; those in flight at the deadline are, as cut."""
    import csv
    from collections import Counter

    from engine.cli import main

    out, table, prompts = tmp_path / "load.json", tmp_path / "load.csv", tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.text for p in PROMPTS))  # the shipped long ones overflow the tiny model
    code = main(["load", "--url", server.url, "--concurrency", "2", "--requests", "1000", "--max-tokens", "20",
                 "--ignore-eos", "--max-duration", "0.5", "--prompts", str(prompts), "--no-history", "--json", str(out),
                 "--csv", str(table)])
    printed = capsys.readouterr().out
    (setting,) = json.loads(out.read_text())["settings"]
    s = setting["summary"]
    # the request each user had in flight, cut: two, one where a user was between requests at
    # the deadline (seen once in a CI run: its last answer just in, its next not yet sent), or
    # none where both were (seen once with a busy loop on one of the two cores)
    cut = s["cut"]
    assert cut in (0, 1, 2) and s["failed"] == cut, printed
    assert code == (0 if s["completed"] else 1)
    assert (s["errored"], s["cut_by"]) == (0, "the deadline")
    assert s["not_sent"] == 1000 - s["completed"] - cut > 0 and s["errors"] == []
    assert Counter(r["outcome"] for r in setting["requests"]) == Counter(
        {"completed": s["completed"], "cut": cut, "not sent": s["not_sent"]})  # none completed on a busy machine
    for r in setting["requests"]:
        if r["outcome"] == "cut":
            assert r["error"] == "cut by the deadline: in flight at 0.5 s" and r["sent"]
        elif r["outcome"] == "not sent":
            assert r["error"] is None and not r["sent"]
    if cut:
        assert f"not sent {s['not_sent']} · failed {cut}: errored 0, cut by the deadline {cut}" in printed
    else:  # nothing failed: the not-sent count alone
        assert f"not sent {s['not_sent']}\n" in printed and "failed" not in printed
    assert "failed 1000" not in printed and f"failed {s['not_sent'] + cut}" not in printed
    (row,) = csv.DictReader(table.open())
    assert (row["failed"], row["errored"], row["cut"], row["cut_by"], row["not_sent"]) == (
        str(cut), "0", str(cut), "the deadline", str(s["not_sent"]))
    assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)  # cancelled requests left the core


def test_a_request_the_server_broke_off_is_errored_and_counted_as_such():
    from tests.serving import ThirdPartyServer

    with ThirdPartyServer(error_on=(1,)) as fake:  # transformers' mid-stream error: {"error": "a string"}
        plan = LoadPlan(url=fake.url, concurrency=(1,), requests=3, max_tokens=8).validated()
        (setting,) = LoadRunner(plan, PROMPTS).run()
        assert fake.requests == 3  # the one user went on after the broken request
    s = setting.summary
    assert [r.outcome for r in sorted(setting.results, key=lambda r: r.start_s)] == ["completed", "errored",
                                                                                     "completed"]
    assert (s.completed, s.failed, s.errored, s.cut, s.not_sent, s.cut_by) == (2, 1, 1, 0, 0, None)
    assert s.errors == ["server error mid-stream: the model ran out of memory"]
    assert s.not_completed() == "failed 1: errored 1, cut by the deadline 0"


def test_an_open_loop_sends_nothing_after_its_deadline():
    from tests.serving import ThirdPartyServer

    with ThirdPartyServer() as fake:  # answers at once: what it was sent completes, or is cut if sent just in time
        plan = LoadPlan(url=fake.url, rates=(4.0,), requests=20, max_tokens=4, max_duration_s=0.5).validated()
        (setting,) = LoadRunner(plan, PROMPTS).run()
        sent = fake.requests
    s = setting.summary
    latest = max(r.start_s for r in setting.results if r.sent)
    assert latest < 0.5, f"a request sent {latest:.2f} s in, after the 0.5 s deadline"
    assert (s.completed + s.cut, s.errored, s.not_sent) == (sent, 0, 20 - sent) and s.not_sent > 0


def test_an_arrival_whose_sleep_runs_late_past_the_deadline_is_not_sent(monkeypatch):
    """On a busy machine the open loop's sleep to the next arrival can end after the deadline it
    checked before sleeping: that request is then not sent (it had been, after the deadline)."""
    import asyncio

    from engine.load import generator
    from tests.serving import ThirdPartyServer

    class LateSleep:  # the generator's asyncio, its sleeps 0.6 s longer
        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(delay):
            await asyncio.sleep(delay + 0.6)

    monkeypatch.setattr(generator, "asyncio", LateSleep())
    reported = []
    with ThirdPartyServer() as fake:
        plan = LoadPlan(url=fake.url, rates=(4.0,), requests=20, max_tokens=4, max_duration_s=0.5).validated()
        (setting,) = LoadRunner(plan, PROMPTS, on_request=lambda label, r: reported.append(r)).run()
        sent = fake.requests
    assert [r.start_s < 0.5 for r in setting.results if r.sent] == [True] * sent
    assert setting.summary.not_sent == 20 - sent and sent >= 1
    assert len(reported) == sent and all(r.sent for r in reported)  # the window counts what was sent


def test_load_command_writes_json_without_the_key(server, tmp_path, capsys):
    from engine.cli import main

    out, table = tmp_path / "load.json", tmp_path / "load.csv"
    assert main(["load", "--url", server.url, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "3",
                 "--ignore-eos", "--api-key", "not-needed-key", "--slo", "ttft:10000", "--json", str(out),
                 "--csv", str(table)]) == 0
    printed = capsys.readouterr().out
    assert "concurrency 2" in printed and "goodput" in printed
    report = json.loads(out.read_text())
    assert [s["value"] for s in report["settings"]] == [1, 2]
    assert report["settings"][0]["summary"]["completed"] == 2
    assert "not-needed-key" not in out.read_text()
    import csv

    rows = list(csv.DictReader(table.open()))
    assert [r["setting"] for r in rows] == ["concurrency 1", "concurrency 2"]
    assert [int(r["completed"]) for r in rows] == [2, 2] and {r["counted_by"] for r in rows} == {"usage"}
    assert float(rows[1]["output_throughput"]) == pytest.approx(report["settings"][1]["summary"]["output_throughput"])
    assert rows[0]["server_kind"] == "vllm"
    from engine.storage.history import history_dir, load_all

    records = [r for r in load_all() if r.kind == "load"]  # each setting joins the history, never the key
    assert [(r.batch, r.extra["url"], r.model, r.hardware) for r in records] == [
        (1, server.url, server.model_name, "remote"), (2, server.url, server.model_name, "remote")]
    assert records[1].extra["aggregate_tokens_per_s"] == pytest.approx(rows[1] and float(rows[1]["output_throughput"]))
    # this workbench's server says what runs the model: the load's records say it, not "served"/"remote"
    info = server.service.loaded.info
    assert {(r.precision, r.device, r.weights_bytes) for r in records} == {(info.precision, info.device,
                                                                             info.weights_bytes)}
    assert records[0].decode_tokens_per_s == pytest.approx(1 / float(rows[0]["tpot_p50_s"]))
    assert all("not-needed-key" not in p.read_text() for p in history_dir().glob("*.json"))


def test_unreachable_server_is_a_clear_error(capsys):
    import socket

    from engine.cli import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["load", "--url", f"http://127.0.0.1:{port}/v1", "--requests", "1"]) == 1
    assert "Can't reach" in capsys.readouterr().err


def test_the_servers_own_metrics_are_read_while_a_setting_runs(server):
    plan = LoadPlan(url=server.url, concurrency=(4,), requests=8, max_tokens=60, ignore_eos=True,
                    scrape_interval_s=0.005).validated()  # the tiny model answers 8 × 60 tokens in a blink
    (setting,) = LoadRunner(plan, PROMPTS).run()
    state = setting.server
    assert state.kind == "vllm" and state.samples  # ours speaks vLLM's names; detected, not configured
    assert 1 <= state.peak("running") <= 4  # (a request sits "waiting" until the next step admits it)
    assert 0 <= state.peak("waiting") <= 4
    assert 0 <= state.peak("kv_usage") < 1
    # the server's own TTFT histogram, read before the first request and after the last answer: every
    # request counted once, each from its arrival at the server, so on average below the client's
    counted = [s.ttft_count for s in state.samples]
    assert counted[-1] - counted[0] == 8 and counted == sorted(counted)
    assert 0 < state.own_ttft_s() < setting.summary.ttft["mean"]
    line = __import__("engine.load.report", fromlist=["x"]).summary_line(setting)
    assert "server (vllm" in line and "its own TTFT" in line


def test_a_first_text_held_back_is_seen_and_the_simulator_times_it_as_late(loaded_llama):
    """A server that streams 3 tokens a chunk (``--stream-interval 3``): each request's first text
    comes with 3 tokens, as its running usage says, and the server's own TTFT (at the first token)
    is below the client's. The simulator, told what each prompt's first text came with, puts the
    TTFT at its third token and counts the two steps between in the client's part."""
    from engine.estimates.simulator import EngineLimits, ServingSimulator, Workload, closed_loop
    from engine.estimates.step_cost import StepCost

    server = Server(loaded_llama, ServeSettings(port=0, max_batch=8, history=False, kv_budget_bytes=1 << 30,
                                                stream_interval=3)).start()
    try:
        plan = LoadPlan(url=server.url, concurrency=(1,), requests=4, max_tokens=7, ignore_eos=True).validated()
        (setting,) = LoadRunner(plan, PROMPTS).run()
    finally:
        server.stop(drain=False, timeout=30)
    assert [r.first_tokens for r in setting.results] == [3] * 4 and all(r.output_tokens == 7 for r in setting.results)
    assert all(r.itl_s[:2] == [0.0, 0.0] for r in setting.results)  # they came with the first
    assert setting.server.own_ttft_s() < setting.summary.ttft["mean"]
    simulator = ServingSimulator(EngineLimits(token_budget=64, prefill_chunk=64), StepCost(1.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                                                                          0.0))
    workload = closed_loop(1, [[5, 6, 7], [8, 9]], [7], requests=4, seed=0)
    simulator.learn_first_text(workload, setting.results)
    assert simulator.first_text == {(5, 6, 7): 3, (8, 9): 3}
    run = simulator.run(workload)
    # a second a step: the prompt's step gives the first token, two decode steps the third
    assert [r.ttft_s for r in run.results] == [3.0] * 4 and run.client_s == [2.0] * 4
    # TPOT as the generator reads it: (E2E - TTFT) / (n - 1), over the 4 steps after the first text
    assert all(r.first_tokens == 3 and r.tpot_s == pytest.approx(4 / 6) for r in run.results)
    assert simulator.run(Workload(tuple(r for r in workload.requests))).results[0].ttft_s == 3.0
    fresh = ServingSimulator(EngineLimits(token_budget=64, prefill_chunk=64), simulator.cost)
    assert fresh.run(workload).results[0].ttft_s == 1.0  # not told: the first token's text is its first


def test_a_server_without_metrics_is_said_to_have_none():
    from engine.endpoint.scrape import KINDS, ServerState, _values, detect, sample

    text = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\nllamacpp:requests_deferred 1\n"
    values = _values(text)
    assert detect(values) == "llama.cpp"
    got = sample(values, "llama.cpp", 1.0)
    assert (got.running, got.waiting, got.kv_usage) == (3, 1, None)  # no KV figure: absent, not 0
    sglang = _values("sglang:num_running_reqs{tp_rank=\"0\"} 2\nsglang:num_queue_reqs 5\nsglang:token_usage 0.25\n")
    assert detect(sglang) == "sglang" and sample(sglang, "sglang", 0).kv_usage == 0.25
    assert (got.ttft_sum_s, got.ttft_count) == (None, None)  # llama.cpp keeps no TTFT histogram
    sglang.update(_values("sglang:time_to_first_token_seconds_sum 1.5\nsglang:time_to_first_token_seconds_count 6\n"))
    later = _values("sglang:time_to_first_token_seconds_sum 2.1\nsglang:time_to_first_token_seconds_count 8\n")
    state = ServerState("sglang", samples=[sample(sglang, "sglang", 0), sample({**sglang, **later}, "sglang", 1)])
    assert state.own_ttft_s() == pytest.approx(0.3)  # 0.6 s over the 2 requests answered between the readings
    assert detect(_values("process_cpu_seconds_total 1\n")) is None and set(KINDS) == {"vllm", "sglang", "llama.cpp"}
    assert ServerState().peak("running") is None


def test_load_predicts_each_setting_beside_what_it_measured(server, tiny_llama, capsys, monkeypatch, tmp_path):
    """``load --predict`` against this workbench's server: the engine's limits read from its
    /v1/models, the model loaded here and its steps timed once (kept: not timed again), each
    setting simulated with the generator's own order and the prompts as the server tokenized them."""
    import engine.estimates.step_cost as step_cost
    from engine.cli import main

    monkeypatch.setenv("INFERENCE_WORKBENCH_HARDWARE_PROFILE", str(tmp_path / "this-machine.json"))  # its timings
    timed = []
    calibrate = step_cost.calibrate

    def briefly(loaded, settings, seconds=30.0):
        timed.append(settings)
        return calibrate(loaded, settings, 2.0)
    monkeypatch.setattr(step_cost, "calibrate", briefly)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.text for p in PROMPTS))
    args = ["load", "--url", server.url, "--concurrency", "1,3", "--requests", "3", "--max-tokens", "4",
            "--ignore-eos", "--no-history", "--prompts", str(prompts), "--predict", "--predict-model", str(tiny_llama)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert sum(line.startswith("  predicted  ") for line in lines) == 2
    assert sum(line.startswith("    predicted against measured: out tok/s") for line in lines) == 2
    assert "whose own steps took ×" in printed  # the served steps, summed on its /metrics, checked against the timed
    # each TTFT split where the server's clock starts, measured against predicted; the client's part
    # fitted at three loads, by how many were in flight
    assert sum(line.startswith("    TTFT on average, measured / predicted: the server's own") for line in lines) == 2
    assert printed.count(" in flight") >= 3 and "the client's part" in printed
    assert len(timed) == 1 and timed[0].max_batch == 8 and timed[0].token_budget == server.settings.token_budget
    assert main(args + ["--json", str(tmp_path / "load.json")]) == 0  # the timing was kept for these limits
    assert len(timed) == 1 and "timing the engine's steps" not in capsys.readouterr().out
    # the recorded load replayed: with the server's own limits (its steps' timing kept), then others
    assert main(["simulate", str(tmp_path / "load.json"), "--model", str(tiny_llama)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith(("concurrency", "  simulated"))] == [
        ["concurrency", "1"], ["simulated", "3/3"], ["concurrency", "3"], ["simulated", "3/3"]]
    assert sum(line.startswith("    predicted against measured: out tok/s") for line in lines) == 2
    assert len(timed) == 1
    assert main(["simulate", str(tmp_path / "load.json"), "--model", str(tiny_llama), "--max-batch", "1"]) == 0
    assert len(timed) == 2 and timed[1].max_batch == 1  # other limits: the steps timed under them
    assert "predicted against measured" not in capsys.readouterr().out  # another server's figures: no errors shown
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["simulate", str(tmp_path / "bad.json")]) != 0
    assert "not a load generator's report" in capsys.readouterr().err


def test_the_prediction_sends_the_prompts_in_the_generators_order_as_the_server_read_them(server, tiny_llama,
                                                                                          monkeypatch, tmp_path):
    """Request by request, the simulator's prompt is the one the generator sent, as long as the
    server counted it: the same order (the same seed and shuffle) and the same tokenizing."""
    import httpx

    import engine.estimates.step_cost as step_cost
    from engine.estimates.predict_load import predictor_for

    monkeypatch.setenv("INFERENCE_WORKBENCH_HARDWARE_PROFILE", str(tmp_path / "this-machine.json"))
    calibrate = step_cost.calibrate
    monkeypatch.setattr(step_cost, "calibrate", lambda loaded, settings, seconds=30.0: calibrate(loaded, settings, 2.0))
    meta = httpx.get(server.url + "/models").json()["data"][0]["meta"]
    assert meta["engine"]["max_batch"] == 8 and meta["engine"]["prefix_caching"] is True
    prompts = [Prompt("The quick brown fox"), Prompt("Memory bandwidth limits " * 3), Prompt("Why? " * 9)]
    predictor = predictor_for(meta, str(tiny_llama), prompts, "chat", progress=lambda line: None)
    plan = LoadPlan(url=server.url, concurrency=(2,), requests=9, max_tokens=3, ignore_eos=True, seed=5).validated()
    (setting,) = LoadRunner(plan, prompts).run()
    predicted = predictor.predict(plan, setting)
    assert len({r.prompt_tokens for r in setting.results}) == 3
    assert [r.prompt_tokens for r in predicted.results] == [r.prompt_tokens for r in setting.results]
    assert predicted.summary.completed == 9 and predicted.summary.output_tokens == 27


def test_predicting_a_server_it_cant_model_says_so():
    from engine.estimates.predict_load import predictor_for

    with pytest.raises(InvalidRequestError, match="this workbench's server"):
        predictor_for({"precision": "bf16"}, "default", PROMPTS, "chat")
    engine = {"max_batch": 8, "token_budget": 128, "prefill_chunk": 512, "chunked_prefill": True, "kv_blocks": 64,
              "block_tokens": 16, "prefix_caching": True}
    with pytest.raises(InvalidRequestError, match="runs on NVIDIA H100"):
        predictor_for({"precision": "bf16", "device": "cuda:0", "device_name": "NVIDIA H100", "engine": engine},
                      "default", PROMPTS, "chat")
    with pytest.raises(InvalidRequestError, match="batch-invariant"):
        predictor_for({"precision": "bf16", "device": "cpu", "engine": {**engine, "batch_invariant": True}},
                      "default", PROMPTS, "chat")
