"""What batch-invariant arithmetic buys and costs, on the default model, in one run.

For each precision: 16 greedy requests (distinct questions behind one system prompt) run at once
through an engine core with a server's limits (batch 16, token budget 128, prefix caching), and
each alone; how many answers differ from their solo answers, plainly and batch-invariant
(engine/generation/invariant.py), and what it costs: a lone request's decode tok/s and the
16-request batch's output tok/s, batch-invariant ÷ plain (the fast precisions' plain runs with
their compiled steps ready).

    python benchmarks/batch_invariant.py [--precisions bf16,bf16-fast] [--tokens 48]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is a token?", "Why is decoding slow?", "What does the KV cache hold?", "What is batching?",
             "Name three primary colours.", "What is quantization?", "How does a compiler work?", "Why is the sky blue?",
             "What is a GPU good at?", "Describe a river.", "What is bandwidth?", "Tell me about tea.",
             "How do bees make honey?", "What is a CPU cache?", "Write a haiku about the sea.", "What is latency?"]
SYSTEM = "You are a careful assistant. Answer in two or three sentences."


def run(loaded, requests, alone: bool):
    from engine.base.events import Finished, TokenGenerated
    from engine.generation.core import CoreSettings, EngineCore

    answers, start, made = [], time.perf_counter(), 0
    batches = [[r] for r in requests] if alone else [requests]
    for batch in batches:
        core = EngineCore(loaded, CoreSettings(token_budget=128, max_batch=16, kv_budget_bytes=1 << 30,
                                               prefix_caching=True))
        ids = [core.submit(r) for r in batch]
        got = {rid: [] for rid in ids}
        for event in core.run():
            if isinstance(event, TokenGenerated):
                got[event.request_id].append(event.token_id)
                made += 1
            elif isinstance(event, Finished) and event.error:
                sys.exit(event.error)
        answers += [got[rid] for rid in ids]
    return answers, made / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="bf16,bf16-fast")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    from engine.base.request import GenerationRequest
    from engine.base.sampling import SamplingParams
    from engine.models.kernels import cpu_flags
    from engine.models.loading import LoadRequest, load_model

    print(f"CPU: {platform.processor() or platform.machine()}; flags: "
          + " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))))
    requests = [GenerationRequest(q, system_prompt=SYSTEM, max_new_tokens=args.tokens, ignore_eos=True,
                                  top_alternatives=0, sampling=SamplingParams(temperature=0.0)) for q in QUESTIONS]
    for precision in args.precisions.split(","):
        loaded = load_model(LoadRequest("default", precision, "cpu"))
        if loaded.fast is not None:
            from engine.generation.compiled_step import compile_decoder

            compile_decoder(loaded.fast)
        figures = {}
        for invariant in (False, True, False, True):  # taking turns: the machine's drift falls on both
            loaded.batch_invariant = invariant
            solo, solo_rate = run(loaded, requests[:4], alone=True)
            batch, batch_rate = run(loaded, requests, alone=False)
            solo_all, _ = run(loaded, requests, alone=True) if invariant not in figures else (None, None)
            entry = figures.setdefault(invariant, {"solo": [], "batch": [], "differ": None})
            entry["solo"].append(solo_rate)
            entry["batch"].append(batch_rate)
            if solo_all is not None:
                entry["differ"] = sum(a != b for a, b in zip(batch, solo_all))
        plain, fixed = figures[False], figures[True]
        best = {k: {part: max(v[part]) for part in ("solo", "batch")} for k, v in figures.items()}
        print(f"{precision}: answers differing from their solo answer: plain {plain['differ']} of 16, "
              f"batch-invariant {fixed['differ']} of 16; a lone request {best[True]['solo']:.1f} vs "
              f"{best[False]['solo']:.1f} tok/s ({best[True]['solo'] / best[False]['solo']:.2f}x), 16 at once "
              f"{best[True]['batch']:.1f} vs {best[False]['batch']:.1f} tok/s "
              f"({best[True]['batch'] / best[False]['batch']:.2f}x), batch-invariant vs plain")


if __name__ == "__main__":
    main()
