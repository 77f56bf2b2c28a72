"""A speculative run measured: the draft's counts, the run itself and, when plain decoding of the
same request ran right before it, the speed-up. The CLI's JSON, the speculative tool and the
history read a :class:`SpeculativeReport`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.base.events import Finished, GenerationEvent
from engine.base.cancel import CancelToken
from engine.generation.speculative import Draft, stream_speculative
from engine.base.request import GenerationRequest
from engine.runs import Run
from engine.generation.generate import generate
from engine.measure import bench
from engine.storage import history

if TYPE_CHECKING:
    from engine.generation.core import EngineCore
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
        return out


def speculative_report(target: "LoadedModel", draft: Draft, request: GenerationRequest, draft_tokens: int,
                       compare_plain: bool = False, cancel: CancelToken | None = None,
                       on_event: Callable[[str, GenerationEvent], None] | None = None,
                       record: bool = False, core: "EngineCore | None" = None) -> SpeculativeReport:
    """Run ``request`` with speculative decoding (after plain decoding of it when ``compare_plain``)
    and report. ``record``: keep the run in the history (a read-only data folder doesn't fail the run).
    ``core``: the model's own engine core (idle), which both runs go through; either way both
    compute the whole prompt (no prefix cache hit), so their times compare."""

    def passing(run: str):
        return (lambda e: on_event(run, e)) if on_event else None

    weights = target.info.weights_bytes
    request = replace(request, reuse_prefix=False)
    plain = None
    if compare_plain:
        plain = bench.measure(generate(target, request, cancel, core=core), weights, passing("plain"))
    measured = bench.measure(stream_speculative(target, draft, request, draft_tokens, cancel, core=core), weights,
                             passing("speculative"))
    result = SpeculativeReport(draft.label, draft_tokens, draft.weights_bytes, measured, plain)
    if record:
        history.remember(target.info, measured.finished, "speculative", measured.finished.text, measured.tokens,
                         **result.summary())
    return result
