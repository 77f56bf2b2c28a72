"""Serving you can trust: one bad request fails alone, the server's clock starts when a request
arrives, a burst fills the batch and the queue before anything is refused, hostile input gets a
clear 4xx, and requests that leave limits out get an answer in seconds."""

from __future__ import annotations

import json
import logging
from functools import partial
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from engine.base.events import Finished, TokenGenerated
from engine.base.sampling import SamplingParams
from engine.base.request import GenerationRequest
from engine.generation.service import Accepted, EngineService, QueueFullError, Rejected, RequestArrived, Ticket, Token
from tests.engine.test_serve import http, server  # noqa: F401 (fixtures: a server of this module's own)
from tests.serving import serve
from engine.generation.generate import generate

PROMPTS = ["The quick brown fox", "Memory bandwidth limits", "A key-value cache stores"]


def completion(server, prompt, **more) -> dict:
    return {"model": server.model_name, "prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": True,
            **more}


def request(prompt: str, tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt, mode="raw", sampling=SamplingParams(temperature=0.0), max_new_tokens=tokens,
                             ignore_eos=True, top_alternatives=0)


def run_until(service: EngineService, done: threading.Event) -> None:
    """Step ``service`` on its own thread until ``done``, then stop it."""
    service.start()
    try:
        assert done.wait(60)
    finally:
        service.stop()
        assert service.join(30)


# -- one bad request fails alone ---------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_get_400_while_other_streams_go_on(server, http, loaded_llama,
                                                                           monkeypatch):
    solo = {p: http.post("/completions", json=completion(server, p)).json()["choices"][0]["text"] for p in PROMPTS}
    vocab = loaded_llama.vocab_size
    bad_ids = ([vocab], [-5, 3], [[1, vocab + 7]])
    texts: dict[str, str] = {}
    all_streams_in, all_decoding, all_bad_queued = threading.Event(), threading.Event(), threading.Event()
    decode, submit = server.service.core.runner.decode, server.service.submit

    def gated_decode(seqs, tokens):
        # The first stream waits for the other two (on a busy machine it could otherwise finish
        # before they arrive); once the three decode together, they wait for the bad requests.
        all_streams_in.wait(30)
        if len(seqs) == len(PROMPTS):
            all_decoding.set()
            all_bad_queued.wait(30)
        return decode(seqs, tokens)

    streams_in, queued = [], []

    def counted_submit(ticket):
        out = submit(ticket)
        if ticket.prompt_ids is None:  # a text prompt: one of the streams
            streams_in.append(ticket)
            if len(streams_in) == len(PROMPTS):
                all_streams_in.set()
        else:
            queued.append(ticket)
            if len(queued) == len(bad_ids):
                all_bad_queued.set()
        return out

    monkeypatch.setattr(server.service.core.runner, "decode", gated_decode)
    monkeypatch.setattr(server.service, "submit", counted_submit)

    def stream(prompt: str) -> None:
        text = ""
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/completions", json=completion(server, prompt, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
        texts[prompt] = text

    refusals = []

    def refused(ids) -> None:
        refusals.append(httpx.post(f"{server.url}/completions", json=completion(server, ids), timeout=60))

    streams = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS]
    bad = [threading.Thread(target=refused, args=(ids,)) for ids in bad_ids]
    try:
        for t in streams:
            t.start()
        assert all_decoding.wait(30)  # all three streams are mid-answer
        for t in bad:
            t.start()
    finally:
        for t in [*bad, *streams]:
            if t.ident is not None:  # started
                t.join(60)
    assert [r.status_code for r in refusals] == [400] * len(bad_ids)
    assert all("not a token of" in r.json()["error"]["message"] for r in refusals)
    assert texts == solo


def test_a_callers_failing_callback_ends_its_request_alone(loaded_llama):
    service = EngineService(loaded_llama)
    events: dict[int, list] = {0: [], 1: [], 2: []}
    done = threading.Event()

    def sink_for(i: int):
        def sink(event) -> None:
            if i == 1 and isinstance(event, Token) and event.event.index == 2:
                raise RuntimeError("the caller's own bug")
            events[i].append(event)
            if isinstance(event, Finished) and all(any(isinstance(e, Finished) for e in v) for v in events.values()):
                done.set()
        return sink

    for i, prompt in enumerate(PROMPTS):
        service.submit(Ticket(request(prompt), sink_for(i)))
    run_until(service, done)
    finals = {i: next(e for e in v if isinstance(e, Finished)) for i, v in events.items()}
    assert finals[1].reason == "cancelled"
    for i in (0, 2):
        tokens = [e.event.token_id for e in events[i] if isinstance(e, Token)]
        assert finals[i].reason == "length"
        assert tokens == [e.token_id for e in generate(loaded_llama, request(PROMPTS[i])) if isinstance(e, TokenGenerated)]


# -- the queue -------------------------------------------------------------------------------------
def test_a_burst_fills_the_batch_and_the_queue_before_429(loaded_llama):
    """64 at once with a batch of 16 and 8 waiting: 24 taken (the core hasn't picked any up yet)."""
    from engine.generation.core import CoreSettings

    service = EngineService(loaded_llama, CoreSettings(max_batch=16), max_waiting=8)
    taken, refused = 0, 0
    for i in range(64):
        try:
            service.submit(Ticket(request("x", 2), lambda e: None))
            taken += 1
        except QueueFullError as exc:
            refused += 1
            assert "16 requests are running and 8 waiting" in str(exc)
            assert exc.retry_after_s == 1  # none has ended yet: too soon to tell
    assert (taken, refused) == (24, 40)


def test_a_full_server_says_when_to_try_again_from_how_often_requests_end():
    from engine.generation.service import retry_after

    assert retry_after([], 100.0) == 1 and retry_after([99.0], 100.0) == 1  # too few to tell
    assert retry_after([90.0, 94.0, 98.0], 100.0) == 4  # one ended every 4 s
    assert retry_after([10.0, 14.0, 195.0, 197.5], 200.0) == 3  # only the last two minutes count: 2.5 → 3
    assert retry_after([150.0, 240.0], 241.0) == 60 and retry_after([99.0, 99.1, 99.2], 100.0) == 1  # 1 … 60


def test_a_submit_wakes_the_core_even_while_a_caller_waits_on_it(loaded_llama):
    """One condition serves the core (waiting for work) and callers of wait_until: a submit that
    woke one waiter could wake the caller and leave the core asleep (a lost wake-up)."""
    service = EngineService(loaded_llama)
    waiters = service._lock._waiters  # CPython's FIFO of threads waiting on the condition
    watcher = threading.Thread(target=service.wait_until, args=(lambda s: s.served >= 1, 60))
    watcher.start()
    deadline = time.monotonic() + 30
    while len(waiters) < 1 and time.monotonic() < deadline:  # the watcher waits first in line …
        watcher.join(0.001)
    service.start()
    while len(waiters) < 2 and time.monotonic() < deadline:  # … then the core, waiting for work
        watcher.join(0.001)
    assert len(waiters) == 2
    accepted = threading.Event()
    service.submit(Ticket(request("x", 2), lambda e: accepted.set() if isinstance(e, Accepted) else None))
    try:
        assert accepted.wait(10), "the core slept through the submit"
        watcher.join(60)
        assert not watcher.is_alive()
    finally:
        service.stop()
        assert service.join(30)


# -- the server's clock ---------------------------------------------------------------------------
def test_a_request_is_timed_from_its_arrival_not_from_when_the_core_takes_it(loaded_llama):
    """The HTTP front end stamps a ticket as it comes in; time spent before the core takes it (the
    inbox, other requests' steps) is part of its TTFT and end-to-end time in /metrics."""
    from engine.serve.metrics import ServerMetrics

    service = EngineService(loaded_llama)
    metrics = ServerMetrics(service, "m")
    arrivals = []
    service.listen(lambda e: arrivals.append(e) if isinstance(e, RequestArrived) else None)
    done = threading.Event()
    waited = 0.75
    ticket = Ticket(request("The quick brown fox", 4), lambda e: done.set() if isinstance(e, Finished) else None,
                    arrived=time.perf_counter() - waited)  # it came in 0.75 s before the core sees it
    service.submit(ticket)
    run_until(service, done)
    sample = partial(metrics.registry.get_sample_value, labels={"model_name": "m"})
    assert sample("vllm:time_to_first_token_seconds_count") == 1
    assert sample("vllm:time_to_first_token_seconds_sum") >= waited
    assert sample("vllm:e2e_request_latency_seconds_sum") >= waited
    assert arrivals[0].at_s == pytest.approx(ticket.arrived - service.started)


def test_the_front_end_stamps_arrival_before_it_reads_the_body(server, http, monkeypatch):
    stamped = []
    submit = server.service.submit
    monkeypatch.setattr(server.service, "submit", lambda ticket: stamped.append(
        (ticket.arrived, time.perf_counter())) or submit(ticket))
    before = time.perf_counter()
    assert http.post("/completions", json=completion(server, "x", max_tokens=2)).status_code == 200
    (arrived, submitted), = stamped
    assert before <= arrived <= submitted


def test_metrics_time_each_token_as_the_gap_since_the_requests_last(loaded_llama):
    """Inter-token latency is the gap between one request's tokens (what its client sees), not
    the length of the step that made the second; TPOT is (last − first) / (n − 1)."""
    from engine.serve.metrics import ServerMetrics

    service = EngineService(loaded_llama)
    metrics = ServerMetrics(service, "m")
    tokens: dict[int, list[float]] = {}
    finished = threading.Event()
    ended = []

    def listener(event) -> None:  # also slows every step a little: gaps are longer than steps
        inner = getattr(event, "event", None)
        if isinstance(inner, TokenGenerated):
            tokens.setdefault(event.request_id, []).append(inner.elapsed_s)
            sum(range(20_000))
        elif isinstance(inner, Finished):
            ended.append(inner)
            if len(ended) == len(PROMPTS):
                finished.set()
    service.listen(listener)
    for prompt in PROMPTS:
        service.submit(Ticket(request(prompt, 8), lambda e: None))
    run_until(service, finished)
    sample = partial(metrics.registry.get_sample_value, labels={"model_name": "m"})
    gaps = [b - a for times in tokens.values() for a, b in zip(times, times[1:])]
    assert sample("vllm:inter_token_latency_seconds_count") == len(gaps) == 3 * 7
    assert sample("vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(gaps), abs=1e-9)
    assert sample("vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(times[0] for times in tokens.values()), abs=1e-9)
    tpots = [(times[-1] - times[0]) / 7 for times in tokens.values()]
    assert sample("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(sum(tpots), abs=1e-9)


# -- hostile input ------------------------------------------------------------------------------------
def test_deeply_nested_json_is_a_400_without_a_traceback(server, http, caplog):
    body = "[" * 100_000 + "]" * 100_000
    with caplog.at_level(logging.ERROR):
        response = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "nests JSON too deeply" in response.json()["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_lone_surrogate_is_a_400_in_the_users_terms(server, http):
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "caf\\ud800e"}], "max_tokens": 2}'
            % server.model_name)
    response = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("messages.0.content: ") and "surrogate" in message
    assert "TypeError" not in response.text and "TextEncodeInput" not in response.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_refused(server, http, content_type):
    """A web page's "simple" cross-origin POST (text/plain, form) needs no preflight: answering
    it would let any page the user visits make a keyless loopback server work."""
    body = json.dumps(completion(server, "x", max_tokens=2))
    headers = {"content-type": content_type} if content_type else {}
    response = http.post("/completions", content=body, headers=headers)
    assert response.status_code == 415
    assert "application/json" in response.json()["error"]["message"]
    fine = http.post("/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert fine.status_code == 200


@pytest.mark.parametrize("host, status", [
    ("evil.example", 403), ("evil.example:8000", 403), ("127.0.0.1.nip.io", 403), ("localhost", 200),
    ("LocalHost:{port}", 200), ("localhost.:{port}", 200), ("127.0.0.1:{port}", 200), ("[::1]:{port}", 200),
])
def test_a_loopback_server_answers_only_loopback_names(server, http, host, status):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as the Host."""
    headers = {"host": host.format(port=server.port)}
    for response in (http.get("/models", headers=headers),
                     http.post("/completions", json=completion(server, "x", max_tokens=2), headers=headers)):
        assert response.status_code == status, response.text
        if status == 403:
            assert response.json()["error"]["code"] == "host_not_allowed"


def test_a_server_open_to_the_network_takes_any_host_name():
    from engine.serve.server import allowed_hosts

    assert allowed_hosts("0.0.0.0") is None
    assert allowed_hosts("127.0.0.2") == {"localhost", "127.0.0.1", "::1", "127.0.0.2"}
    assert allowed_hosts("::1") == {"localhost", "127.0.0.1", "::1"}


# -- defaults ----------------------------------------------------------------------------------------
def test_left_out_sampling_takes_the_models_generation_config():
    from transformers import GenerationConfig

    from engine.serve import protocol

    defaults = protocol.model_defaults(GenerationConfig(temperature=0.3, top_p=0.8, top_k=20, max_new_tokens=40,
                                                        bos_token_id=1))
    assert defaults.sampling == {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    assert (defaults.max_tokens, defaults.max_tokens_from) == (40, "model")
    bare = protocol.parse(protocol.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    engine_request = protocol.chat_to_engine(bare, defaults)
    assert engine_request.sampling == SamplingParams(temperature=0.3, top_p=0.8, top_k=20)
    assert engine_request.max_new_tokens == 40
    given = protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", "temperature": 0.9,
                                                        "top_p": 1, "max_tokens": 7})
    engine_request, _ = protocol.completion_to_engine(given, defaults)
    assert (engine_request.sampling.temperature, engine_request.sampling.top_p) == (0.9, 1.0)
    assert engine_request.max_new_tokens == 7
    assert protocol.model_defaults(GenerationConfig(max_new_tokens=40), max_tokens=9).max_tokens == 9
    none = protocol.model_defaults(GenerationConfig())
    assert none.sampling == {} and none.max_tokens == protocol.DEFAULT_MAX_TOKENS
    assert "OpenAI's" in none.describe()


def test_a_request_without_max_tokens_stops_at_the_servers_default(loaded_llama):
    server = serve(loaded_llama, default_max_tokens=5)
    try:
        body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        answer = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"
        assert "stop after 5 tokens" in server.defaults.describe()
    finally:
        assert server.stop(drain=False, timeout=30)


def test_the_panels_examples_answer_within_their_limit(server):
    """The Server tab's examples, run as pasted: each answer ends within its max_tokens."""
    import contextlib
    import io

    from app.widgets.server_panel import EXAMPLE_MAX_TOKENS, examples
    from engine.generation.service import RequestEvent

    ended = []
    stop_listening = server.service.listen(
        lambda e: ended.append(e.event) if isinstance(e, RequestEvent) and isinstance(e.event, Finished) else None)
    shown = examples(server.url, server.model_name, key=False)
    assert shown["curl"].startswith("curl -N ")  # it streams: unbuffered, or a pipe holds the tokens back
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(shown["Python (openai)"], "example.py", "exec"), {})
        assert out.getvalue()
        if shutil.which("curl"):
            done = subprocess.run(["bash", "-c", shown["curl"]], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.rstrip().endswith("data: [DONE]")
        assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)
    finally:
        stop_listening()
    assert len(ended) == (2 if shutil.which("curl") else 1)
    assert all(f.reason in ("eos", "length") and 0 < f.tokens <= EXAMPLE_MAX_TOKENS for f in ended)


def test_the_windows_door_is_open_when_the_server_says_it_started(loaded_llama):
    """The window submits its prompt as soon as it hears ServerStarted: the door must be open by
    then (it opened just after, and a busy machine let the window in first: a closed door)."""
    from engine.base.cancel import CancelToken
    from engine.jobs import JobContext, ServerStarted, ServeJob, Tagged
    from engine.prompts import PromptDoor
    from engine.serve.server import ServeSettings

    job = ServeJob(ServeSettings(port=0, history=False, kv_budget_bytes=1 << 30))
    door = PromptDoor()
    cancel = CancelToken()
    finished = threading.Event()
    tags = []

    def emit(event) -> None:  # runs on the job's thread, as the window's queued slot would, at once
        if isinstance(event, ServerStarted):
            tags.append(door.ask(request("The quick brown fox", 3), CancelToken()))
        elif isinstance(event, Tagged) and isinstance(event.event, Finished):
            finished.set()
            cancel.cancel()

    runner = threading.Thread(target=job.run, args=(JobContext(loaded_llama, cancel, emit, door=door),))
    runner.start()
    try:
        assert finished.wait(60)
    finally:
        cancel.cancel()
        runner.join(60)
    assert len(tags) == 1 and not runner.is_alive()
    assert tags[0][1] is False  # straight into the server's batch, not waiting at the door


def test_a_request_being_taken_in_is_still_in_flight(loaded_llama, monkeypatch):
    """While the core tokenizes a request it is in flight: a caller waiting for in_flight == 0
    (the server drained) must not see 0 then."""
    service = EngineService(loaded_llama)
    seen = []
    encode = loaded_llama.encode
    monkeypatch.setattr(loaded_llama, "encode", lambda r: seen.append((service.in_flight, service.waiting))
                        or encode(r))
    done = threading.Event()
    service.submit(Ticket(request("The quick brown fox", 2), lambda e: done.set() if isinstance(e, Finished) else None))
    run_until(service, done)
    assert seen == [(1, 1)]
    assert service.in_flight == 0


def test_a_core_that_cannot_be_rebuilt_stops_the_service_and_tells_every_caller(loaded_llama, monkeypatch):
    """A step fails for everyone and no fresh core can be made: nobody is left waiting, and new
    requests are refused instead of queueing forever."""
    from engine.base.errors import EngineError
    from engine.generation import service as service_module
    from engine.generation.service import NotServingError

    service = EngineService(loaded_llama)
    heard: dict[int, list] = {0: [], 1: []}
    done = threading.Event()
    for i in heard:
        service.submit(Ticket(request(PROMPTS[i], 8), lambda e, i=i: heard[i].append(e) or (
            done.set() if all(any(isinstance(x, Finished) for x in v) for v in heard.values()) else None)))

    def broken_step():
        raise RuntimeError("a kernel failed")
        yield  # (a step's events, as the core makes them)

    def no_core(*args, **kwargs):
        raise MemoryError("no room for a fresh core")

    monkeypatch.setattr(service.core, "stepping", broken_step)
    monkeypatch.setattr(service_module, "EngineCore", no_core)
    service.start()
    assert done.wait(60) and service.join(30)
    for events in heard.values():
        (finished,) = [e for e in events if isinstance(e, Finished)]
        assert finished.reason == "error" and "a kernel failed" in finished.error and finished.total_s > 0
    with pytest.raises(NotServingError):
        service.submit(Ticket(request("x", 2), lambda e: None))
    assert service.in_flight == 0
    assert isinstance(NotServingError("x"), EngineError)


def test_a_seed_torch_cannot_take_is_a_400(server, http):
    response = http.post("/completions", json=completion(server, "x", seed=2**70))
    assert response.status_code == 400 and "seed" in response.json()["error"]["message"]


def test_a_model_served_elsewhere_is_not_served_again_from_here():
    from types import SimpleNamespace

    from engine.base.errors import EngineError
    from engine.base.cancel import CancelToken
    from engine.jobs import JobContext, ServeJob
    from engine.serve.server import ServeSettings

    remote = SimpleNamespace(info=SimpleNamespace(name="remote-model"), model=None)
    ctx = JobContext(remote, CancelToken(), lambda event: None)
    with pytest.raises(EngineError, match="remote-model is served elsewhere"):
        ServeJob(ServeSettings(port=0, history=False)).run(ctx)
