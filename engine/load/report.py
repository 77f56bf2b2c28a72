"""A load's results as text (one line per setting) and JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.load.generator import LoadPlan, SettingResult

if TYPE_CHECKING:
    from engine.estimates.simulator import Simulated


def ms(stats: dict | None, key: str, unit: str = " ms") -> str:
    """A figure of a distribution (engine/load/metrics.distribution) in ms, "—" when absent."""
    return "—" if not stats else f"{stats[key] * 1000:.0f}{unit}"


def summary_header(plan: LoadPlan | None = None,
                   note: str = "(ms; tokens from the server's usage unless marked *)") -> str:
    """The summary lines' column names (``goodput`` where ``plan`` has an SLO), then ``note``."""
    return (f"{'setting':<18} {'done':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>7} "
            f"{'TPOT p50':>9} {'p99':>7} {'ITL p99':>8} {'E2E p50':>8}"
            + ("  goodput" if plan is not None and plan.slo else "") + f"   {note}")


def _row(name: str, s, mark: str = "") -> str:
    """A summary's figures in the header's columns, under ``name``."""
    line = (f"{name:<18} {s.completed:>3}/{s.requests:<2} {s.request_throughput:>7.2f} "
            f"{s.output_throughput:>9.1f}{mark:1} {ms(s.ttft, 'median', ''):>9} {ms(s.ttft, 'p99', ''):>7} "
            f"{ms(s.tpot, 'median', ''):>9} {ms(s.tpot, 'p99', ''):>7} {ms(s.itl, 'p99', ''):>8} {ms(s.e2e, 'median', ''):>8}")
    return line + (f"  {s.goodput:.2f} req/s" if s.goodput is not None else "")


def summary_line(result: SettingResult) -> str:
    s = result.summary
    line = _row(result.label, s, "" if s.counted_by == "usage" else "*")
    if s.completed < s.requests:  # e.g. "not sent 4789 · failed 1: errored 0, cut by the deadline 1"
        line += "\n    " + s.not_completed() + (f" · errors: {'; '.join(s.errors[:3])}" if s.errors else "")
    line += "\n    " + server_line(result.server, (s.ttft or {}).get("mean"))
    return line


def predicted_line(predicted, measured=None, name: str = "  predicted") -> str:
    """The serving simulator's figures for a setting (engine/estimates/simulator.py), in the
    summary line's columns under ``name``, and how far each is from what was measured."""
    p = predicted
    line = _row(name, p)
    if measured is not None:
        parts = []
        for name, pair in (("out tok/s", (p.output_throughput, measured.output_throughput)),
                           ("TTFT p50", _median(p.ttft, measured.ttft)), ("TPOT p50", _median(p.tpot, measured.tpot))):
            if pair[0] is not None and pair[1]:
                parts.append(f"{name} {(pair[0] - pair[1]) / pair[1]:+.0%}")
        if parts:
            line += "\n    predicted against measured: " + ", ".join(parts)
    return line


def _median(predicted: dict | None, measured: dict | None) -> tuple[float | None, float | None]:
    return (predicted or {}).get("median"), (measured or {}).get("median")


@dataclass(frozen=True)
class TTFTSplit:
    """A setting's mean TTFT split where the server's clock starts (the request's arrival at its
    handler): the server's own part and the client's (the network, the HTTP side's wait), each
    measured and predicted. Where a TTFT's error lies: a step model off shows in the server's
    part, a front end off in the client's."""

    server_s: float
    """Measured by the server itself (its /metrics histogram's mean over the setting)."""
    predicted_server_s: float
    client_s: float
    """The client's mean TTFT less ``server_s``."""
    predicted_client_s: float


def ttft_split(setting: "SettingResult", predicted: "Simulated") -> TTFTSplit | None:
    """``setting``'s TTFT split (:class:`TTFTSplit`) against its prediction; ``None`` where the
    server's /metrics has no TTFT of its own or nothing was answered, measured or predicted."""
    server = setting.server.own_ttft_s() if setting.server is not None else None
    client = (setting.summary.ttft or {}).get("mean")
    simulated = [(r.ttft_s, part) for r, part in zip(predicted.results, predicted.client_s)
                 if r.ok and r.ttft_s is not None]
    if server is None or client is None or not simulated:
        return None
    return TTFTSplit(server, statistics.fmean(t - part for t, part in simulated), client - server,
                     statistics.fmean(part for _, part in simulated))


def split_line(split) -> str:
    """A prediction's mean TTFT split at the server's handler (``TTFTSplit``), each part measured
    against predicted: where its error lies."""
    server = f"{(split.predicted_server_s - split.server_s) / split.server_s:+.0%}" if split.server_s > 0 else "—"
    return (f"    TTFT on average, measured / predicted: the server's own {split.server_s * 1e3:.1f} / "
            f"{split.predicted_server_s * 1e3:.1f} ms ({server}), the client's part {split.client_s * 1e3:.1f} / "
            f"{split.predicted_client_s * 1e3:.1f} ms")


def server_line(server, client_ttft_s: float | None = None) -> str:
    """What the server's /metrics said during the setting (``client_ttft_s``: the client's mean
    TTFT, said beside the server's own)."""
    if server.kind is None:
        return f"server: no state ({server.reason or 'not scraped'})"
    parts = []
    for name, label in (("running", "running"), ("waiting", "waiting")):
        peak = server.peak(name)
        if peak is not None:
            parts.append(f"{label} ≤ {peak:.0f}")
    kv = server.peak("kv_usage")
    if kv is not None:
        parts.append(f"KV cache ≤ {kv:.1%}")
    preempted = server.peak("preemptions")
    if preempted:
        parts.append(f"{preempted:.0f} preemptions")
    own = server.own_ttft_s()
    if own is not None:
        parts.append(f"its own TTFT {own * 1e3:.1f} ms on average from arrival" + (
            f" ({client_ttft_s * 1e3:.1f} ms here)" if client_ttft_s is not None else ""))
    return f"server ({server.kind}, {len(server.samples)} scrapes): " + ", ".join(parts)


def write_json(path: Path, plan: LoadPlan, results: list[SettingResult]) -> None:
    from dataclasses import asdict

    plan_dict = {k: v for k, v in asdict(plan).items() if k != "api_key"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"plan": plan_dict, "settings": [r.to_dict() for r in results],
                                "definitions": "vLLM's: TTFT to first content chunk; TPOT = (E2E - TTFT)/(n - 1); "
                                               "ITL per token, pooled (a chunk's gap shared by the tokens it "
                                               "carried, where the server's running usage says how many); "
                                               "output tokens from usage where sent; failed = errored (HTTP "
                                               "error, server error, broken or empty stream) + cut (in flight "
                                               "when the deadline or Stop ended the setting); not sent (the "
                                               "setting ended before its turn) is not failed"},
                               indent=2), encoding="utf-8")


CSV_COLUMNS = ("setting", "mode", "value", "model", "requests", "completed", "failed", "errored", "cut", "cut_by",
               "not_sent", "duration_s",
               "request_throughput", "output_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
               "itl_p99_s", "e2e_p50_s", "goodput", "counted_by", "server_kind", "server_running_peak",
               "server_waiting_peak", "server_kv_usage_peak", "ttft_mean_s", "server_own_ttft_mean_s")


def csv_row(result: SettingResult) -> dict:
    """One setting's summary as a CSV row (blank where a figure is absent)."""
    s, server = result.summary, result.server

    def stat(stats, key):
        return "" if not stats else stats[key]

    def peak(name):
        value = server.peak(name)
        return "" if value is None else value

    return {"setting": result.label, "mode": result.mode, "value": result.value, "model": result.model,
            "requests": s.requests, "completed": s.completed, "failed": s.failed, "errored": s.errored, "cut": s.cut,
            "cut_by": s.cut_by or "", "not_sent": s.not_sent, "duration_s": s.duration_s,
            "request_throughput": s.request_throughput, "output_throughput": s.output_throughput,
            "ttft_p50_s": stat(s.ttft, "median"), "ttft_p99_s": stat(s.ttft, "p99"),
            "tpot_p50_s": stat(s.tpot, "median"), "tpot_p99_s": stat(s.tpot, "p99"), "itl_p99_s": stat(s.itl, "p99"),
            "e2e_p50_s": stat(s.e2e, "median"), "goodput": "" if s.goodput is None else s.goodput,
            "counted_by": s.counted_by, "server_kind": server.kind or "", "server_running_peak": peak("running"),
            "server_waiting_peak": peak("waiting"), "server_kv_usage_peak": peak("kv_usage"),
            "ttft_mean_s": stat(s.ttft, "mean"),
            "server_own_ttft_mean_s": "" if server.own_ttft_s() is None else server.own_ttft_s()}


def write_csv(path: Path, results: list[SettingResult]) -> None:
    """A row per setting, so loads against several servers line up in one spreadsheet."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for result in results:
            writer.writerow(csv_row(result))


def history_record(plan: LoadPlan, result: SettingResult, load_id: str | None = None):
    """One setting as a run of the history (kind ``load``): the server's model, its URL, the
    concurrency reached as the batch, the per-request speed (1 / TPOT p50) and the throughput of
    all requests; the summary whole in ``extra``. Never the key."""
    import time

    import httpx

    from engine.storage.history import RunRecord  # lazy: importing it loads numpy

    s = result.summary
    done = [r for r in result.results if r.ok]
    batch = int(result.value) if result.mode == "concurrency" else max(1, s.max_concurrency)
    prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    tpot = s.tpot["median"] if s.tpot else None
    kind = result.server.kind or "server"
    runs_on = result.runs_on
    return RunRecord(
        kind="load", when=time.strftime("%Y-%m-%dT%H:%M:%S"), model=result.model, model_ref=plan.url,
        # what the server says runs the model (this workbench's does), else that a server runs it
        precision=str(runs_on.get("precision") or "served"), device=str(runs_on.get("device") or "remote"),
        device_name=f"{kind} at {httpx.URL(plan.url).netloc.decode()}"
                    + (f" ({runs_on['device_name']})" if runs_on.get("device_name") else ""),
        hardware="remote", parameters=runs_on.get("n_params") if isinstance(runs_on.get("n_params"), int) else None,
        weights_bytes=runs_on.get("size") if isinstance(runs_on.get("size"), int) else None,
        kv_cache_bytes=None, kv_bytes_per_token=None,
        prompt_tokens=round(sum(prompt) / len(prompt)) if prompt else 0,
        tokens=round(s.output_tokens / len(done)) if done else 0, batch=batch,
        decode_tokens_per_s=1 / tpot if tpot else None, ttft_s=s.ttft["median"] if s.ttft else None,
        peak_memory_bytes=None,
        extra={"url": plan.url, "mode": result.mode, "value": result.value, "label": result.label,
               "server_kind": result.server.kind, "aggregate_tokens_per_s": s.output_throughput,
               "summary": s.to_dict(), "max_tokens": plan.max_tokens, "endpoint": plan.endpoint, "load_id": load_id,
               **({"error": "; ".join(s.errors[:3]) or s.not_completed()} if not s.completed else {})},
    )


def remember(plan: LoadPlan, results: list[SettingResult], load_id: str | None = None) -> None:
    """Every setting that completed a request joins the history; a history that can't be written
    never fails a load (it is logged)."""
    import logging

    from engine.storage.history import save  # lazy: importing it loads numpy

    for result in results:
        if result.summary.completed:
            try:
                save(history_record(plan, result, load_id))
            except OSError as exc:
                logging.getLogger(__name__).warning("could not save the load to the history: %s", exc)
