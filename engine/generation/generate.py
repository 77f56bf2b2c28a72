"""One generation: a single request through the model's engine service (engine/generation/service.py)
and so its engine core, as a stream of events.

Our own loop rather than ``model.generate()`` with a streamer, so every token comes with
what it cost (latency, KV bytes measured and predicted, memory) and a cancel flag is
checked between tokens. Greedy output equals ``model.generate(do_sample=False)``.

Timing: ``latency_s`` is the engine's own time for a token: the first token's from the
request to the token (the prompt), a later token's the step that made it, so a slow consumer
(a terminal, a GUI) never makes the model look slow. ``elapsed_s`` and ``total_s`` are wall clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError, OutOfMemoryError, RequestOutOfMemoryError, is_out_of_memory
from engine.base.events import Finished, GenerationEvent, Prefilled
from engine.base.memory import default_kv_budget
from engine.base.request import GenerationRequest
from engine.generation.core import CoreSettings
from engine.generation.decoding import PREFILL_CHUNK
from engine.generation.kv_manager import BLOCK_TOKENS
from engine.generation.service import EngineService, Ticket

if TYPE_CHECKING:
    from engine.generation.proposer import Proposer
    from engine.models.model import LoadedModel

__all__ = ["PREFILL_CHUNK", "generate", "stream"]


def generate(model, request: GenerationRequest, cancel: CancelToken | None = None,
             service: "EngineService | None" = None) -> Iterator[GenerationEvent]:
    """``request`` answered by ``model``, as events: a loaded model (engine/models/model.py)
    through its engine service (``service``: the model's own, kept between requests,
    :func:`kept_service`; ``None``: one of the request's own); a model served elsewhere
    (engine/endpoint) streams itself. Validates and tokenizes now (errors raise here)."""
    own = getattr(model, "generate", None)
    if own is not None:  # a served model: its server does the work
        return own(request, cancel)
    if model.model is None:
        raise EngineError("This model was unloaded: load it again to generate.")
    return stream(model, request.validated(), cancel or CancelToken(), service=service)


def stream(loaded: "LoadedModel", request: GenerationRequest, cancel: CancelToken,
           proposer: "Proposer | None" = None, service: "EngineService | None" = None,
           prompt_ids: list[int] | None = None) -> Iterator[GenerationEvent]:
    """``proposer``: guesses for each decode step to verify (a draft: engine/generation/speculative.py)
    instead of a token per step, lent to the service for this request. ``service``: the model's
    own, idle, whose prefix cache holds the earlier prompts and answers (:func:`kept_service`);
    ``None``: a service of the request's own. Submitted now: a bad request raises here."""
    service = service or EngineService(loaded, alone())
    if not service.core.idle:
        raise EngineError("The model's core is busy with another request.")
    lent = ExitStack()  # the proposer's loan ends with the request
    try:
        if proposer is not None:
            lent.enter_context(service.borrowed(proposer=proposer))
        # a draft guessing changes the step: the figure waits for a plain answer
        plain = service.core.proposer.lookahead == 0
        activations = decode_activations(service) if plain else loaded.decode_activations
        events = service.answer(request, cancel, prompt_ids)
    except BaseException:
        lent.close()
        raise
    return _answered(loaded, events, activations, proposer, lent)


def _answered(loaded: "LoadedModel", events: Iterator[GenerationEvent], activations: int | None, proposer,
              lent: ExitStack) -> Iterator[GenerationEvent]:
    """The service's events for one request, its prompt's and its end's with the decode step's
    activations; an unexpected failure said in the request's terms."""
    try:
        for event in events:
            if isinstance(event, (Finished, Prefilled)):
                event = replace(event, activation_bytes=activations)
            yield event
    except OutOfMemoryError as exc:  # the service's words are for every request in flight: this one's
        raise RequestOutOfMemoryError(_out_of_memory(loaded, proposer), getattr(exc, "finished", None)) from exc
    except EngineError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(_out_of_memory(loaded, proposer)) from exc
        what = "Speculative decoding" if proposer is not None else "Generation"
        raise EngineError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        events.close()  # a client that stopped reading: its request ends before the loan does
        lent.close()


def _out_of_memory(loaded: "LoadedModel", proposer) -> str:
    hint = ("use a smaller draft or fewer draft tokens" if proposer is not None else
            "shorten the prompt or answer, or pick a smaller precision")
    return f"Out of memory on {loaded.device} while generating: {hint}."


def alone(**limits) -> CoreSettings:
    """A core's settings for one request at a time: the prompt in chunks of :data:`PREFILL_CHUNK`
    (read now: tests and callers may change it), cancel checked between them; ``limits`` more."""
    return CoreSettings(token_budget=PREFILL_CHUNK + 1, max_batch=1, prefill_chunk=PREFILL_CHUNK, **limits)


def kept_service(loaded: "LoadedModel") -> EngineService:
    """A loaded model's engine service, for one request at a time, that keeps its prefix cache
    from one to the next (the window's: a chat's next turn copies the KV of the conversation so
    far instead of computing it). Its KV budget is one context's worth and two blocks (8,192
    tokens where the context is unknown), at most what the machine can spare
    (engine/base/memory.py's default), so kept blocks stay bounded."""
    per_token = loaded.info.kv_bytes_per_token
    budget = None
    if per_token:
        # a whole context and its next token must fit (a request may use it all): one context and two blocks
        budget = min(((loaded.info.context_length or 8192) + 2 * BLOCK_TOKENS) * per_token,
                     default_kv_budget(loaded.device))
    return EngineService(loaded, alone(kv_budget_bytes=budget, prefix_caching=budget is not None))


def decode_activations(service: EngineService) -> int | None:
    """A decode step's activations for the service's model at one sequence, read from the
    allocator (engine/base/memory.StepAllocations) once per loaded model: a throwaway one-token
    sequence read and one token decoded under the watch, before the request it serves is
    submitted, so no request's clock or tokens see it (on a CPU the watch slows its step several
    times over)."""
    loaded = service.loaded
    if loaded.decode_activations_read or not service.core.idle:
        return loaded.decode_activations
    probe = GenerationRequest(prompt="(a decode step watched)", mode="raw", max_new_tokens=2, ignore_eos=True,
                              reuse_prefix=False, top_alternatives=0)
    ticket = service.submit(Ticket(probe, lambda event: None, prompt_ids=[min(loaded.eos_ids, default=0)]))
    service.turn()  # its token read
    step = service.turn(watch=True)
    while not ticket.ended:  # (it ends at its second token: nothing is left)
        service.turn()
    measured = step.activation_bytes if step is not None else None
    # (none on a CPU: another watch was running; read again at the next answer)
    loaded.decode_activations = measured
    loaded.decode_activations_read = measured is not None or loaded.device.type not in ("cpu", "cuda")
    return measured
