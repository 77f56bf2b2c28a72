"""What guesses a running request's next tokens for the target to verify (vLLM v1's proposers).

The engine core asks its proposer for guesses before each decode pass, feeds each request its
last token and its guesses in that one pass, lets the sampler keep the guesses the target agrees
with (engine/generation/sampling.py: :func:`choose`), rolls the request's cache back to what was
kept and tells the proposer how many it got right. The plain proposer guesses nothing: a decode
step is one token per request. Speculative decoding's draft is another
(engine/generation/speculative.py: :class:`Speculation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.base.events import DraftVerified
    from engine.base.request import GenerationRequest
    from engine.generation.sampling import RequestSampler


@dataclass(frozen=True)
class Proposal:
    """A request's guesses for one step: the token ids, the draft's distribution for each
    (sampled requests: the acceptance rule needs them; empty for greedy), and the time taken."""

    tokens: tuple[int, ...] = ()
    probs: tuple["torch.Tensor", ...] = ()
    draft_s: float = 0.0


NOTHING = Proposal()

MAX_DRAFT_TOKENS = 16
"""The most tokens a proposer guesses per step (so the most a sequence's cache is rolled back)."""


class Proposer:
    """Guesses nothing: one token per request per step. Subclasses guess (speculation)."""

    lookahead = 0
    """The most tokens it guesses per step: the scheduler keeps blocks free for them and the
    target's cache must roll back what is rejected (``> 0``: the core's runner can)."""
    kv_bytes_per_token = 0
    """What a token costs a cache of the proposer's own (a draft model's): the core's KV budget
    covers it too, so the target's blocks are fewer by its share."""

    def limit_blocks(self, blocks: int | None, block_tokens: int) -> None:
        """Its own cache may hold at most ``blocks`` blocks of ``block_tokens`` (its share of the
        core's KV budget: as many blocks as the target's, each holding the same tokens)."""

    def add(self, seq: int, request: "GenerationRequest", tokens: int) -> None:
        """``seq`` starts (or starts again after a preemption); ``tokens``: its longest."""

    def prefill(self, seq: int, ids: "torch.Tensor") -> None:
        """``seq``'s prompt (a chunk, or a prefix copied from the prefix cache) goes into its cache."""

    def propose(self, seq: int, sampler: "RequestSampler", committed: "torch.Tensor", room: int) -> Proposal:
        """Guesses for ``seq`` after ``committed`` (its ids so far, [n], the last not yet in the
        target's cache); at most ``room`` - 1 (the target adds a token of its own)."""
        return NOTHING

    def settle(self, seq: int, proposal: Proposal, accepted: int, committed: int, verify_s: float,
               ) -> "DraftVerified | None":
        """``accepted`` of ``proposal`` were kept (``committed``: ids before the step); the
        event saying so, or ``None`` when nothing was proposed."""
        return None

    def counts(self, seq: int) -> dict:
        """Totals for ``seq``'s Finished event (drafted and accepted tokens)."""
        return {}

    def remove(self, seq: int) -> None:
        """``seq`` ended or was preempted: free what is held for it."""
