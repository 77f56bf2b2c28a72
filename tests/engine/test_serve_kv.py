"""The server's KV cache in blocks: prefix caching on by default (and off on request), preemption
when the budget runs out, each counted in /metrics under vLLM's names and in the usage OpenAI
reports, with every answer equal to the one it gets alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.base.events import STEP_PARTS, Preempted, TokenGenerated
from engine.base.request import GenerationRequest
from engine.estimates.step_cost import served_work
from engine.generation.service import RequestEvent, TrafficStep
from engine.serve.traffic import TrafficLog
from tests.serving import serve
from engine.generation.generate import generate

SYSTEM = ("You are the workbench's guide. You answer questions about inference in one short line, "
          "naming the figure that shows it.")
QUESTIONS = ["What is a token?", "Why is decoding slow?", "What does the KV cache hold?", "What is batching?"]


def metrics(server) -> dict:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "finished_reason" not in s.labels and "le" not in s.labels}


def body(server, question: str, max_tokens: int = 6) -> dict:
    return {"model": server.model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def ask_all(loaded, **settings):
    server = serve(loaded, **settings)
    ask_all.traffic = traffic = TrafficLog()
    server.service.listen(traffic.add)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            answers = [http.post("/chat/completions", json=body(server, q)).json() for q in QUESTIONS]
        ask_all.text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
        return answers, metrics(server)
    finally:
        server.stop(drain=False, timeout=30)


def test_a_shared_system_prompt_is_read_once_and_the_answers_are_the_same(loaded_llama):
    answers, figures = ask_all(loaded_llama)
    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]) and all(c < p for c, p in zip(cached, prompts))
    assert figures["vllm:prefix_cache_queries_total"] == sum(prompts)
    assert figures["vllm:prefix_cache_hits_total"] == sum(cached)
    assert figures["vllm:kv_cache_kept_blocks"] > 0
    assert figures["vllm:num_preemptions_total"] == 0 and figures["vllm:kv_cache_usage_perc"] == 0
    tracks = list(ask_all.traffic.requests.values())
    assert [t.cached_tokens for t in tracks] == cached
    assert "from the prefix cache" in tracks[1].describe() and "from the prefix cache" not in tracks[0].describe()
    steps = ask_all.traffic.steps()
    assert steps["cached_tokens"].sum() == sum(cached)
    # the steps' seconds and parts, summed on /metrics, are the steps the traffic saw
    seconds, parts = served_work(ask_all.text)
    assert seconds == pytest.approx(steps["step_s"].sum(), rel=1e-9) and seconds > 0
    counted = dict(zip(STEP_PARTS, parts))
    assert counted["steps"] == len(steps["step_s"]) and counted["decode_rows"] == steps["decode_tokens"].sum()
    assert counted["prompt_tokens"] == steps["prefill_tokens"].sum() > 0 and counted["prompt_chunks"] >= 4
    assert steps["kept_bytes"][-1] == steps["kv_blocks_kept"][-1] * 16 * loaded_llama.info.kv_bytes_per_token > 0

    plain, figures = ask_all(loaded_llama, prefix_caching=False)
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in plain] == [0] * 4
    assert figures["vllm:prefix_cache_queries_total"] == figures["vllm:prefix_cache_hits_total"] == 0
    assert figures["vllm:kv_cache_kept_blocks"] == 0
    assert [a["choices"][0]["message"]["content"] for a in plain] == \
        [a["choices"][0]["message"]["content"] for a in answers]


def test_a_tight_kv_budget_preempts_and_every_stream_still_gets_its_solo_answer(loaded_llama):
    prompts = [f"{word} " * 6 for word in ("fox", "cache", "token", "batch", "weight", "bandwidth")]
    solo = []
    for prompt in prompts:
        request = GenerationRequest(prompt, mode="raw", max_new_tokens=40, ignore_eos=True)
        solo.append([e.token_id for e in generate(loaded_llama, request) if isinstance(e, TokenGenerated)])
    worst = max(len(loaded_llama.encode(GenerationRequest(p, mode="raw"))) for p in prompts) + 41
    server = serve(loaded_llama, max_batch=6, kv_budget_bytes=2 * worst * loaded_llama.info.kv_bytes_per_token)
    traffic = TrafficLog()
    server.service.listen(traffic.add)
    preempted = []
    server.service.listen(lambda e: preempted.append(e) if isinstance(e, RequestEvent)
                          and isinstance(e.event, Preempted) else None)

    async def one(client, prompt):
        answer = await client.post("/completions", json={
            "model": server.model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        return answer.json()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    try:
        answers = asyncio.run(main())
        figures = metrics(server)
    finally:
        server.stop(drain=False, timeout=30)
    for answer, expected in zip(answers, solo):
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 40 and answer["choices"][0]["finish_reason"] == "length"
        assert [loaded_llama.token_text(t) for t in expected] == tokens
    assert preempted, "the budget was meant to run out"
    assert figures["vllm:num_preemptions_total"] == len(preempted)
    # the traffic view: each preemption a mark on its request's row, its wait and recompute as spans
    tracks = [t for t in traffic.requests.values() if t.preempted_s]
    assert sum(len(t.preempted_s) for t in traffic.requests.values()) == len(preempted)
    for track in tracks:
        phases = [name for name, _, _ in track.spans(traffic.now)]
        assert phases[:3] == ["waiting", "prefill", "decode"]
        assert phases.count("waiting") == len(track.preempted_s) + 1 and phases[-1] == "decode"
        assert "preempted" in track.describe()
    steps = traffic.steps()
    assert steps["preempted"].sum() == len(preempted)
    total = server.service.core.kv.total_blocks
    assert (steps["kv_blocks_used"] + steps["kv_blocks_kept"]).max() <= total


def test_the_serve_command_takes_no_prefix_caching():
    import argparse

    from engine.cli.serve import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"), {"fp32": None})
    assert parser.parse_args(["serve"]).no_prefix_caching is False
    assert parser.parse_args(["serve", "--no-prefix-caching"]).no_prefix_caching is True


def test_the_service_says_how_its_kv_cache_is_laid_out(loaded_llama, tiny_models):
    from engine.models.loading import LoadRequest, load_model

    server = serve(loaded_llama, kv_budget_bytes=1 << 20)
    try:
        line = server.service.describe_kv()
    finally:
        server.stop(drain=False, timeout=30)
    blocks = (1 << 20) // (16 * loaded_llama.info.kv_bytes_per_token)
    assert f"{blocks:,} blocks of 16 tokens" in line and "prefix caching on" in line
    assert "copied into each request's cache" in line  # the reference runner's way
    gemma = load_model(LoadRequest(str(tiny_models["gemma2"]), "fp32", "cpu"))
    server = serve(gemma)
    try:
        line = server.service.describe_kv()
        assert "prefix caching on" in line and "sliding-window layers need only their window's" in line
    finally:
        server.stop(drain=False, timeout=30)
    fast = load_model(LoadRequest(str(tiny_models["llama"]), "fp32-fast", "cpu"))
    server = serve(fast)
    try:
        assert "shared in place" in server.service.describe_kv()
    finally:
        server.stop(drain=False, timeout=30)


def test_requests_served_together_on_the_fast_path_share_their_prefix_in_place(tiny_models):
    """Four requests at once behind one system prompt on a *-fast precision: its blocks are held
    once while they run; the traffic view's bands (each request's own blocks, the shared ones once)
    add up to the step's KV bytes, and /metrics reads the same pool, never past its budget."""
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), "fp32-fast", "cpu"))
    alone = [a["choices"][0]["message"]["content"] for a in ask_all(loaded)[0]]
    server = serve(loaded, kv_budget_bytes=1 << 22)
    traffic, maps = TrafficLog(), []
    server.service.listen(traffic.add)
    server.service.listen(lambda event: maps.append(event.blocks) if isinstance(event, TrafficStep) else None)
    try:
        async def together():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/chat/completions", json=body(server, q, 24))
                                              for q in QUESTIONS))

        answers = [r.json() for r in asyncio.run(together())]
        figures = metrics(server)
    finally:
        server.stop(drain=False, timeout=30)
    assert [a["choices"][0]["message"]["content"][:len(b)] for a, b in zip(answers, alone)] == alone
    steps = traffic.steps()
    assert steps["kv_blocks_shared"].max() > 0 and steps["shared_bytes"].max() > 0
    times, table, shared, kept = traffic.kv_stack()
    assert (table.sum(axis=0) + shared == steps["kv_bytes"]).all()  # the bands are the held bytes, no more
    assert any("shared with other requests (held once)" in t.describe() for t in traffic.requests.values())
    assert 0 < figures["vllm:kv_cache_pool_bytes"] <= figures["vllm:kv_cache_budget_bytes"] == 1 << 22
    # the block map: the pool's blocks, the prefix's held by all four at once, cached once they end
    assert max(max(m, default=0) for m in maps) == len(QUESTIONS)
    assert traffic.block_map == maps[-1] and -1 in traffic.block_map and max(traffic.block_map) == 0
    assert len(traffic.block_map) * 16 * loaded.info.kv_bytes_per_token == figures["vllm:kv_cache_pool_bytes"]
