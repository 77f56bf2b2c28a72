"""One generation: a single request through the engine core (engine/generation/core.py), as a stream of events.

Our own loop rather than ``model.generate()`` with a streamer, so every token comes with
what it cost (latency, KV bytes measured and predicted, memory) and a cancel flag is
checked between tokens. Greedy output equals ``model.generate(do_sample=False)``.

Timing: ``latency_s`` is the engine's own time for a token: the first token's from the
request to the token (the prompt), a later token's the step that made it, so a slow consumer
(a terminal, a GUI) never makes the model look slow. ``elapsed_s`` and ``total_s`` are wall clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.generation.cancel import CancelToken
from engine.generation.decoding import PREFILL_CHUNK
from engine.errors import EngineError, NonFiniteError, OutOfMemoryError, is_out_of_memory
from engine.events import Finished, GenerationEvent, StepCompleted
from engine.request import GenerationRequest

if TYPE_CHECKING:
    from engine.models.model import LoadedModel
    from engine.generation.speculative import Speculation

__all__ = ["PREFILL_CHUNK", "stream"]


def stream(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
           cancel: CancelToken, speculation: "Speculation | None" = None) -> Iterator[GenerationEvent]:
    """``speculation``: decode with a draft (engine/generation/speculative.py) instead of a token per step."""
    try:
        yield from _run(loaded, request, prompt_ids, cancel, speculation)
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            hint = ("use a smaller draft or fewer draft tokens" if speculation is not None else
                    "shorten the prompt or answer, or pick a smaller precision")
            raise OutOfMemoryError(f"Out of memory on {loaded.device} while generating: {hint}.") from exc
        what = "Speculative decoding" if speculation is not None else "Generation"
        raise EngineError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _run(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
         cancel: CancelToken, speculation) -> Iterator[GenerationEvent]:
    """The request alone in a core of its own: the prompt in chunks of :data:`PREFILL_CHUNK`
    (cancel is checked between them), then a token per step (or a speculative step's tokens)."""
    from engine.generation.core import CoreSettings, EngineCore

    chunk = PREFILL_CHUNK  # read now: tests and callers may change it
    core = EngineCore(loaded, CoreSettings(token_budget=chunk + 1, max_batch=1, prefill_chunk=chunk),
                      speculation=speculation)
    core.submit(request, cancel, prompt_ids)
    for event in core.run():
        if isinstance(event, StepCompleted):
            continue
        if isinstance(event, Finished) and event.reason == "error":
            raise NonFiniteError(event.error, event)  # the run so far travels with the error
        yield event
