"""Prefix caching measured side by side in one run: the same requests against the server with it on
(the default) and off (``serve --no-prefix-caching``), default model.

1. Sixteen short questions sent at once behind one ~600-token system prompt (streamed chat): mean
   and p50 TTFT with caching / without (target ≤ 0.25), prompt tokens found in the cache (usage's
   ``cached_tokens`` and ``/metrics``), and whether the answers are the same text.
2. A six-turn chat over the API, each turn's prompt the whole conversation so far: TTFT of each
   turn with caching and without, turn 6's ratio (target ≤ 0.3).
3. The same chat the window's way (in this process: its kept core, engine/generation/generate.py's
   ``kept_service``, with *Reuse cached prompt KV* on and off): TTFT of turn 6 with / without.

Each server is ``inference-workbench serve`` in a subprocess (batch 16, no history); the two are
measured in turns (on, off, on, off) and the means of the two rounds printed.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/prefix_cache.py [--precision bf16] [--tokens 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.preemption import QUESTIONS, cpu_flags  # noqa: E402
from benchmarks.serve import free_port, start_server, stop, wait_healthy  # noqa: E402

TURNS = ["What is a token?", "And why does the model make them one at a time?", "What does the KV cache keep?",
         "How big does it get?", "What is batching for?", "So what should I measure first?"]


def system_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of the README's prose, cut at a sentence."""
    from transformers import AutoTokenizer

    from engine.models import default_model

    tokenizer = AutoTokenizer.from_pretrained(default_model.model_dir())
    prose = " ".join(line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                     if line.strip() and not line.startswith(("#", "|", "`", "-", "```")))
    text = "You are the workbench's guide. Use this manual to answer in one short line.\n" + prose
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids).rsplit(".", 1)[0] + "."


async def ask(client, model: str, messages: list[dict], tokens: int) -> dict:
    """One streamed chat request: TTFT to the first content chunk, the text, the final usage."""
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, usage = None, [], None
    async with client.stream("POST", "/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(choice["delta"]["content"])
    return {"ttft": ttft, "text": "".join(parts), "usage": usage}


async def burst(url: str, model: str, system: str, tokens: int) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(ask(client, model, [{"role": "system", "content": system},
                                                           {"role": "user", "content": q}], tokens)
                                      for q in QUESTIONS))


async def conversation(url: str, model: str, system: str, tokens: int) -> list[dict]:
    import httpx

    messages = [{"role": "system", "content": system}]
    turns = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for question in TURNS:
            messages.append({"role": "user", "content": question})
            answer = await ask(client, model, messages, tokens * 2)
            messages.append({"role": "assistant", "content": answer["text"]})
            turns.append(answer)
    return turns


def hits(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
              for s in f.samples}
    return values.get("vllm:prefix_cache_queries_total", 0.0), values.get("vllm:prefix_cache_hits_total", 0.0)


def measure(precision: str, caching: bool, system: str, tokens: int) -> dict:
    port = free_port()
    process = start_server(port, precision, extra=() if caching else ("--no-prefix-caching",))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", process)
        model = __import__("httpx").get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(burst(base + "/v1", model, system[:200], 2))  # warm-up (a different prompt)
        before = hits(base)
        answers = asyncio.run(burst(base + "/v1", model, system, tokens))
        after = hits(base)
        chat = asyncio.run(conversation(base + "/v1", model, system, tokens))
    finally:
        stop(process)
    return {"burst": answers, "queried": after[0] - before[0], "hit": after[1] - before[1], "chat": chat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=600)
    args = parser.parse_args()

    system = system_prompt(args.system_tokens)
    print(f"default model, {args.precision}, {len(QUESTIONS)} questions × {args.tokens} tokens behind a "
          f"{args.system_tokens}-token system prompt; CPU flags: {cpu_flags()}")
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.rounds):
        for caching in (True, False):
            runs[caching].append(measure(args.precision, caching, system, args.tokens))

    def mean_ttft(caching: bool) -> float:
        return statistics.mean(a["ttft"] for run in runs[caching] for a in run["burst"])

    def p50_ttft(caching: bool) -> float:
        return statistics.median(a["ttft"] for run in runs[caching] for a in run["burst"])

    on, off = runs[True], runs[False]
    pairs = [(a["text"], b["text"]) for x, y in zip(on, off) for a, b in zip(x["burst"], y["burst"])]
    same = f"{sum(a == b for a, b in pairs)} of {len(pairs)}"
    print("\n1. sixteen questions at once, one system prompt")
    print(f"   mean TTFT: cached {mean_ttft(True) * 1e3:8.1f} ms   not cached {mean_ttft(False) * 1e3:8.1f} ms   "
          f"ratio {mean_ttft(True) / mean_ttft(False):.3f} (target ≤ 0.25)")
    print(f"   p50 TTFT:  cached {p50_ttft(True) * 1e3:8.1f} ms   not cached {p50_ttft(False) * 1e3:8.1f} ms   "
          f"ratio {p50_ttft(True) / p50_ttft(False):.3f}")
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in on[0]["burst"]]
    prompts = [a["usage"]["prompt_tokens"] for a in on[0]["burst"]]
    print(f"   prompt tokens {sum(prompts)}, from the cache {sum(cached)} (usage); /metrics: queried "
          f"{on[0]['queried']:.0f}, hit {on[0]['hit']:.0f}; without caching: hit {off[0]['hit']:.0f}")
    print(f"   answers the same text with and without: {same} (in bf16 a prompt read in other chunks rounds "
          "otherwise, and a near-tie can part the answers; fp32: all)")
    print("\n2. a six-turn chat (each turn's prompt is the conversation so far)")
    for turn in range(len(TURNS)):
        with_cache = statistics.mean(run["chat"][turn]["ttft"] for run in on)
        without = statistics.mean(run["chat"][turn]["ttft"] for run in off)
        usage = on[0]["chat"][turn]["usage"]
        print(f"   turn {turn + 1}: prompt {usage['prompt_tokens']:4d} tokens, "
              f"{usage['prompt_tokens_details']['cached_tokens']:4d} from the cache; TTFT cached "
              f"{with_cache * 1e3:7.1f} ms, not {without * 1e3:7.1f} ms, ratio {with_cache / without:.3f}")
    last = statistics.mean(run["chat"][-1]["ttft"] for run in on) / statistics.mean(run["chat"][-1]["ttft"] for run in off)
    print(f"   turn 6 ratio {last:.3f} (target ≤ 0.3)")
    window_chat(args.precision, system, args.tokens, args.rounds)


def window_chat(precision: str, system: str, tokens: int, rounds: int) -> None:
    """The six turns through the window's route: a kept core per model, the request's
    ``reuse_prefix`` as the Generation panel's switch sets it."""
    from engine.base.events import Finished
    from engine.base.request import ChatMessage, GenerationRequest
    from engine.generation.generate import generate, kept_service
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest("default", precision, "cpu"))
    ttfts: dict[bool, list[list[float]]] = {True: [], False: []}
    cached_last = 0
    texts: dict[bool, list[str]] = {}
    for _ in range(rounds):
        for reuse in (True, False):
            service, history, times, answers = kept_service(loaded), [], [], []
            for question in TURNS:
                request = GenerationRequest(question, system_prompt=system, history=tuple(history),
                                            max_new_tokens=tokens * 2, ignore_eos=True, top_alternatives=5,
                                            reuse_prefix=reuse)
                final = next(e for e in generate(loaded, request, service=service) if isinstance(e, Finished))
                times.append(final.ttft_s)
                answers.append(final.text)
                history += [ChatMessage("user", question), ChatMessage("assistant", final.text)]
                if reuse:
                    cached_last = final.cached_tokens
                    prompt_last = final.prompt_tokens
            ttfts[reuse].append(times)
            texts[reuse] = answers
    print("\n3. the same chat the window's way (its kept core; Reuse cached prompt KV on / off)")
    for turn in range(len(TURNS)):
        on = statistics.mean(t[turn] for t in ttfts[True])
        off = statistics.mean(t[turn] for t in ttfts[False])
        print(f"   turn {turn + 1}: TTFT reused {on * 1e3:7.1f} ms, computed {off * 1e3:7.1f} ms, ratio {on / off:.3f}")
    last = statistics.mean(t[-1] for t in ttfts[True]) / statistics.mean(t[-1] for t in ttfts[False])
    print(f"   turn 6: {cached_last} of {prompt_last} prompt tokens from the cache; ratio {last:.3f} (target ≤ 0.3); "
          f"answers the same: {sum(a == b for a, b in zip(texts[True], texts[False]))} of {len(TURNS)} turns")


if __name__ == "__main__":
    main()
