"""What one request measured and what a load's requests add up to, with vLLM's definitions
(vllm/benchmarks/serve.py):

- TTFT: request sent → first content chunk arrived;
- TPOT: (E2E − TTFT) / (output tokens − 1), per request;
- ITL: every gap between two content chunks, pooled over all requests;
- E2E: request sent → last chunk;
- throughput: completed requests and output tokens per second of the whole setting;
- goodput: requests per second that met every SLO given (``ttft:ms,tpot:ms,e2e:ms``).

Output tokens are the server's ``usage`` count where it sent one, else the content chunks
counted (one token per chunk assumed), and each result says which.

A request that did not complete either failed or was never sent: it *errored* (an HTTP error, a
server error mid-stream, a broken or empty stream), was *cut* (in flight when the setting's
deadline, or Stop, ended it), or was *not sent* (the setting ended before its turn). Only the
first two are failures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from engine.base.errors import InvalidRequestError


@dataclass
class RequestResult:
    index: int
    prompt_kind: str = ""
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0
    """When it was sent, seconds from the start of its setting."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Per token after the first: a chunk's gap since the one before, shared by the tokens it carried
    (where the server says how many: its running usage; else a chunk counts as one token)."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival of every content chunk, seconds after sending."""
    first_tokens: int = 1
    """The tokens its first content chunk carried, where the server says (its running usage): more
    than one when the first tokens' text was held back (part of one character, a special token),
    so its TTFT is the last of their steps."""
    prompt_tokens: int | None = None
    output_tokens: int = 0
    counted_by: str = "chunks"
    """``usage`` (the server's count) or ``chunks`` (content chunks counted)."""
    finish_reason: str | None = None
    text: str = ""
    status: int | None = None
    sent: bool = False
    """The request went out (``False``: the setting ended before its turn)."""
    cut: bool = False
    """It was in flight when the setting's deadline (or Stop) ended it."""

    @property
    def outcome(self) -> str:
        """``completed``, ``errored``, ``cut`` or ``not sent`` (see the module's docstring)."""
        if self.ok:
            return "completed"
        if not self.sent:
            return "not sent"
        return "cut" if self.cut else "errored"

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        out["outcome"] = self.outcome
        return out


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` (milliseconds) → ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slo = {}
    for part in text.split(","):
        name, _, value = part.strip().partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise InvalidRequestError(f"{part!r}: an SLO is ttft:MS, tpot:MS or e2e:MS (milliseconds).")
        try:
            ms = float(value)
        except ValueError:
            raise InvalidRequestError(f"{part!r}: {value!r} is not a number of milliseconds.") from None
        if not math.isfinite(ms) or ms <= 0:
            raise InvalidRequestError(f"{part!r}: the limit must be above 0 ms.")
        slo[name] = ms / 1000
    return slo


def distribution(values) -> dict | None:
    """mean, median, p90, p99 and max of ``values`` (``None`` when there are none)."""
    if not len(values):
        return None
    import numpy as np

    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "median": float(np.median(array)), "p90": float(np.percentile(array, 90)),
            "p99": float(np.percentile(array, 99)), "max": float(array.max())}


def not_completed(not_sent: int, errored: int, cut: int, cut_by: str | None = None) -> str:
    """What became of the requests that did not complete, the same words wherever they are shown:
    ``not sent 4789 · failed 1: errored 0, cut by the deadline 1`` (``""`` when none)."""
    parts = [f"not sent {not_sent}"] if not_sent else []
    if errored or cut:
        parts.append(f"failed {errored + cut}: errored {errored}, cut by {cut_by or 'the deadline'} {cut}")
    return " · ".join(parts)


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    """``errored + cut``; requests never sent are not failures."""
    duration_s: float
    request_throughput: float
    output_throughput: float
    """Output tokens per second, all completed requests together."""
    total_token_throughput: float | None
    ttft: dict | None
    tpot: dict | None
    itl: dict | None
    e2e: dict | None
    output_tokens: int
    counted_by: str
    """``usage``, ``chunks`` or ``mixed``."""
    max_concurrency: int
    goodput: float | None = None
    slo: dict | None = None
    errors: list[str] = field(default_factory=list)
    """The errored requests' errors (a few, each once)."""
    errored: int = 0
    cut: int = 0
    not_sent: int = 0
    cut_by: str | None = None
    """What ended the setting early: ``the deadline`` or ``Stop`` (``None``: it ran to its end)."""

    def not_completed(self) -> str:
        return not_completed(self.not_sent, self.errored, self.cut, self.cut_by)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float] | None = None,
              cut_by: str | None = None) -> Summary:
    done = [r for r in results if r.ok]
    outcomes = [r.outcome for r in results]
    output = sum(r.output_tokens for r in done)
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    sources = {r.counted_by for r in done}
    spans = sorted([(r.start_s, 1) for r in results if r.e2e_s is not None] +
                   [(r.start_s + r.e2e_s, -1) for r in results if r.e2e_s is not None])
    busiest = current = 0
    for _, step in spans:
        current += step
        busiest = max(busiest, current)
    goodput = None
    if slo:
        good = [r for r in done if all(_value(r, name) is not None and _value(r, name) <= limit
                                       for name, limit in slo.items())]
        goodput = len(good) / duration_s if duration_s > 0 else 0.0
    return Summary(
        requests=len(results), completed=len(done), failed=outcomes.count("errored") + outcomes.count("cut"),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s if duration_s > 0 else 0.0,
        output_throughput=output / duration_s if duration_s > 0 else 0.0,
        total_token_throughput=(output + sum(prompts)) / duration_s if duration_s > 0 and len(prompts) == len(done)
        else None,
        ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=distribution([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=distribution([gap for r in done for gap in r.itl_s]),
        e2e=distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        output_tokens=output, counted_by=sources.pop() if len(sources) == 1 else ("mixed" if sources else "none"),
        max_concurrency=busiest, goodput=goodput, slo=slo,
        errors=sorted({r.error for r in results if r.error and r.outcome == "errored"})[:10],
        errored=outcomes.count("errored"), cut=outcomes.count("cut"), not_sent=outcomes.count("not sent"),
        cut_by=cut_by)


def _value(result: RequestResult, name: str) -> float | None:
    return {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2e": result.e2e_s}[name]
