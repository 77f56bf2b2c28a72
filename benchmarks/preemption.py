"""KV blocks on demand with preemption vs reserving each request's longest answer up front, on
the same KV budget, side by side in one run (default model).

The budget holds four requests' worst case (prompt + ``max_tokens``). Sixteen requests arrive at
once. Reserving up front (the engine core's scheduler before blocks on demand) runs four at a
time; taking blocks as requests grow runs as many as the blocks in use allow and, when they run
out, preempts the newest request (its blocks freed, recomputed when it runs again: vLLM's
default). Printed: output tok/s of each, their ratio (target ≥ 1.0), the preemptions, the most
requests running at once, and whether every answer equals its solo answer (greedy).

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/preemption.py [--precision fp32-fast] [--tokens 192] [--requests 16]

Answers decoded in a batch are compared with the request decoded alone; where a batch's
arithmetic rounds differently (bf16), a near-tie can part them, so the default is fp32-fast.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from engine.base.events import Finished, Preempted, StepCompleted, TokenGenerated
from engine.generation.core import CoreSettings, EngineCore
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

QUESTIONS = ["Explain microservices in simple terms.", "What is a KV cache?", "Name three primary colours.",
             "Why do language models need so much memory?", "Write a haiku about the sea.", "What does a CPU do?",
             "Give me a tip for learning to cook.", "What is quantization?", "How does a compiler work?",
             "Why is the sky blue?", "What is a GPU good at?", "Describe a river.", "What is bandwidth?",
             "Tell me about tea.", "What is batching?", "How do bees make honey?"]


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            flags = next(line for line in info if line.startswith("flags")).split(":")[1].split()
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f in flags)


def run(loaded, requests, settings: CoreSettings) -> dict:
    core = EngineCore(loaded, settings)
    rids = [core.submit(r) for r in requests]
    tokens = {rid: [] for rid in rids}
    preempted = most = generated = 0
    start = time.perf_counter()
    while not core.idle:
        for event in core.step():
            if isinstance(event, TokenGenerated):
                tokens[event.request_id].append(event.token_id)
                generated += 1
            elif isinstance(event, Preempted):
                preempted += 1
            elif isinstance(event, StepCompleted):
                most = max(most, event.running)
            elif isinstance(event, Finished) and event.reason == "error":
                raise SystemExit(f"request {event.request_id} failed: {event.error}")
    seconds = time.perf_counter() - start
    return {"tokens": [tokens[rid] for rid in rids], "rate": generated / seconds, "seconds": seconds,
            "preempted": preempted, "most": most}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32-fast")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()

    loaded = load_model(LoadRequest("default", args.precision, "cpu"))
    requests = [GenerationRequest(QUESTIONS[i % len(QUESTIONS)], max_new_tokens=args.tokens, ignore_eos=True,
                                  top_alternatives=0) for i in range(args.requests)]
    worst = max(len(loaded.encode(r)) for r in requests) + args.tokens + 1
    budget = 4 * worst * loaded.info.kv_bytes_per_token
    print(f"default model, {args.precision}, {args.requests} requests × {args.tokens} tokens, KV budget "
          f"{budget / 2**20:.1f} MiB = 4 × the worst case ({worst} tokens); CPU flags: {cpu_flags()}; "
          f"threads {os.environ.get('INFERENCE_WORKBENCH_THREADS', 'adaptive')}")
    started = time.perf_counter()
    solo = [[e.token_id for e in generate(loaded, r) if isinstance(e, TokenGenerated)] for r in requests]
    print(f"solo answers: {time.perf_counter() - started:.0f} s")
    base = dict(max_batch=args.requests, token_budget=128, kv_budget_bytes=budget)
    rows = {}
    for name, settings in (("reserve up front", CoreSettings(**base, reserve_up_front=True)),
                           ("blocks on demand", CoreSettings(**base)),
                           ("reserve up front (again)", CoreSettings(**base, reserve_up_front=True)),
                           ("blocks on demand (again)", CoreSettings(**base))):
        rows[name] = row = run(loaded, requests, settings)
        equal = sum(a == b for a, b in zip(row["tokens"], solo))
        print(f"{name:26s} {row['rate']:7.1f} tok/s  {row['seconds']:6.1f} s  most running {row['most']:2d}  "
              f"preemptions {row['preempted']:3d}  answers equal to solo {equal}/{len(solo)}")
    reserve = (rows["reserve up front"]["rate"] + rows["reserve up front (again)"]["rate"]) / 2
    demand = (rows["blocks on demand"]["rate"] + rows["blocks on demand (again)"]["rate"]) / 2
    print(f"throughput, blocks on demand / reserve up front: {demand / reserve:.2f} (target ≥ 1.0)")


if __name__ == "__main__":
    main()
