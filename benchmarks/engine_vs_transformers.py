"""Our decode loop against plain ``model.generate`` on the same loaded weights.

For each precision the two run A B A B … (interleaved, so machine noise hits both
alike), each making exactly N tokens (EOS ignored). Two figures per side:

- per-token: the median time between consecutive tokens over all rounds (ours from the
  events' ``latency_s``; generate's from a streamer that only records ``perf_counter()``
  in ``put``). Medians shrug off the scheduler hiccups of a busy 2-core machine.
- wall: (N − 1) / (time for N tokens − time for 1 token), each a whole call.

The ratio is engine ÷ generate tok/s: ≥ 1.0 means our per-token bookkeeping (logprobs,
top-5 alternatives, KV bytes, memory, incremental text) costs nothing measurable. A third
figure, "bare", is a loop of forward passes and argmax with no bookkeeping at all: the floor
both are measured against. Many short interleaved rounds keep slow drifts of a shared
machine from landing on one side.

    python benchmarks/engine_vs_transformers.py --precisions fp32,bf16 --tokens 64 --rounds 12
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from engine.measure.bench import versions
from engine.base.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

PROMPT = "Explain microservices in simple terms."


class _Clock:
    """A streamer that records when generate hands over each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def ours(loaded, n: int) -> tuple[float, list[float]]:
    request = GenerationRequest(PROMPT, max_new_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    steps = [e.latency_s for e in generate(loaded, request) if isinstance(e, TokenGenerated)]
    return time.perf_counter() - start, steps[1:]


def theirs(loaded, config, ids, n: int) -> tuple[float, list[float]]:
    config.max_new_tokens = n
    clock = _Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    generation_config=config, streamer=clock)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == n
    # the first put() is the prompt, the second the first new token
    return elapsed, [b - a for a, b in zip(clock.times[1:], clock.times[2:])]


def bare(loaded, ids, n: int) -> list[float]:
    """Forward passes and argmax only: what decoding costs with no bookkeeping."""
    from transformers import DynamicCache

    model, steps = loaded.model, []
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(n - 1):
            start = time.perf_counter()
            token = out.logits[0, -1].float().argmax()
            out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {args.model}; "
          f"{args.tokens} tokens × {args.rounds} interleaved rounds")
    print(f"{'':>5}  {'bare':>6} {'engine':>8} {'generate':>9} {'ratio':>6}   {'engine':>8} {'generate':>9} {'ratio':>6}")
    print(f"{'':>5}  {'per-token median, tok/s':^32}   {'wall, tok/s (median)':^25}")
    results = {}
    n = args.tokens
    for precision in args.precisions.split(","):
        loaded = load_model(LoadRequest(args.model, precision, "cpu"))
        ids = torch.tensor([loaded.encode(GenerationRequest(PROMPT))])
        config = copy.deepcopy(loaded.model.generation_config)
        config.do_sample, config.eos_token_id = False, None  # exactly N tokens, like ignore_eos
        ours(loaded, 4), theirs(loaded, config, ids, 4)  # warm both paths
        steps = {"engine": [], "generate": [], "bare": []}
        wall = {"engine": [], "generate": []}
        for _ in range(args.rounds):
            steps["bare"] += bare(loaded, ids, n)
            for name, run in (("engine", lambda k: ours(loaded, k)),
                              ("generate", lambda k: theirs(loaded, config, ids, k))):
                full, step_times = run(n)
                one, _ = run(1)
                steps[name] += step_times
                wall[name].append((n - 1) / (full - one))
        step_rate = {k: 1 / statistics.median(v) for k, v in steps.items()}
        wall_rate = {k: statistics.median(v) for k, v in wall.items()}
        results[precision] = {
            "per_token_tok_s": step_rate, "per_token_ratio": step_rate["engine"] / step_rate["generate"],
            "wall_tok_s_rounds": wall, "wall_ratio": wall_rate["engine"] / wall_rate["generate"],
        }
        r = results[precision]
        print(f"{precision:>5}  {step_rate['bare']:6.1f} {step_rate['engine']:8.1f} {step_rate['generate']:9.1f} "
              f"{r['per_token_ratio']:6.3f}"
              f"   {wall_rate['engine']:8.1f} {wall_rate['generate']:9.1f} {r['wall_ratio']:6.3f}")
        loaded.close()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "versions": versions(), "tokens": n, "rounds": args.rounds}, fh, indent=2)


if __name__ == "__main__":
    main()
