"""The window's prompts: one road into the loaded model's engine service, served or not.

A prompt is asked at the model's :class:`PromptDoor` (from the GUI thread) and answered as a
ticket of the model's engine service (engine/generation/service.py): the same service,
tokenizer, queue, prefix cache and error shape whoever steps it. Its events come back through
the job stepping the service, each ``Tagged(("window", n), event)``.

The service steps on the model's thread. While a server runs, its loop
(:class:`~engine.jobs.ServeJob`) holds the door open, and a prompt joins the HTTP clients'
batch at once. Otherwise the prompt waits at the door for its :class:`PromptJob`, queued behind
the model's other jobs. A sweep or a speculative run that holds the service on loan never
takes a waiting prompt into its batch: only the prompt's own job takes it from the door.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError
from engine.base.events import Finished, Prefilled
from engine.base.request import GenerationRequest
from engine.generation.generate import decode_activations, generate
from engine.generation.service import EngineService, NotServingError, Ticket
from engine.jobs import JobContext, Tagged, using_model_service

Tag = tuple[str, int]


@dataclass(frozen=True)
class Failed:
    """A prompt's answer ended with ``error`` where no ``Finished`` could say so: the job stepping
    it broke, or a model served elsewhere raised (``error.finished``, where set, holds the answer
    so far)."""

    error: BaseException


@dataclass(frozen=True)
class Prompt:
    """A prompt asked at the door."""

    tag: Tag
    request: GenerationRequest
    cancel: CancelToken

    def ticket(self, emit: Callable[[object], None], activations: int | None = None) -> Ticket:
        """This prompt as a ticket of the engine service, its events going out through ``emit``
        (its ``Prefilled`` and ``Finished`` with ``activations``, a decode step's, where known)."""
        tag = self.tag

        def sink(event) -> None:
            if activations is not None and isinstance(event, (Prefilled, Finished)):
                event = replace(event, activation_bytes=activations)
            emit(Tagged(tag, event))
        # the window reads each token's own text piece: no token's text alone is worked out for it
        return Ticket(self.request, sink, client="window", endpoint="window", cancel=self.cancel, token_texts=False)


class PromptDoor:
    """The model's door for the window's prompts; thread-safe. Open while a server steps the
    model's service: a prompt then goes straight in; closed, it waits here for its
    :class:`PromptJob`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._service: EngineService | None = None
        self._emit: Callable[[object], None] | None = None
        self._waiting: list[Prompt] = []
        self._next = 1

    def ask(self, request: GenerationRequest, cancel: CancelToken) -> tuple[Prompt, bool]:
        """Ask ``request``; returns it as a :class:`Prompt` and whether it waits at the door (then
        its :class:`PromptJob` must come to answer it). Raises ``QueueFullError`` when the
        server's queue is full."""
        with self._lock:
            prompt = Prompt(("window", self._next), request, cancel)
            self._next += 1
            if self._service is not None:
                try:
                    self._service.submit(prompt.ticket(self._emit))
                    return prompt, False
                except NotServingError:  # the server is stopping: the prompt waits for the window's job
                    pass
            self._waiting.append(prompt)
            return prompt, True

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._service is not None

    def waiting(self) -> set[Tag]:
        """The tags of the prompts waiting at the door."""
        with self._lock:
            return {prompt.tag for prompt in self._waiting}

    def drop(self, tag: Tag) -> None:
        """Forget a waiting prompt (nothing is left to answer it)."""
        with self._lock:
            self._waiting = [prompt for prompt in self._waiting if prompt.tag != tag]

    def take(self, tag: Tag) -> Prompt | None:
        """The waiting prompt ``tag``, for the job that answers it (``None``: it was dropped)."""
        with self._lock:
            prompt = next((prompt for prompt in self._waiting if prompt.tag == tag), None)
            self._waiting = [waiting for waiting in self._waiting if waiting is not prompt]
        return prompt

    def open(self, service: EngineService, emit: Callable[[object], None]) -> None:
        """A server steps ``service`` on the model's thread: prompts go straight into it from now,
        their events out through ``emit``."""
        with self._lock:
            self._service, self._emit = service, emit

    def close(self) -> None:
        with self._lock:
            self._service = self._emit = None


@dataclass(frozen=True)
class PromptJob:
    """Answers ``prompt``, waiting at the model's door, through its engine service stepped on this
    thread (its prefix cache holds the earlier prompts and answers, so a chat's next turn copies
    the conversation's KV). Its events go out tagged; a prompt that fails ends with its
    ``Finished`` carrying the error, or :class:`Failed`. Returns whether it answered it."""

    prompt: Prompt
    kind: ClassVar[str] = "generation"

    @property
    def request(self) -> GenerationRequest:
        return self.prompt.request

    def run(self, ctx: JobContext) -> bool:
        prompt = ctx.door.take(self.prompt.tag)
        if prompt is None:  # dropped: nothing is left to hear its answer
            return False
        with using_model_service(ctx) as service:
            if service is None:  # a model served elsewhere: its server does the work
                _elsewhere(ctx, prompt)
            else:
                _answer(ctx, service, prompt)
        return True


def _answer(ctx: JobContext, service: EngineService, prompt: Prompt) -> None:
    ticket = None
    try:
        # a decode step's activations, read once per model before the prompt's clock starts
        ticket = service.submit(prompt.ticket(ctx.emit, decode_activations(service)))
        while not ticket.ended:
            if service.turn() is None and service.in_flight == 0:
                raise EngineError("The engine service lost this prompt.")
    except BaseException as exc:
        if ticket is None or not ticket.ended:
            if ticket is not None:
                ticket.abort()
            error = exc if isinstance(exc, EngineError) else EngineError(
                f"Generation failed: {type(exc).__name__}: {exc}")
            ctx.emit(Tagged(prompt.tag, Failed(error)))
        raise


def _elsewhere(ctx: JobContext, prompt: Prompt) -> None:
    try:
        for event in generate(ctx.model, prompt.request, prompt.cancel):
            ctx.emit(Tagged(prompt.tag, event))
    except Exception as exc:  # this prompt's failure, its answer so far kept (EndpointError.finished)
        ctx.emit(Tagged(prompt.tag, Failed(exc)))
