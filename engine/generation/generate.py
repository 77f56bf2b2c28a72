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
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.generation.decoding import PREFILL_CHUNK
from engine.base.errors import EngineError, NonFiniteError, OutOfMemoryError, is_out_of_memory
from engine.base.events import Finished, GenerationEvent, Prefilled, StepCompleted
from engine.base.memory import default_kv_budget
from engine.base.request import GenerationRequest
from engine.generation.core import CoreSettings, EngineCore
from engine.generation.kv_manager import BLOCK_TOKENS

if TYPE_CHECKING:
    from engine.generation.proposer import Proposer
    from engine.models.model import LoadedModel

__all__ = ["PREFILL_CHUNK", "generate", "stream"]


def generate(model, request: GenerationRequest, cancel: CancelToken | None = None,
             core: "EngineCore | None" = None) -> Iterator[GenerationEvent]:
    """``request`` answered by ``model``, as events: a loaded model (engine/models/model.py)
    through the engine core (``core``: an idle one kept between requests, :func:`kept_core`;
    ``None``: one of its own); a model served elsewhere (engine/endpoint) streams itself.
    Validates and tokenizes now (errors raise here)."""
    own = getattr(model, "generate", None)
    if own is not None:  # a served model: its server does the work
        return own(request, cancel)
    if model.model is None:
        raise EngineError("This model was unloaded: load it again to generate.")
    request = request.validated()
    return stream(model, request, model.encode(request), cancel or CancelToken(), core=core)


def stream(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
           cancel: CancelToken, proposer: "Proposer | None" = None,
           core: "EngineCore | None" = None) -> Iterator[GenerationEvent]:
    """``proposer``: guesses for each decode step to verify (a draft: engine/generation/speculative.py)
    instead of a token per step. ``core``: an idle core kept from one request to the next
    (:func:`kept_core`), whose prefix cache holds the earlier prompts and answers (lent to the
    proposer for this request); ``None``: a core of the request's own."""
    try:
        yield from _run(loaded, request, prompt_ids, cancel, proposer, core)
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            hint = ("use a smaller draft or fewer draft tokens" if proposer is not None else
                    "shorten the prompt or answer, or pick a smaller precision")
            raise OutOfMemoryError(f"Out of memory on {loaded.device} while generating: {hint}.") from exc
        what = "Speculative decoding" if proposer is not None else "Generation"
        raise EngineError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def alone(**limits) -> CoreSettings:
    """A core's settings for one request at a time: the prompt in chunks of :data:`PREFILL_CHUNK`
    (read now: tests and callers may change it), cancel checked between them; ``limits`` more."""
    return CoreSettings(token_budget=PREFILL_CHUNK + 1, max_batch=1, prefill_chunk=PREFILL_CHUNK, **limits)


def kept_core(loaded: "LoadedModel") -> "EngineCore":
    """A core for one request at a time that keeps its prefix cache from one to the next (the
    window's: a chat's next turn copies the KV of the conversation so far instead of computing
    it). Its KV budget is one context's worth and two blocks (8,192 tokens where the context is
    unknown), at most what the machine can spare (engine/base/memory.py's default), so kept
    blocks stay bounded."""
    per_token = loaded.info.kv_bytes_per_token
    budget = None
    if per_token:
        # a whole context and its next token must fit (a request may use it all): one context and two blocks
        budget = min(((loaded.info.context_length or 8192) + 2 * BLOCK_TOKENS) * per_token,
                     default_kv_budget(loaded.device))
    return EngineCore(loaded, alone(kv_budget_bytes=budget, prefix_caching=budget is not None))


def _run(loaded: "LoadedModel", request: GenerationRequest, prompt_ids: list[int],
         cancel: CancelToken, proposer, core=None) -> Iterator[GenerationEvent]:
    """The request alone in a core (its own, or ``core``, idle): the prompt in chunks, then a
    token per step (or a speculative step's tokens)."""
    if core is None:
        yield from _alone(EngineCore(loaded, alone(), proposer=proposer), request, prompt_ids, cancel)
    elif not core.idle:
        raise EngineError("The model's core is busy with another request.")
    elif proposer is not None:
        with core.borrowed(proposer=proposer):
            yield from _alone(core, request, prompt_ids, cancel)
    else:
        yield from _alone(core, request, prompt_ids, cancel)


def _alone(core: "EngineCore", request: GenerationRequest, prompt_ids: list[int],
           cancel: CancelToken) -> Iterator[GenerationEvent]:
    plain = core.proposer.lookahead == 0  # (a draft guessing: its own state; the figure waits for a plain answer)
    activations = decode_activations(core, prompt_ids[0]) if plain else core.loaded.decode_activations
    core.submit(request, cancel, prompt_ids)
    for event in core.run():
        if isinstance(event, StepCompleted):
            continue
        if isinstance(event, Finished):
            if event.reason == "error":
                raise NonFiniteError(event.error, event)  # the run so far travels with the error
            event = replace(event, activation_bytes=activations)
        elif isinstance(event, Prefilled):
            event = replace(event, activation_bytes=activations)
        yield event


def decode_activations(core: "EngineCore", token: int) -> int | None:
    """A decode step's activations for ``core``'s model at one sequence, read from the allocator
    (engine/base/memory.StepAllocations) once per loaded model: a throwaway one-token sequence read
    and one token decoded under the watch through the idle core, before the request it serves is
    submitted, so no request's clock or tokens see it (on a CPU the watch slows its step several times over)."""
    loaded = core.loaded
    if loaded.decode_activations_read or not core.idle:
        return loaded.decode_activations
    probe = GenerationRequest(prompt="(a decode step watched)", mode="raw", max_new_tokens=2, ignore_eos=True,
                              reuse_prefix=False, top_alternatives=0)
    core.submit(probe, CancelToken(), [token])
    core.step()  # its token read
    core.watch_next = True
    measured = next((e.activation_bytes for e in core.step() if isinstance(e, StepCompleted)), None)
    while not core.idle:  # (it ends at its second token: nothing is left)
        core.step()
    # (none on a CPU: another watch was running; read again at the next answer)
    loaded.decode_activations = measured
    loaded.decode_activations_read = measured is not None or loaded.device.type not in ("cpu", "cuda")
    return measured
