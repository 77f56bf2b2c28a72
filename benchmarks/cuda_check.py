"""One short check of a GPU's figures, on a machine with an NVIDIA GPU (never a CI step).

For each precision on the device, the default model is loaded once and then, interleaved
round after round, our engine and transformers' ``generate`` each make N greedy tokens of the
same prompt. Printed per precision:

- decode tok/s (median of the per-token times over all rounds): ours (on CUDA a lone request's
  decode step is captured once as a CUDA graph and replayed: engine/generation/runners.py), the
  same engine with that step eager, ``generate``'s, and the same engine on the CPU where
  ``--cpu-precisions`` names one (the issue's "against the same steps on the CPU"); which step
  ran, and for how many tokens the greedy answers of the captured and the eager step agree;
- the share of the device's memory-bandwidth roofline the weights stream at (weights bytes ×
  tok/s ÷ bandwidth): the bandwidth measured here (a reduction over a tensor far bigger than
  the caches) and the datasheet's where resources/hardware.json knows the device;
- the memory figures the window plots, from the engine's own events at the last token
  (allocated, reserved, peak; NVML's whole-device figure), against the prediction: weights
  (engine/estimates/estimate.py) + the KV cache of the prompt and answer.

A precision the device can't run (the fast path is CPU-only for now, bitsandbytes without a
GPU build…) prints the engine's own refusal instead of figures.

    python benchmarks/cuda_check.py --tokens 64 --rounds 3
    python benchmarks/cuda_check.py --device cpu --precisions fp32,bf16-fast   # the script itself, on a CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from engine.base.errors import EngineError
from engine.estimates.estimate import config_for, count_parameters, weights_bytes
from engine.base.events import Finished, TokenGenerated
from engine.generation.compiled_step import compile_decoder
from engine.measure.bench import versions
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine_vs_transformers import theirs  # benchmarks/ is on the path when run as a script
from engine.generation.core import EngineCore
from engine.generation.service import EngineService
from engine.generation.generate import alone, generate
from engine.generation.runners import ReferenceBatchRunner

PROMPT = "Explain microservices in simple terms."
GPU_PRECISIONS = ("fp16", "bf16", "int8", "nf4", "bf16-fast", "int8-fast", "int4-fast")
MiB = 2 ** 20


def measured_bandwidth(device: torch.device) -> float:
    """Bytes a second a reduction reads from the device's memory (best of 5; 2 GiB on a GPU)."""
    if device.type == "cpu":
        from engine.estimates.hardware import measure_cpu

        return measure_cpu()["bandwidth_bytes_per_s"]
    data = torch.ones(1024 * 1024 * 1024, dtype=torch.float16, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        data.sum()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    size = data.numel() * data.element_size()
    del data
    torch.cuda.empty_cache()
    return size / best


def datasheet(device: torch.device):
    """The device's profile from resources/hardware.json, matched by name, or ``None``."""
    if device.type != "cuda":
        return None
    from engine.estimates.hardware import shipped_profiles

    name = torch.cuda.get_device_name(device).lower()
    for profile in shipped_profiles():
        if profile.kind == "gpu" and profile.id.lower() in name.replace(" ", "").replace("-", ""):
            return profile
    return None


def _ours(loaded, request, service=None) -> tuple[list[float], TokenGenerated, Finished]:
    events = list(generate(loaded, request, service=service))
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    return [t.latency_s for t in tokens[1:]], tokens[-1], events[-1]


def _services(loaded) -> tuple[EngineService | None, EngineService | None]:
    """Two kept services for the reference path (None, None on the fast path): the engine's own runner
    (on CUDA a lone request's decode step is captured once as a CUDA graph and replayed) and one
    whose steps stay eager, for the same steps side by side."""
    if loaded.fast is not None:
        return None, None
    eager = ReferenceBatchRunner(loaded.model, loaded.supports_logits_to_keep, graphs=False)
    eager_core = EngineCore(loaded, alone(), runner=eager)
    return EngineService(loaded, alone()), EngineService(loaded, alone(), core=eager_core)


def _step_kind(service) -> str:
    if service is None:
        return "fast path"
    runner = service.core.runner  # the reference runner (the fast path has no service here)
    if runner.graph is not None and runner.graph.graph is not None:
        return f"CUDA graph ({runner.graph.capacity} slots)"
    return f"eager ({runner.graph_error})" if runner.graph_error else "eager"


def check(name: str, device: str, tokens: int, rounds: int, cpu_too: bool) -> dict:
    """Figures of one precision on ``device`` (or the engine's refusal)."""
    row: dict = {"precision": name, "device": device}
    try:
        loaded = load_model(LoadRequest("default", name, device))
    except EngineError as exc:
        return {**row, "refused": str(exc)}
    request = GenerationRequest(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    ids = torch.tensor([loaded.encode(request)], device=loaded.device)
    config = copy.deepcopy(loaded.model.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.do_sample = tokens, tokens, False
    cpu = None
    if cpu_too:
        try:
            cpu = load_model(LoadRequest("default", name, "cpu"))
        except EngineError as exc:
            row["cpu_refused"] = str(exc)
    if name.endswith("-fast") and loaded.fast is not None:
        report = compile_decoder(loaded.fast)
        row["compile_s"], row["compile_error"] = report.seconds, report.error
    ours, eager_steps, theirs_steps, on_cpu = [], [], [], []
    last = final = None
    service, eager_service = _services(loaded)
    _ours(loaded, request, service)  # warm: the allocator and kernels settle (and the step is captured)
    answers = {}
    for _ in range(rounds):
        steps, last, final = _ours(loaded, request, service)
        ours += steps
        answers["ours"] = final.token_ids
        if eager_service is not None:
            steps, _, eager_final = _ours(loaded, request, eager_service)
            eager_steps += steps
            answers["eager"] = eager_final.token_ids
        if loaded.fast is None:  # generate runs the same weights only on the reference path
            theirs_steps += theirs(loaded, config, ids, tokens)[1]
        if cpu is not None:
            on_cpu += _ours(cpu, request)[0]
    if "eager" in answers:
        a, b = answers["ours"], answers["eager"]
        row["same_tokens"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    row["step"] = _step_kind(service)
    predicted_weights = weights_bytes(count_parameters(config_for("default")), name, loaded.device.type)
    predicted_kv = loaded.predicted_kv_bytes(ids.shape[1] + tokens - 1)
    memory = last.memory
    row.update(
        ours_tok_s=1 / statistics.median(ours),
        eager_tok_s=1 / statistics.median(eager_steps) if eager_steps else None,
        generate_tok_s=1 / statistics.median(theirs_steps) if theirs_steps else None,
        cpu_tok_s=1 / statistics.median(on_cpu) if on_cpu else None,
        weights_bytes=loaded.info.weights_bytes, weights_predicted=predicted_weights,
        kv_bytes=final.kv_cache_bytes, kv_predicted=predicted_kv,
        allocated=memory.device_allocated_bytes, reserved=memory.device_reserved_bytes,
        peak=memory.device_peak_bytes, device_used=memory.device_used_bytes, rss=memory.rss_bytes,
    )
    loaded.close()
    if cpu is not None:
        cpu.close()
    return row


def _mib(value) -> str:
    return "—" if value is None else f"{value / MiB:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", default=",".join(GPU_PRECISIONS))
    parser.add_argument("--cpu-precisions", default="bf16,bf16-fast,int8-fast,int4-fast",
                        help="also run these on the CPU, for the same steps side by side ('' for none)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run it where a GPU machine is lent, or pass --device cpu", file=sys.stderr)
        return 2
    bandwidth = measured_bandwidth(device)
    sheet = datasheet(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}: read bandwidth measured {bandwidth / 1e9:.0f} GB/s"
          + (f", datasheet {sheet.bandwidth_bytes_per_s / 1e9:.0f} GB/s ({sheet.name})" if sheet else ""))
    print(json.dumps(versions()))
    cpu_names = {p for p in args.cpu_precisions.split(",") if p} if device.type != "cpu" else set()
    rows = []
    for precision in args.precisions.split(","):
        print(f"{precision} …", flush=True)
        rows.append(check(precision, args.device, args.tokens, args.rounds, precision in cpu_names))
    print(f"\n{args.tokens} greedy tokens × {args.rounds} rounds, interleaved; decode tok/s = 1 / median per-token time")
    print(f"{'precision':<11} {'ours':>7} {'eager':>7} {'generate':>9} {'on CPU':>7} {'roofline':>9}   "
          f"{'weights MiB (predicted)':>24} {'KV MiB (predicted)':>19} {'allocated':>10} {'reserved':>9} "
          f"{'peak':>8} {'NVML used':>10}")
    tokens = args.tokens
    for row in rows:
        if "refused" in row:
            print(f"{row['precision']:<11} refused: {row['refused']}")
            continue
        roofline = row["weights_bytes"] * row["ours_tok_s"] / bandwidth
        generate = f"{row['generate_tok_s']:.1f}" if row["generate_tok_s"] else "—"
        cpu = f"{row['cpu_tok_s']:.1f}" if row["cpu_tok_s"] else "—"
        eager = f"{row['eager_tok_s']:.1f}" if row.get("eager_tok_s") else "—"
        print(f"{row['precision']:<11} {row['ours_tok_s']:>7.1f} {eager:>7} {generate:>9} {cpu:>7} {roofline:>8.2%}   "
              f"{_mib(row['weights_bytes']):>10} ({_mib(row['weights_predicted'])}){'':>5} "
              f"{_mib(row['kv_bytes']):>8} ({_mib(row['kv_predicted'])}){'':>2} {_mib(row['allocated']):>10} "
              f"{_mib(row['reserved']):>9} {_mib(row['peak']):>8} {_mib(row['device_used']):>10}")
        same = f"; greedy tokens equal to the eager step's: {row['same_tokens']} of {tokens}" if "same_tokens" in row else ""
        print(f"{'':<11} decode step: {row['step']}{same}")
        if row.get("compile_error"):
            print(f"{'':<11} compile failed: {row['compile_error']}")
        if row.get("cpu_refused"):
            print(f"{'':<11} on the CPU: {row['cpu_refused']}")
    if device.type == "cuda":
        print("\nallocated should be the weights plus the KV cache and a step's activations; reserved is what "
              "PyTorch's allocator holds from the driver; NVML counts the whole device (the CUDA context too).")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"device": name, "bandwidth_bytes_per_s": bandwidth, "rows": rows, "versions": versions()},
                      out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
