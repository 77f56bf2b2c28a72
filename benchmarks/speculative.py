"""Speculative decoding on the fast path, measured side by side in one run on the default model:

- the verification pass: the last token and k guesses as one sequence's rows of the compiled
  batched step, against one compiled decode step, after a prompt of each ``--contexts`` length
  (target: at most 1.3× at k = 4 on int8-fast);
- prompt lookup (``ngram:N``) on an edit-this-text prompt, whose answer repeats its input, against
  plain decoding of the same request (target: 1.5× or more, the same tokens);
- early exit (``early-exit:K``), whose guesses cost a real pass: the speed-up predicted from the
  acceptance rate and what a guess and a check cost, (1 − α^(k+1)) / ((1 − α)(k·c + v)), against
  the measured one (target: within 15%).

Each run is plain decoding then speculative decoding of the same request, back to back, in
``--rounds`` rounds; each figure is the median. Every engine runs its compiled steps.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/speculative.py [--precisions int8-fast,bf16-fast] [--contexts 128,512] [--rounds 3]
                                     [--lookup ngram:3] [--lookup-tokens 8] [--early-exit early-exit:8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.base.request import GenerationRequest  # noqa: E402
from engine.generation.compiled_step import compile_decoder  # noqa: E402
from engine.generation.paged_cache import PagedCache  # noqa: E402
from engine.generation.speculative import load_draft, parse_draft  # noqa: E402
from engine.measure.speculative_run import speculative_report  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402

EDIT = ("Copy this paragraph exactly, but write \"ocean\" instead of \"sea\": The sea was calm that morning. "
        "Fishermen pushed their boats from the sand and rowed out past the rocks, where the sea turned from green "
        "to deep blue. By noon the nets were full, and the boats came home slowly, heavy with silver fish, while "
        "children waited on the shore.")


def verify_ratio(loaded, context: int, guesses: int, rounds: int = 60) -> tuple[float, float, float]:
    """Median times of one compiled decode step and of a verification pass of ``guesses`` + 1 rows
    after ``context`` tokens, alternating, and the median of their ratios."""
    ids = [(7 * i) % 4000 + 100 for i in range(context)]
    steps, passes, ratios = [], [], []
    with torch.inference_mode():
        cache = PagedCache(loaded.fast)
        cache.add(0, context + guesses + 2)
        cache.prefill(0, torch.tensor([ids]))
        for i in range(rounds + 5):
            started = time.perf_counter()
            cache.decode([0], [ids[i]])
            step = time.perf_counter() - started
            cache.crop(0, context)
            started = time.perf_counter()
            cache.prefill(0, torch.tensor([ids[i:i + guesses + 1]]), rows=guesses + 1)
            check = time.perf_counter() - started
            cache.crop(0, context)
            if i >= 5:  # the first few warm the caches and the allocator
                steps.append(step)
                passes.append(check)
                ratios.append(check / step)
    return statistics.median(steps), statistics.median(passes), statistics.median(ratios)


def runs(loaded, draft_text: str, request: GenerationRequest, guesses: int, rounds: int) -> dict:
    """Plain then speculative decoding of ``request``, ``rounds`` times: median figures."""
    draft = load_draft(parse_draft(draft_text, loaded.info.precision), loaded)
    draft.wait_for_compile()  # its compiled step, built or loaded before any timing
    reports = [speculative_report(loaded, draft, request, guesses, compare_plain=True) for _ in range(rounds)]
    predicted = [r.break_even for r in reports]
    draft.close()
    return {
        "draft": draft.label,
        "plain": statistics.median(r.plain_decode_tokens_per_s for r in reports),
        "speculative": statistics.median(r.finished.decode_tokens_per_s for r in reports),
        "measured": statistics.median(r.speedup_vs_plain for r in reports),
        "predicted": statistics.median(p.predicted for p in predicted) if all(predicted) else None,
        "alpha": statistics.median(p.alpha for p in predicted) if all(predicted) else None,
        "c": statistics.median(p.draft_cost for p in predicted) if all(predicted) else None,
        "v": statistics.median(p.verify_cost for p in predicted) if all(predicted) else None,
        "kept": f"{reports[-1].accepted_tokens}/{reports[-1].drafted_tokens}",
        "same": all(r.same_tokens_as_plain for r in reports),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="int8-fast,bf16-fast")
    parser.add_argument("--contexts", default="128,512", help="prompt lengths for the verification pass")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k of the verification pass and early exit")
    parser.add_argument("--lookup", default="ngram:3")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="k of prompt lookup (its guesses cost nothing)")
    parser.add_argument("--early-exit", default="early-exit:8")
    parser.add_argument("--tokens", type=int, default=96, help="max new tokens of each run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    request = GenerationRequest(EDIT, max_new_tokens=args.tokens)
    print(f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}", flush=True)
    results = []
    for precision in args.precisions.split(","):
        print(f"\nloading default ({precision}) …", flush=True)
        loaded = load_model(LoadRequest("default", precision, "cpu"))
        print(f"  {compile_decoder(loaded.fast).describe()}", flush=True)
        for context in contexts:
            step, check, ratio = verify_ratio(loaded, context, args.draft_tokens)
            print(f"  verification of {args.draft_tokens}+1 tokens after {context}: {check * 1e3:.2f} ms against a "
                  f"decode step's {step * 1e3:.2f} ms: {ratio:.2f}×", flush=True)
        for draft, guesses in ((args.lookup, args.lookup_tokens), (args.early_exit, args.draft_tokens)):
            result = runs(loaded, draft, request, guesses, args.rounds)
            results.append((precision, guesses, result))
            print(f"  {result['draft']} (k = {guesses}): {result['kept']} kept, {result['speculative']:.1f} against "
                  f"plain {result['plain']:.1f} tok/s: {result['measured']:.2f}×, predicted "
                  + ("—" if result["predicted"] is None else f"{result['predicted']:.2f}×")
                  + f"; same tokens: {result['same']}", flush=True)
        loaded.close()
    print("\nprecision   draft          k   α     c     v     plain t/s  spec t/s  measured  predicted  pred÷meas  "
          "same")
    for precision, guesses, r in results:
        known = r["predicted"] is not None
        print(f"{precision:<11} {r['draft']:<14} {guesses:<3} "
              + (f"{r['alpha']:.2f}  {r['c']:.2f}  {r['v']:.2f}  " if known else "—     —     —     ")
              + f"{r['plain']:>9.1f}  {r['speculative']:>8.1f}  {r['measured']:>7.2f}×  "
              + (f"{r['predicted']:>8.2f}×  {r['predicted'] / r['measured']:>8.2f}" if known else f"{'—':>9}  {'—':>8}")
              + f"  {r['same']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
