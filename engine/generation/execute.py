"""The core's execute and sample stages: a planned step's forward passes, then its tokens.

The scheduler's plan names the prompt chunks to read and the requests to decode; here the
runner (engine/generation/runners.py) reads each chunk into its request's cache, the proposer
(engine/generation/proposer.py) guesses tokens for the decode pass to check, the requests with
guesses check them in a pass of their own and the rest decode together in one batched pass, and
the sampler (engine/generation/sampling.py) chooses every request's tokens in one call. What
the passes computed goes in a :class:`StepWork`, which the output stage reads.

A request whose own work fails (its chunk, its guesses, its check) is set aside with its error
and the step goes on without it; running out of memory, and the batched pass, are everyone's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.base.errors import is_out_of_memory
from engine.generation.proposer import NOTHING, Proposal
from engine.generation.sampling import Choice, sample_batch


@dataclass(eq=False)
class StepWork:
    """One step's work as it goes: what the plan gave it, what its forward passes computed (the
    requests whose scores are ready, in the order of ``rows`` and ``counts``), and what went wrong."""

    decoding: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    proposals: dict[int, Proposal] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)
    failed: list = field(default_factory=list)
    scored: list = field(default_factory=list)
    """Prompts whose scores this step completed (sent before their first token)."""
    cached: int = 0
    preempted: int = 0
    memory: object = None
    kv_read: int = 0
    """Cache tokens the decode rows attend over (each row's context and its new token), as planned."""
    pairs: float = 0.0
    """Token pairs the prompt chunks attend over, as planned."""

    def take(self, r, scores, count: int) -> None:
        """``r``'s scores are ready: ``count`` rows of them."""
        self.ready.append(r)
        self.rows.append(scores)
        self.counts.append(count)

    def set_aside(self, r, exc: Exception) -> None:
        """``r``'s own work failed: it leaves with ``exc`` (running out of memory is everyone's)."""
        if is_out_of_memory(exc):
            raise exc
        self.failed.append((r, exc))


class StepExecutor:
    """Runs a planned step's forward passes and samples its tokens, for one loaded model's core."""

    def __init__(self, loaded, runner, outputs) -> None:
        self.loaded, self.runner, self.outputs = loaded, runner, outputs
        self.paged = bool(getattr(runner, "paged", False))

    def read_prompts(self, work: StepWork, kv, proposer) -> None:
        """Each prompt chunk through the runner (and the proposer); a prompt read to its end
        gives its first token's scores."""
        import torch

        for r, size in work.chunks:
            if r.prefill_started is None:
                r.prefill_started = time.perf_counter()
            try:
                ids = torch.tensor([r.feed[r.prefilled:r.prefilled + size]], dtype=torch.long,
                                   device=self.loaded.device)
                if r.scoring_prompt:
                    out = self.runner.prefill(r.rid, ids, rows=size).view(size, -1)
                    self.outputs.score_prompt(r, r.prefilled, out)
                    out = out[-1]
                else:
                    out = self.runner.prefill(r.rid, ids)
                proposer.prefill(r.rid, ids)
                r.prefilled += size
                r.computed += size
                kv.keep(r.rid, r.feed, r.prefilled, None if self.paged else self.copier(r))
                if r.prefilled == len(r.feed) and r.request.prompt_logprobs is not None and not r.prompt_scored:
                    work.scored.append(self.outputs.prompt_scored(r))
            except Exception as exc:
                work.set_aside(r, exc)
                continue
            if r.prefilled == len(r.feed):
                work.take(r, out.unsqueeze(0), 1)

    def decode(self, work: StepWork, proposer) -> None:
        """The proposer's guesses for each generating request; a request with guesses checks its
        last token and them in one pass of its own (the scores after each), the rest decode one
        token each in one batched pass."""
        import torch

        proposals = work.proposals
        for r in work.decoding:
            try:
                proposals[r.rid] = proposer.propose(r.rid, r.sampler, r.seen.all(), self.room(r))
            except Exception as exc:
                work.set_aside(r, exc)
        decoding = work.decoding = [r for r in work.decoding if r.rid in proposals]  # (a failed guess: not decoded)
        for r in (r for r in decoding if proposals[r.rid].tokens):
            guesses = proposals[r.rid].tokens
            started = time.perf_counter()
            try:
                ids = torch.tensor([[r.next_token, *guesses]], dtype=torch.long, device=self.loaded.device)
                out = self.runner.prefill(r.rid, ids, rows=len(guesses) + 1)
            except Exception as exc:
                work.set_aside(r, exc)
                continue
            work.verify_s[r.rid] = time.perf_counter() - started
            r.computed += len(guesses) + 1
            work.take(r, out.view(len(guesses) + 1, -1), len(guesses) + 1)
        plain = [r for r in decoding if not proposals[r.rid].tokens]
        if plain:
            scores = self.runner.decode([r.rid for r in plain], [r.next_token for r in plain])
            work.rows.append(scores)
            for r in plain:
                r.computed += 1
                work.ready.append(r)
                work.counts.append(1)

    def sample(self, work: StepWork) -> list[Choice | Exception]:
        """Every ready request's tokens from the step's scores, the whole batch in one call."""
        import torch

        ready, proposals = work.ready, work.proposals
        if not ready:
            return []
        return sample_batch([r.sampler for r in ready], torch.cat(work.rows) if len(work.rows) > 1 else work.rows[0],
                            work.counts, [r.seen.all() for r in ready],
                            [proposals.get(r.rid, NOTHING).tokens for r in ready],
                            [proposals.get(r.rid, NOTHING).probs for r in ready],
                            top=max(r.request.top_alternatives for r in ready))

    def room(self, r) -> int:
        """Tokens ``r`` may still get: its ``max_tokens`` and the context."""
        room = r.request.max_new_tokens - len(r.tokens)
        context = self.loaded.info.context_length
        return room if context is None else min(room, context - len(r.prompt) - len(r.tokens))

    def copier(self, r):
        """What the KV manager calls to copy a block of ``r``'s cache out (a runner with a cache
        of its own per request)."""
        return lambda start, end: self.runner.block_kv(r.rid, start, end)
