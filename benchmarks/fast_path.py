"""The fast path against the reference path, transformers' ``generate`` and llama.cpp, side by side.

Every engine is loaded once, then all of them run round after round, interleaved (A B C …
A B C …), each making exactly N greedy tokens of the same prompt on the default model, so the
drift of a shared machine lands on all alike. Per engine: decode tok/s as the median of the
per-token times over all rounds; the ratio to ``generate`` in fp32; the share of this machine's
measured read bandwidth the weights a token reads stream at (the roofline: all the weights but
an embedding table the head doesn't share, of which a token reads one row). The bandwidth is read
again right before and right after each engine's round (a fraction of a second each), and each
round's share is its own rate over the mean of those two: on a machine whose memory's speed drifts
(a shared host's moves by half within minutes) a figure taken once would make the share drift
with it. The table gives the median share and the range of the rounds'.

When ``llama-bench`` is on PATH (and ``llama-quantize`` to make the F32/BF16/Q8_0 files from the
default model's Q4_1 GGUF: the bit width is what sets the speed, not the values), each of our four
fast precisions is set against llama.cpp at the same bit width, one ``llama-bench -p 0 -n N``
per round between ours, and the table gives the median of the per-round ratios. With
``llama-batched-bench`` too, the engine core at ``--batch`` sequences against it (and against
itself at one sequence: what batching buys; both with the compiled steps ready), for each of
``--batch-precisions``; and a prompt of
``--prompt`` tokens (``llama-bench -p``) for each fast precision. llama.cpp is built outside the
project (never a CI step); see the README's benchmarks section.

    python benchmarks/fast_path.py --tokens 64 --rounds 3
    INFERENCE_WORKBENCH_NO_INT8_KERNELS=1 python benchmarks/fast_path.py …   # the weight-only kernels instead
    python benchmarks/fast_path.py --random-config Qwen/Qwen3-0.6B --batch 0 --prompt 0   # weights past the L3
    python benchmarks/fast_path.py --engines generate-fp32,int8-fast,int8-fast+compiled --rounds 5

"+compiled" engines, and the batched runner, make the compiled decode steps ready first
(engine/generation/compiled_step.py: the one-sequence step and the batched step, built by a child
process into the user cache, about four minutes per precision the first time on two cores,
loaded in seconds afterwards).
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
from engine.models.loading import LoadRequest, load_model, weights_read_bytes
from engine.base.request import GenerationRequest
from engine_vs_transformers import _Clock  # benchmarks/ is on the path when run as a script
from engine.generation.generate import generate

PROMPT = "Explain microservices in simple terms."
DEFAULT_ENGINES = ("generate-fp32", "fp32-fast+compiled", "bf16-fast+compiled", "int8-fast+compiled",
                   "int4-fast+compiled")
MODEL = "default"
"""The model every engine loads (``--model``, ``--random-config``)."""
LLAMA_SOURCE: str | None = None
"""The GGUF llama.cpp's files are made from: the default model's, or ``--gguf``'s (none: no llama.cpp)."""
LLAMA_TYPES = {"fp32-fast": "F32", "bf16-fast": "BF16", "int8-fast": "Q8_0", "int4-fast": "Q4_1"}
"""llama.cpp's file type at the bit width of each of our fast precisions."""


def _tool(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def llama_files(types) -> dict[str, str]:
    """The default model's GGUF in each of ``types``: its own Q4_1, the rest requantized once
    (kept beside it in the user cache)."""
    import subprocess

    from pathlib import Path

    from engine.models import default_model

    if LLAMA_SOURCE is None:
        default_model.ensure()
    source = default_model.gguf_path() if LLAMA_SOURCE is None else Path(LLAMA_SOURCE)
    files = {}
    for kind in types:
        path = source if kind == "Q4_1" and LLAMA_SOURCE is None else source.with_name(
            f"{source.stem}.requantized-{kind}.gguf")
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


def batch_model(name: str):
    """The default model at precision ``name`` with its compiled steps ready (one sequence and
    batches), as the app runs it once its background build is done."""
    loaded = load_model(LoadRequest(MODEL, name, "cpu"))
    print(f"  {compile_decoder(loaded.fast).describe()}")
    return loaded


def our_batched(loaded, tokens: int, batch: int):
    """A function running our batched runner once (``batch`` copies of the prompt): aggregate decode
    tok/s, and the prompt's token count."""
    from engine.base.events import BatchFinished
    from engine.measure.batch import stream_batch

    request = GenerationRequest(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    ids = loaded.encode(request)

    def run() -> float:
        finished = [e for e in stream_batch(loaded, request, [ids] * batch) if isinstance(e, BatchFinished)][0]
        return finished.aggregate_tokens_per_s
    return run, len(ids)


def prompt_text(tokens: int) -> str:
    """A raw prompt of about ``tokens`` tokens: the start of the shipped evaluation text."""
    from engine.measure import quality

    loaded = load_model(LoadRequest(MODEL, "bf16", "cpu"))
    ids = quality.text_tokens(loaded, quality.read_text(None)[1])[1:tokens + 1]
    text = loaded.tokenizer.decode(ids)
    loaded.close()
    return text


def our_prompt(name: str, text: str):
    """A function reading ``text`` once as a prompt (one token generated): prompt tok/s; and its
    token count."""
    from engine.base.events import Prefilled

    loaded = load_model(LoadRequest(MODEL, name, "cpu"))
    request = GenerationRequest(text, mode="raw", max_new_tokens=1, reuse_prefix=False)

    def run() -> float:
        prefilled = next(e for e in generate(loaded, request) if isinstance(e, Prefilled))
        return prefilled.prefill_tokens_per_s
    return run, len(loaded.encode(request))


def llama_prompt(path: str, tokens: int):
    """A function running ``llama-bench -p tokens -n 0`` once: prompt tok/s."""
    import subprocess

    def run() -> float:
        out = subprocess.run([_tool("llama-bench"), "-m", path, "-p", str(tokens), "-n", "0", "-r", "1",
                              "-t", str(torch.get_num_threads()), "-o", "json"], check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out)[0]["avg_ts"]
    return run


def _steps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def read_per_token(loaded) -> int:
    """The weight bytes one decode token reads: all of them, less an input embedding table the
    head doesn't share (the quantized precisions keep one beside their quantized head; a token
    reads one row of it). llama.cpp's files tie the two, so the head reads the table whole."""
    return weights_read_bytes(loaded.model, loaded.info.weights_bytes)


def make_engine(name: str, tokens: int):
    """(a function that returns per-token decode times, weights bytes, weight bytes a token reads)."""
    request = GenerationRequest(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    if name.startswith("generate-"):
        loaded = load_model(LoadRequest(MODEL, name.split("-", 1)[1], "cpu"))
        ids = torch.tensor([loaded.encode(request)])
        config = copy.deepcopy(loaded.model.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.do_sample = tokens, tokens, False

        def run() -> list[float]:
            clock = _Clock()
            loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  streamer=clock)
            return _steps(clock.times[1:])  # the first put is the prompt
        return run, loaded.info.weights_bytes, read_per_token(loaded)
    loaded = load_model(LoadRequest(MODEL, name.removesuffix("+compiled"), "cpu"))
    if name.endswith("+compiled"):  # one sequence: the batched step is the batch runner's to build
        print(f"  {compile_decoder(loaded.fast, rows=False).describe()}")

    def run() -> list[float]:
        return [e.latency_s for e in generate(loaded, request) if isinstance(e, TokenGenerated)][1:]
    return run, loaded.info.weights_bytes, read_per_token(loaded)


def random_model(hub_id: str) -> str:
    """A folder with random bf16 weights in ``hub_id``'s shipped config and the default model's
    tokenizer, made once in the user cache. The vocabulary is the tokenizer's (49,152 tokens, not
    the config's): llama.cpp reads the same weights only where the two agree, and every other
    tensor keeps the config's shape."""
    from engine.estimates.estimate import shipped_config
    from engine.models import default_model
    from engine.storage.paths import cache_dir

    folder = cache_dir() / "benchmarks" / f"random-{hub_id.replace('/', '--')}-default-vocabulary"
    if (folder / "config.json").exists():
        return str(folder)
    config = shipped_config(hub_id)
    if config is None:
        raise SystemExit(f"no shipped config for {hub_id} (resources/configs)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"making random weights in {hub_id}'s config (once) …", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model.ensure()))
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    parser.add_argument("--batch", type=int, default=16, help="sequences for the batched runner (0: skip it)")
    parser.add_argument("--batch-precisions", default="bf16-fast,int8-fast,int4-fast",
                        help="the batched runner's precisions (each also at one sequence: the batching gain)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens for the prompt column (0: skip it)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--model", default="default", help="any model the app loads (a folder, a .gguf file, a hub id)")
    parser.add_argument("--random-config", metavar="HUB_ID",
                        help="random weights in a shipped config (resources/configs: e.g. Qwen/Qwen3-0.6B), made once "
                             "in bf16 into the user cache: a real model's size and shape, for speed only")
    parser.add_argument("--gguf", help="the model as a GGUF (F32 or BF16) for llama.cpp's files, where --model or "
                                       "--random-config is not the default model")
    args = parser.parse_args()
    global MODEL, LLAMA_SOURCE
    MODEL = random_model(args.random_config) if args.random_config else args.model
    LLAMA_SOURCE = args.gguf

    from engine.estimates.hardware import bandwidth_probe, measure_cpu

    # a fixed thread count: llama.cpp's runs between ours would otherwise read as another program's
    # load, and ours would give up a thread (and the compiled step, built for two)
    os.environ.setdefault("INFERENCE_WORKBENCH_THREADS", str(torch.get_num_threads()))
    # measured now, before the engines load and after the rounds (the hardware profile's cached
    # figure is from whenever it was first taken: this machine's bandwidth moves by a third)
    bandwidth_before = measure_cpu()["bandwidth_bytes_per_s"]
    probe = bandwidth_probe()
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    peer = _tool("llama-bench") is not None and _tool("llama-quantize") is not None
    if not peer:
        print("llama-bench / llama-quantize are not on PATH: no llama.cpp figures (build llama.cpp outside the project)")
    elif MODEL != "default" and LLAMA_SOURCE is None:
        peer = False
        print("no llama.cpp figures: name this model's GGUF with --gguf (llama.cpp's convert_hf_to_gguf.py writes one)")
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
                engines[f"llama.cpp {kind}"] = (llama_bench(files[kind], args.tokens), os.path.getsize(files[kind]),
                                               os.path.getsize(files[kind]))
                pairs[name] = f"llama.cpp {kind}"
    batched = {}  # name -> run; pairs by precision: ours at batch, ours alone, llama.cpp at batch
    batch_pairs = {}
    if args.batch:
        for precision in [p.strip() for p in args.batch_precisions.split(",") if p.strip()]:
            print(f"loading the batched runner ({precision}, {args.batch} sequences and one) …", flush=True)
            loaded = batch_model(precision)
            run, prompt_tokens = our_batched(loaded, args.tokens, args.batch)
            batched[f"ours {precision} ×{args.batch}"] = run
            batched[f"ours {precision} ×1"] = our_batched(loaded, args.tokens, 1)[0]
            kind = LLAMA_TYPES.get(precision)
            theirs = None
            if peer and _tool("llama-batched-bench") and kind:
                theirs = f"llama.cpp {kind} ×{args.batch}"
                batched[theirs] = llama_batched(llama_files([kind])[kind], args.tokens, args.batch, prompt_tokens)
            batch_pairs[precision] = (f"ours {precision} ×{args.batch}", f"ours {precision} ×1", theirs)
    prompts = {}
    prompt_pairs = {}
    if args.prompt:
        text = prompt_text(args.prompt)
        for name in names:
            precision = name.removesuffix("+compiled")
            if precision not in LLAMA_TYPES or f"ours {precision}" in prompts:
                continue
            print(f"loading {precision} for the prompt column …", flush=True)
            run, count = our_prompt(precision, text)
            prompts[f"ours {precision}"] = run
            theirs = None
            if peer:
                kind = LLAMA_TYPES[precision]
                theirs = f"llama.cpp {kind} p{count}"
                prompts[theirs] = llama_prompt(llama_files([kind])[kind], count)
            prompt_pairs[precision] = (f"ours {precision}", theirs, count)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    per_round: dict[str, list[float]] = {name: [] for name in engines}
    shares: dict[str, list[float]] = {name: [] for name in engines}  # of the bandwidth read around each round
    probes: list[float] = []
    batch_rates: dict[str, list[float]] = {name: [] for name in batched}
    prompt_rates: dict[str, list[float]] = {name: [] for name in prompts}
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up and is dropped
        for name, (run, _, read) in engines.items():
            before = probe()
            times = run()
            after = probe()
            if round_:
                steps[name] += times
                per_round[name].append(1.0 / statistics.median(times))
                shares[name].append(100 * read * per_round[name][-1] / ((before + after) / 2))
                probes += [before, after]
        for name, run in batched.items():
            rate = run()
            if round_:
                batch_rates[name].append(rate)
        for name, run in prompts.items():
            rate = run()
            if round_:
                prompt_rates[name].append(rate)
    bandwidth_after = measure_cpu()["bandwidth_bytes_per_s"]
    bandwidth = (bandwidth_before + bandwidth_after) / 2
    rate = {name: 1.0 / statistics.median(times) for name, times in steps.items()}
    base = rate.get("generate-fp32")
    from engine.models import kernels

    from engine.estimates.hardware import last_level_cache_bytes

    flags = sorted(f for f in kernels.cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni")) or f == "avx2")
    l3 = last_level_cache_bytes()
    print(f"\nmodel: {MODEL}; last-level cache {f'{l3 / 2**20:.0f} MiB' if l3 else 'unknown'}: a token's reads "
          "that fit in it come from the cache, the rest from the memory (column 'from')")
    print(f"{args.tokens} greedy tokens × {args.rounds} rounds, interleaved; {torch.get_num_threads()} threads; "
          f"read bandwidth measured before and after the rounds {bandwidth_before / 1e9:.1f} and "
          f"{bandwidth_after / 1e9:.1f} GB/s, around each engine's rounds {min(probes) / 1e9:.1f}-"
          f"{max(probes) / 1e9:.1f} GB/s (each round's share of the roofline is over the mean of its two)\nCPU flags: {' '.join(flags)}; int8-activation "
          f"kernels: {'on' if kernels.kernels() else 'off (' + str(kernels.unavailable()) + ')'}")
    print(f"{'engine':<20} {'tok/s':>7} {'vs generate fp32':>17} {'weights':>10} {'read/token':>11} "
          f"{'from':>7} {'% of roofline (range)':>22}")
    rows = []
    for name in engines:
        weights, read = engines[name][1:]
        roofline = statistics.median(shares[name])  # what a token reads, not what is held
        source = "?" if not l3 else ("L3" if read <= l3 else "memory")
        spread = f"{min(shares[name]):.0f}-{max(shares[name]):.0f}"
        print(f"{name:<20} {rate[name]:7.1f} {(f'{rate[name] / base:.2f}×' if base else ''):>17} "
              f"{weights / 2**20:8.1f}Mi {read / 2**20:9.1f}Mi {source:>7} {roofline:11.0f}% ({spread:>7})")
        rows.append({"engine": name, "tokens_per_s": rate[name], "vs_generate_fp32": rate[name] / base if base else None,
                     "weights_bytes": weights, "read_per_token_bytes": read, "roofline_percent": roofline,
                     "roofline_percent_rounds": shares[name], "reads_from": source})
    if pairs:
        print(f"\n{'ours':<20} {'tok/s':>7}   {'llama.cpp':<15} {'tok/s':>7}   ratio (median of {args.rounds} rounds)")
        for ours, theirs in pairs.items():
            ratio = statistics.median(a / b for a, b in zip(per_round[ours], per_round[theirs]))
            print(f"{ours:<20} {rate[ours]:7.1f}   {theirs:<15} {rate[theirs]:7.1f}   {ratio:.2f}")
            rows.append({"engine": ours, "versus": theirs, "ratio": ratio})
    def ratio(a: str, b: str, rates) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    if prompt_rates:
        print(f"\nprompt of {args.prompt} tokens (prompt tok/s; ratio: median of the per-round ratios):")
        for precision, (ours, theirs, count) in prompt_pairs.items():
            line = f"  {precision:<10} ours {statistics.median(prompt_rates[ours]):8.1f}"
            if theirs:
                line += (f"   {theirs:<22} {statistics.median(prompt_rates[theirs]):8.1f}   "
                         f"ratio {ratio(ours, theirs, prompt_rates):.2f}")
                rows.append({"engine": f"prompt {precision}", "versus": theirs, "ratio": ratio(ours, theirs, prompt_rates)})
            print(line)
            rows.append({"engine": f"prompt {precision}", "tokens_per_s": statistics.median(prompt_rates[ours]),
                         "prompt_tokens": count})
    if batch_rates:
        print(f"\nbatched, {args.batch} sequences × {args.tokens} tokens through the engine core (decode tok/s of all):")
        for precision, (ours, alone, theirs) in batch_pairs.items():
            line = (f"  {precision:<10} ×{args.batch} {statistics.median(batch_rates[ours]):7.1f}   ×1 "
                    f"{statistics.median(batch_rates[alone]):6.1f}   gain {ratio(ours, alone, batch_rates):.2f}×")
            if theirs:
                line += (f"   {theirs:<20} {statistics.median(batch_rates[theirs]):7.1f}   "
                         f"ratio {ratio(ours, theirs, batch_rates):.2f}")
                rows.append({"engine": f"batch{args.batch} {precision}", "versus": theirs,
                             "ratio": ratio(ours, theirs, batch_rates)})
            print(line)
            rows.append({"engine": f"batch{args.batch} {precision}", "tokens_per_s": statistics.median(batch_rates[ours]),
                         "gain_over_one": ratio(ours, alone, batch_rates)})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "bandwidth_bytes_per_s": bandwidth,
                       "bandwidth_before_after": [bandwidth_before, bandwidth_after],
                       "bandwidth_around_rounds": probes, "tokens": args.tokens,
                       "rounds": args.rounds, "versions": versions()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
