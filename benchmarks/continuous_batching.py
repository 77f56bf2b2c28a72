"""The engine core under load: one request, sixteen at once, and Poisson arrivals with and without
chunked prefill (default model, int8-fast unless told otherwise).

Prints, measured in one run:
1. single-request decode tok/s through today's plain path vs through the core (target ≥ 0.97);
2. 16 requests arriving together: aggregate decode tok/s against one request (target ≥ 8×) and
   the p50 per-token latency against one request's (target ≤ 2.5×);
3. N requests with Poisson arrivals near saturation: throughput, TTFT and per-token latency
   p50/p99, with chunked prefill on and off, and the same with a 2,000-token prompt arriving
   mid-run: how much it raises the others' p99 per-token latency (target ≤ 3× with chunking).

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/continuous_batching.py [--precision int8-fast] [--tokens 48] [--requests 32]

Per-token latency is each token's gap since that request's previous token (vLLM's ITL); TTFT
counts from submission (queueing included). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from engine.generation.core import CoreSettings, EngineCore
from engine.generation.compiled_step import compile_decoder
from engine.base.events import Finished, TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

PROMPTS = ["Explain microservices in simple terms.", "What is a KV cache?", "Name three primary colours.",
           "Why do language models need so much memory?", "Write a haiku about the sea.",
           "What does a CPU do?", "Give me a tip for learning to cook.", "What is quantization?"]


def _request(prompt: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt, max_new_tokens=tokens, ignore_eos=True)


def plain_rate(loaded, tokens: int) -> float:
    steps = [e.latency_s for e in generate(loaded, _request(PROMPTS[0], tokens)) if isinstance(e, TokenGenerated)]
    return 1.0 / statistics.median(steps[1:])


def run_core(loaded, arrivals: list[tuple[float, GenerationRequest]], settings: CoreSettings) -> dict:
    """Submit each request at its arrival time (seconds from start) and run until all end."""
    core = EngineCore(loaded, settings)
    pending = sorted(arrivals, key=lambda a: a[0])
    start = time.perf_counter()
    gaps: dict[int, list[float]] = {}
    ttft: dict[int, float] = {}
    long_ids: set[int] = set()
    decode_tokens = 0
    first_token_at = last_token_at = None
    while pending or not core.idle:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, request = pending.pop(0)
            rid = core.submit(request)
            if len(request.prompt) > 4000:
                long_ids.add(rid)
        if core.idle:  # nothing to do until the next arrival
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        for event in core.step():
            if isinstance(event, TokenGenerated):
                if event.index == 0:
                    ttft[event.request_id] = event.latency_s
                else:
                    gaps.setdefault(event.request_id, []).append(event.latency_s)
                    decode_tokens += 1
                stamp = time.perf_counter()
                first_token_at = first_token_at or stamp
                last_token_at = stamp
            elif isinstance(event, Finished) and event.reason not in ("length", "eos", "stop_string"):
                raise RuntimeError(f"request {event.request_id} ended: {event.reason} {event.error or ''}")
    others = [g for rid, values in gaps.items() if rid not in long_ids for g in values]
    return {
        "tokens_per_s": decode_tokens / (last_token_at - first_token_at),
        "ttft_p50": float(np.percentile(list(ttft.values()), 50)), "ttft_p99": float(np.percentile(list(ttft.values()), 99)),
        "itl_p50": float(np.percentile(others, 50)), "itl_p99": float(np.percentile(others, 99)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="int8-fast")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=int, default=64,
                        help="tokens per step: decode tokens plus prompt chunks (smaller chunks, shorter stalls)")
    parser.add_argument("--compile", action="store_true", help="compile the single-sequence step first")
    args = parser.parse_args()

    loaded = load_model(LoadRequest("default", args.precision, "cpu"))
    if args.compile and loaded.fast is not None:
        compile_decoder(loaded.fast)
    settings = CoreSettings(token_budget=args.token_budget, max_batch=64)

    # 1. one request: today's plain path against the core, interleaved
    plain, cored = [], []
    for _ in range(3):
        plain.append(plain_rate(loaded, args.tokens))
        result = run_core(loaded, [(0.0, _request(PROMPTS[0], args.tokens))], settings)
        cored.append(1.0 / result["itl_p50"])
    one_plain, one_core = statistics.median(plain), statistics.median(cored)
    print(f"1. one request: plain path {one_plain:.1f} tok/s, through the core {one_core:.1f} tok/s "
          f"→ {one_core / one_plain:.2f}× (target ≥ 0.97)")

    # 2. sixteen together
    together = run_core(loaded, [(0.0, _request(PROMPTS[i % len(PROMPTS)], args.tokens)) for i in range(16)],
                        settings)
    one_itl = 1.0 / one_core
    print(f"2. 16 at once: {together['tokens_per_s']:.1f} tok/s in all = {together['tokens_per_s'] / one_core:.1f}× "
          f"one request (target ≥ 8×); per-token p50 {together['itl_p50'] * 1000:.0f} ms = "
          f"{together['itl_p50'] / one_itl:.2f}× one request's (target ≤ 2.5×)")

    # 3. Poisson arrivals near saturation: the rate that the batch of 16 sustains
    rng = random.Random(args.seed)
    rate = 0.9 * together["tokens_per_s"] / args.tokens  # requests per second
    t, arrivals = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(rate)
        arrivals.append((t, _request(PROMPTS[i % len(PROMPTS)], args.tokens)))
    middle = arrivals[len(arrivals) // 2][0]
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)  # ≈ 2,000 tokens
    with_long = arrivals + [(middle, _request(long_prompt, 8))]
    print(f"3. {args.requests} requests, Poisson arrivals at {rate:.2f}/s (90% of the batch-16 throughput):")
    print(f"   {'':34} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} {'per-token p50':>14} {'p99':>8}")
    rows = {}
    for chunked in (True, False):
        for label, plan in (("", arrivals), (" + a 2,000-token prompt", with_long)):
            name = ("chunked prefill" if chunked else "whole prompts") + label
            r = rows[name] = run_core(loaded, plan, CoreSettings(token_budget=args.token_budget, max_batch=64,
                                                                chunked_prefill=chunked))
            print(f"   {name:<34} {r['tokens_per_s']:7.1f} {r['ttft_p50'] * 1000:7.0f}ms {r['ttft_p99'] * 1000:6.0f}ms "
                  f"{r['itl_p50'] * 1000:12.0f}ms {r['itl_p99'] * 1000:6.0f}ms")
    for chunked in ("chunked prefill", "whole prompts"):
        ratio = rows[chunked + " + a 2,000-token prompt"]["itl_p99"] / rows[chunked]["itl_p99"]
        print(f"   the long prompt raises the others' p99 per-token latency {ratio:.2f}× with {chunked}"
              + (" (target ≤ 3×)" if chunked == "chunked prefill" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
