"""``GET /metrics``: the server's state in Prometheus text, under vLLM's metric names (``vllm:…``,
label ``model_name``) so a Grafana board made for vLLM reads it unchanged.

Gauges are read when scraped (requests running and waiting, KV cache used); histograms and
counters are fed by the core's events (engine/generation/service.py's listener), on the core's thread.

Times are a client's, as vLLM's are: from the request's arrival at the HTTP front end (its wait
for the core included) to each token's event. TTFT: arrival to first token; inter-token latency:
the gap between two tokens of one request (not the length of the step that made the second);
time per output token: (last token − first token) / (tokens − 1); end-to-end: arrival to finish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.base.events import STEP_PARTS, Finished, TokenGenerated
from engine.serve.protocol import FINISH_REASONS
from engine.generation.service import RequestArrived, RequestEvent, TrafficStep

if TYPE_CHECKING:
    from engine.generation.service import EngineService

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """One registry per server (two servers in one process never mix their figures)."""

    def __init__(self, service: "EngineService", model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, read) -> None:
            g = Gauge(name, doc, list(labels), registry=registry)
            g.labels(**labels).set_function(read)

        gauge("vllm:num_requests_running", "Requests in the batch (admitted, not finished).",
              lambda: max(0, service.in_flight - service.waiting))
        gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", lambda: service.waiting)
        def usage() -> float:
            used, _, total = service.kv_blocks()
            return used / total if total else 0.0

        gauge("vllm:kv_cache_usage_perc", "KV blocks held by running requests as a fraction of the budget's "
              "(1 = full; blocks kept for prefix reuse count as free, being evictable, as in vLLM).", usage)
        gauge("vllm:kv_cache_bytes", "KV-cache bytes held by running requests (measured; workbench).",
              service.kv_bytes)
        gauge("vllm:kv_cache_kept_blocks", "KV blocks kept for prefix reuse (workbench).",
              lambda: service.kv_blocks()[1])
        gauge("vllm:kv_cache_shared_blocks", "KV blocks more than one running request holds, held once (workbench).",
              lambda: service.kv_pool()[0])
        gauge("vllm:kv_cache_pool_bytes", "Bytes of the KV block pool's storage, read from its tensors: never past "
              "the budget (workbench).", lambda: service.kv_pool()[1])
        gauge("vllm:kv_cache_budget_bytes", "The KV budget the pool grows to at most (workbench).",
              lambda: service.settings.kv_budget_bytes or 0)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=registry).labels(**labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            c = Counter(name, doc, [*labels, *extra], registry=registry)
            return c if extra else c.labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per-request mean time per output token after the first.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens read.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted: their KV blocks taken back "
                                   "for others, computed again when admitted again.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (copied, "
                                   "not computed).")
        self.step_seconds = counter("vllm:engine_step_seconds", "Seconds the engine core's steps took, on its clock "
                                    "(workbench; with vllm:engine_step_work, what the serving simulator's step "
                                    "cost is checked against).")
        work = counter("vllm:engine_step_work", "What the engine core's steps held, summed by part: steps, batched "
                       "decode passes, decode rows, cached tokens the rows read, prompt chunks, prompt tokens, "
                       "prompt token pairs attended, lone-row passes (workbench).", ("part",))
        self._work = [work.labels(**labels, part=part) for part in STEP_PARTS]
        self._success = counter("vllm:request_success", "Requests finished, by reason.", ("finished_reason",))
        self._labels = labels
        self._times: dict[int, list[float]] = {}
        """Each unfinished request's first and latest token, seconds since its arrival."""
        self.close = service.listen(self.on_event)
        """Stop hearing the service (it outlives its server: it is the model's)."""

    def on_event(self, event) -> None:
        if isinstance(event, TrafficStep):
            step = event.step
            self.preemptions.inc(step.preempted)
            self.prefix_queries.inc(step.prefix_query_tokens)
            self.prefix_hits.inc(step.cached_tokens)
            if step.decode_tokens or step.prompt_chunks:  # the steps the step cost is fitted to
                self.step_seconds.inc(step.step_s)
                for child, value in zip(self._work, step.parts()):
                    child.inc(value)
        elif isinstance(event, RequestArrived):
            self.prompt_tokens.inc(event.prompt_tokens)
        elif isinstance(event, RequestEvent):
            inner = event.event
            if isinstance(inner, TokenGenerated):
                self.generation_tokens.inc()
                times = self._times.get(event.request_id)
                if times is None:
                    self.ttft.observe(inner.elapsed_s)
                    self._times[event.request_id] = [inner.elapsed_s, inner.elapsed_s]
                else:
                    self.itl.observe(max(0.0, inner.elapsed_s - times[1]))
                    times[1] = inner.elapsed_s
            elif isinstance(inner, Finished):
                times = self._times.pop(event.request_id, None)
                self.e2e.observe(inner.total_s)
                if times is not None and inner.tokens > 1:
                    self.tpot.observe((times[1] - times[0]) / (inner.tokens - 1))
                self._success.labels(**self._labels, finished_reason=FINISH_REASONS[inner.reason]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
