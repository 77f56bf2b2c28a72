"""This checkout's engine core against another revision's, side by side in one run (default model).

For a change to the engine (a new scheduler or KV layout, say): the same measurements run
in this tree and in a temporary worktree of ``--rev``, in subprocesses taking turns (new, old,
new, old…), so the machine's drift falls on both. Measured through the engine core with the
server's settings (batch 16, token budget 128, a 1 GiB KV budget, and this tree's defaults
beside them: prefix caching on):

1. one request alone: decode tok/s (median per-token latency after the first), target ≥ 0.97× old;
2. sixteen requests at once: output tok/s of all (first token to last), target ≥ 1.0× old;
3. one request as ``bench`` and the library send it (``generate()``, its alternatives included):
   tok/s as its reader receives the tokens (first to last, wall clock), target ≥ 0.97× old.

Prompts differ per request (no prefix is shared, so caching can't flatter the new tree).

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/against_revision.py --rev 3da7d77 [--precision fp32] [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r'''
import json, statistics, sys, time
if sys.argv[3] == "base":
    from engine.base.events import Finished, TokenGenerated
    from engine.base.request import GenerationRequest
else:  # a revision before engine/base (whose names the editable install would still find: asked by path)
    from engine.events import Finished, TokenGenerated
    from engine.request import GenerationRequest
from engine.generation.core import CoreSettings, EngineCore
from engine.models.loading import LoadRequest, load_model

precision, tokens = sys.argv[1], int(sys.argv[2])
loaded = load_model(LoadRequest("default", precision, "cpu"))
settings = CoreSettings(token_budget=128, max_batch=16, kv_budget_bytes=1 << 30)
QUESTIONS = ["Explain microservices in simple terms.", "What is a KV cache?", "Name three primary colours.",
             "Why do language models need so much memory?", "Write a haiku about the sea.", "What does a CPU do?",
             "Give me a tip for learning to cook.", "What is quantization?", "How does a compiler work?",
             "Why is the sky blue?", "What is a GPU good at?", "Describe a river.", "What is bandwidth?",
             "Tell me about tea.", "What is batching?", "How do bees make honey?"]

def run(prompts, n):
    core = EngineCore(loaded, settings)
    for p in prompts:
        core.submit(GenerationRequest(p, max_new_tokens=n, ignore_eos=True, top_alternatives=0))
    gaps, first, last, made = [], None, None, 0
    for event in core.run():
        if isinstance(event, TokenGenerated):
            now = time.perf_counter()
            first = first or now
            last = now
            made += 1
            if event.index:
                gaps.append(event.latency_s)
    return gaps, made / (last - first)

def received(n):
    from engine.generation.generate import generate
    request = GenerationRequest(QUESTIONS[0], max_new_tokens=n, ignore_eos=True, mode="raw")
    times = [time.perf_counter() for e in generate(loaded, request) if isinstance(e, TokenGenerated)]
    return (len(times) - 1) / (times[-1] - times[0])

run(QUESTIONS[:2], 8)  # warm-up
received(8)
gaps, _ = run(QUESTIONS[:1], tokens * 2)
_, rate16 = run(QUESTIONS, tokens)
print(json.dumps({"single": 1 / statistics.median(gaps), "sixteen": rate16, "window": received(tokens * 2)}))
'''


def measure(tree: Path, precision: str, tokens: int) -> dict:
    layout = "base" if (tree / "engine" / "base").is_dir() else "flat"
    out = subprocess.run([sys.executable, "-c", MEASURE, precision, str(tokens), layout], cwd=tree, capture_output=True,
                         text=True, env={"PYTHONPATH": str(tree), **_env()})
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from benchmarks.preemption import cpu_flags

    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            rows = {"new": [], "old": []}
            for _ in range(args.rounds):
                for name, tree in (("new", ROOT), ("old", old)):
                    rows[name].append(measure(tree, args.precision, args.tokens))
                    print(f"{name}: {rows[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    print(f"\ndefault model, {args.precision}, {args.rounds} rounds, CPU flags: {cpu_flags()}; this tree vs {args.rev}")
    for key, label, target in (("single", "one request, decode tok/s", 0.97),
                               ("sixteen", "16 at once, output tok/s", 1.0),
                               ("window", "one via generate(), tok/s", 0.97)):
        new = statistics.median(r[key] for r in rows["new"])
        was = statistics.median(r[key] for r in rows["old"])
        print(f"  {label:28s} new {new:7.1f}  old {was:7.1f}  ratio {new / was:.3f} (target ≥ {target})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
