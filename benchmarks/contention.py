"""Decode speed when another program keeps one core busy, against the same model on a quiet machine.

A desktop app shares the machine. For each precision (default model, greedy, the same prompt)
this runs, round after round and interleaved so drift lands on all alike:

- quiet: nothing else running;
- busy, adaptive: a busy loop pinned to the last CPU, the engine choosing its thread count
  as it goes (engine/generation/threads.py: the cores other processes leave free);
- busy, fixed: the same busy loop, the thread count held at PyTorch's start-up value (what
  the engine did before it adapted).

It prints decode tok/s (median of per-token times) and each busy figure as a ratio of quiet.
The issue's target: every adaptive ratio ≥ 0.4.

    python benchmarks/contention.py --tokens 64 --rounds 3
    python benchmarks/contention.py --precisions bf16,int8-fast+compiled

Run it on an otherwise quiet machine: anything else running is a second load it doesn't count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from engine.base.events import TokenGenerated
from engine.generation.compiled_step import compile_decoder
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

PROMPT = "Explain microservices in simple terms."
BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class BusyCore:
    """A pure-Python busy loop pinned to one CPU, for as long as the ``with`` block lasts."""

    def __init__(self, cpu: int) -> None:
        self.cpu = cpu

    def __enter__(self) -> "BusyCore":
        self.process = subprocess.Popen([sys.executable, "-c", BUSY, str(self.cpu)])
        time.sleep(0.5)  # running flat out before the first token
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


def _fixed_threads(count: int | None) -> None:
    if count is None:
        os.environ.pop("INFERENCE_WORKBENCH_THREADS", None)
    else:
        os.environ["INFERENCE_WORKBENCH_THREADS"] = str(count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16,int8-fast,int8-fast+compiled")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    start_threads = torch.get_num_threads()
    request = GenerationRequest(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
    models = {}
    for name in [p.strip() for p in args.precisions.split(",") if p.strip()]:
        print(f"loading {name} …", flush=True)
        loaded = load_model(LoadRequest("default", name.removesuffix("+compiled"), "cpu"))
        if name.endswith("+compiled"):
            print(f"  {compile_decoder(loaded.fast).describe()}")
        models[name] = loaded

    def steps(loaded) -> list[float]:
        return [e.latency_s for e in generate(loaded, request) if isinstance(e, TokenGenerated)][1:]

    conditions = ("quiet", "busy, adaptive", "busy, fixed")
    times = {(name, c): [] for name in models for c in conditions}
    for round_ in range(args.rounds + 1):  # round 0 warms up and is dropped
        for name, loaded in models.items():
            for condition in conditions:
                _fixed_threads(start_threads if condition == "busy, fixed" else None)
                if condition == "quiet":
                    measured = steps(loaded)
                else:
                    with BusyCore(cpus[-1]):
                        measured = steps(loaded)
                if round_:
                    times[(name, condition)] += measured
    _fixed_threads(None)

    rate = {key: 1.0 / statistics.median(values) for key, values in times.items()}
    print(f"\n{args.tokens} greedy tokens × {args.rounds} rounds, interleaved; CPUs {cpus}; PyTorch starts with "
          f"{start_threads} threads; the busy loop runs on CPU {cpus[-1]}")
    print(f"{'precision':<22} {'quiet':>8} {'busy, adaptive':>15} {'ratio':>6} {'busy, fixed':>12} {'ratio':>6}")
    rows = []
    for name in models:
        quiet, adaptive, fixed = (rate[(name, c)] for c in conditions)
        print(f"{name:<22} {quiet:8.1f} {adaptive:15.1f} {adaptive / quiet:6.2f} {fixed:12.1f} {fixed / quiet:6.2f}")
        rows.append({"precision": name, "quiet_tokens_per_s": quiet, "busy_adaptive_tokens_per_s": adaptive,
                     "busy_fixed_tokens_per_s": fixed, "adaptive_ratio": adaptive / quiet,
                     "fixed_ratio": fixed / quiet})
    worst = min(row["adaptive_ratio"] for row in rows)
    print(f"\nworst adaptive ratio {worst:.2f} (target ≥ 0.4)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "tokens": args.tokens, "rounds": args.rounds, "cpus": cpus,
                       "start_threads": start_threads}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
