"""Send a load to an OpenAI-compatible server and measure every request as its chunks arrive.

Closed loop (``concurrency``): that many requests in flight, a new one sent as one ends, as a
fixed pool of users would. Open loop (``rates``): requests arrive on their own schedule, gaps
drawn from a gamma distribution with shape ``burstiness`` (1 = Poisson) and mean 1/rate, as
``vllm bench serve`` does, so a server slower than the arrivals builds a queue. Every setting is
bounded by a request count and a duration; at the deadline what is still in flight is cancelled
and counted as cut (failed), and what was never sent is counted as not sent (not failed). Streams
are read with httpx and httpx-sse; each chunk is time-stamped as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.base.errors import EngineError, InvalidRequestError
from engine.load.metrics import RequestResult, Summary, summarize
from engine.load.prompts import Prompt
from engine.endpoint.scrape import ServerState, metrics_url, scrape, scrape_once
from engine.endpoint.stream import StreamReader


@dataclass(frozen=True)
class LoadPlan:
    url: str
    """The API's base URL, ``http://HOST:PORT/v1``."""
    model: str | None = None
    """``None``: the first model the server lists."""
    api_key: str | None = None
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    burstiness: float = 1.0
    requests: int = 32
    max_duration_s: float = 300.0
    max_tokens: int = 128
    ignore_eos: bool = False
    endpoint: str = "chat"
    seed: int = 0
    slo: dict | None = None
    request_timeout_s: float = 600.0
    scrape: bool = True
    """Read the server's /metrics while each setting runs (engine/endpoint/scrape.py)."""
    scrape_interval_s: float = 0.5

    def validated(self) -> "LoadPlan":
        if not self.url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{self.url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1).")
        if not self.concurrency and not self.rates:
            raise InvalidRequestError("Give a concurrency (closed loop) or a rate (open loop).")
        if self.requests < 1 or self.max_tokens < 1 or self.max_duration_s <= 0:
            raise InvalidRequestError("requests, max tokens and max duration must be above 0.")
        if self.burstiness <= 0:
            raise InvalidRequestError("burstiness must be above 0 (1 is Poisson).")
        if self.endpoint not in ("chat", "completions"):
            raise InvalidRequestError("endpoint must be 'chat' or 'completions'.")
        return self

    def settings(self) -> list[tuple[str, float]]:
        return [("concurrency", c) for c in self.concurrency] + [("rate", r) for r in self.rates]


@dataclass
class SettingResult:
    mode: str
    """``concurrency`` or ``rate``."""
    value: float
    results: list[RequestResult]
    summary: Summary
    model: str = ""
    server: ServerState = field(default_factory=ServerState)
    """What the server said about itself meanwhile (its /metrics), if anything."""
    runs_on: dict = field(default_factory=dict)
    """What its ``/models`` says runs the model (this workbench's server: precision, device…)."""

    @property
    def label(self) -> str:
        return setting_label(self.mode, self.value)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "value": self.value, "model": self.model, "summary": self.summary.to_dict(),
                "server": self.server.to_dict(), "runs_on": dict(self.runs_on),
                "requests": [r.to_dict() for r in self.results]}


@dataclass
class LoadRunner:
    """Runs a plan (blocking, in the caller's thread); :meth:`stop` from any thread ends it early."""

    plan: LoadPlan
    prompts: list[Prompt]
    on_request: Callable[[str, RequestResult], None] | None = None
    """Called (on the runner's thread) with the setting's label and each finished request."""
    on_result: Callable[[SettingResult], None] | None = None
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _task: asyncio.Task | None = field(default=None, repr=False)
    _stopped: bool = False
    runs_on: dict = field(default_factory=dict, repr=False)
    """What the server's ``/models`` says runs the model (:func:`served_model`)."""

    def run(self) -> list[SettingResult]:
        if not self.prompts:
            raise InvalidRequestError("A load needs at least one prompt.")
        return asyncio.run(self._main())

    def stop(self) -> None:
        self._stopped = True
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)

    async def _main(self) -> list[SettingResult]:
        import httpx

        self._loop = asyncio.get_running_loop()
        plan = self.plan
        most = max([int(c) for c in plan.concurrency] + [plan.requests if plan.rates else 1])
        limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
        timeout = httpx.Timeout(plan.request_timeout_s, connect=10.0)
        headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
        out = []
        async with httpx.AsyncClient(base_url=plan.url.rstrip("/"), limits=limits, timeout=timeout,
                                     headers=headers) as client:
            model, self.runs_on = await served_model(client, plan.model)
            for mode, value in plan.settings():
                if self._stopped:
                    break
                self._task = asyncio.ensure_future(self._setting(client, model, mode, value))
                result = await self._task
                out.append(result)
                if self.on_result:
                    self.on_result(result)
        return out

    async def _setting(self, client, model: str, mode: str, value: float) -> SettingResult:
        plan = self.plan
        rng = random.Random(plan.seed)
        order = setting_order(plan.requests, rng, lambda i: self.prompts[i % len(self.prompts)])
        results = [RequestResult(i, p.kind) for i, p in enumerate(order)]
        label = f"{mode} {value:g}"
        start = time.perf_counter()

        async def one(i: int) -> None:
            await send(client, model, order[i], plan, results[i], start, running_usage=server.kind == "vllm")
            if self.on_request and results[i].sent:  # (one due after the deadline is not sent)
                self.on_request(label, results[i])

        work: list[asyncio.Task] = []
        server = ServerState()
        watcher = None
        # the first reading before any request: the kind is known however short the setting
        if plan.scrape and await scrape_once(client, metrics_url(plan.url), server, start):
            watcher = asyncio.ensure_future(scrape(client, metrics_url(plan.url), server, start,
                                                   plan.scrape_interval_s))
        try:
            if mode == "concurrency":
                queue = iter(range(plan.requests))

                async def user() -> None:
                    for i in queue:
                        await one(i)
                work += [asyncio.ensure_future(user()) for _ in range(int(value))]
            else:
                for i in range(plan.requests):
                    work.append(asyncio.ensure_future(one(i)))
                    if i + 1 < plan.requests:
                        gap = next_gap(rng, value, plan.burstiness)
                        if time.perf_counter() + gap - start >= plan.max_duration_s:
                            break  # the next arrival is past the deadline: it and the rest are not sent
                        await asyncio.sleep(gap)
            left = max(0.0, plan.max_duration_s - (time.perf_counter() - start))
            _, pending = await asyncio.wait(work, timeout=left)
            cut_by = "the deadline" if pending else None
            if not pending and watcher is not None and not watcher.done():  # a last reading: the last answers too
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                await scrape_once(client, metrics_url(plan.url), server, start)
        except asyncio.CancelledError:  # stop(): what ran is kept, the rest marked
            cut_by = "Stop"
        finally:
            for task in work + ([watcher] if watcher else []):
                task.cancel()
            await asyncio.gather(*work, *([watcher] if watcher else []), return_exceptions=True)
        for r in results:  # in flight when the setting ended: cut (what was never sent stays "not sent")
            if r.sent and not r.ok and r.error is None and cut_by:
                r.cut = True
                r.error = (f"cut by the deadline: in flight at {plan.max_duration_s:g} s" if cut_by == "the deadline"
                           else "cut by Stop: in flight when the load was stopped")
        ended = [r.start_s + r.e2e_s for r in results if r.e2e_s is not None]
        duration = (max(ended) if ended else time.perf_counter() - start)
        return SettingResult(mode, value, results, summarize(results, duration, plan.slo, cut_by), model, server,
                             dict(self.runs_on))


def setting_label(mode: str, value: float) -> str:
    """How a setting is named wherever it is shown: ``concurrency 4``, ``rate 0.5/s``."""
    return f"concurrency {value:g}" if mode == "concurrency" else f"rate {value:g}/s"


def setting_order(requests: int, rng: random.Random, item: Callable[[int], object]) -> list:
    """A setting's requests in the order they are sent: ``item(i)`` for request ``i`` (prompt
    ``i % n``), shuffled with ``rng`` (the serving simulator orders its requests the same way)."""
    order = [item(i) for i in range(requests)]
    rng.shuffle(order)
    return order


def next_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """Seconds from one arrival to the next of an open loop: gamma-distributed with shape
    ``burstiness`` (1 = Poisson) and mean ``1 / rate``, as ``vllm bench serve`` draws them."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def served_model(client, model: str | None) -> tuple[str, dict]:
    """The model to send (``model``, or the first ``GET /models`` lists) and what the listing says
    runs it (``meta``: this workbench's server names its precision and device; others little)."""
    import httpx

    try:
        response = await client.get("/models")
        listed = response.json().get("data") or [] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        listed = []
    listed_id, meta = listed_model(listed, model)
    if model is None:
        model = await first_model(client) if listed_id is None else listed_id
    return model, meta


def listed_model(listed: list, model: str | None) -> tuple[str | None, dict]:
    """The entry of a ``GET /models`` listing naming ``model`` (the first when ``None``): its id and
    its ``meta`` (``None`` and ``{}``: none listed)."""
    entry = next((m for m in listed if isinstance(m, dict) and (model is None or m.get("id") == model)), None)
    if entry is None:
        return None, {}
    meta = entry.get("meta")
    return entry.get("id"), meta if isinstance(meta, dict) else {}


async def first_model(client) -> str:
    """The first model ``GET /models`` lists."""
    import httpx

    try:
        response = await client.get("/models")
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"Can't reach {client.base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise InvalidRequestError(f"{client.base_url}/models answered {response.status_code}: {_message(response.text)}")
    models = response.json().get("data") or []
    if not models:
        raise InvalidRequestError(f"{client.base_url}/models lists no model.")
    return models[0]["id"]


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def request_body(model: str, prompt: Prompt, plan: LoadPlan, running_usage: bool = False) -> tuple[str, dict]:
    """``running_usage``: ask for vLLM's ``continuous_usage_stats`` (servers with vLLM's metrics take it),
    so a chunk of several tokens is known as such."""
    body = {"model": model, "max_tokens": plan.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if running_usage else {})}}
    if plan.ignore_eos:
        body["ignore_eos"] = True
    if plan.endpoint == "chat":
        return "/chat/completions", {**body, "messages": [{"role": "user", "content": prompt.text}]}
    return "/completions", {**body, "prompt": prompt.text}


async def send(client, model: str, prompt: Prompt, plan: LoadPlan, result: RequestResult, origin: float,
               running_usage: bool = False) -> None:
    """One streamed request, its figures written into ``result`` as they arrive; not sent at all
    if its moment comes at or after the plan's deadline (an open loop's arrival whose sleep ran
    late on a busy machine, a closed loop's next request)."""
    import httpx
    from httpx_sse import SSEError, aconnect_sse


    reader = StreamReader()
    path, body = request_body(model, prompt, plan, running_usage)
    sent = time.perf_counter()
    if sent - origin >= plan.max_duration_s:
        return
    result.start_s = sent - origin
    result.sent = True
    last = None
    chunks = 0
    try:
        async with aconnect_sse(client, "POST", path, json=body) as source:
            response = source.response
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_message((await response.aread()).decode(errors='replace'))}"
                return
            async for event in source.aiter_sse():
                now = time.perf_counter()
                if event.data == "[DONE]":
                    break
                chunk = json.loads(event.data)
                if isinstance(chunk, dict) and "error" in chunk:  # OpenAI's {"message": …}; transformers' a string
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    result.error = f"server error mid-stream: {message}"
                    return
                pieces = reader.read(chunk)
                if reader.usage:
                    result.prompt_tokens = reader.usage.get("prompt_tokens")
                    result.output_tokens = reader.usage.get("completion_tokens", 0)
                    result.counted_by = "usage"
                result.finish_reason = reader.finish_reason or result.finish_reason
                if not pieces:
                    continue
                result.text += "".join(p.text for p in pieces)
                chunks += len(pieces)
                result.chunk_times_s.append(now - sent)
                if last is None:
                    result.ttft_s = now - sent
                    result.first_tokens = len(pieces)
                    result.itl_s += [0.0] * (len(pieces) - 1)  # came with the first token
                else:
                    result.itl_s += [(now - last) / len(pieces)] * len(pieces)
                last = now
            result.text += reader.rest()
        end = time.perf_counter()
    except (httpx.HTTPError, SSEError, ValueError, EngineError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    if result.counted_by != "usage":
        result.output_tokens = chunks
    result.e2e_s = end - sent
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "the stream ended without any text"
