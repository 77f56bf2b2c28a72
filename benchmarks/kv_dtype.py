"""What an int8 KV cache buys and costs, against 16-bit caches under the same weights, measured side
by side in one run on the default model:

- a token's bytes: read from the block pool's tensors, and as predicted from the config;
- one sequence's decode tok/s after a prompt of each ``--contexts`` length (every token's attention
  reads the whole cache), and ``--batch`` sequences' aggregate decode tok/s, each after its own
  ``--batch-context``-token prompt (the attention then reads far more than the weights);
- the quality price: the mean KL divergence over the shipped text at ctx 512, every probability,
  of an int8 cache against a full-precision one under the same weights (``--quality-precision``,
  fp32-fast: the default model's dequantized 4-bit weights), beside llama.cpp's
  (``llama-perplexity --kl-divergence -ctk q8_0 -ctv q8_0`` on an F32 GGUF of those weights,
  against its f32 cache) where llama-perplexity and llama-quantize are on PATH.

Every engine runs its compiled steps (one sequence, batches), as the app does once they are ready;
the rounds alternate between the KV dtypes, and each figure is the median.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/kv_dtype.py [--precision int8-fast] [--kv-dtypes fp16,bf16,int8] [--contexts 512,4096]
                                  [--batch 16] [--batch-context 1024] [--tokens 32] [--rounds 3] [--chunks N]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.fast_path import _tool, llama_files  # noqa: E402
from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.base.events import BatchFinished  # noqa: E402
from engine.base.request import GenerationRequest  # noqa: E402
from engine.estimates.hardware import last_level_cache_bytes  # noqa: E402
from engine.generation.compiled_step import compile_decoder  # noqa: E402
from engine.generation.paged_cache import PagedCache  # noqa: E402
from engine.measure import quality  # noqa: E402
from engine.measure.batch import stream_batch  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402
from engine.base.units import format_bytes, kv_dtype_label  # noqa: E402


def decode_rate(loaded, prompts: list[list[int]], tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    """Aggregate decode tok/s of ``prompts`` decoded together (one: a sequence's own rate), and
    each one's greedy tokens."""
    request = GenerationRequest("(the prompts are token ids)", mode="raw", max_new_tokens=tokens, ignore_eos=True)
    finished = [e for e in stream_batch(loaded, request, prompts) if isinstance(e, BatchFinished)][0]
    return finished.aggregate_tokens_per_s, [tuple(s.token_ids) for s in finished.sequences]


def llama_kld(chunks: int | None) -> tuple[float, float] | None:
    """llama.cpp's mean KL divergence (and its standard error) of a q8_0 cache against its f32
    cache, on an F32 GGUF of the default model's weights; ``None`` where its tools aren't on PATH."""
    if not (_tool("llama-perplexity") and _tool("llama-quantize")):
        return None
    model = llama_files(["F32"])["F32"]
    text = str(quality.default_text_path())
    common = [_tool("llama-perplexity"), "-m", model, "-c", "512", "-t", str(torch.get_num_threads()), "-fa", "on"]
    common += ["--chunks", str(chunks)] if chunks else []
    with tempfile.TemporaryDirectory() as folder:
        base = str(Path(folder) / "f32.kld")
        subprocess.run(common + ["-f", text, "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", base],
                       check=True, capture_output=True)
        out = subprocess.run(common + ["--kl-divergence-base", base, "--kl-divergence", "-ctk", "q8_0", "-ctv", "q8_0"],
                             check=True, capture_output=True, text=True)
    found = re.search(r"Mean\s+KLD:\s+([-\d.]+)\s+±\s+([\d.]+)", out.stdout + out.stderr)
    return (float(found.group(1)), float(found.group(2))) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8-fast", help="the weights every KV dtype runs under")
    parser.add_argument("--kv-dtypes", default="fp16,bf16,int8")
    parser.add_argument("--contexts", default="512,4096", help="one sequence's prompt lengths")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded after each prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quality-precision", default="fp32-fast")
    parser.add_argument("--chunks", type=int, help="score only the first N chunks of the text (default: all)")
    args = parser.parse_args()
    dtypes = args.kv_dtypes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]

    engines = {}
    for kv in dtypes:
        print(f"loading default ({args.precision}, {kv} KV cache) …", flush=True)
        engines[kv] = load_model(LoadRequest("default", args.precision, "cpu", kv_dtype=kv))
        print(f"  {compile_decoder(engines[kv].fast).describe()}", flush=True)
    text_name, text = quality.read_text(None)
    ids = quality.text_tokens(engines[dtypes[0]], text)[1:]
    needed = max(max(contexts), args.batch * args.batch_context)
    if len(ids) < needed:
        raise SystemExit(f"the shipped text has {len(ids)} tokens; these prompts need {needed}")
    singles = {c: [ids[:c]] for c in contexts}
    batch = [ids[i * args.batch_context:(i + 1) * args.batch_context] for i in range(args.batch)]

    rates: dict[tuple[str, str], list[float]] = {}
    answers: dict[str, list[tuple[int, ...]]] = {}
    for _ in range(args.rounds):
        for kv in dtypes:
            for c in contexts:
                rate, _ = decode_rate(engines[kv], singles[c], args.tokens)
                rates.setdefault((kv, f"ctx {c}"), []).append(rate)
            rate, answers[kv] = decode_rate(engines[kv], batch, args.tokens)
            rates.setdefault((kv, "batch"), []).append(rate)

    print(f"\nmodel: default (SmolLM2-135M-Instruct) as {args.precision}; {torch.get_num_threads()} threads; "
          f"CPU flags: {cpu_flags()}; last-level cache "
          f"{f'{last_level_cache_bytes() / 2**20:.0f} MiB' if last_level_cache_bytes() else 'unknown'}")
    print(f"decode: {args.tokens} greedy tokens after each prompt (the shipped text), median of {args.rounds} "
          "rounds, alternating between the KV dtypes; compiled steps")
    columns = [f"ctx {c}" for c in contexts] + ["batch"]
    names = [f"1 seq @ {c}" for c in contexts] + [f"{args.batch} seqs @ {args.batch_context}"]
    print(f"{'KV cache':<32} {'bytes/token':>12} {'predicted':>12} " + " ".join(f"{n:>15}" for n in names))
    measured = {}
    for kv in dtypes:
        loaded = engines[kv]
        with torch.inference_mode():
            measured[kv] = PagedCache(loaded.fast).per_token_bytes  # from the pool's tensors
        medians = [statistics.median(rates[(kv, c)]) for c in columns]
        print(f"{kv_dtype_label(loaded.info.kv_dtype):<32} {format_bytes(measured[kv]):>12} "
              f"{format_bytes(loaded.info.kv_bytes_per_token):>12} " + " ".join(f"{m:>11.1f} t/s" for m in medians))
    if "int8" in dtypes:
        for other in (d for d in dtypes if d != "int8"):
            ratios = [statistics.median(rates[("int8", c)]) / statistics.median(rates[(other, c)]) for c in columns]
            print(f"int8 ÷ {other:<25} {measured['int8'] / measured[other]:>12.3f} {'':>12} "
                  + " ".join(f"{r:>14.2f}×" for r in ratios))
        for other in (d for d in dtypes if d != "int8"):  # reported, not a target: greedy answers part at near-ties
            pairs = list(zip(answers["int8"], answers[other]))
            same = sum(a == b for x, y in pairs for a, b in zip(x, y)) / sum(len(y) for _, y in pairs)
            apart = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in pairs]
            print(f"greedy answers of the {len(pairs)} sequences, int8 cache against {other}: {100 * same:.1f}% of "
                  f"tokens the same, {sum(a is None for a in apart)} of {len(pairs)} identical throughout, the rest "
                  f"first apart at tokens {sorted(a for a in apart if a is not None)}")

        print(f"\nquality: {args.quality_precision} weights, {text_name} at ctx 512"
              + (f", first {args.chunks} chunks" if args.chunks else "") + ", every probability", flush=True)
        reference = load_model(LoadRequest("default", args.quality_precision, "cpu"))
        int8 = load_model(LoadRequest("default", args.quality_precision, "cpu", kv_dtype="int8"))
        tokens = quality.text_tokens(int8, text)
        report, _ = quality.measure(int8, tokens, text_name, 512, args.chunks, reference)
        ours = report.divergence
        print(f"  ours      int8 cache vs {reference.info.kv_dtype} cache: mean KLD {ours.kld_mean:.6f} ± "
              f"{ours.kld_mean_err:.6f} ({report.tokens_scored:,} tokens), same top {100 * ours.same_top:.2f}%")
        theirs = llama_kld(args.chunks)
        if theirs is None:
            print("  llama.cpp: llama-perplexity or llama-quantize not on PATH")
        else:
            print(f"  llama.cpp q8_0 cache vs f32 cache:   mean KLD {theirs[0]:.6f} ± {theirs[1]:.6f}")
            bound = theirs[0] + 2 * theirs[1]
            print(f"  ours ≤ theirs + 2 standard errors ({bound:.6f}): {'yes' if ours.kld_mean <= bound else 'no'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
