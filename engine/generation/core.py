"""The engine core: one step scheduler that many requests run through at once (continuous batching).

Before each step the scheduler (engine/generation/scheduler.py) decides who runs: it admits
waiting requests while the batch has room and their KV blocks fit (engine/generation/kv_manager.py:
blocks are taken as a request grows, never reserved for its longest answer), preempts the
newest request when the running ones need blocks that aren't there, and gives the step's token
budget to one decode token per generating request and chunks of the prompts still being read,
so a long prompt is read over several steps instead of stalling everyone else for its whole length.
The core carries the plan out: it sets up admitted requests' caches (copying any prefix found in the
prefix cache); the execute stage (engine/generation/execute.py) runs the chunks and the batched
decode step and samples; the output stage (engine/generation/step_output.py) makes the events. The
thread count and the memory the events carry are read on their own clock, not every step
(engine/generation/upkeep.py). A request that ends (its stop rule, its cancel flag, an error) leaves
between steps and its blocks are freed at once; the full blocks it computed stay in the prefix cache
(when it is on) for later requests that begin the same way.

Each request carries its own sampling settings, stop rules and cancel flag, and gets the same
events as a generation alone (:class:`Prefilled`, :class:`TokenGenerated`, :class:`Finished`,
each with its ``request_id``); every step adds a :class:`StepCompleted` for the traffic plots.

The forward passes belong to a runner (engine/generation/runners.py): the reference runner (transformers,
one cache per request, one after another) or the fast path's paged cache (the KV manager's block
pool, one batched step). A proposer (engine/generation/proposer.py) may guess tokens for the decode pass to verify
(speculative decoding); the sampler takes the whole step's batch at once
(engine/generation/sampling.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError, InvalidRequestError, is_out_of_memory
from engine.base.events import Finished, GenerationEvent, Preempted, StepCompleted
from engine.base.memory import MemoryProbe, StepAllocations
from engine.base.request import GenerationRequest
from engine.generation.decoding import PREFILL_CHUNK, SeenTokens, failed_event, finished_event
from engine.generation.execute import StepExecutor, StepWork
from engine.generation.invariant import PROMPT_CHUNK, fixed_row_products
from engine.generation.kv_manager import BLOCK_TOKENS, KVCacheManager
from engine.generation.output import OutputProcessor
from engine.generation.proposer import NOTHING, Proposal, Proposer
from engine.generation.runners import batch_runner_for
from engine.generation.sampling import Choice, make_sampler
from engine.generation.scheduler import Scheduler, attention_reads
from engine.generation.step_output import StepOutputs
from engine.generation.upkeep import Upkeep

if TYPE_CHECKING:
    from engine.models.model import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSettings:
    token_budget: int = 64
    """Tokens one step may put through the model: a decode token per generating request, the
    rest for prompt chunks."""
    max_batch: int = 64
    """Requests running at once; more wait."""
    kv_budget_bytes: int | None = None
    """KV-cache bytes the running requests' blocks and the prefix cache may hold together
    (counted in blocks); ``None``: no limit."""
    chunked_prefill: bool = True
    """Read long prompts in chunks between decode steps; off: a prompt goes through whole."""
    prefill_chunk: int = PREFILL_CHUNK
    """The largest prompt chunk of one request in one step."""
    prefix_caching: bool = False
    """Keep computed full blocks for later requests with the same prefix (needs a KV budget:
    kept blocks are evicted against it)."""
    block_tokens: int = BLOCK_TOKENS
    reserve_up_front: bool = False
    """Admit a request only when the blocks of its longest answer are free, and take them all
    at once (the scheduler before blocks on demand; for comparison: benchmarks/preemption.py)."""


@dataclass(eq=False)
class _Request:
    rid: int
    request: GenerationRequest
    prompt: list[int]
    cancel: CancelToken
    longest: int
    """Prompt and longest answer, in tokens (capped by the context)."""
    arrived: float
    feed: list[int] = field(default_factory=list)
    """What the cache must hold before decoding (engine/generation/scheduler.py)."""
    computed: int = 0
    """Tokens in its cache."""
    hit: list[int] | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    """Prompt tokens copied from the prefix cache at its first admission."""
    in_runner: bool = False
    blocks_freed: int = 0
    """Blocks its last preemption freed."""
    counts: dict = field(default_factory=dict)
    """The proposer's totals (speculation's drafted/accepted tokens), added up when it lets the
    request go (a preemption, its end)."""
    sampler: object = None
    output: OutputProcessor | None = None
    """Its text and stop rules (engine/generation/output.py)."""
    seen: SeenTokens | None = None
    tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    prefilled: int = 0
    prefill_started: float | None = None
    next_token: int | None = None
    prompt_scores: list = field(default_factory=list)
    """With ``prompt_logprobs``: each prompt token's score so far (from the second token on)."""
    prompt_scored: bool = False
    """Its :class:`PromptScored` was sent (a recomputed prompt, after a preemption, isn't scored twice)."""
    continued: bool | None = None
    """Whether its chat prompt continued from the last exchange's tokens (``None``: not asked)."""

    @property
    def reuse_prefix(self) -> bool:
        """Copy kept blocks? Not when the prompt is scored: every position must be computed."""
        return self.request.reuse_prefix and self.request.prompt_logprobs is None

    @property
    def scoring_prompt(self) -> bool:
        """Its next prompt chunk must give every position's scores, not only the last one's."""
        return self.request.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt) - 1


class EngineCore:
    """Submit requests, then call :meth:`step` (or iterate :meth:`run`) until :attr:`idle`."""

    def __init__(self, loaded: "LoadedModel", settings: CoreSettings | None = None, runner=None,
                 proposer: Proposer | None = None) -> None:

        self.loaded = loaded
        self.runner = runner if runner is not None else batch_runner_for(loaded)
        self.paged = bool(getattr(self.runner, "paged", False))
        """Whether the runner keeps the keys and values in the KV manager's pool (blocks shared in
        place) rather than a cache of its own per request (cached blocks copied in and out)."""
        self._configure(settings or CoreSettings(), proposer=proposer)
        self.steps = 0
        self.watch_next = False
        """Read the next step's activations from the allocator (StepCompleted.activation_bytes)."""
        self.probe = MemoryProbe(loaded.device)
        self.probe.reset_peak()
        self.upkeep = Upkeep(self.probe)
        self.outputs = StepOutputs(loaded, self.runner, self._finish)
        self.executor = StepExecutor(loaded, self.runner, self.outputs)
        self.start = time.perf_counter()
        self._next_id = 1

    def _configure(self, settings: CoreSettings, kept: KVCacheManager | None = None,
                   proposer: Proposer | None = None) -> None:
        """Limits, KV manager and scheduler for ``settings``, and ``proposer`` (``None``: none);
        ``kept``: a manager whose kept blocks (and prefix-cache counts) carry over, the most
        recently used first, as many as fit."""
        if settings.token_budget < 1 or settings.max_batch < 1:
            raise InvalidRequestError("The token budget and the batch size must be at least 1.")
        if settings.block_tokens < 1:
            raise InvalidRequestError("A KV block holds at least one token.")
        # a token's bytes: the pool's storage's, where the runner keeps the pool; else the config's
        per_token = self.runner.per_token_bytes if self.paged else self.loaded.info.kv_bytes_per_token
        budget = settings.kv_budget_bytes
        proposer = proposer or Proposer()
        # a draft's own cache holds the same tokens as the target's: the budget covers both
        blocks = None if budget is None or not per_token else budget // (
            (per_token + proposer.kv_bytes_per_token) * settings.block_tokens)
        proposer.limit_blocks(blocks, settings.block_tokens)
        reason = None
        if settings.prefix_caching:
            reason = getattr(self.runner, "prefix_cache_reason", lambda: "this runner can't copy blocks")()
            if blocks is None:
                reason = "it needs a KV budget to evict kept blocks against"
        sliding = getattr(self.runner, "sliding_tokens", lambda: None)()
        kv = KVCacheManager(per_token or None, blocks, settings.prefix_caching and reason is None,
                            settings.block_tokens, storage=self.runner if self.paged else None,
                            sizer=lambda data: sum(t.nbytes for part in data for t in part if t is not None),
                            sliding_tokens=sliding, lacks_window=self.runner.lacks_window if self.paged else
                            lambda data: any(t is None for t in data[0]))
        if kept is not None:
            kv.adopt(kept)
        if self.paged:
            self.runner.bind(kv)
        self.proposer = proposer
        """What guesses tokens for the decode pass to verify (speculation), or the plain one: none."""
        lookahead = self.proposer.lookahead
        self.runner.rollback = lookahead > 0  # rejected guesses are cropped from the cache
        self.settings, self.kv, self.prefix_caching_off = settings, kv, reason
        """``prefix_caching_off``: why prefix caching is off though asked for (``None``: on, or not asked for)."""
        self.scheduler = Scheduler(kv, settings.max_batch, settings.token_budget, settings.prefill_chunk,
                                   settings.chunked_prefill, lookahead, settings.reserve_up_front)

    def reconfigure(self, settings: CoreSettings, proposer: Proposer | None = None) -> None:
        """New limits for this idle core (the window's one request at a time, or a server's batch
        and budget) and its proposer (``None``: none): the same runner and caches, the prefix
        cache's kept blocks carried over."""
        if not self.idle:
            raise EngineError("The engine core is busy: its limits change only when it is idle.")
        self._configure(settings, kept=self.kv, proposer=proposer)

    @contextmanager
    def borrowed(self, settings: CoreSettings | None = None, proposer: Proposer | None = None):
        """This idle core for a client that needs other limits (a batch sweep: its batch, no KV
        budget) or a proposer (a speculative run) for a while; then back as it was. The prefix
        cache's kept blocks go with it where the borrowed settings cache prefixes too (and come
        back with what was added), else wait untouched. A client that leaves mid-run (an error,
        an abandoned stream) has its requests dropped first."""
        if not self.idle:
            raise EngineError("The engine core is busy: it is lent only when it is idle.")
        before, kv, ahead = self.settings, self.kv, self.proposer
        self._configure(settings or before, kept=kv, proposer=proposer)
        try:
            yield self
        finally:
            self._drop_all()
            self._configure(before, kept=self.kv if self.kv.prefix_caching else kv, proposer=ahead)

    def _drop_all(self) -> None:
        """Take every request out (nothing is emitted): a client left without finishing them."""
        for r in [*self.waiting, *self.running]:
            self._drop(r, "its client left")

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[_Request]:
        return self.scheduler.running

    # -- requests ----------------------------------------------------------------------
    def submit(self, request: GenerationRequest, cancel: CancelToken | None = None,
               prompt_ids: list[int] | None = None, arrived: float | None = None) -> int:
        """Queue a request; returns its id. Raises now for a bad request (empty, over-long prompt,
        token ids outside the vocabulary, longer than the whole KV budget). ``arrived``: when the
        caller received it (``time.perf_counter()``; default now): its TTFT and total time count
        from then, so a server's wait before the core picks the request up is part of them."""
        request = request.validated()
        prompt = list(prompt_ids) if prompt_ids is not None else self.loaded.encode(request)
        self.loaded.check_prompt(prompt)  # token ids given by the caller too
        context = self.loaded.info.context_length
        longest = len(prompt) + request.max_new_tokens if context is None else min(
            len(prompt) + request.max_new_tokens, context)
        if not self.kv.fits_alone(longest + 1 + self.scheduler.lookahead):
            need = self.kv.block_bytes(self.kv.blocks_for(longest + 1 + self.scheduler.lookahead))
            raise InvalidRequestError(f"This request needs {need:,} bytes of KV cache at its longest, over the whole "
                                      f"budget of {self.settings.kv_budget_bytes:,}: shorten it or raise the budget.")
        rid, self._next_id = self._next_id, self._next_id + 1
        continued = None
        if request.continues is not None and request.mode == "chat":
            earlier = [*request.continues[0], *request.continues[1]]
            continued = prompt[:len(earlier)] == earlier
        self.scheduler.add(_Request(rid, request, prompt, cancel or CancelToken(), longest,
                                    time.perf_counter() if arrived is None else arrived, feed=prompt,
                                    continued=continued))
        return rid

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def kv_bytes(self) -> int:
        """Bytes the cache holds for every running request: the pool's held blocks (a shared one
        once, each block's bytes read from the storage; sliding-window layers' only within their
        windows), or what a copying runner's caches hold."""
        if self.paged:
            return self.runner.held_nbytes()
        return sum(self.runner.kv_bytes(r.rid) for r in self.running if r.in_runner)

    def kept_bytes(self) -> int:
        """Bytes of the cached blocks no request holds (the pool's, or a copying runner's copies)."""
        return self.kv.kept_bytes

    def run(self) -> Iterator[GenerationEvent]:
        while not self.idle:
            yield from self._step()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[GenerationEvent]:
        return list(self._step())

    def stepping(self) -> Iterator[GenerationEvent]:
        """One step's events as :meth:`step` makes them, each made when the one before is read."""
        return self._step()

    def _step(self) -> Iterator[GenerationEvent]:
        """One step's events, made as they are consumed: a request's tokens one by one (a step
        may give it several: the draft's accepted guesses), so a cancel pressed while one is
        shown stops before the next. Schedule (engine/generation/scheduler.py) → execute the
        forward passes and sample (engine/generation/execute.py) → process the outputs into
        events (engine/generation/step_output.py).

        Whatever fails in one request's own work (its admission, its prompt chunk, its guesses,
        its verification, sampling, detokenizing, stop rules) ends that request alone with the
        error; the batched decode pass and running out of memory are everyone's, and raise."""
        import torch

        self.upkeep.before_step()
        invariant = bool(getattr(self.loaded, "batch_invariant", False))
        self.runner.batch_invariant = invariant
        self.scheduler.aligned = PROMPT_CHUNK if invariant else None
        began = time.perf_counter()
        yield from self._drop_cancelled()
        queried = self.kv.queries
        work = StepWork()
        yield from self._start(self.scheduler.schedule(), work)
        # a watched step: what its forward passes and sampling held at most beyond what it keeps
        watch = StepAllocations(self.loaded.device) if self.watch_next else None
        self.watch_next = False
        exact = fixed_row_products if invariant else nullcontext
        with watch or nullcontext():
            with torch.inference_mode(), exact():
                self.executor.read_prompts(work, self.kv, self.proposer)
                self.executor.decode(work, self.proposer)
                choices = self.executor.sample(work)
            work.rows.clear()  # the scores are sampled: let go of them before the watch ends
        yield from self._outputs(work, choices, began)
        yield self._step_completed(work, began, queried, watch)
        self.steps += 1

    def _drop_cancelled(self) -> Iterator[GenerationEvent]:
        """Requests cancelled between steps leave before this one, unless the last token left half
        a character: one more token completes it (and ends it)."""
        for r in [*self.waiting, *self.running]:
            if r.cancel.cancelled and not (r.output is not None and r.output.pending):
                try:
                    yield self._finish(r, "cancelled")
                except Exception as exc:
                    yield self._fail(r, exc)

    def _start(self, plan, work: StepWork) -> Iterator[GenerationEvent]:
        """The plan's preemptions and admissions; what this step reads and decodes."""
        for r in plan.preempted:
            yield from self._guarded(r, self._preempt(r))
        for r in plan.admitted:
            work.cached += len(r.hit or ()) * self.kv.block_tokens
            yield from self._guarded(r, self._admit(r))
        work.decoding = [r for r in plan.decoding if r in self.running]
        work.chunks = [(r, size) for r, size in plan.chunks if r in self.running and r.in_runner]
        work.preempted = len(plan.preempted)
        work.kv_read, work.pairs = attention_reads(work.decoding, work.chunks)

    def _outputs(self, work: StepWork, choices: list, began: float) -> Iterator[GenerationEvent]:
        """The step's events: failures, prompts scored, then each request's tokens."""
        for r, exc in work.failed:
            yield self._fail(r, exc)
        yield from work.scored
        memory = self.upkeep.memory()
        now = time.perf_counter()
        chosen = {r.rid: choice for r, choice in zip(work.ready, choices)}
        for r in list(self.running):
            choice = chosen.get(r.rid)
            if choice is None:
                continue
            if isinstance(choice, Exception):
                if is_out_of_memory(choice):
                    raise choice
                yield self._fail(r, choice)
                continue
            proposal = work.proposals.get(r.rid, NOTHING)
            yield from self._guarded(r, self._emit(r, choice, proposal, work.verify_s.get(r.rid, 0.0), began, now,
                                                   memory))
        work.memory = memory

    def _step_completed(self, work: StepWork, began: float, queried: int, watch) -> StepCompleted:
        now = time.perf_counter()
        predicted = [self.loaded.predicted_kv_bytes(r.computed) for r in self.running if r.in_runner]
        return StepCompleted(
            step=self.steps, batch=len(work.ready),
            decode_tokens=len(work.decoding), prefill_tokens=sum(size for _, size in work.chunks),
            waiting=len(self.waiting), running=len(self.running), kv_cache_bytes=self.kv_bytes(),
            kv_cache_bytes_predicted=None if None in predicted else sum(predicted),
            step_s=now - began, elapsed_s=now - self.start, memory=work.memory, preempted=work.preempted,
            cached_tokens=work.cached, prefix_query_tokens=self.kv.queries - queried,
            kv_blocks_used=self.kv.used_blocks, kv_blocks_kept=self.kv.kept_blocks, kv_kept_bytes=self.kept_bytes(),
            kv_blocks_total=self.kv.total_blocks, kv_block_tokens=self.kv.block_tokens,
            kv_blocks_shared=self.kv.shared_blocks,
            kv_pool_bytes=self.runner.storage_nbytes() if self.paged else 0,
            activation_bytes=watch.activation_bytes if watch else None,
            kv_tokens_read=work.kv_read, prompt_pairs=work.pairs, prompt_chunks=len(work.chunks))

    # -- admission and preemption -------------------------------------------------------------
    def _admit(self, r: _Request) -> Iterator[GenerationEvent]:
        """Set up ``r``'s cache (admitted by the scheduler this step), with the blocks the prefix
        cache had for it copied in; the first admission also makes its sampler and detokenizer."""
        device = self.loaded.device
        if r.sampler is None:
            r.sampler = make_sampler(r.request.sampling, device)
            r.output = OutputProcessor(self.loaded.tokenizer, r.request, self.loaded.eos_ids,
                                      self.loaded.info.context_length, len(r.prompt))
            r.seen = SeenTokens(r.prompt, min(r.request.max_new_tokens, 4096), device)
        # alone, the cache is sized for the whole answer at once (no copies as it grows);
        # in a batch every slot shares the capacity: the whole answer where that stays small
        if self.settings.max_batch == 1:
            self.runner.add(r.rid, r.longest)
        else:
            self.runner.add(r.rid, len(r.feed) + 1, hoped=r.longest)
        r.in_runner = True
        self.proposer.add(r.rid, r.request, r.longest)
        if r.hit:
            import torch

            cached = len(r.hit) * self.kv.block_tokens  # the scheduler counted them as read
            if self.paged:  # its table begins with them: read in place
                self.runner.found(r.rid, cached)
            else:
                self.runner.load_kv(r.rid, [self.kv.copy_of(block) for block in r.hit])
            with torch.inference_mode():  # a draft reads the prefix (its own cache, no copy)
                self.proposer.prefill(r.rid, torch.tensor([r.feed[:cached]], dtype=torch.long, device=device))
            if not r.tokens:  # its Prefilled is still to come (a first admission, or preempted in its prompt)
                r.cached_tokens = cached
        r.hit = None
        yield from ()

    def _release_proposer(self, r: _Request) -> None:
        """Free what the proposer holds for ``r``, its totals added to ``r.counts``."""
        for name, value in self.proposer.counts(r.rid).items():
            r.counts[name] = r.counts.get(name, 0) + value
        self.proposer.remove(r.rid)

    def _preempt(self, r: _Request) -> Iterator[GenerationEvent]:
        """Free ``r``'s cache: the scheduler took its blocks back and queued it again."""
        if r.in_runner:
            self.runner.remove(r.rid)
            r.in_runner = False
        self._release_proposer(r)
        log.info("request %d preempted after %d tokens (KV blocks ran out); it will be recomputed",
                 r.rid, len(r.tokens))
        yield Preempted(step=self.steps, tokens=len(r.tokens), blocks_freed=r.blocks_freed,
                        elapsed_s=time.perf_counter() - r.arrived, request_id=r.rid)

    # -- one request failing alone ----------------------------------------------------------
    def _guarded(self, r: _Request, events: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
        """``events`` of ``r``'s own work; if that work fails, ``r`` ends with the error instead."""
        try:
            yield from events
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            yield self._fail(r, exc)

    def _fail(self, r: _Request, exc: Exception) -> Finished:
        """End ``r`` because its own work raised ``exc``; the other requests go on."""
        message = _failure(r, exc)
        if r not in self.running and r not in self.waiting:  # it failed while finishing: free what
            return self._drop(r, message)  # the runner or the draft may still hold for it
        try:
            return self._finish(r, "error", error=message)
        except Exception:  # its state is too broken to total: drop it by hand
            log.exception("request %d could not be finished cleanly", r.rid)
            return self._drop(r, message)

    def _drop(self, r: _Request, message: str) -> Finished:
        """Take ``r`` out of the core whatever state a failure (or a client leaving) left it in."""
        self.scheduler.remove(r)
        for part in (self.runner if r.in_runner else None, self.proposer):
            if part is not None:
                try:
                    part.remove(r.rid)
                except Exception:  # it held nothing for ``r`` (the failure came before it did)
                    pass
        return failed_event(r.rid, message, tokens=len(r.tokens), prompt_tokens=len(r.prompt),
                            total_s=time.perf_counter() - r.arrived)

    def _emit(self, r: _Request, choice: Choice, proposal: Proposal, verify_s: float, began: float, now: float,
              memory) -> Iterator[GenerationEvent]:
        """What the step gave ``r``: its cache rolled back to the accepted guesses (and the
        proposer told), then its tokens, made into events by the output stage."""
        if proposal.tokens:
            keep = r.computed - (len(proposal.tokens) - choice.accepted)
            self.kv.crop(r.rid, keep)
            self.runner.crop(r.rid, keep)
            r.computed = keep
            verified = self.proposer.settle(r.rid, proposal, choice.accepted, len(r.prompt) + len(r.tokens), verify_s)
            if verified is not None:
                # the step's time with its rollback (the caches cropped to what was kept)
                yield replace(verified, elapsed_s=now - r.arrived, step_s=time.perf_counter() - began)
        yield from self.outputs.tokens(r, choice, began, now, memory, self.proposer.lookahead > 0,
                                       lambda r: r in self.running)

    def _finish(self, r: _Request, reason: str, stop_string: str | None = None, error: str | None = None) -> Finished:
        """End ``r`` now: its totals, its full blocks kept for later prompts (unless it failed:
        its cache may hold what made it fail), and its blocks freed before the next step."""
        in_cache = min(r.computed, len(r.prompt) + len(r.tokens) - 1) if r.tokens else r.computed
        kv = 0
        if r.in_runner:
            if r.computed > in_cache and self.runner.rollback:  # it stopped part-way through a step's accepted guesses
                self.kv.crop(r.rid, in_cache)
                self.runner.crop(r.rid, in_cache)
                r.computed = in_cache
            if reason != "error":
                self.kv.keep(r.rid, r.prompt + r.tokens, in_cache, None if self.paged else self.executor.copier(r))
            kv = self.runner.kv_bytes(r.rid)
        self.scheduler.remove(r)
        if r.in_runner:
            self.runner.remove(r.rid)
            r.in_runner = False
        self._release_proposer(r)
        text = r.output.text if r.output is not None else ""
        self.upkeep.memory(fresh=True)  # its peak includes its end
        event = finished_event(reason, r.tokens, r.latencies, len(r.prompt), r.arrived, self.probe, kv,
                               self.loaded.predicted_kv_bytes(in_cache), text, stop_string, **r.counts)
        return replace(event, request_id=r.rid, error=error, cached_tokens=r.cached_tokens, preemptions=r.preemptions,
                       prefix_cache_bytes=self.kv.kept_bytes if self.kv.prefix_caching else None,
                       prompt_ids=tuple(r.prompt), continued=r.continued)


def _failure(r: _Request, exc: Exception) -> str:
    """Log ``r``'s own failure; what its Finished says."""
    log.error("request %d failed; the others go on", r.rid, exc_info=exc)
    return f"The engine failed on this request: {type(exc).__name__}: {exc}"
