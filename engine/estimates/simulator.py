"""A simulator of continuous batching: what response times many users would get, before they come.

The engine core's own scheduler and KV cache manager (engine/generation/scheduler.py,
engine/generation/kv_manager.py) run on a simulated clock, so the schedule is the engine's by
construction: the batch limit, the token budget with chunked prefill, KV blocks taken from one
pool as requests grow, preemption (recompute) when none is left, prefix caching with the same
chained block keys. What is modelled is only each step's time, from a step-cost model
(engine/estimates/step_cost.py): measured on this machine from the engine's own steps, or
predicted for a GPU from its specifications.

Requests arrive as the load generator sends them (engine/load/generator.py): an open loop at a
rate (gaps from a gamma distribution, 1 = Poisson, the generator's own random draws for the same
seed), or a closed loop of N users each sending its next request when its last one ended. Out
come the load generator's own figures (engine/load/metrics.py, vLLM's definitions): TTFT, TPOT,
ITL and end-to-end distributions, throughput and goodput under an SLO, and the KV cache's use and
preemptions over time.

Left out, unless a step-cost model's front end (engine/estimates/step_cost.py ``FrontEnd``) says
it: the network and HTTP, tokenizing. Left out always: answers that end early at an
end-of-sequence token (each request generates its output length), speculative decoding, and the
limit sliding-window layers put on prefix-cache hits (Gemma 2 and 3, Mistral). Assumed: the same
prompt gets the same answer (greedy, as the load generator asks), which decides what the prefix
cache keeps, and how many tokens its first text comes with where a server's answers showed it
(:meth:`ServingSimulator.learn_first_text`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.base.errors import InvalidRequestError
from engine.generation.kv_manager import BLOCK_TOKENS, KVCacheManager
from engine.generation.scheduler import Scheduler, attention_reads
from engine.load.generator import next_gap, setting_order
from engine.load.metrics import RequestResult, Summary, summarize

if TYPE_CHECKING:
    from engine.estimates.step_cost import StepCost


@dataclass(frozen=True)
class SimRequest:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    """When it is sent (an open loop's; a closed loop sends each when a user is free)."""
    shared_prefix: int = 0
    """Its first tokens, the same for every request that shares a prefix (a system prompt)."""
    prompt_ids: tuple[int, ...] | None = None
    """Its prompt's own token ids, where known (the same prompt twice is then found in the prefix
    cache as the server finds it); ``None``: ids made up from the lengths."""
    refused: bool = False
    """The server refuses it at once (its prompt is one the model can't take)."""
    first_tokens: int = 1
    """The tokens its client's first text comes with, as measured for its prompt (more than one:
    the first tokens' text is held back, part of one character): its TTFT is the last of them."""


@dataclass(frozen=True)
class Workload:
    requests: tuple[SimRequest, ...]
    users: int | None = None
    """A closed loop of this many users (``None``: an open loop, each request at its arrival)."""

    @property
    def label(self) -> str:
        return f"concurrency {self.users}" if self.users else f"{len(self.requests)} requests"


def open_loop(rate: float, prompts: Sequence, outputs: Sequence[int], requests: int, seed: int = 0,
              burstiness: float = 1.0, shared_prefix: int = 0) -> Workload:
    """``requests`` arriving at ``rate`` per second, gaps drawn as the load generator draws them
    (the same seed gives the same arrivals); each request's prompt (a length, or its token ids)
    and output length taken in turn from ``prompts`` and ``outputs`` after the generator's
    shuffle."""
    if rate <= 0 or burstiness <= 0:
        raise InvalidRequestError("A rate and its burstiness must be above 0.")
    lengths = _shuffled(prompts, outputs, requests, seed)
    rng = lengths.pop()  # the generator draws its gaps from the same random stream, after its shuffle
    out, t = [], 0.0
    for i, (prompt, output) in enumerate(lengths):
        out.append(_request(prompt, output, t, shared_prefix))
        if i + 1 < requests:
            t += next_gap(rng, rate, burstiness)
    return Workload(tuple(out))


def closed_loop(users: int, prompts: Sequence, outputs: Sequence[int], requests: int, seed: int = 0,
                shared_prefix: int = 0) -> Workload:
    """``users`` each sending a request as soon as their last one ended, ``requests`` in all."""
    if users < 1:
        raise InvalidRequestError("A closed loop needs at least one user.")
    lengths = _shuffled(prompts, outputs, requests, seed)
    lengths.pop()
    return Workload(tuple(_request(p, o, 0.0, shared_prefix) for p, o in lengths), users)


def recorded(setting: dict, max_tokens: int) -> Workload:
    """A load generator's recorded setting (one of the ``settings`` of its ``--json`` report) as a
    workload: each request sent as it was (an open loop at its send time, or a closed loop of as
    many users), its prompt and answer as many tokens as they were (an answer that didn't
    complete: the ``max_tokens`` asked for; a request refused with a 4xx, refused). A request the
    server never counted the prompt of, and never refused, is left out."""
    try:
        arriving = setting["mode"] == "rate"  # an open loop: each request at its own send time
        users = None if arriving else int(setting["value"])
        sent = sorted((r for r in setting["requests"] if r.get("sent", True)), key=lambda r: float(r["start_s"]))
        out = []
        for r in sent:
            arrival = float(r["start_s"]) if arriving else 0.0
            output = int(r["output_tokens"]) if r.get("outcome") == "completed" else max_tokens
            if r.get("prompt_tokens"):
                out.append(SimRequest(int(r["prompt_tokens"]), max(1, output), arrival,
                                      first_tokens=max(1, int(r.get("first_tokens") or 1))))
            elif 400 <= int(r.get("status") or 0) < 500:
                out.append(SimRequest(1, max(1, output), arrival, refused=True))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"Not a setting of the load generator's report: {exc!r} is missing or "
                                  "malformed.") from None
    if not out:
        raise InvalidRequestError("The recorded setting has no request whose prompt the server counted.")
    return Workload(tuple(out), users)


def _request(prompt, output: int, arrival: float, shared: int) -> SimRequest:
    """A length, a prompt's token ids, or ``None``: a prompt the server refuses."""
    if prompt is None:
        return SimRequest(1, output, arrival, refused=True)
    if isinstance(prompt, int):
        return SimRequest(prompt, output, arrival, shared)
    return SimRequest(len(prompt), output, arrival, 0, tuple(prompt))


def _shuffled(prompts: Sequence[int], outputs: Sequence[int], requests: int, seed: int) -> list:
    """The load generator's order: prompt ``i % len(prompts)`` for request ``i``, shuffled with a
    ``random.Random(seed)`` (returned last: the generator goes on drawing from it)."""
    if requests < 1 or not prompts or not outputs:
        raise InvalidRequestError("A workload needs at least one request, prompt length and output length.")
    if min(p if isinstance(p, int) else len(p) for p in prompts if p is not None) < 1 or min(outputs) < 1:
        raise InvalidRequestError("Prompt and output lengths must be at least one token.")
    rng = random.Random(seed)
    order = setting_order(requests, rng, lambda i: (prompts[i % len(prompts)], outputs[i % len(outputs)]))
    return [*order, rng]


@dataclass(frozen=True)
class EngineLimits:
    """The engine's knobs as a server runs them (engine/generation/core.py ``CoreSettings``)."""

    max_batch: int = 16
    token_budget: int = 128
    prefill_chunk: int = 128
    kv_blocks: int | None = None
    """The KV budget in blocks (``None``: no limit, and no prefix caching)."""
    prefix_caching: bool = True
    chunked_prefill: bool = True
    block_tokens: int = BLOCK_TOKENS

    @classmethod
    def of(cls, settings, kv_bytes_per_token: int | None) -> "EngineLimits":
        """A core's settings (``CoreSettings``) and a token's KV bytes: the budget in blocks."""
        blocks = None
        if settings.kv_budget_bytes is not None and kv_bytes_per_token:
            blocks = settings.kv_budget_bytes // (kv_bytes_per_token * settings.block_tokens)
        return cls(settings.max_batch, settings.token_budget, settings.prefill_chunk, blocks,
                   settings.prefix_caching, settings.chunked_prefill, settings.block_tokens)


@dataclass(frozen=True)
class Moment:
    """The engine after one simulated step."""

    t: float
    running: int
    waiting: int
    kv_blocks: int
    """Blocks held by running requests."""
    preemptions: int
    """Preemptions so far."""


@dataclass
class Simulated:
    workload: Workload
    results: list[RequestResult]
    summary: Summary
    steps: int
    preemptions: int
    timeline: list[Moment] = field(default_factory=list)
    """The engine after each step (every step while there are fewer than 4,000; then evenly thinned)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache."""
    shapes: list[tuple] = field(default_factory=list)
    """With ``trace``: each step's decode rows, prompt tokens, cache tokens read, prompt token
    pairs, preemptions and prompt chunks, as ``StepCompleted`` counts them."""
    prompt_steps: list[int] = field(default_factory=list)
    """Each request's steps before its first token (its prompt's chunks, what the prefix cache left
    of it; again after a preemption); 0: it never ran."""
    in_flight: list[int] = field(default_factory=list)
    """Each request's count of others in the engine (running or waiting) when it was sent."""
    client_s: list[float] = field(default_factory=list)
    """Each request's client's part of its TTFT: what the front end gives for its count in flight
    (``FrontEnd.client_at``; 0 without one), and the steps its first text waited for after its
    first token (``SimRequest.first_tokens``). Its TTFT less this is the server's own, from
    arrival to the first token, as a server's /metrics counts it."""


@dataclass(eq=False)
class _Running:
    """A simulated request as the scheduler sees it (its ``Scheduled`` protocol)."""

    rid: int
    prompt: list[int]
    longest: int
    output: int
    arrival: float
    reuse_prefix: bool = True
    tokens: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)
    prefilled: int = 0
    next_token: int | None = None
    computed: int = 0
    hit: list[int] | None = None
    preemptions: int = 0
    blocks_freed: int = 0
    times: list[float] = field(default_factory=list)
    cached: int | None = None
    prompt_steps: int = 0
    answer: int = 0
    """Its answer's first token id (:meth:`_Ids.answer`); the next ones follow it."""


def simulate(workload: Workload, limits: EngineLimits, cost: "StepCost", slo: dict | None = None,
             max_duration_s: float | None = None, trace: bool = False) -> Simulated:
    """``workload`` through a server that starts empty (:meth:`ServingSimulator.run`)."""
    return ServingSimulator(limits, cost).run(workload, slo, max_duration_s, trace)


class ServingSimulator:
    """A server's engine on a simulated clock: the engine core's scheduler and KV cache manager
    over one block pool, kept from one workload to the next as a running server keeps its prefix
    cache (a load generator's settings, one after another)."""

    def __init__(self, limits: EngineLimits, cost: "StepCost") -> None:
        self.limits, self.cost = limits, cost
        self.kv = KVCacheManager(1, limits.kv_blocks, limits.prefix_caching, limits.block_tokens)
        self.scheduler = Scheduler(self.kv, limits.max_batch, limits.token_budget, limits.prefill_chunk,
                                   limits.chunked_prefill)
        self._ids = _Ids()
        self._next_rid = 0
        self.first_text: dict[tuple[int, ...], int] = {}
        """Each prompt's tokens its first text came with, as a server's answers to it showed
        (:meth:`learn_first_text`); a prompt not in it takes its request's ``first_tokens``."""

    def learn_first_text(self, workload: Workload, measured: Sequence[RequestResult]) -> None:
        """What a load generator measured of ``workload`` (request ``j`` its result ``j``): how
        many tokens each prompt's first text came with. The same prompt gets the same answer (the
        generator asks for greedy answers), so its first text comes as late again."""
        for request, result in zip(workload.requests, measured):
            if request.prompt_ids and result.ok and result.counted_by == "usage":
                self.first_text[request.prompt_ids] = max(1, result.first_tokens)

    def run(self, workload: Workload, slo: dict | None = None, max_duration_s: float | None = None,
            trace: bool = False, cancelled: Callable[[], bool] | None = None) -> Simulated:
        """Run ``workload`` (its clock from 0) through the engine's scheduler, each step taking what
        the step cost says; the load generator's figures for it (``slo`` as ``parse_slo`` gives
        it), cut at ``max_duration_s`` as the generator cuts a setting. ``trace``: each step's
        shape kept (:attr:`Simulated.shapes`). ``cancelled``, asked before each step, ends the run
        there (what is in flight is cut). A request the KV budget can't hold even alone raises
        ``InvalidRequestError``."""
        kv, scheduler, cost, limits = self.kv, self.scheduler, self.cost, self.limits
        requests = workload.requests
        results = [RequestResult(i, sent=True, counted_by="usage") for i in range(len(requests))]
        for i, request in enumerate(requests):
            if not request.refused and not kv.fits_alone(request.prompt_tokens + request.output_tokens + 1):
                raise InvalidRequestError(f"Request {i + 1} ({request.prompt_tokens} prompt and "
                                          f"{request.output_tokens} output tokens) doesn't fit the KV budget "
                                          "even alone.")
        if workload.users:
            arrivals = [(0.0, i) for i in range(min(workload.users, len(requests)))]
            sent_next = len(arrivals)
        else:
            arrivals = [(r.arrival_s, i) for i, r in enumerate(requests)]
            sent_next = len(requests)
        heapq.heapify(arrivals)
        base = self._next_rid
        self._next_rid += len(requests)
        preempted_before = scheduler.preemptions
        t, steps, left, cached = 0.0, 0, len(requests), 0
        timeline: list[Moment] = []
        shapes: list[tuple] = []
        prompt_steps = [0] * len(requests)
        in_flight, client = [0] * len(requests), [0.0] * len(requests)
        prompts: dict[int, list[int]] = {}  # each request's prompt, from when it is sent
        deadline = max_duration_s if max_duration_s is not None else float("inf")
        front = cost.front
        # each request's latency outside the engine: dealt from the measured ones (the same for the
        # same workload), else their median, else none
        spread = front.request_spread_s if front is not None else ()
        latency = (_dealt(spread, len(requests), random.Random(len(requests))) if spread else
                   [front.request_s if front is not None else 0.0] * len(requests))
        try:
            while left:
                if cancelled is not None and cancelled():
                    break
                while arrivals and arrivals[0][0] <= t and arrivals[0][0] < deadline:
                    when, i = heapq.heappop(arrivals)
                    request = requests[i]
                    if request.refused:  # answered at once with an error: its user sends the next one
                        results[i].start_s, results[i].error = when, "refused: a prompt the model can't take"
                        left -= 1
                        if workload.users and sent_next < len(requests):
                            heapq.heappush(arrivals, (when, sent_next))
                            sent_next += 1
                        continue
                    if i not in prompts:  # sent now
                        prompts[i] = list(request.prompt_ids) if request.prompt_ids else self._ids.prompt(request)
                        results[i].start_s, results[i].prompt_tokens = when, len(prompts[i])
                        in_flight[i] = len(scheduler.running) + len(scheduler.waiting)
                        if front is not None and front.client_s:  # its client's part, with as many in flight
                            client[i] = front.client_at(in_flight[i])
                            latency[i] += client[i] - front.client_at(0)  # the measured latencies': at none
                        # its latency outside the engine is spent before the engine sees it (the request
                        # read, its prompt tokenized), so it overlaps the step under way; less than none
                        # (the step model over the measured), it is taken off its times after
                        if latency[i] > 0:
                            heapq.heappush(arrivals, (when + latency[i], i))
                            latency[i] = 0.0
                            continue
                    prompt = prompts[i]
                    scheduler.add(_Running(base + i, prompt, len(prompt) + request.output_tokens,
                                           request.output_tokens, results[i].start_s, feed=prompt,
                                           answer=self._ids.answer(prompt)))
                if not scheduler.running and not scheduler.waiting:
                    if not arrivals or arrivals[0][0] >= deadline:
                        break
                    t = arrivals[0][0]  # idle until the next arrival
                    continue
                plan = scheduler.schedule()
                for r in plan.admitted:
                    if r.cached is None:  # its first admission: what the prefix cache gave its prompt
                        r.cached = len(r.hit or ()) * limits.block_tokens
                        cached += r.cached
                if not plan.decoding and not plan.chunks:
                    raise InvalidRequestError("The KV budget holds none of the waiting requests: make it larger.")
                kv_read, attended = attention_reads(plan.decoding, plan.chunks)
                prompt_tokens = sum(size for _, size in plan.chunks)
                t += cost.seconds(len(plan.decoding), len(plan.chunks), prompt_tokens, kv_read, attended)
                if front is not None:  # the server's front end, on the same cores
                    ending = sum(1 for r, size in plan.chunks if r.prefilled + size == len(r.feed))
                    t += front.step_s + front.token_s * (len(plan.decoding) + ending)
                if t > deadline:  # the setting ends during this step: what it would give is never sent
                    for when, i in arrivals:  # sent before the end, waiting for the server: cut
                        if when < deadline and i not in prompts:
                            results[i].start_s, results[i].prompt_tokens = when, requests[i].prompt_tokens
                    break
                steps += 1
                if trace:
                    shapes.append((len(plan.decoding), prompt_tokens, kv_read, attended, len(plan.preempted),
                                   len(plan.chunks)))
                made = set()
                for r, size in plan.chunks:
                    r.prompt_steps += not r.tokens
                    r.prefilled += size
                    r.computed += size
                    kv.keep(r.rid, r.feed, r.prefilled)
                    if r.prefilled == len(r.feed):
                        made.add(r)
                for r in plan.decoding:
                    r.computed += 1
                    made.add(r)
                for r in [r for r in scheduler.running if r in made]:  # the core's order: its running list
                    token = r.answer + len(r.tokens)
                    r.tokens.append(token)
                    r.next_token = token
                    r.times.append(t)
                    if len(r.tokens) >= r.output:
                        in_cache = min(r.computed, len(r.prompt) + len(r.tokens) - 1)
                        kv.keep(r.rid, r.prompt + r.tokens, in_cache)
                        scheduler.remove(r)
                        j = r.rid - base
                        first = min(self.first_text.get(requests[j].prompt_ids, requests[j].first_tokens),
                                    len(r.times))
                        _finished(results[j], r, latency[j], first)
                        client[j] += r.times[first - 1] - r.times[0]
                        prompt_steps[j] = r.prompt_steps
                        left -= 1
                        if workload.users and sent_next < len(requests):  # the user sends its next request now
                            heapq.heappush(arrivals, (t + max(0.0, latency[j]), sent_next))
                            sent_next += 1
                timeline.append(Moment(t, len(scheduler.running), len(scheduler.waiting), kv.used_blocks,
                                       scheduler.preemptions - preempted_before))
        finally:
            for r in [*scheduler.running, *scheduler.waiting]:  # cut (or a failure): the next run starts empty
                scheduler.remove(r)
        for result in results:
            if result.ok or result.error:
                continue
            if result.prompt_tokens is None:  # its moment came after the end: not sent
                result.sent = False
            else:  # in flight at the end
                result.cut = True
                result.error = (f"cut by the deadline: in flight at {max_duration_s:g} s" if max_duration_s is not None
                                else "cut: the simulation was stopped")
        ended = [r.start_s + r.e2e_s for r in results if r.e2e_s is not None]
        summary = summarize(results, max(ended) if ended else min(t, deadline), slo, "the deadline" if left else None)
        return Simulated(workload, results, summary, steps, scheduler.preemptions - preempted_before,
                         _thinned(timeline), cached, shapes, prompt_steps, in_flight, client)


def _dealt(values: Sequence[float], n: int, draw: random.Random) -> list[float]:
    """``n`` of ``values``, each as often as the others (give or take one), in a shuffled order:
    the simulated requests' latencies spread as the measured ones did. Drawn with replacement
    instead, how many of the few slow ones came up would move a percentile by itself (a p90 of
    24 requests hangs on its three slowest)."""
    dealt: list[float] = []
    while len(dealt) < n:
        deck = list(values)
        draw.shuffle(deck)
        dealt += deck
    return dealt[:n]


def _finished(result: RequestResult, r: _Running, latency: float = 0.0, first: int = 1) -> None:
    """``r``'s figures as its client sees them, ``latency`` later than the engine made them (what
    a fitted latency outside the engine leaves after it: none, or less than none where the step
    model gives more than the server took), its first ``first`` tokens in one chunk (their text
    held back until the last of them), as the load generator reads them."""
    times = r.times
    result.ok = True
    result.first_tokens = first
    result.ttft_s = max(0.0, times[first - 1] - r.arrival + latency)
    result.e2e_s = max(result.ttft_s, times[-1] - r.arrival + latency)
    result.itl_s = [0.0] * (first - 1) + [b - a for a, b in zip(times[first - 1:], times[first:])]
    result.chunk_times_s = [max(0.0, x - r.arrival + latency) for x in times[first - 1:]]
    result.output_tokens = len(r.tokens)
    result.finish_reason = "length"


def _thinned(timeline: list[Moment], most: int = 4000) -> list[Moment]:
    if len(timeline) <= most:
        return timeline
    every = len(timeline) / most
    return [timeline[int(i * every)] for i in range(most)] + [timeline[-1]]


class _Ids:
    """Token ids for simulated prompts and answers: a shared prefix gets the same ids in every
    request, everything else ids no other request has (so nothing else is found in the cache);
    except that the same prompt gets the same answer, as a greedy server gives it (the load
    generator asks for temperature 0): sent again, its answer's blocks are found cached already,
    as the server finds them, rather than cached anew, pushing other prompts' blocks out."""

    ANSWERS = 1 << 40
    """Answers' ids start here, ``1 << 20`` apart: above any vocabulary's and any made-up prompt's."""

    def __init__(self) -> None:
        self._next = 1 << 20
        self._answers: dict[int, int] = {}

    def answer(self, prompt: list[int]) -> int:
        """The first token id of ``prompt``'s answer (the same for the same prompt)."""
        slot = self._answers.setdefault(hash(tuple(prompt)), len(self._answers))
        return self.ANSWERS + (slot << 20)

    def prompt(self, request: SimRequest) -> list[int]:
        shared = min(request.shared_prefix, request.prompt_tokens - 1)
        own = range(self._next + 1, self._next + 1 + request.prompt_tokens - shared)
        self._next += request.prompt_tokens - shared
        return [*range(1, shared + 1), *own]


USERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The loads a serving curve simulates by default: closed loops of this many users."""
RATE_SHARES = (0.1, 0.25, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2)
"""Open-loop loads as shares of the server's capacity (:func:`capacity`)."""
MOST_REQUESTS = 1024
"""The most requests one load of a curve sends (a large batch sends four a row, up to this)."""


@dataclass(frozen=True)
class CurvePoint:
    load: float
    """Users (a closed loop) or requests per second arriving (an open loop)."""
    summary: Summary
    preemptions: int
    timeline: tuple[Moment, ...] = ()
    """The engine after each step (thinned as :attr:`Simulated.timeline` is)."""


def _requests(limits: EngineLimits, users: int = 0) -> int:
    """Requests one load of a curve sends: four a user (a closed loop) or four a batch row (an
    open loop), at least 32, at most :data:`MOST_REQUESTS`."""
    return min(MOST_REQUESTS, max(32, 4 * (users or limits.max_batch)))


def serving_curve(cost: "StepCost", limits: EngineLimits, prompt_tokens: int, output_tokens: int,
                  shared_prefix: int = 0, loads: Sequence[float] = USERS, slo: dict | None = None,
                  cancelled: Callable[[], bool] | None = None, rate: bool = False) -> list[CurvePoint]:
    """Latency and throughput against load: for each load, requests of ``prompt_tokens`` (the
    first ``shared_prefix`` the same in all) and ``output_tokens`` through a server that starts
    empty; a load is a closed loop of that many users (four requests a user, at least 32) or,
    with ``rate``, requests arriving at that many a second as the load generator spaces them
    (:data:`MOST_REQUESTS`, or four a batch row if fewer, at least 32). ``cancelled``, asked at
    every simulated step, ends the curve early (what it holds then is not to be shown)."""
    out = []
    for load in loads:
        if cancelled is not None and cancelled():
            break
        if rate:
            workload = open_loop(load, [prompt_tokens], [output_tokens], _requests(limits),
                                 shared_prefix=shared_prefix)
        else:
            workload = closed_loop(int(load), [prompt_tokens], [output_tokens], _requests(limits, int(load)),
                                   shared_prefix=shared_prefix)
        run = ServingSimulator(limits, cost).run(workload, slo, cancelled=cancelled)
        out.append(CurvePoint(load, run.summary, run.preemptions, tuple(run.timeline)))
    return out


def capacity(cost: "StepCost", limits: EngineLimits, prompt_tokens: int, output_tokens: int,
             shared_prefix: int = 0, cancelled: Callable[[], bool] | None = None) -> float:
    """The requests a second the server completes when it is never idle: a closed loop of as
    many users as its batch holds."""
    curve = serving_curve(cost, limits, prompt_tokens, output_tokens, shared_prefix, [limits.max_batch],
                          cancelled=cancelled)
    return curve[0].summary.request_throughput if curve else 0.0


def most_load(curve: list[CurvePoint], ttft_p90_s: float) -> float | None:
    """The largest load of ``curve`` whose p90 TTFT stays within ``ttft_p90_s`` (``None``: not
    even the smallest), as long as every smaller load's does too."""
    best = None
    for point in curve:
        ttft = point.summary.ttft
        if ttft is None or ttft["p90"] > ttft_p90_s:
            break
        best = point.load
    return best
