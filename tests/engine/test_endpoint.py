"""A served model as a model source (engine/endpoint), against the project's own server started on a
free loopback port (real HTTP), and a `serve` process killed mid-answer."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from engine.endpoint import connect, parse_endpoint
from engine.endpoint.stream import StreamReader, spread
from engine.base.errors import EndpointAuthError, EndpointError, InvalidRequestError
from engine.base.events import EndpointAnswered, Finished, TokenGenerated
from engine.base.cancel import CancelToken
from engine.base.request import GenerationRequest
from tests.serving import serve
from engine.generation.generate import generate

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(loaded_llama):
    server = serve(loaded_llama)
    yield server
    assert server.stop(drain=False, timeout=30)


def _events(model, request, cancel=None):
    events = list(model.generate(request, cancel))
    return [e for e in events if isinstance(e, TokenGenerated)], events[-2], events[-1]


def test_spec_parsing():
    assert parse_endpoint("endpoint:http://127.0.0.1:8000/v1#m").url == "http://127.0.0.1:8000/v1"
    assert parse_endpoint("endpoint:http://h:1#a/b#c").model == "a/b#c"
    assert parse_endpoint("http://h:9").url == "http://h:9/v1"  # a bare host gets the API's path
    assert parse_endpoint("endpoint:https://api.example.com/v1/").model is None
    for bad in ("endpoint:ftp://h/v1", "endpoint:", "endpoint:h:8000"):
        with pytest.raises(InvalidRequestError, match="http"):
            parse_endpoint(bad)


def test_greedy_stream_equals_the_local_model_with_its_logprobs(server, loaded_llama):
    model = connect(parse_endpoint(f"endpoint:{server.url}"))
    try:
        info = model.info
        assert (info.source, info.name, model.kind, model.metrics_kind) == ("endpoint", server.model_name,
                                                                            "workbench", "vllm")
        # the workbench's server says what it runs (as llama.cpp's `meta` does): its weights' bytes and parameters
        assert (info.weights_bytes, info.parameters) == (loaded_llama.info.weights_bytes, loaded_llama.info.parameters)
        assert info.device == "remote"
        assert info.context_length == loaded_llama.info.context_length
        request = GenerationRequest(PROMPT, max_new_tokens=12, ignore_eos=True)
        tokens, answered, finished = _events(model, request)
        local = [e for e in generate(loaded_llama, request) if isinstance(e, (TokenGenerated, Finished))]
        local_tokens, local_done = local[:-1], local[-1]
        assert [t.token_id for t in tokens] == [t.token_id for t in local_tokens]  # token for token
        assert finished.token_ids == local_done.token_ids and finished.text == local_done.text
        for ours, theirs in zip(tokens, local_tokens):
            assert math.isclose(ours.logprob, theirs.logprob, abs_tol=1e-4)
            assert [a.token_id for a in ours.top_alternatives] == [a.token_id for a in theirs.top_alternatives]
            assert ours.kv_cache_bytes is None and ours.memory.device == "remote"  # not seen, not zero
        assert isinstance(answered, EndpointAnswered) and answered.counted_by == "logprobs"
        assert answered.server == "Inference Workbench"
        assert (answered.usage_prompt_tokens, answered.usage_completion_tokens) == (local_done.prompt_tokens, 12)
        assert (finished.reason, finished.tokens, finished.prompt_tokens) == ("length", 12, local_done.prompt_tokens)
        assert finished.ttft_s == pytest.approx(tokens[0].latency_s) and finished.ttft_s > 0
        assert finished.decode_tokens_per_s == pytest.approx(11 / finished.decode_s)
        assert finished.kv_cache_bytes is None and finished.peak_memory_bytes is None
    finally:
        model.close()


def test_raw_mode_uses_completions_and_a_model_picked_by_name(server, loaded_llama):
    model = connect(parse_endpoint(f"endpoint:{server.url}#{server.model_name}"))
    try:
        request = GenerationRequest("Memory bandwidth", mode="raw", max_new_tokens=6, ignore_eos=True)
        tokens, _, finished = _events(model, request)
        local = [e for e in generate(loaded_llama, request) if isinstance(e, TokenGenerated)]
        assert [t.token_id for t in tokens] == [t.token_id for t in local]
        assert finished.tokens == 6
    finally:
        model.close()
    with pytest.raises(EndpointError, match="not 'nope'"):
        connect(parse_endpoint(f"endpoint:{server.url}#nope"))


def test_several_tokens_per_chunk_share_the_gap(loaded_llama):
    server = serve(loaded_llama, stream_interval=4)
    try:
        model = connect(parse_endpoint(f"endpoint:{server.url}"))
        tokens, answered, finished = _events(model, GenerationRequest(PROMPT, max_new_tokens=10, ignore_eos=True))
        model.close()
    finally:
        server.stop(drain=False, timeout=30)
    assert len(tokens) == finished.tokens == 10 and answered.chunks == 3  # 4 + 4 + 2
    assert answered.chunk_times_s == tuple(sorted({t.elapsed_s for t in tokens}))  # per-chunk arrivals
    arrivals = sorted({t.elapsed_s for t in tokens})
    assert len(arrivals) == 3
    by_chunk = [[t for t in tokens if t.elapsed_s == at] for at in arrivals]
    assert [len(c) for c in by_chunk] == [4, 4, 2]
    assert by_chunk[0][0].latency_s == pytest.approx(finished.ttft_s)  # the first token: TTFT
    assert all(t.latency_s == 0 for t in by_chunk[0][1:])  # came with it
    for earlier, chunk in zip(by_chunk, by_chunk[1:]):  # each token: its share of the chunk's gap
        gap = chunk[0].elapsed_s - earlier[0].elapsed_s
        assert all(t.latency_s == pytest.approx(gap / len(chunk)) for t in chunk)
    assert sum(t.latency_s for t in tokens) == pytest.approx(tokens[-1].elapsed_s)


def test_the_reader_counts_by_usage_or_by_chunks_and_says_which():
    reader = StreamReader()
    chunk = lambda text, done: {"choices": [{"delta": {"content": text}}], "usage": {"completion_tokens": done}}
    assert reader.read(chunk("", 0)) == []  # the role chunk
    assert [p.text for p in reader.read(chunk("Hello wor", 3))] == ["Hello wor", "", ""]
    assert [p.text for p in reader.read(chunk("ld", 4))] == ["ld"]
    assert reader.read({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}) == []
    assert reader.counted_by == "usage per chunk" and reader.usage["prompt_tokens"] == 5
    plain = StreamReader()
    assert len(plain.read({"choices": [{"delta": {"content": "two tokens"}}]})) == 1
    assert plain.counted_by == "chunks"
    with pytest.raises(EndpointError, match="boom"):
        plain.read({"error": {"message": "boom"}})
    assert spread(3, 0.3, False, 1.0) == pytest.approx([0.1, 0.1, 0.1])
    assert spread(2, 0.0, True, 0.5) == [0.5, 0.0]


def test_wrong_key_is_a_401_said_as_such(loaded_llama):
    server = serve(loaded_llama, api_key="right-key")
    try:
        with pytest.raises(EndpointAuthError, match="401.*API key is wrong or missing") as caught:
            connect(parse_endpoint(f"endpoint:{server.url}"), api_key="wrong-key")
        assert caught.value.status == 401 and "wrong-key" not in str(caught.value)
        model = connect(parse_endpoint(f"endpoint:{server.url}"), api_key="right-key")
        tokens, _, finished = _events(model, GenerationRequest(PROMPT, max_new_tokens=3, ignore_eos=True))
        assert finished.tokens == 3
        model.close()
    finally:
        server.stop(drain=False, timeout=30)


def test_an_unreachable_host_says_so_within_the_timeout(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(EndpointError, match="Can't reach.*nothing listens"):
        connect(parse_endpoint(f"http://127.0.0.1:{port}/v1"))
    assert time.monotonic() - started < 5
    import engine.endpoint.source as source

    monkeypatch.setattr(source, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        with pytest.raises(EndpointError, match="no answer within 0.5 s"):
            connect(parse_endpoint(f"http://127.0.0.1:{silent.getsockname()[1]}/v1"))
        assert time.monotonic() - started < 3


def test_cancel_mid_stream_ends_the_answer_and_frees_the_server(server):
    model = connect(parse_endpoint(f"endpoint:{server.url}"))
    cancel = CancelToken()
    tokens = []
    try:
        for event in model.generate(GenerationRequest(PROMPT, max_new_tokens=4000, ignore_eos=True), cancel):
            if isinstance(event, TokenGenerated):
                tokens.append(event)
                if len(tokens) == 3:
                    cancel.cancel()
            finished = event
    finally:
        model.close()
    assert isinstance(finished, Finished) and finished.reason == "cancelled" and 3 <= len(tokens) < 4000
    # the server notices the closed connection at its next token
    assert server.service.wait_until(lambda s: s.in_flight == 0, timeout=30)
    assert server.service.kv_bytes() == 0


def test_a_server_that_dies_mid_stream_keeps_the_answer_as_incomplete(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
         "--no-history", "--offline"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        model = None
        deadline = time.monotonic() + 120
        while model is None:  # another process: its readiness can only be asked for, bounded
            try:
                model = connect(parse_endpoint(f"http://127.0.0.1:{port}/v1"))
            except EndpointError:
                assert process.poll() is None, process.stderr.read()[-500:]
                assert time.monotonic() < deadline, "serve did not answer within 120 s"
                time.sleep(0.2)
        tokens = []
        with pytest.raises(EndpointError, match="mid-answer.*kept, marked incomplete") as caught:
            for event in model.generate(GenerationRequest(PROMPT, max_new_tokens=4000, ignore_eos=True)):
                if isinstance(event, TokenGenerated):
                    tokens.append(event)
                    if len(tokens) == 5:
                        process.send_signal(signal.SIGKILL)
        partial = caught.value.finished
        assert partial.reason == "error" and partial.error and 5 <= partial.tokens == len(tokens) < 4000
        assert partial.token_ids == tuple(t.token_id for t in tokens)
        model.close()
    finally:
        process.kill()
        process.wait(20)


def test_the_load_generator_times_each_token_of_a_several_token_chunk(loaded_llama):
    from engine.load.generator import LoadPlan, LoadRunner
    from engine.load.prompts import Prompt

    server = serve(loaded_llama, stream_interval=3)
    try:
        plan = LoadPlan(url=server.url, concurrency=(2,), requests=2, max_tokens=7, ignore_eos=True).validated()
        (setting,) = LoadRunner(plan, [Prompt(PROMPT)]).run()
    finally:
        server.stop(drain=False, timeout=30)
    assert setting.server.kind == "vllm"  # our /metrics use vLLM's names: running usage asked for
    for result in setting.results:
        assert result.ok and result.output_tokens == 7 and result.counted_by == "usage"
        assert len(result.chunk_times_s) == 3  # 3 + 3 + 1 tokens
        assert len(result.itl_s) == 6  # per token after the first, not per chunk
        gaps = [b - a for a, b in zip(result.chunk_times_s, result.chunk_times_s[1:])]
        assert result.itl_s == pytest.approx([0, 0] + [gaps[0] / 3] * 3 + [gaps[1]])
    pooled = [gap for r in setting.results for gap in r.itl_s]
    assert setting.summary.itl["mean"] == pytest.approx(sum(pooled) / 12)


def test_cli_bench_and_compare_a_local_lane_with_an_endpoint_lane(server, tiny_llama, tmp_path, capsys):
    import json

    from engine.cli import main

    bench_json, compare_json = tmp_path / "bench.json", tmp_path / "compare.json"
    assert main(["bench", "--model", f"endpoint:{server.url}", "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--ignore-eos", "--json", str(bench_json), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tokens counted by logprobs" in out and "KV cache n/a (the server's own)" in out
    assert "decode   6 tokens · " in out and "per token p50" in out
    report = json.loads(bench_json.read_text())
    assert report["source"] == "endpoint" and len(report["token_ids"]) == 6
    assert report["weights_bytes"] == server.service.loaded.info.weights_bytes  # as the server says it
    assert (report["tokens"], report["tokens_counted_by"]) == (6, "logprobs")
    assert report["endpoint"]["counted_by"] == "logprobs" and report["endpoint"]["usage_completion_tokens"] == 6
    assert report["endpoint"]["server_samples"] == [] or report["endpoint"]["server_samples"][0]["kind"] == "vllm"

    assert main(["compare", "--lane", f"{tiny_llama}:fp32:cpu", "--lane", f"endpoint:{server.url}#{server.model_name}",
                 "--prompt", PROMPT, "--max-new-tokens", "10", "--ignore-eos", "--json", str(compare_json),
                 "--quiet"]) == 0
    table = capsys.readouterr().out
    summary = json.loads(compare_json.read_text())["summary"]
    assert summary[1]["token_agreement"] == 1.0 and summary[1]["first_divergence"] is None  # token for token
    assert summary[1]["label"].endswith(f"served at {server.url}")
    assert all(row["decode_tokens_per_s"] > 0 and row["ttft_s"] > 0 for row in summary)  # both speeds
    assert summary[1]["weights_bytes"] == summary[0]["weights_bytes"] and summary[1]["kv_cache_bytes"] is None
    assert "served at" in table and "100.0%" in table

    assert main(["sweep", "--model", f"endpoint:{server.url}"]) != 0
    assert "inference-workbench load" in capsys.readouterr().err


def test_bench_counts_the_decode_tokens_of_a_server_without_token_ids_from_its_usage(tmp_path, capsys):
    """A server of `transformers serve`'s shape (text chunks of several tokens, no ids, no logprobs,
    no [DONE], `usage` only on the finishing chunk): bench said "decode 0 tokens" (it counted the
    token ids) while the usage said 32."""
    import json

    from engine.cli import main
    from tests.serving import ThirdPartyServer

    out = tmp_path / "bench.json"
    with ThirdPartyServer(tokens_per_chunk=3) as server:
        assert main(["bench", "--model", f"endpoint:{server.url}", "--prompt", PROMPT, "--max-new-tokens", "32",
                     "--json", str(out), "--quiet"]) == 0
        assert server.requests == 1
    printed = capsys.readouterr().out
    assert "decode   32 tokens (the server's usage, over 11 chunks) · " in printed, printed
    assert "per chunk p50" in printed  # one latency per chunk: its tokens' own are not known
    assert "tokens counted by usage (its chunks carry no per-token count)" in printed
    report = json.loads(out.read_text())
    served = report["endpoint"]
    assert (served["usage_completion_tokens"], served["chunks"], served["counted_by"]) == (32, 11, "chunks")  # 10×3+2
    assert report["token_ids"] == []  # the server named none
    assert (report["tokens"], report["tokens_counted_by"]) == (32, "usage")
    assert report["decode_tokens_per_s"] == pytest.approx(31 / report["decode_s"])  # (usage − 1) / decode time
