"""The fast path's KV cache as a block pool, against another revision's, side by side in one run.

The same measurements run in this tree and in a temporary worktree of ``--rev`` (a revision
whose fast runner kept a rectangle per batch: one slot per sequence at one shared capacity, and
cached prefixes as copies), in subprocesses taking turns, default model, through the engine core:

a. **shared prefix**: 16 requests behind a 600-token system prompt, the prompt cached first; the
   KV storage held while all 16 run, read from the cache tensors' storages (target: ≤ 0.2× the
   other revision's);
b. **one long request among short ones**: a ``--long``-token prompt and 15 short ones decoding
   together; the blocks held against the bytes of the tokens held (target ≤ 1.1×), and the
   storage against the KV budget (never past it);
c. **decode step**: the median step at 1 and at 16 sequences near position 64, compiled steps
   where they are built (``--compiled``; else the eager steps), target ≥ 0.95×;
d. **a 6-turn chat** with paragraph breaks through the window's kept core: turn 6 reads only its
   new tokens (every whole block of the conversation before it from the cache);
e. **a prompt after a cached prefix**: 512 new tokens behind a cached 1,024-token system prompt,
   read in chunks of 256 that attend over the prefix (the median of 3 prompts' prefill time).

    python benchmarks/paged_kv.py --rev 401657a [--precisions int8-fast,bf16-fast] [--long 4096] [--parts a,b,c,d,e]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r'''
import json, statistics, sys, time
import torch
from engine.base.events import StepCompleted
from engine.base.request import GenerationRequest
from engine.generation.core import CoreSettings, EngineCore
from engine.models.loading import LoadRequest, load_model

precision, part, long_tokens, compiled = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
loaded = load_model(LoadRequest("default", precision, "cpu"))
if compiled:
    from engine.generation.compiled_step import compile_decoder
    report = compile_decoder(loaded.fast)
    if report.error or report.rows_error:
        sys.exit(f"the compiled steps aren't ready: {report.error or report.rows_error}")
BUDGET = 1 << 30
QUESTIONS_D = ["List three uses of a KV cache, as a numbered list.", "Explain the second one in two paragraphs.",
               "Give an example of it, as a short list.", "What does it cost in memory? Answer in two paragraphs.",
               "And on a GPU? Give two points as a list.", "Summarise our conversation in two short paragraphs."]

def storage(core):
    runner = core.runner
    return sum(t.untyped_storage().nbytes() for t in runner.keys + runner.values)

def ids(text, n):
    out = loaded.tokenizer(text * (n // 4 + 8), add_special_tokens=False)["input_ids"][:n]
    assert len(out) == n
    return out

out = {}
if part == "a":
    core = EngineCore(loaded, CoreSettings(token_budget=256, max_batch=16, kv_budget_bytes=BUDGET, prefix_caching=True))
    system = ids("You are a careful assistant who answers plainly. ", 600)
    request = GenerationRequest("(ids)", mode="raw", max_new_tokens=16, ignore_eos=True, top_alternatives=0)
    core.submit(request, prompt_ids=system + ids(" Warm up.", 4))
    list(core.run())
    for i in range(16):
        core.submit(request, prompt_ids=system + ids(f" Question {i}: why?", 6))
    most = 0
    while not core.idle:
        for event in core.step():
            if isinstance(event, StepCompleted) and event.running == 16:
                most = max(most, storage(core) + (0 if getattr(core, "paged", False) else core.kept_bytes()))
    out["held"] = most
elif part == "b":
    core = EngineCore(loaded, CoreSettings(token_budget=512, max_batch=16, kv_budget_bytes=BUDGET))
    request = GenerationRequest("(ids)", mode="raw", max_new_tokens=8, ignore_eos=True, top_alternatives=0)
    core.submit(request, prompt_ids=ids("A long document about caches. ", long_tokens))
    for i in range(15):
        core.submit(request, prompt_ids=ids(f"Short {i}. ", 12))
    worst, tokens_bytes, held_bytes, past = 0.0, 0, 0, 0
    while not core.idle:
        for event in core.step():
            if isinstance(event, StepCompleted) and event.running == 16 and event.decode_tokens == 16:
                used = storage(core)
                tokens = sum(r.computed for r in core.running) * loaded.info.kv_bytes_per_token
                held = event.kv_cache_bytes if getattr(core, "paged", False) else used
                if held / tokens > worst:
                    worst, tokens_bytes, held_bytes = held / tokens, tokens, held
                past = max(past, used - BUDGET)
    out.update(ratio=worst, tokens=tokens_bytes, held=held_bytes, past=past)
elif part == "d":
    from engine.base.events import Finished
    from engine.base.request import ChatMessage
    from engine.base.sampling import SamplingParams
    from engine.generation.generate import generate, kept_service
    service = kept_service(loaded)
    history, continues, turns, before = (), None, [], 0
    for question in QUESTIONS_D:
        extra = {"continues": continues} if "continues" in GenerationRequest.__dataclass_fields__ else {}
        request = GenerationRequest(question, history=history, max_new_tokens=200, top_alternatives=0,
                                    sampling=SamplingParams(temperature=0.0), **extra)
        final = [e for e in generate(loaded, request, service=service) if isinstance(e, Finished)][0]
        turns.append((final.prompt_tokens, final.cached_tokens, before, final.text.count("\n\n")))
        before = final.prompt_tokens + final.tokens
        history += (ChatMessage("user", question), ChatMessage("assistant", final.text))
        continues = (final.prompt_ids, final.token_ids) if extra or hasattr(final, "prompt_ids") else None
    out["turns"] = turns
elif part == "e":
    core = EngineCore(loaded, CoreSettings(token_budget=256, prefill_chunk=256, kv_budget_bytes=BUDGET,
                                           prefix_caching=True))
    system = ids("You are a careful assistant who answers plainly. ", 1024)
    request = GenerationRequest("(ids)", mode="raw", max_new_tokens=1, ignore_eos=True, top_alternatives=0)
    core.submit(request, prompt_ids=system + ids(" Warm up.", 16))
    list(core.run())
    times = []
    for i in range(3):
        core.submit(request, prompt_ids=system + ids(f" Document {i}: a long question about caches. ", 512))
        times.append(sum(e.step_s for e in core.run() if isinstance(e, StepCompleted) and e.prefill_tokens))
    out["prefill"] = statistics.median(times)
else:
    core = EngineCore(loaded, CoreSettings(token_budget=1024, max_batch=16, kv_budget_bytes=BUDGET))
    request = GenerationRequest("(ids)", mode="raw", max_new_tokens=96, ignore_eos=True, top_alternatives=0)
    for rows in (1, 16):
        for i in range(rows):
            core.submit(request, prompt_ids=ids(f"Row {i} of a batch. ", 48))
        steps = []
        while not core.idle:
            for event in core.step():
                if isinstance(event, StepCompleted) and event.decode_tokens == rows and event.prefill_tokens == 0:
                    steps.append(event.step_s)
        out[f"step{rows}"] = statistics.median(steps[8:72])
print(json.dumps(out))
'''


def measure(tree: Path, precision: str, part: str, long: int, compiled: bool) -> dict:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", MEASURE, precision, part, str(long), "1" if compiled else "0"],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{tree} {precision} {part} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the revision to compare against")
    parser.add_argument("--precisions", default="int8-fast,bf16-fast")
    parser.add_argument("--parts", default="a,b,c,d")
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compiled", action="store_true", help="part c with the compiled steps (built once)")
    args = parser.parse_args()
    from engine.models.kernels import cpu_flags

    print(f"CPU: {platform.processor() or platform.machine()}; flags: "
          + " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))))
    with tempfile.TemporaryDirectory() as folder:
        old = Path(folder) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for precision in args.precisions.split(","):
                for part in args.parts.split(","):
                    new_runs, old_runs = [], []
                    for _ in range(args.rounds if part in "ce" else 1):
                        new_runs.append(measure(ROOT, precision, part, args.long, args.compiled))
                        old_runs.append(measure(old, precision, part, args.long, args.compiled))
                    report(precision, part, new_runs, old_runs, args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)


def report(precision: str, part: str, new: list[dict], old: list[dict], args) -> None:
    mib = 2 ** 20
    if part == "a":
        n, o = new[0]["held"], old[0]["held"]
        print(f"{precision} a) 16 requests behind 600 tokens: KV storage {n / mib:.1f} MiB vs {o / mib:.1f} MiB "
              f"at {args.rev}: {n / o:.3f}x (target <= 0.2)")
    elif part == "b":
        n, o = new[0], old[0]
        print(f"{precision} b) one {args.long}-token request among 15 short: blocks held {n['held'] / mib:.1f} MiB "
              f"for {n['tokens'] / mib:.1f} MiB of tokens: {n['ratio']:.3f}x (target <= 1.1); storage past the "
              f"budget: {n['past'] / mib:.1f} MiB; at {args.rev} the rectangle held {o['held'] / mib:.1f} MiB "
              f"({o['ratio']:.2f}x the tokens)")
    elif part == "d":
        for name, runs in (("this tree", new[0]), (args.rev, old[0])):
            turns = runs["turns"][1:]
            whole = [cached == (before - 1) // 16 * 16 for _, cached, before, _ in turns]
            missed = sum((before - 1) // 16 * 16 - cached for _, cached, before, _ in turns)
            prompt, cached, before, _ = turns[-1]
            breaks = sum(t[3] for t in runs["turns"])
            print(f"{precision} d) 6-turn chat ({breaks} paragraph breaks in the answers), {name}: turns 2-6 found "
                  f"every whole block of the conversation before them in {sum(whole)} of {len(whole)} "
                  f"({missed} tokens computed again); turn 6: prompt {prompt} tokens, {cached} from the cache, "
                  f"{(before - 1) // 16 * 16} expected")
    elif part == "e":
        n = statistics.median(r["prefill"] for r in new)
        o = statistics.median(r["prefill"] for r in old)
        print(f"{precision} e) 512 new tokens behind a cached 1,024-token prompt: prefill {n * 1e3:.0f} ms vs "
              f"{o * 1e3:.0f} ms at {args.rev}: {o / n:.3f}x as fast")
    else:
        for rows in (1, 16):
            n = statistics.median(r[f"step{rows}"] for r in new)
            o = statistics.median(r[f"step{rows}"] for r in old)
            print(f"{precision} c) decode step, {rows} sequences{' (compiled)' if args.compiled else ''}: "
                  f"{n * 1e3:.2f} ms vs {o * 1e3:.2f} ms at {args.rev}: {o / n:.3f}x as fast (target >= 0.95)")


if __name__ == "__main__":
    main()
