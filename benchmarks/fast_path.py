"""The fast path against the reference path, transformers' ``generate`` and (if installed) llama.cpp.

Every engine is loaded once, then all of them run round after round, interleaved (A B C …
A B C …), each making exactly N greedy tokens of the same prompt on the default model, so the
drift of a shared machine lands on all alike. Per engine: decode tok/s as the median of the
per-token times over all rounds; the ratio to ``generate`` in fp32 (the issue's baseline);
the share of this machine's measured read bandwidth the weights stream at (the roofline:
weights bytes × tok/s ÷ bandwidth); and, for int8/int4, the ratio to llama.cpp's Q8_0/Q4_1
when ``llama-cpp-python`` is installed (it compiles from source, so it is never a CI step;
``--gguf-q8`` names a Q8_0 file, the default model's own GGUF is Q4_1).

    python benchmarks/fast_path.py --tokens 64 --rounds 3
    python benchmarks/fast_path.py --engines generate-fp32,int8-fast,int8-fast+compiled --rounds 5

"+compiled" engines compile the decode step first (torch.compile, cached on disk in the user
cache: ~40 s per engine the first time on two cores, seconds afterwards).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import time

import torch

from engine.measure.bench import versions
from engine.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.request import GenerationRequest
from engine_vs_transformers import _Clock  # benchmarks/ is on the path when run as a script

PROMPT = "Explain microservices in simple terms."
DEFAULT_ENGINES = ("generate-fp32", "generate-bf16", "fp32", "fp32-fast", "fp32-fast+compiled", "bf16", "bf16-fast",
                   "bf16-fast+compiled", "int8", "int8-fast", "int8-fast+compiled", "nf4", "int4-fast",
                   "int4-fast+compiled")


def _steps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def make_engine(name: str, tokens: int, gguf_q8: str | None):
    """(a function that returns per-token decode times, weights bytes)."""
    request = GenerationRequest(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    if name.startswith("generate-"):
        loaded = load_model(LoadRequest("default", name.split("-", 1)[1], "cpu"))
        ids = torch.tensor([loaded.encode(request)])
        config = copy.deepcopy(loaded.model.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.do_sample = tokens, tokens, False

        def run() -> list[float]:
            clock = _Clock()
            loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  streamer=clock)
            return _steps(clock.times[1:])  # the first put is the prompt
        return run, loaded.info.weights_bytes
    if name.startswith("llama.cpp-"):
        from llama_cpp import Llama

        from engine.models import default_model

        default_model.ensure()  # fetched and checked, GGUF kept in the cache
        path = gguf_q8 if name.endswith("q8_0") else str(default_model.gguf_path())
        llm = Llama(model_path=path, n_threads=torch.get_num_threads(), n_ctx=1024, verbose=False)
        prompt_ids = llm.tokenize(PROMPT.encode())

        def run() -> list[float]:
            times = []
            for _ in llm.generate(prompt_ids, temp=0.0, reset=True):
                times.append(time.perf_counter())
                if len(times) == tokens:
                    break
            return _steps(times)
        import os

        return run, os.path.getsize(path)
    loaded = load_model(LoadRequest("default", name.removesuffix("+compiled"), "cpu"))
    if name.endswith("+compiled"):
        from engine.generation.fast import _bucket

        report = loaded.fast.compile(capacities=(_bucket(len(loaded.encode(request)) + tokens),))
        print(f"  compiled in {report.seconds:.1f} s" + (f" — failed: {report.error}" if report.error else ""))

    def run() -> list[float]:
        return [e.latency_s for e in loaded.generate(request) if isinstance(e, TokenGenerated)][1:]
    return run, loaded.info.weights_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    parser.add_argument("--gguf-q8", help="a Q8_0 GGUF of the same model, for llama.cpp's int8 figure")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from engine.estimates.hardware import this_machine

    bandwidth = this_machine().bandwidth_bytes_per_s
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    if importlib.util.find_spec("llama_cpp") is not None:
        names.append("llama.cpp-q4_1")
        if args.gguf_q8:
            names.append("llama.cpp-q8_0")
    else:
        print("llama-cpp-python is not installed: no llama.cpp figures (pip install llama-cpp-python compiles it)")
    engines = {}
    for name in names:
        print(f"loading {name} …", flush=True)
        engines[name] = make_engine(name, args.tokens, args.gguf_q8)
    steps: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up and is dropped
        for name, (run, _) in engines.items():
            times = run()
            if round_:
                steps[name] += times
    rate = {name: 1.0 / statistics.median(times) for name, times in steps.items()}
    base = rate.get("generate-fp32")
    print(f"\n{args.tokens} greedy tokens × {args.rounds} rounds, interleaved; {torch.get_num_threads()} threads; "
          f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'engine':<20} {'tok/s':>7} {'vs generate fp32':>17} {'weights':>10} {'% of roofline':>14} {'vs llama.cpp':>13}")
    rows = []
    for name in names:
        weights = engines[name][1]
        roofline = 100 * weights * rate[name] / bandwidth
        versus = ""
        if name.startswith(("int8-fast", "int4-fast")):
            other = rate.get("llama.cpp-q8_0" if name.startswith("int8") else "llama.cpp-q4_1")
            versus = f"{rate[name] / other:.2f}×" if other else ""
        print(f"{name:<20} {rate[name]:7.1f} {(f'{rate[name] / base:.2f}×' if base else ''):>17} "
              f"{weights / 2**20:8.1f}Mi {roofline:13.0f}% {versus:>13}")
        rows.append({"engine": name, "tokens_per_s": rate[name], "vs_generate_fp32": rate[name] / base if base else None,
                     "weights_bytes": weights, "roofline_percent": roofline})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "bandwidth_bytes_per_s": bandwidth, "tokens": args.tokens,
                       "rounds": args.rounds, "versions": versions()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
