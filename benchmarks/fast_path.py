"""The fast path against the reference path, transformers' ``generate`` and llama.cpp, side by side.

Every engine is loaded once, then all of them run round after round, interleaved (A B C …
A B C …), each making exactly N greedy tokens of the same prompt on the default model, so the
drift of a shared machine lands on all alike. Per engine: decode tok/s as the median of the
per-token times over all rounds; the ratio to ``generate`` in fp32; the share of this machine's
measured read bandwidth the weights stream at (the roofline).

When ``llama-bench`` is on PATH (and ``llama-quantize`` to make the F32/BF16/Q8_0 files from the
default model's Q4_1 GGUF: the bit width is what sets the speed, not the values), each of our four
fast precisions is set against llama.cpp at the same bit width, one ``llama-bench -p 0 -n N``
per round between ours, and the table gives the median of the per-round ratios. With
``llama-batched-bench`` too, the batched runner at ``--batch`` sequences against it. llama.cpp
is built outside the project (never a CI step); see the README's benchmarks section.

    python benchmarks/fast_path.py --tokens 64 --rounds 3
    python benchmarks/fast_path.py --engines generate-fp32,int8-fast,int8-fast+compiled --rounds 5

"+compiled" engines make the compiled decode step ready first (engine/generation/compiled_step.py:
built by a child process into the user cache, 1-2 minutes per engine the first time on two
cores, loaded in seconds afterwards).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch

from engine.generation.compiled_step import compile_decoder
from engine.measure.bench import versions
from engine.base.events import TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine_vs_transformers import _Clock  # benchmarks/ is on the path when run as a script
from engine.generation.generate import generate

PROMPT = "Explain microservices in simple terms."
DEFAULT_ENGINES = ("generate-fp32", "fp32-fast+compiled", "bf16-fast+compiled", "int8-fast+compiled",
                   "int4-fast+compiled")
LLAMA_TYPES = {"fp32-fast": "F32", "bf16-fast": "BF16", "int8-fast": "Q8_0", "int4-fast": "Q4_1"}
"""llama.cpp's file type at the bit width of each of our fast precisions."""


def _tool(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def llama_files(types) -> dict[str, str]:
    """The default model's GGUF in each of ``types``: its own Q4_1, the rest requantized once
    (kept beside it in the user cache)."""
    import subprocess

    from engine.models import default_model

    default_model.ensure()
    source = default_model.gguf_path()
    files = {}
    for kind in types:
        path = source if kind == "Q4_1" else source.with_name(f"{source.stem}.requantized-{kind}.gguf")
        if not path.exists():
            print(f"  making {path.name} with llama-quantize …", flush=True)
            subprocess.run([_tool("llama-quantize"), "--allow-requantize", str(source), str(path), kind],
                           check=True, capture_output=True)
        files[kind] = str(path)
    return files


def llama_bench(path: str, tokens: int):
    """A function running ``llama-bench`` once: [seconds per token]."""
    import subprocess

    def run() -> list[float]:
        out = subprocess.run([_tool("llama-bench"), "-m", path, "-p", "0", "-n", str(tokens), "-r", "1",
                              "-t", str(torch.get_num_threads()), "-o", "json"], check=True, capture_output=True,
                             text=True).stdout
        return [1.0 / json.loads(out)[0]["avg_ts"]]
    return run


def llama_batched(path: str, tokens: int, batch: int, prompt_tokens: int):
    """A function running ``llama-batched-bench`` once: aggregate decode tok/s of ``batch`` sequences."""
    import subprocess

    def run() -> float:
        out = subprocess.run([_tool("llama-batched-bench"), "-m", path, "-c", str(batch * (prompt_tokens + tokens) + 64),
                              "-npp", str(prompt_tokens), "-ntg", str(tokens), "-npl", str(batch),
                              "-t", str(torch.get_num_threads()), "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])["speed_tg"]
    return run


def our_batched(name: str, tokens: int, batch: int):
    """A function running our batched runner once (``batch`` copies of the prompt): aggregate decode
    tok/s, and the prompt's token count."""
    from engine.base.events import BatchFinished
    from engine.measure.batch import stream_batch

    loaded = load_model(LoadRequest("default", name, "cpu"))
    request = GenerationRequest(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    ids = loaded.encode(request)

    def run() -> float:
        finished = [e for e in stream_batch(loaded, request, [ids] * batch) if isinstance(e, BatchFinished)][0]
        return finished.aggregate_tokens_per_s
    return run, len(ids)


def _steps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def make_engine(name: str, tokens: int):
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
    loaded = load_model(LoadRequest("default", name.removesuffix("+compiled"), "cpu"))
    if name.endswith("+compiled"):
        print(f"  {compile_decoder(loaded.fast).describe()}")

    def run() -> list[float]:
        return [e.latency_s for e in generate(loaded, request) if isinstance(e, TokenGenerated)][1:]
    return run, loaded.info.weights_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    parser.add_argument("--batch", type=int, default=16, help="sequences for the batched runner (0: skip it)")
    parser.add_argument("--batch-precision", default="bf16-fast", help="the batched runner's precision")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from engine.estimates.hardware import this_machine

    # a fixed thread count: llama.cpp's runs between ours would otherwise read as another program's
    # load, and ours would give up a thread (and the compiled step, built for two)
    os.environ.setdefault("INFERENCE_WORKBENCH_THREADS", str(torch.get_num_threads()))
    bandwidth = this_machine().bandwidth_bytes_per_s
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    peer = _tool("llama-bench") is not None and _tool("llama-quantize") is not None
    if not peer:
        print("llama-bench / llama-quantize are not on PATH: no llama.cpp figures (build llama.cpp outside the project)")
    engines = {}
    for name in names:
        print(f"loading {name} …", flush=True)
        engines[name] = make_engine(name, args.tokens)
    pairs = {}  # our engine -> llama.cpp's at its bit width
    if peer:
        files = llama_files(sorted({LLAMA_TYPES[n.removesuffix("+compiled")] for n in names
                                    if n.removesuffix("+compiled") in LLAMA_TYPES}))
        for name in names:
            kind = LLAMA_TYPES.get(name.removesuffix("+compiled"))
            if kind:
                engines[f"llama.cpp {kind}"] = (llama_bench(files[kind], args.tokens), os.path.getsize(files[kind]))
                pairs[name] = f"llama.cpp {kind}"
    batched = {}
    if args.batch:
        print(f"loading the batched runner ({args.batch_precision}, {args.batch} sequences) …", flush=True)
        run, prompt_tokens = our_batched(args.batch_precision, args.tokens, args.batch)
        batched[f"ours {args.batch_precision}"] = run
        kind = LLAMA_TYPES.get(args.batch_precision)
        if peer and _tool("llama-batched-bench") and kind:
            batched[f"llama.cpp {kind}"] = llama_batched(llama_files([kind])[kind], args.tokens, args.batch,
                                                         prompt_tokens)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    per_round: dict[str, list[float]] = {name: [] for name in engines}
    batch_rates: dict[str, list[float]] = {name: [] for name in batched}
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up and is dropped
        for name, (run, _) in engines.items():
            times = run()
            if round_:
                steps[name] += times
                per_round[name].append(1.0 / statistics.median(times))
        for name, run in batched.items():
            rate = run()
            if round_:
                batch_rates[name].append(rate)
    rate = {name: 1.0 / statistics.median(times) for name, times in steps.items()}
    base = rate.get("generate-fp32")
    print(f"\n{args.tokens} greedy tokens × {args.rounds} rounds, interleaved; {torch.get_num_threads()} threads; "
          f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'engine':<20} {'tok/s':>7} {'vs generate fp32':>17} {'weights':>10} {'% of roofline':>14}")
    rows = []
    for name in engines:
        weights = engines[name][1]
        roofline = 100 * weights * rate[name] / bandwidth
        print(f"{name:<20} {rate[name]:7.1f} {(f'{rate[name] / base:.2f}×' if base else ''):>17} "
              f"{weights / 2**20:8.1f}Mi {roofline:13.0f}%")
        rows.append({"engine": name, "tokens_per_s": rate[name], "vs_generate_fp32": rate[name] / base if base else None,
                     "weights_bytes": weights, "roofline_percent": roofline})
    if pairs:
        print(f"\n{'ours':<20} {'tok/s':>7}   {'llama.cpp':<15} {'tok/s':>7}   ratio (median of {args.rounds} rounds)")
        for ours, theirs in pairs.items():
            ratio = statistics.median(a / b for a, b in zip(per_round[ours], per_round[theirs]))
            print(f"{ours:<20} {rate[ours]:7.1f}   {theirs:<15} {rate[theirs]:7.1f}   {ratio:.2f}")
            rows.append({"engine": ours, "versus": theirs, "ratio": ratio})
    if batch_rates:
        print(f"\nbatched, {args.batch} sequences × {args.tokens} tokens (decode tok/s of all):")
        for name, rates in batch_rates.items():
            print(f"  {name:<20} {statistics.median(rates):7.1f}")
            rows.append({"engine": f"batch{args.batch} {name}", "tokens_per_s": statistics.median(rates)})
        if len(batch_rates) == 2:
            (ours, a), (_, b) = batch_rates.items()
            print(f"  ratio {statistics.median(x / y for x, y in zip(a, b)):.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "bandwidth_bytes_per_s": bandwidth, "tokens": args.tokens,
                       "rounds": args.rounds, "versions": versions()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
