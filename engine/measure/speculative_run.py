"""A speculative run measured: the draft's counts, the run itself and, when plain decoding of the
same request ran right before it, the speed-up and the speed-up predicted from what the steps
cost. The CLI's JSON, the speculative tool and the history read a :class:`SpeculativeReport`.

The prediction (Leviathan et al., 2023): if each guess is accepted with probability α, given the
guesses before it were, a step of k guesses yields (1 − α^(k+1)) / (1 − α) tokens on average and
costs k·c + v plain decode steps, c a guess's draft time and v the rest of the step (the
target's pass over k + 1 tokens, the acceptance rule, its tokens' events), both read from the
steps' clocks and divided by a plain step's time. The expected speed-up is their ratio; the
measured one is the run's decode tok/s over the plain run's. α is estimated from the steps: of the guesses
the target looked at (up to and including the first it rejected: those after it are never
looked at), the share it kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.base.events import DraftVerified, Finished, GenerationEvent, TokenGenerated
from engine.base.cancel import CancelToken
from engine.generation.speculative import Draft, stream_speculative
from engine.base.request import GenerationRequest
from engine.runs import Run
from engine.generation.generate import generate
from engine.measure import bench
from engine.storage import history

if TYPE_CHECKING:
    from engine.generation.service import EngineService
    from engine.models.model import LoadedModel


@dataclass(frozen=True)
class SpeculativeReport:
    """What a speculative run measured: the draft's counts, the run itself, and (when plain
    decoding of the same request ran right before it) the speed-up. The CLI's JSON, the
    speculative window and the history all read this."""

    draft: str
    draft_tokens_per_step: int
    draft_weights_bytes: int | None
    run: Run
    """The speculative run's events and series (``run.finished`` carries the drafted/accepted counts)."""
    plain: Run | None = None

    @property
    def finished(self) -> Finished:
        return self.run.finished

    @property
    def drafted_tokens(self) -> int:
        return self.finished.drafted_tokens or 0

    @property
    def accepted_tokens(self) -> int:
        return self.finished.accepted_tokens or 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def plain_decode_tokens_per_s(self) -> float | None:
        return None if self.plain is None else self.plain.finished.decode_tokens_per_s

    @property
    def speedup_vs_plain(self) -> float | None:
        speed, base = self.finished.decode_tokens_per_s, self.plain_decode_tokens_per_s
        return speed / base if speed and base else None

    @property
    def wall_speedup_vs_plain(self) -> float | None:
        if self.plain is None or not self.finished.total_s:
            return None
        return self.plain.finished.total_s / self.finished.total_s

    @property
    def steps(self) -> list[DraftVerified]:
        """The run's steps that had guesses, in order."""
        return [e for e in self.run.events if isinstance(e, DraftVerified) and e.drafted_ids]

    @property
    def plain_step_s(self) -> float | None:
        """A plain decode step's time: the plain run's decode time per token."""
        base = self.plain_decode_tokens_per_s
        return 1.0 / base if base else None

    @property
    def emit_s(self) -> float:
        """What a plain step's token takes after its scores (its events: detokenizing, logprobs,
        the KV figure): the plain run's time per token less its steps' own clocks."""
        if self.plain is None or self.plain_step_s is None:
            return 0.0
        return emit_seconds(self.plain_step_s, [t.latency_s for t in self.plain.tokens[1:]])

    @property
    def break_even(self) -> BreakEven | None:
        """The speed-up predicted from the steps' costs (with the plain run only)."""
        if self.plain_step_s is None:
            return None
        return break_even(self.steps, plain_steps_of(self.run.events), self.plain_step_s, self.emit_s)

    @property
    def same_tokens_as_plain(self) -> bool | None:
        return None if self.plain is None else list(self.finished.token_ids) == list(self.plain.finished.token_ids)

    def summary(self) -> dict:
        """The speculative keys of the bench JSON (and of a history record); the plain keys only
        when plain decoding ran."""
        out = {"draft": self.draft, "draft_tokens_per_step": self.draft_tokens_per_step,
               "draft_weights_bytes": self.draft_weights_bytes, "drafted_tokens": self.drafted_tokens,
               "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate}
        if self.plain is not None:
            out.update(plain_decode_tokens_per_s=self.plain_decode_tokens_per_s,
                       speedup_vs_plain=self.speedup_vs_plain, wall_speedup_vs_plain=self.wall_speedup_vs_plain,
                       same_tokens_as_plain=self.same_tokens_as_plain)
            predicted = self.break_even
            if predicted is not None:
                out.update(alpha=predicted.alpha, guesses_per_step=predicted.guesses,
                           draft_cost=predicted.draft_cost, verify_cost=predicted.verify_cost,
                           plain_steps=predicted.plain_steps, predicted_speedup=predicted.predicted,
                           break_even_alpha=predicted.break_even_alpha)
        return out


def expected_tokens(alpha: float, guesses: float) -> float:
    """Tokens a step of ``guesses`` guesses yields on average when each is accepted with
    probability ``alpha`` (given those before it were), the target's own token included."""
    if alpha >= 1.0:
        return guesses + 1.0
    return (1.0 - alpha ** (guesses + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, guesses: float, draft_cost: float, verify_cost: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + v)): tokens a step yields over what it costs in plain decode
    steps (``draft_cost`` c per guess, ``verify_cost`` v for the rest of the step)."""
    return expected_tokens(alpha, guesses) / (guesses * draft_cost + verify_cost)


def break_even_alpha(guesses: float, draft_cost: float, verify_cost: float) -> float | None:
    """The acceptance rate at which speculation pays exactly (expected speed-up 1); ``None``
    where it can't pay even if every guess were accepted."""
    if expected_speedup(1.0, guesses, draft_cost, verify_cost) < 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):  # the speed-up grows with alpha
        middle = (low + high) / 2
        if expected_speedup(middle, guesses, draft_cost, verify_cost) < 1.0:
            low = middle
        else:
            high = middle
    return high


@dataclass(frozen=True)
class BreakEven:
    """The speed-up predicted from a run's steps beside the one measured."""

    alpha: float
    """Per-guess acceptance: of the guesses the target looked at, the share it kept."""
    guesses: float
    """Guesses per step that had some (k)."""
    draft_cost: float
    """A guess's draft time over a plain decode step's (c)."""
    verify_cost: float
    """The rest of a step that had guesses, over a plain decode step (v)."""
    plain_steps: int
    """Steps with no guess (prompt lookup found nothing): plain decode steps."""
    predicted: float
    """The run's expected speed-up: the steps with guesses as the formula has them, the plain ones 1×."""
    break_even_alpha: float | None
    """The α at which these costs pay exactly (``None``: they can't, even at α = 1)."""


def explain(predicted: BreakEven) -> str:
    """The prediction in words: what it is made of and where speculation would pay."""
    text = (f"expected {predicted.predicted:.2f}×: a guess kept with α = {predicted.alpha:.2f}, "
            f"k = {predicted.guesses:.1f} guesses a step at c = {predicted.draft_cost:.2f} plain steps each, "
            f"the target's check v = {predicted.verify_cost:.2f}")
    if predicted.plain_steps:
        text += f", {predicted.plain_steps} step{'' if predicted.plain_steps == 1 else 's'} with no guess (plain)"
    if predicted.break_even_alpha is None:
        best = expected_speedup(1.0, predicted.guesses, predicted.draft_cost, predicted.verify_cost)
        return text + f"; it can't pay: with every guess accepted it would be {best:.2f}×"
    return text + f"; it pays where α > {predicted.break_even_alpha:.2f}"


def step_cost_s(step: DraftVerified, emit_s: float) -> float:
    """A step's whole time: its own clock (the draft, the check, the acceptance rule) and its
    tokens' events, at ``emit_s`` each (what a plain step's token takes after its scores)."""
    return max(step.step_s, step.verify_s + step.draft_s) + (step.accepted + 1) * emit_s


def emit_seconds(plain_step_s: float, clocks: list[float]) -> float:
    """What a plain step's token takes after its scores (its events: detokenizing, logprobs, the
    KV figure): a plain step's time less the median of the steps' own clocks ``clocks``."""
    return max(0.0, plain_step_s - statistics.median(clocks)) if clocks else 0.0


def _running_costs(steps: list[DraftVerified], plain_step_s: float,
                   emit_s: float) -> Iterator[tuple[float, float, float]]:
    """α, c and v from the steps up to each one, in order: α the share of the guesses looked at
    that were kept, c a guess's draft time and v the rest of a step, over a plain step's time."""
    accepted = looked_at = guesses = 0
    draft_s = rest_s = 0.0
    for n, s in enumerate(steps, 1):
        k = len(s.drafted_ids)
        accepted += s.accepted
        looked_at += s.accepted + (s.accepted < k)
        guesses += k
        draft_s += s.draft_s
        rest_s += step_cost_s(s, emit_s) - s.draft_s
        yield accepted / looked_at if looked_at else 0.0, draft_s / guesses / plain_step_s, rest_s / n / plain_step_s


def step_predictions(steps: list[DraftVerified], plain_step_s: float, emit_s: float = 0.0) -> list[float]:
    """Each step's predicted speed-up (its own k) from the acceptance and costs of the steps up to
    it: what the speculative tool draws beside each step's measured one."""
    return [expected_speedup(alpha, len(s.drafted_ids), c, v)
            for s, (alpha, c, v) in zip(steps, _running_costs(steps, plain_step_s, emit_s))]


def plain_steps_of(events) -> int:
    """A speculative run's decode steps that had no guess (prompt lookup found nothing): its tokens
    after the first that no step with guesses made."""
    count, guessed = 0, False
    for event in events:
        if isinstance(event, DraftVerified) and event.drafted_ids:
            guessed = True
        elif isinstance(event, TokenGenerated) and event.index and not event.drafted:
            count += not guessed  # a step's own token ends it
            guessed = False
    return count


def break_even(steps: list[DraftVerified], plain_steps: int, plain_step_s: float,
               emit_s: float = 0.0) -> BreakEven | None:
    """The prediction for a run whose steps with guesses were ``steps``, beside ``plain_steps``
    steps without, against plain steps of ``plain_step_s`` (each
    token's events after its scores taking ``emit_s``). Every cost is read from the steps' own
    clocks; the run's measured speed-up is read from its decode time, which the prediction never
    sees."""
    steps = [s for s in steps if s.drafted_ids]
    if not steps or not plain_step_s > 0:
        return None
    *_, (alpha, draft_cost, verify_cost) = _running_costs(steps, plain_step_s, emit_s)
    guesses = [len(s.drafted_ids) for s in steps]
    tokens = sum(expected_tokens(alpha, k) for k in guesses) + plain_steps
    cost = sum(k * draft_cost + verify_cost for k in guesses) + plain_steps
    mean = sum(guesses) / len(guesses)
    return BreakEven(alpha, mean, draft_cost, verify_cost, plain_steps, tokens / cost,
                     break_even_alpha(mean, draft_cost, verify_cost))


def speculative_report(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       compare_plain: bool = False, cancel: CancelToken | None = None,
                       on_event: Callable[[str, GenerationEvent], None] | None = None,
                       record: bool = False, service: "EngineService | None" = None) -> SpeculativeReport:
    """Run ``request`` with speculative decoding (after plain decoding of it when ``compare_plain``)
    and report. ``record``: keep the run in the history (a read-only data folder doesn't fail the run).
    ``service``: the model's own engine service (idle), which both runs go through; either way both
    compute the whole prompt (no prefix cache hit), so their times compare."""

    def passing(run: str):
        return (lambda e: on_event(run, e)) if on_event else None

    weights = target.info.weights_bytes
    request = replace(request, reuse_prefix=False)
    plain = None
    if compare_plain:
        plain = bench.measure(generate(target, request, cancel, service=service), weights, passing("plain"))
    measured = bench.measure(stream_speculative(target, draft, request, draft_tokens, cancel, service=service), weights,
                             passing("speculative"))
    result = SpeculativeReport(draft.label, draft_tokens, draft.weights_bytes, measured, plain)
    if record:
        history.remember(target.info, measured.finished, "speculative", measured.finished.text, measured.tokens,
                         **result.summary())
    return result
