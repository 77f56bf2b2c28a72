"""The CLI's reports as text: a bench run, a speculative run, a comparison's table, an estimate.
The JSON (``--json``) carries the same figures; these are what a person reads in a terminal. And
the options several commands share (:func:`add_kv_dtype`)."""

from __future__ import annotations

from dataclasses import asdict

from engine.estimates.costs import TABLE_LOOKUP
from engine.base.units import format_bytes, format_count, format_rate, format_seconds, kv_dtype_label
from engine.endpoint.stream import served_line


def summary(r: dict) -> str:
    """A short human summary of a bench report."""
    lat = sorted(r["per_token_latency_s"][1:])

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

    kv, kv_pred = r["kv_cache_bytes"], r["kv_cache_bytes_predicted"]
    if kv_pred:
        delta = f" (Δ {100 * (kv - kv_pred) / kv_pred:+.2f}%)"
    else:
        delta = ""
    served = r.get("endpoint")
    if served:
        answered = "served   " + served_line(served)
        kv_line = "KV cache n/a (the server's own)" + _server_state(served["server_samples"])
        memory_line = "memory   n/a (on the server)"
    lines = [
        "",
        f"model    {r['model']} [{r['original_format']}] as {r['precision']} · "
        f"{format_count(r['parameters'])} params · weights {format_bytes(r['weights_bytes'])} · "
        f"{'connected' if served else 'loaded'} in {format_seconds(r['load_s'])}",
        f"device   {r['device']} · {r['device_name']}",
        f"prompt   {r['prompt_tokens']} tokens · prefill {format_seconds(r['prefill_s'])} "
        f"({format_rate(r['prefill_tokens_per_s'])}) · TTFT {format_seconds(r['ttft_s'])}",
        f"decode   {decode_tokens(r)} · {format_rate(r['decode_tokens_per_s'])} · "
        f"per {'chunk' if r['tokens_counted_by'] in ('usage', 'chunks') else 'token'} "
        f"p50 {format_seconds(pct(0.5))} · p95 {format_seconds(pct(0.95))}",
        kv_line if served else f"KV cache {format_bytes(kv)} measured · {format_bytes(kv_pred)} predicted{delta}"
        + (f" · {kv_dtype_label(r['kv_dtype'])}" if r.get("kv_dtype") else ""),
        memory_line if served else f"memory   peak {format_bytes(r['peak_memory_bytes'])}"
        + (" (process RSS)" if r["device"] == "cpu" else " (device)"),
        f"finish   {r['finish_reason']}" + (f" ({r['stop_string']!r})" if r["stop_string"] else ""),
    ]
    if served:
        lines.insert(-1, answered)
    return "\n".join(lines)


def decode_tokens(r: dict) -> str:
    """The answer's token count, and how it was counted where the stream named no token (a server
    that sends neither ids nor logprobs nor a running usage: its latencies are per chunk)."""
    chunks = (r.get("endpoint") or {}).get("chunks")
    how = {"usage": f" (the server's usage, over {chunks} chunks)",
           "chunks": " (chunks counted as one token each: the server sent no usage)"}
    return f"{r['tokens']} tokens" + how.get(r["tokens_counted_by"], "")


def _server_state(samples: list[dict]) -> str:
    """The peak of what a server's /metrics said while it answered."""
    peak = {key: max((s[key] for s in samples if s[key] is not None), default=None)
            for key in ("kv_usage", "running", "waiting")}
    if not samples:
        return ""
    kv = "n/a" if peak["kv_usage"] is None else f"{peak['kv_usage']:.1%}"
    slots = next((s for s in reversed(samples) if s.get("slots_total")), None)
    if slots:
        return f" · server says: {peak['running']:.0f} of {slots['slots_total']} slots busy at most, KV {kv}"
    count = lambda key: "n/a" if peak[key] is None else f"{peak[key]:.0f}"
    return f" · server says: KV {kv} in use at most, {count('running')} running, {count('waiting')} waiting"


def speculative_summary(report) -> str:
    rate = report.acceptance_rate
    line = (f"draft    {report.draft}: {report.accepted_tokens}/{report.drafted_tokens} drafted tokens "
            f"accepted ({'—' if rate is None else f'{100 * rate:.0f}%'}), {report.draft_tokens_per_step} per step")
    if report.plain is not None:
        speedup = report.speedup_vs_plain
        line += (f"\nplain    {format_rate(report.plain_decode_tokens_per_s)} decode → speed-up "
                 f"{'—' if speedup is None else f'{speedup:.2f}×'}"
                 f"{'' if report.same_tokens_as_plain else ' (sampled: the tokens differ from the plain run)'}")
        predicted = report.break_even
        if predicted is not None:
            from engine.measure.speculative_run import explain  # lazy: importing it loads numpy

            line += f"\npredict  {explain(predicted)}"
    return line


def compare_table(rows: list) -> str:
    """The summary as aligned text columns."""
    def pct(value):
        return "—" if value is None else f"{100 * value:.1f}%"

    header = ("lane", "load", "weights", "peak", "TTFT", "tok/s", "p50", "p95", "tokens", "KV", "agree",
              "diverge@", "|Δlogp|", "stop")
    lines = [header]
    for row in rows:
        r = asdict(row)
        lines.append((
            f"{r['lane']} {r['label']}", format_seconds(r["load_s"]), format_bytes(r["weights_bytes"]),
            format_bytes(r["peak_memory_bytes"]), format_seconds(r["ttft_s"]), format_rate(r["decode_tokens_per_s"], ""),
            format_seconds(r["latency_p50_s"]), format_seconds(r["latency_p95_s"]), str(r["tokens"]),
            format_bytes(r["kv_cache_bytes"]), pct(r["token_agreement"]),
            "—" if r["first_divergence"] is None else str(r["first_divergence"]),
            "—" if r["mean_abs_logprob_delta"] is None else f"{r['mean_abs_logprob_delta']:.4f}",
            str(r["finish_reason"]),
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def estimate_summary(e, hw) -> str:
    ridge = ("never at this context: each sequence's KV reads grow as fast as its compute"
             if e.ridge_batch is None else f"compute-bound from batch {e.ridge_batch:,.0f}")
    lines = [
        f"model      {e.model}: {format_count(e.parameters)} parameters",
        f"hardware   {hw.name}: {format_bytes(hw.memory_bytes)}, {hw.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
        f"{hw.bf16_flops / 1e12:.1f} TFLOP/s bf16",
        f"memory     weights {format_bytes(e.weights_bytes)} ({e.precision}) + KV {format_bytes(e.kv_bytes_total)} "
        f"({e.batch} × {e.context} tokens × {format_bytes(e.kv_bytes_per_token)}/token, {e.kv_dtype}) + activations "
        f"{format_bytes(e.activation_bytes)} = {format_bytes(e.total_bytes)} → {'fits' if e.fits else 'does NOT fit'}",
        f"decode     ceiling {e.decode_tokens_per_s_ceiling:,.1f} tok/s in all ({e.per_request_tokens_per_s:,.1f} per request), "
        f"{e.bound}-bound; {ridge}",
        f"           a step reads {format_bytes(e.weights_read_bytes)} of the weights"
        + (f" ({TABLE_LOOKUP})" if e.weights_read_bytes < e.weights_bytes else "") + " + the KV cache",
        f"prefill    {e.context} tokens ≈ {format_seconds(e.prefill_s)} at peak FLOP/s",
    ]
    if e.usd_per_million_tokens is not None:
        lines.append(f"money      ${e.usd_per_million_tokens:,.3f} per 1M output tokens at ${hw.usd_per_hour}/h"
                     + (f"; {e.wh_per_million_tokens:,.0f} Wh per 1M tokens at {hw.watts:.0f} W"
                        if e.wh_per_million_tokens else ""))
    if e.training_breakeven_tokens:
        lines.append(f"training   {e.training_flops:.2e} FLOPs; serving matches it after "
                     f"{e.training_breakeven_tokens:.2e} generated tokens")
    return "\n".join(lines)


def parallel_summary(plan) -> str:
    """A tensor-parallel plan (engine/estimates/parallel.py) as a table and the commands."""
    gib = 2**30
    usable = plan.options[0].usable_per_gpu_bytes / gib if plan.options else 0.0
    lines = ["", f"tensor parallel on {plan.hardware} (each GPU may use {plan.memory_utilization:.0%} of its memory: "
             f"{usable:.1f} GiB)",
             f"{'GPUs':>4} {'weights':>10} {'KV':>9} {'activ.':>8} {'runtime':>8} {'total':>10} {'fits':>5} "
             f"{'link/token':>11} {'tok/s ceiling':>14}  bound"]
    for o in plan.options:
        lines.append(f"{o.gpus:>4} {o.weights_per_gpu_bytes / gib:>8.1f} G {o.kv_per_gpu_bytes / gib:>7.2f} G "
                     f"{o.activation_per_gpu_bytes / gib:>6.2f} G {o.runtime_per_gpu_bytes / gib:>6.1f} G "
                     f"{o.total_per_gpu_bytes / gib:>8.1f} G {'yes' if o.fits else 'no':>5} "
                     f"{o.allreduce_bytes_per_token / 2**20:>8.2f} MiB {o.decode_tokens_per_s_ceiling:>14.1f}  {o.bound}")
    if plan.chosen is None:
        lines.append("no size up to the largest tried fits: a smaller precision, a shorter context or more GPUs")
        return "\n".join(lines)
    price = "" if plan.usd_per_million_tokens is None else f", ${plan.usd_per_million_tokens:.2f} per 1M tokens"
    lines += [f"→ {plan.chosen.gpus} GPUs{price}", f"  {plan.vllm_command}", f"  {plan.sglang_command}"]
    return "\n".join(lines)


def add_kv_dtype(parser) -> None:
    """``--kv-dtype`` (engine/models/precision.py's ``KV_DTYPES``), for every command that loads a model."""
    from engine.models.precision import KV_DTYPES  # lazy: start-up

    parser.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES), type=str.lower,
                        help="what the KV cache keeps keys and values in: auto (the precision's own), fp32, bf16, "
                             "fp16, int8 (llama.cpp's q8_0 blocks) or fp8_e4m3 (a GPU's); other than auto, the fast "
                             "path's choice (default: %(default)s)")
