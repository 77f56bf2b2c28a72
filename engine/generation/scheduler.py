"""The scheduler: before each step of the engine core it decides who runs and with what, and
returns that as a :class:`StepPlan`; the core (engine/generation/core.py) carries it out.

The shape of vLLM v1's and nano-vllm's: requests wait in a queue (first come, first served) and
run in a batch of at most ``max_batch``. Each step first gives every decoding request the KV
block its next token needs (engine/generation/kv_manager.py); when none is left it **preempts**
the newest running request: its blocks are freed and it goes back to the front of the queue,
to be computed again (its prompt and the tokens it has so far) when it is admitted again:
vLLM's default, recompute. Then, if nobody was preempted, waiting requests are admitted while
the batch has room and their tokens' blocks fit (a request's prompt found in the prefix cache
is found, not computed). Last, the step's token budget goes to a decode token for each
decoding request and the rest to prompt chunks, so a long prompt is read over several steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.generation.kv_manager import KVCacheManager


class Scheduled(Protocol):
    """What the scheduler reads and sets of a request (the core's request state)."""

    rid: int
    prompt: list[int]
    tokens: list[int]
    feed: list[int]
    """What its cache must hold before it decodes: the prompt, or after a preemption the prompt
    and every token it had."""
    prefilled: int
    """Tokens of ``feed`` in the cache."""
    next_token: int | None
    """The token its next decode step feeds (``None`` while ``feed`` is being read)."""
    computed: int
    """Tokens in its cache."""
    hit: list[int] | None
    """Blocks found in the prefix cache at its admission: the start of its block table (a copying
    runner copies them into its cache)."""
    preemptions: int
    blocks_freed: int
    longest: int
    """Its prompt and longest answer, in tokens."""
    reuse_prefix: bool
    """Whether it may copy blocks from the prefix cache."""


@dataclass
class StepPlan:
    preempted: list = field(default_factory=list)
    """Requests moved back to the queue this step (their caches to be freed)."""
    admitted: list = field(default_factory=list)
    """Requests admitted this step (caches to be set up, their ``hit`` copied in)."""
    decoding: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    """(request, tokens of its ``feed`` to read this step)."""


def attention_reads(decoding, chunks) -> tuple[int, float]:
    """What a step's attention reads, known before it runs: the cache tokens its decode rows attend
    over (each row's context and its new token), and the token pairs its prompt chunks attend over
    (each chunk token over the tokens before it). The engine core reports them with each step; the
    serving simulator's step-cost model reads them."""
    return (sum(r.computed + 1 for r in decoding),
            sum(size * (r.prefilled + (size + 1) / 2) for r, size in chunks))


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch: int, token_budget: int, prefill_chunk: int,
                 chunked_prefill: bool = True, lookahead: int = 0, reserve_up_front: bool = False) -> None:
        self.kv = kv
        self.max_batch, self.token_budget = max_batch, token_budget
        self.prefill_chunk, self.chunked_prefill = prefill_chunk, chunked_prefill
        self.lookahead = lookahead
        """Cache slots a decode step may fill past the next token (speculation's guesses)."""
        self.reserve_up_front = reserve_up_front
        """The old way, kept to compare against (benchmarks/preemption.py): admission takes the
        blocks of a request's longest answer at once, so nobody is ever preempted."""
        self.aligned: int | None = None
        """Batch-invariant arithmetic (engine/generation/invariant.py): prompt chunks end at multiples
        of this many tokens, whatever the budget left, and a prefix hit is cut to such a multiple."""
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions = 0
        self._made_keys: dict[int, tuple[list[int], list[bytes]]] = {}

    def add(self, r: Scheduled) -> None:
        self.waiting.append(r)

    def remove(self, r: Scheduled) -> None:
        """``r`` ends: out of the queues, its blocks freed."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.kv.release(r.rid)
        self._made_keys.pop(r.rid, None)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for r in [r for r in self.running if r.next_token is not None]:  # oldest first
            while r in self.running and not self.kv.hold(r.rid, r.computed + 1 + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
            if r in self.running:
                plan.decoding.append(r)
        if not plan.preempted:
            self._admit(plan)
        budget = self.token_budget - len(plan.decoding)
        for r in self.running:
            left = len(r.feed) - r.prefilled
            if not left:
                continue
            if self.aligned:  # to the next multiple, budget or not (the step's first chunk always goes)
                size = min(left, self.aligned - r.prefilled % self.aligned)
                if size > budget and plan.chunks:
                    break
            else:
                size = min(left, self.prefill_chunk, budget) if self.chunked_prefill else left
            if size <= 0:
                break
            plan.chunks.append((r, size))
            budget -= size
        return plan

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting requests in order while the batch has room and their blocks fit (the
        first that doesn't fit waits, and so do those behind it).

        With prefix caching, a request whose next uncached block is one a running request is
        still computing waits for it rather than computing it again (SGLang's in-batch prefix
        caching): sixteen questions behind one system prompt read the prompt once."""
        pending: set[bytes] | None = None
        for r in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            need = (r.longest if self.reserve_up_front else len(r.feed)) + 1 + self.lookahead
            if not self.kv.can_hold(r.rid, need):
                break
            if self.kv.prefix_caching and r.reuse_prefix:
                keys = self._keys(r)
                found = self.kv.kept_run(keys)
                if pending is None:
                    pending = {k for s in self.running for k in self._keys(s)[s.prefilled // self.kv.block_tokens:]}
                if found < len(keys) and keys[found] in pending:
                    continue
                pending.update(keys[found:])
            self.waiting.remove(r)
            keys = self._keys(r)
            if self.aligned:  # a hit only up to a multiple of the aligned chunk
                keys = keys[:len(keys) * self.kv.block_tokens // self.aligned * self.aligned // self.kv.block_tokens]
            r.hit = self.kv.lookup(r.rid, r.feed, keys) if self.kv.prefix_caching and r.reuse_prefix else []
            r.prefilled = r.computed = len(r.hit) * self.kv.block_tokens  # found, not read
            self.kv.hold(r.rid, need)
            self.running.append(r)
            plan.admitted.append(r)

    def _keys(self, r: Scheduled) -> list[bytes]:
        """The prefix-cache keys of ``r``'s ``feed`` (made once per feed)."""
        made = self._made_keys.get(r.rid)
        if made is None or made[0] is not r.feed:
            made = self._made_keys[r.rid] = (r.feed, self.kv.prefix_keys(r.feed))
        return made[1]

    def _preempt(self, r: Scheduled) -> None:
        self.running.remove(r)
        r.blocks_freed = self.kv.release(r.rid)
        r.feed = r.prompt + r.tokens
        r.prefilled = r.computed = 0
        r.next_token, r.hit = None, None
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)
