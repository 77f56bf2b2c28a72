"""The load generator against an OpenAI-compatible server the project did not write: transformers'
own `transformers serve`, from the transformers package already installed, on a tiny model folder
(offline). It puts `usage` on its last content-free chunk and may send several tokens in one chunk."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.load.generator import LoadPlan, LoadRunner
from engine.load.prompts import Prompt
from engine.generation.generate import generate


@pytest.fixture(scope="module")
def transformers_serve(tiny_llama):
    command = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if command is None:
        pytest.skip("the transformers CLI is not installed here, so `transformers serve` can't start")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([command, "serve", str(tiny_llama), "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:  # a server in another process: its readiness can only be asked for, bounded
            if process.poll() is not None:
                pytest.skip(f"`transformers serve` exited at start: {process.stderr.read()[-300:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("`transformers serve` did not answer /health within 120 s")
            time.sleep(0.2)
        yield f"{url}/v1", str(tiny_llama)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def test_load_against_transformers_serve_counts_tokens_from_its_usage(transformers_serve):
    url, model = transformers_serve
    plan = LoadPlan(url=url, model=model, concurrency=(2,), requests=4, max_tokens=8).validated()
    (setting,) = LoadRunner(plan, [Prompt("The quick brown fox"), Prompt("Memory bandwidth limits")]).run()
    summary = setting.summary
    assert (summary.completed, summary.failed) == (4, 0), summary.errors
    assert summary.counted_by == "usage"  # read from the chunk that ends the stream
    for result in setting.results:
        assert 1 <= result.output_tokens <= 8 and result.prompt_tokens > 0
        assert len(result.chunk_times_s) <= result.output_tokens  # a chunk may carry several tokens
        assert len(result.itl_s) == len(result.chunk_times_s) - 1
        assert result.finish_reason in ("length", "stop")
    assert summary.output_tokens == sum(r.output_tokens for r in setting.results)
    assert setting.server.kind is None and "metrics" in setting.server.reason  # none, said so (not zeros)


def test_endpoint_source_against_transformers_serve(transformers_serve, loaded_llama):
    from engine.endpoint import connect, parse_endpoint
    from engine.base.events import EndpointAnswered, Finished, TokenGenerated
    from engine.base.request import GenerationRequest

    url, model_name = transformers_serve
    model = connect(parse_endpoint(f"endpoint:{url}#{model_name}"))
    try:
        assert model.metrics_kind is None  # no /metrics: nothing scraped, nothing made up
        request = GenerationRequest("The quick brown fox", max_new_tokens=8)
        events = list(model.generate(request))
    finally:
        model.close()
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    answered, finished = events[-2], events[-1]
    assert isinstance(answered, EndpointAnswered) and isinstance(finished, Finished)
    # it sends no [DONE], its usage only on the finishing chunk, no logprobs, and holds back bytes that
    # don't decode alone, so a chunk may carry several tokens: counted by chunks, said so, total from usage
    assert answered.counted_by == "chunks" and answered.chunks == len(tokens) <= finished.tokens == 8
    assert answered.usage_completion_tokens == 8 and finished.prompt_tokens == answered.usage_prompt_tokens > 0
    assert all(t.logprob is None and t.token_id == -1 and t.kv_cache_bytes is None for t in tokens)
    assert finished.reason == "length" and finished.token_ids == ()
    local = [e for e in generate(loaded_llama, request) if isinstance(e, Finished)][0]
    assert finished.text == local.text and finished.prompt_tokens == local.prompt_tokens  # the same greedy answer
    if answered.chunks > 1:
        assert finished.decode_tokens_per_s == pytest.approx(7 / finished.decode_s)
    else:  # a busy server may send all 8 in one chunk: no time between chunks, so no rate (not infinity)
        assert finished.decode_s == 0 and finished.decode_tokens_per_s is None
