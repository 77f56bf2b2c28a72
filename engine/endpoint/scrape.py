"""What a server says about itself while a load runs: its Prometheus ``/metrics`` (vLLM, SGLang,
llama.cpp, or ours, which uses vLLM's names), scraped every half second and read as requests
running, waiting and the KV cache's fill. The kind is detected from the names, not configured;
a server without ``/metrics`` (or with names we don't know) is said to have none, not zeros.

Names, checked against each server: vLLM ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v0.10), ``vllm:num_preemptions_total``;
SGLang ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``; llama.cpp
(``llama-server --metrics``) ``llamacpp:requests_processing``, ``llamacpp:requests_deferred`` (no KV
figure in recent builds: its ``/slots`` says which slots are busy).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

KINDS = {
    "vllm": {"running": ("vllm:num_requests_running",), "waiting": ("vllm:num_requests_waiting",),
             "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
             "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
             "ttft": ("vllm:time_to_first_token_seconds",)},
    "sglang": {"running": ("sglang:num_running_reqs",), "waiting": ("sglang:num_queue_reqs",),
               "kv_usage": ("sglang:token_usage",), "preemptions": (),
               "ttft": ("sglang:time_to_first_token_seconds",)},
    "llama.cpp": {"running": ("llamacpp:requests_processing",), "waiting": ("llamacpp:requests_deferred",),
                  "kv_usage": ("llamacpp:kv_cache_usage_ratio",), "preemptions": (), "ttft": ()},
}
"""``ttft``: the server's own time-to-first-token histogram, from each request's arrival at it
(its ``_sum`` and ``_count`` are read)."""
INTERVAL_S = 0.5


@dataclass(frozen=True)
class ServerSample:
    at_s: float
    """Seconds from the start of the setting."""
    running: float | None
    waiting: float | None
    kv_usage: float | None
    """Fraction of the server's KV cache in use (0-1)."""
    preemptions: float | None
    ttft_sum_s: float | None = None
    """The server's own times to first token so far, summed (its histogram's ``_sum``)."""
    ttft_count: float | None = None


@dataclass
class ServerState:
    kind: str | None = None
    """``vllm``, ``sglang``, ``llama.cpp`` or ``None`` (no /metrics, or names we don't know)."""
    reason: str = ""
    """Why there is no state, when there is none."""
    samples: list[ServerSample] = field(default_factory=list)

    def peak(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return max(values) if values else None

    def own_ttft_s(self) -> float | None:
        """The server's own mean time to first token over the readings, from each request's arrival
        at it (a client's TTFT less this is what lies between them: the network, the HTTP front
        end's wait); ``None`` where its /metrics has no such histogram or no request was answered."""
        read = [s for s in self.samples if s.ttft_sum_s is not None and s.ttft_count is not None]
        if len(read) < 2 or read[-1].ttft_count <= read[0].ttft_count:
            return None
        return (read[-1].ttft_sum_s - read[0].ttft_sum_s) / (read[-1].ttft_count - read[0].ttft_count)

    def to_dict(self) -> dict:
        return asdict(self)


def _values(text: str) -> dict[str, float]:
    """Every sample of the exposition, summed over label sets, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def detect(values: dict[str, float]) -> str | None:
    for kind, names in KINDS.items():
        if any(name in values for name in names["running"]):
            return kind
    return None


def sample(values: dict[str, float], kind: str, at_s: float) -> ServerSample:
    def first(key: str) -> float | None:
        return next((values[n] for n in KINDS[kind][key] if n in values), None)
    ttft = next((n for n in KINDS[kind]["ttft"] if f"{n}_count" in values), None)
    return ServerSample(at_s, first("running"), first("waiting"), first("kv_usage"), first("preemptions"),
                        values.get(f"{ttft}_sum"), values.get(f"{ttft}_count"))


def read_into(state: ServerState, url: str, status: int, text: str, at_s: float) -> bool:
    """One answer of ``url`` read into ``state``; ``False`` once there is nothing to read
    (``state.reason`` says why)."""
    if status != 200:
        state.reason = f"{url} answered {status}: the server shows no metrics"
        return False
    try:
        values = _values(text)
    except ValueError:
        state.reason = f"{url} is not Prometheus text"
        return False
    if state.kind is None:
        state.kind = detect(values)
        if state.kind is None:
            state.reason = f"{url} has none of the metric names of vLLM, SGLang or llama.cpp"
            return False
    state.samples.append(sample(values, state.kind, at_s))
    return True


async def scrape_once(client, metrics_url: str, state: ServerState, origin: float) -> bool:
    """One reading into ``state`` (an httpx ``AsyncClient``); ``False`` once there is nothing to read."""
    import httpx

    try:
        response = await client.get(metrics_url, timeout=5.0)
    except httpx.HTTPError as exc:
        state.reason = f"{metrics_url}: {type(exc).__name__}"
        return False
    return read_into(state, metrics_url, response.status_code, response.text, time.perf_counter() - origin)


def scrape_once_sync(client, metrics_url: str, state: ServerState, origin: float) -> bool:
    """:func:`scrape_once` with an httpx ``Client`` (a thread of its own, no event loop)."""
    import httpx

    try:
        response = client.get(metrics_url, timeout=5.0)
    except httpx.HTTPError as exc:
        state.reason = f"{metrics_url}: {type(exc).__name__}"
        return False
    return read_into(state, metrics_url, response.status_code, response.text, time.perf_counter() - origin)


async def scrape(client, metrics_url: str, state: ServerState, origin: float, interval: float = INTERVAL_S) -> None:
    """Fill ``state`` every ``interval`` until cancelled (the load's setting ends)."""
    while await scrape_once(client, metrics_url, state, origin):
        await asyncio.sleep(interval)


def read_slots(text: str) -> tuple[int, int] | None:
    """llama.cpp's ``/slots``: ``(busy, total)`` from its list of slots (``is_processing`` each), or
    ``None`` for anything else."""
    import json

    try:
        slots = json.loads(text)
    except ValueError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) and "is_processing" in s for s in slots):
        return None
    return sum(bool(s["is_processing"]) for s in slots), len(slots)


def metrics_url(api_url: str) -> str:
    """``http://host:port/v1`` → ``http://host:port/metrics`` (where all three servers put it)."""
    base = api_url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"
