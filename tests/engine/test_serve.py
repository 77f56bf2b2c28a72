"""The server, started for real on a free loopback port and driven by real clients (httpx and the
official openai SDK) over a tiny random-weight model."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest

from engine.base.events import Finished, StepCompleted
from engine.serve.server import ServeSettings
from tests.serving import serve
from engine.generation.service import RequestEvent, TrafficStep
from engine.generation.generate import generate

PROMPTS = ["The quick brown fox", "Memory bandwidth limits", "A key-value cache stores", "Quantization stores",
           "Emoji and flags", "leading spaces and", "Café, naïve, résumé", "日本語のテキスト"]


@pytest.fixture(scope="module")
def server(loaded_llama):
    server = serve(loaded_llama)
    yield server
    assert server.stop(drain=False, timeout=30)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture
def sdk(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def chat(server, content: str, **more) -> dict:
    return {"model": server.model_name, "messages": [{"role": "user", "content": content}], "temperature": 0,
            **more}


def test_models_and_health(server, http, sdk):
    listed = http.get("/models").json()
    assert [m["id"] for m in listed["data"]] == [server.model_name]
    assert [m.id for m in sdk.models.list()] == [server.model_name]
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200


def test_chat_whole_and_streamed_agree_with_exact_usage(server, http, sdk, loaded_llama):
    from engine.base.request import GenerationRequest

    body = chat(server, PROMPTS[0], max_tokens=12, ignore_eos=True)
    whole = http.post("/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    expected_prompt = len(loaded_llama.encode(GenerationRequest(PROMPTS[0])))
    cached = whole["usage"].pop("prompt_tokens_details")["cached_tokens"]  # earlier tests may have left blocks
    assert whole["usage"] == {"prompt_tokens": expected_prompt, "completion_tokens": 12,
                              "total_tokens": expected_prompt + 12}
    assert cached % 16 == 0 and 0 <= cached < expected_prompt
    assert whole["choices"][0]["finish_reason"] == "length"

    stream = sdk.chat.completions.create(model=server.model_name, messages=body["messages"], temperature=0,
                                         max_tokens=12, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stream_ends_with_done(server, http):
    with http.stream("POST", "/chat/completions", json=chat(server, "Hello", max_tokens=4, stream=True)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_completions_with_logprobs_match_the_engine(server, http, loaded_llama):
    from engine.base.events import TokenGenerated
    from engine.base.request import GenerationRequest

    body = {"model": server.model_name, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}
    whole = http.post("/completions", json=body).json()
    choice = whole["choices"][0]
    engine = [e for e in generate(loaded_llama, GenerationRequest(PROMPTS[1], mode="raw", max_new_tokens=6,
                                                                 ignore_eos=True, top_alternatives=3))
              if isinstance(e, TokenGenerated)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in engine], abs=1e-4)
    assert choice["logprobs"]["tokens"] == [loaded_llama.token_text(e.token_id) for e in engine]
    for top, e in zip(choice["logprobs"]["top_logprobs"], engine, strict=True):  # OpenAI's shape: text → logprob
        likeliest = {}
        for a in e.top_alternatives:
            likeliest.setdefault(a.text, a.logprob)
        assert top == pytest.approx(likeliest, abs=1e-4)
    assert choice["text"] == "".join(e.text for e in engine if not e.special)
    assert whole["usage"]["completion_tokens"] == 6

    with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
        parts = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [p["choices"][0] for p in parts if p["choices"]]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [lp for c in streamed if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]] == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-6)


def test_chat_logprobs_and_top_logprobs(server, sdk):
    reply = sdk.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Hi"}],
                                        temperature=0, max_tokens=5, logprobs=True, top_logprobs=3,
                                        extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.token == item.top_logprobs[0].token  # greedy: the chosen token is the likeliest
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())


def test_stop_string_is_left_out_as_openai_does(server, http):
    body = chat(server, PROMPTS[2], max_tokens=24, ignore_eos=True)
    full = http.post("/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = re.search(r"[a-z]{2,}", full).group()  # random weights: mostly odd characters, some letters
    cut = full[:full.find(stop)]
    whole = http.post("/chat/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert (whole["message"]["content"], whole["finish_reason"]) == (cut, "stop")
    with http.stream("POST", "/chat/completions", json={**body, "stop": stop, "stream": True}) as r:
        parts = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in parts) == cut


def test_32_concurrent_streams_each_equal_their_solo_answer(server, http):
    solo = {}
    for prompt in PROMPTS:
        body = chat(server, prompt, max_tokens=16, ignore_eos=True)
        solo[prompt] = http.post("/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    batches = []
    stop_listening = server.service.listen(
        lambda e: batches.append(e.step.batch) if isinstance(e, TrafficStep) else None)

    async def one(client, prompt):
        body = chat(server, prompt, max_tokens=16, ignore_eos=True, stream=True)
        text = ""
        async with client.stream("POST", "/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["delta"].get("content") or ""
        return prompt, text

    async def all32():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=40)) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)]) for i in range(32)))

    try:
        answers = asyncio.run(all32())
    finally:
        stop_listening()
    assert len(answers) == 32
    for prompt, text in answers:
        assert text == solo[prompt], prompt
    assert max(batches) == 8  # they ran batched, as many at once as the server allows


def test_disconnect_mid_stream_cancels_and_frees_the_cache(server, http):
    """The client leaves: the request is cancelled and its cache freed, and the service says so
    already when the request's end is told (its cache figure was the step before's until the
    step's events had all been delivered: a caller who saw in_flight 0 could read it)."""
    finished, kv_at_finish = [], []

    def heard(e):
        if isinstance(e, RequestEvent) and isinstance(e.event, Finished):
            finished.append(e.event)
            kv_at_finish.append(server.service.kv_bytes())

    stop_listening = server.service.listen(heard)
    try:
        body = chat(server, PROMPTS[3], max_tokens=200, ignore_eos=True, stream=True)
        with http.stream("POST", "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            assert server.service.wait_until(lambda s: s.kv_bytes() > 0, timeout=30)
        assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)
    finally:
        stop_listening()
    assert server.service.kv_bytes() == 0 and kv_at_finish == [0]
    assert [f.reason for f in finished] == ["cancelled"]
    assert finished[0].tokens < 200


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": None}, 400, "model"),
    ({"temperature": 5}, 400, "temperature"),
    ({"n": 2}, 400, "n must be 1"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools is not supported"),
    ({"frobnicate": 1}, 400, "Unsupported parameter: frobnicate"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, 400, "end with a user message"),
    ({"model": "gpt-4o"}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "fox " * 400}]}, 413, "context"),
])
def test_errors_are_openai_shaped(server, http, body, status, words):
    if isinstance(body, dict):
        full = {k: v for k, v in {**chat(server, "Hello", max_tokens=2), **body}.items() if v is not None}
        response = http.post("/chat/completions", json=full)
    else:
        response = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"]
    assert "Traceback" not in response.text


def test_unknown_path_and_method_are_json(server, http):
    missing = http.get("/nowhere")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = http.get("/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_sdk_raises_the_typed_errors(server, sdk):
    import openai

    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        sdk.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "x"}], n=2)


def test_key_body_limit_queue_limit_and_history(loaded_llama, tmp_path, monkeypatch):
    import openai

    from engine.storage import history

    server = serve(loaded_llama, api_key="sekrit-key-123", max_batch=1, max_waiting=1, max_body_bytes=2000,
                    history=True)
    try:
        anonymous = httpx.post(f"{server.url}/chat/completions", json=chat(server, "x"))
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        headers = {"Authorization": "Bearer sekrit-key-123"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            big = http.post("/chat/completions", json=chat(server, "x" * 3000))
            assert big.status_code == 413 and "request body" in big.json()["error"]["message"]
            assert http.post("/chat/completions", json=chat(server, "Hi", max_tokens=3)).status_code == 200

            gate = threading.Event()  # holds the core in its next decode step: the queue can't drain
            decode = server.service.core.runner.decode
            monkeypatch.setattr(server.service.core.runner, "decode", lambda *a: gate.wait(30) and decode(*a))
            long = chat(server, PROMPTS[0], max_tokens=200, ignore_eos=True, stream=True)

            def second() -> None:  # waits in the queue (its headers come once the core takes it)
                with httpx.Client(base_url=server.url, headers=headers, timeout=60) as other:
                    with other.stream("POST", "/chat/completions", json=long) as response:
                        next(response.iter_lines())  # then it leaves: cancelled

            with http.stream("POST", "/chat/completions", json=long) as first:
                next(first.iter_lines())  # running (the batch holds one)
                waiting = threading.Thread(target=second)
                waiting.start()
                assert server.service.wait_until(lambda s: s.waiting == 1, timeout=30)
                refused = http.post("/chat/completions", json=chat(server, "x", max_tokens=2))
                assert refused.status_code == 429
                assert "waiting" in refused.json()["error"]["message"]
                wait = int(refused.headers["Retry-After"])  # when to try again, as OpenAI's API says it
                assert 1 <= wait <= 60 and f"try again in {wait} s" in refused.json()["error"]["message"]
                gate.set()
                waiting.join(30)
                assert not waiting.is_alive()
        assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)
    finally:
        assert server.stop(drain=False, timeout=30)
    served = [r for r in history.load_all() if r.kind == "served"]
    assert served and all(r.extra["client"].startswith("127.0.0.1:") for r in served)
    assert len({r.extra["serving"] for r in served}) == 1  # one server run: one row in the history
    assert {r.extra["endpoint"] for r in served} == {"/v1/chat/completions"}
    for path in history.history_dir().glob("*.json"):
        assert "sekrit" not in path.read_text()


def test_stop_during_traffic_ends_every_stream_cleanly(loaded_llama):
    server = serve(loaded_llama, max_batch=4)
    stopping = []

    async def stream(client, prompt):
        body = chat(server, prompt, max_tokens=200, ignore_eos=True, stream=True)
        lines = []
        async with client.stream("POST", "/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 3 and not stopping:  # the first stream to get a token stops the server
                        stopping.append(asyncio.get_running_loop().run_in_executor(None, server.stop, False, 30))
        return lines

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(stream(client, p) for p in PROMPTS[:4]))

    results = asyncio.run(main())
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["choices"][0]["finish_reason"] == "abort"
    assert server.service.join(30) and not server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/models")


def test_metrics_use_vllm_names_and_count_what_was_served(loaded_llama):
    from prometheus_client.parser import text_string_to_metric_families

    server = serve(loaded_llama)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            used = [http.post("/chat/completions", json=chat(server, p, max_tokens=5, ignore_eos=True)).json()["usage"]
                    for p in PROMPTS[:3]]
            text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    finally:
        server.stop(drain=False, timeout=30)
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("vllm:generation_tokens_total", None)] == sum(u["completion_tokens"] for u in used)
    assert samples[("vllm:prompt_tokens_total", None)] == sum(u["prompt_tokens"] for u in used)
    assert samples[("vllm:request_success_total", "length")] == 3
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == 3
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == 3 * 4
    assert samples[("vllm:num_requests_running", None)] == 0
    assert samples[("vllm:num_requests_waiting", None)] == 0
    assert samples[("vllm:kv_cache_usage_perc", None)] == 0


def test_a_public_address_needs_a_key():
    from engine.base.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="API key"):
        ServeSettings(host="0.0.0.0").validated()
    assert ServeSettings(host="0.0.0.0", api_key="k").validated()
    assert ServeSettings(host="::1").validated() and ServeSettings(host="localhost").validated()


def test_serve_command_refuses_a_public_address_without_a_key(capsys):
    from engine.cli import main

    assert main(["serve", "--host", "0.0.0.0"]) == 1
    assert "API key" in capsys.readouterr().err


def test_an_engine_failure_ends_the_requests_in_flight_with_an_error(loaded_llama, monkeypatch):
    server = serve(loaded_llama)
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        ended = []
        server.service.listen(lambda e: ended.append(e.event) if isinstance(e, RequestEvent)
                              and isinstance(e.event, Finished) else None)
        monkeypatch.setattr(server.service.core.runner, "prefill", broken)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            whole = http.post("/chat/completions", json=chat(server, "Hi", max_tokens=3))
            assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
            assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)
            # the traffic view, the metrics and the history see it end as well as its caller
            assert [(f.reason, "boom" in f.error) for f in ended] == [("error", True)]
            assert server.service.served == 1
            monkeypatch.undo()
            again = http.post("/chat/completions", json=chat(server, "Hi", max_tokens=3))
            assert again.status_code == 200  # a fresh core took over
    finally:
        server.stop(drain=False, timeout=30)


def test_the_step_events_carry_every_request_state(server, http):
    import threading

    steps, emptied = [], threading.Event()

    def listener(event):
        if isinstance(event, TrafficStep):
            steps.append(event)
            if not event.requests:
                emptied.set()
    stop_listening = server.service.listen(listener)
    try:
        http.post("/chat/completions", json=chat(server, PROMPTS[4], max_tokens=3, ignore_eos=True))
        assert emptied.wait(30)  # the step it finished in (told after the answer went out)
    finally:
        stop_listening()
    assert steps and isinstance(steps[0].step, StepCompleted)
    phases = [s.requests[0].phase for s in steps if s.requests]
    assert phases[-1] == "decode" and steps[-1].requests == ()


def test_serve_command_streams_and_ctrl_c_ends_streams_cleanly(tiny_llama, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_llama), "--port", "0",
                                "--no-history"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = process.stdout.readline()  # "Serving NAME at URL (…)": the port it picked
        url = re.search(r" at (http://\S+/v1) ", line).group(1)
        model = re.search(r"Serving (\S+) at", line).group(1)
        body = {"model": model, "messages": [{"role": "user", "content": "fox"}], "max_tokens": 250,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as r:
            lines = []
            for event in r.iter_lines():
                if event:
                    lines.append(event)
                if len(lines) == 3:
                    process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        process.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert "stopped after 1 requests" in process.stderr.read()


def test_traffic_log_output_rate_is_tokens_over_the_last_second():
    from engine.base.events import MemorySample
    from engine.generation.service import RequestState
    from engine.serve.traffic import TrafficLog

    log = TrafficLog()
    memory = MemorySample(None, "cpu")
    for i, at in enumerate((1.000, 1.005, 1.5, 2.2)):  # a token per step, the first two 5 ms apart
        step = StepCompleted(i, 1, 1, 0, 0, 1, 10, None, 0.005, at, memory)
        log.add(TrafficStep(step, (RequestState(1, "decode", 10, i + 1),), None, at))
    at, rate = log.output_rate(window_s=1.0)
    assert list(rate) == [1.0, 2.0, 3.0, 2.0]  # tokens in the second before each step, never 2 per 5 ms
    assert log.now_figures() == (2.0, 10)  # the summary line's figures, read from the newest steps alone
