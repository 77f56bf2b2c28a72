"""Where a batched decode step's time goes, at one sequence and at ``--batch``, side by side.

    python benchmarks/batch_step.py [--precision int8-fast] [--batch 16] [--tokens 64] [--rounds 5]

Readies the default model's compiled steps, then alternates round by round between an engine
core decoding one sequence and one decoding ``--batch`` (the same prompt, ``--tokens`` greedy
tokens each, no alternatives: what ``benchmarks/fast_path.py``'s batched column runs). Per step
it times the core's whole step and, inside it, the runner's decode pass (the model: the compiled
step where it is ready); the rest is the core's own work (sampling, events, bookkeeping). Prints
their medians and two gains, each the median of the per-round ratios: the core's (``batch`` ×
one row's step ÷ the batch's step: what the fast_path benchmark's "core ×16 ÷ ×1" measures) and
the decode pass's alone (the most the core could reach if its own work cost nothing). With
``--profile``, one more run of each under the torch profiler splits the decode pass into the
kernels' operators (products, attention, the scores' totals) and the rest of the compiled step
(inductor's own loops). Run it on a quiet machine: the figures are ratios measured in one
process, never compared across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.base.events import StepCompleted  # noqa: E402
from engine.base.request import GenerationRequest  # noqa: E402
from engine.generation.compiled_step import compile_decoder  # noqa: E402
from engine.generation.core import CoreSettings, EngineCore  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402

PROMPT = "Explain what a KV cache is, in two short paragraphs."
IN_PASS = ("workbench::q8_linear", "workbench::q4_linear", "workbench::attend_rows")
"""The kernels' operators the decode pass runs (the rest of the pass: the compiled step's own loops)."""
OPERATORS = (*IN_PASS, "workbench::row_totals")
"""… and the sampler's, which runs outside the pass."""


def decode_run(loaded, ids: list[int], request: GenerationRequest, batch: int, profile: bool = False):
    """One run of ``batch`` copies of the prompt through a fresh core: per decode step (the
    prompts' step left out), the whole step and the runner's decode pass, in seconds; with
    ``profile``, the profiler's per-operator self times (µs, summed over the steps)."""
    core = EngineCore(loaded, CoreSettings(token_budget=len(ids) * batch + batch, max_batch=batch,
                                           prefill_chunk=len(ids)))
    decode = core.runner.decode
    passes: list[float] = []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return decode(*args, **kwargs)
        finally:
            passes.append(time.perf_counter() - started)

    core.runner.decode = timed
    for _ in range(batch):
        core.submit(request, None, ids)
    core.step()  # the prompts
    passes.clear()
    steps: list[float] = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    with profiler or contextlib.nullcontext():
        while not core.idle:
            steps += [e.step_s for e in core.step() if isinstance(e, StepCompleted)]
    if len(steps) != len(passes):
        raise RuntimeError(f"{len(steps)} steps but {len(passes)} decode passes: a step decoded no batch")
    ops = {e.key: e.self_cpu_time_total for e in profiler.key_averages()} if profiler is not None else {}
    return steps, passes, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8-fast")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="split the decode pass by operator (one more run each)")
    args = parser.parse_args()
    if args.batch < 2 or args.tokens < 2 or args.rounds < 1:
        sys.exit("--batch and --tokens at least 2, --rounds at least 1")
    loaded = load_model(LoadRequest("default", args.precision, "cpu"))
    if loaded.fast is not None:
        report = compile_decoder(loaded.fast)
        print(f"  {report.describe()}")
    request = GenerationRequest(PROMPT, max_new_tokens=args.tokens, ignore_eos=True, top_alternatives=0)
    ids = loaded.encode(request)
    sizes = (1, args.batch)
    decode_run(loaded, ids, request, args.batch)  # warm both: caches, views, the kernels' first calls
    decode_run(loaded, ids, request, 1)
    steps = {b: [] for b in sizes}
    passes = {b: [] for b in sizes}
    for _ in range(args.rounds):
        for b in sizes:
            s, p, _ = decode_run(loaded, ids, request, b)
            steps[b].append(statistics.median(s))
            passes[b].append(statistics.median(p))

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:7.3f}"

    print(f"\n{args.precision}, {args.tokens} greedy tokens a sequence, {args.rounds} rounds alternating, "
          f"{torch.get_num_threads()} threads; medians of the per-round median steps (ms)")
    print(f"CPU flags: {cpu_flags()}")
    print(f"{'sequences':>9}  {'step':>7}  {'decode pass':>11}  {'the core':>8}")
    for b in sizes:
        rest = [s - p for s, p in zip(steps[b], passes[b])]
        print(f"{b:>9}  {ms(steps[b])}  {ms(passes[b]):>11}  {ms(rest):>8}")
    n = args.batch
    core_gain = statistics.median(n * one / many for one, many in zip(steps[1], steps[n]))
    pass_gain = statistics.median(n * one / many for one, many in zip(passes[1], passes[n]))
    print(f"gain at {n} sequences (aggregate tok/s ÷ one sequence's): the core {core_gain:.2f}×, "
          f"its decode pass alone {pass_gain:.2f}×")
    if args.profile:
        print("\nper step, from one more run of each under the torch profiler (ms):")
        print(f"{'sequences':>9}  " + "  ".join(f"{name.split('::')[1]:>11}" for name in OPERATORS)
              + f"  {'rest of pass':>12}")
        for b in sizes:
            s, p, ops = decode_run(loaded, ids, request, b, profile=True)
            inside = sum(ops.get(name, 0.0) for name in IN_PASS) / 1e3 / len(p)
            cells = "  ".join(f"{ops.get(name, 0.0) / 1e3 / len(p):>11.3f}" for name in OPERATORS)
            print(f"{b:>9}  {cells}  {sum(p) / len(p) * 1e3 - inside:>12.3f}")


if __name__ == "__main__":
    main()
