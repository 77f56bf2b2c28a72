"""What a client of the engine service (engine/generation/service.py) holds and hears: its
:class:`Ticket` for a submitted request, the answers to a submission (:class:`Accepted`,
:class:`Rejected`, :class:`Token`), the refusals (:class:`QueueFullError`,
:class:`NotServingError`), the error a request ended with (:func:`failure`), and what a
listener hears of the traffic (:class:`RequestArrived`, :class:`RequestEvent`,
:class:`TrafficStep` with each request's :class:`RequestState`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.base.cancel import CancelToken
from engine.base.errors import EngineError, request_failed
from engine.base.events import Finished, StepCompleted, TokenGenerated
from engine.base.request import GenerationRequest


class QueueFullError(EngineError):
    """More requests wait than the server takes; try again later: in about ``retry_after_s``
    seconds (the server's ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


RETRY_WINDOW_S = 120.0
"""Requests that ended this recently tell how soon one ends next."""


def retry_after(ends: "list[float]", now: float) -> int:
    """Whole seconds until a full server likely has room: the mean time between the requests that
    ended in the last :data:`RETRY_WINDOW_S` seconds (``ends``, a monotonic clock's times; one
    must end before another is taken), from 1 to 60; 1 where too few ended to tell."""
    recent = [t for t in ends if now - t <= RETRY_WINDOW_S]
    if len(recent) < 2:
        return 1
    between = (recent[-1] - recent[0]) / (len(recent) - 1)
    return int(min(60, max(1, math.ceil(between))))


class NotServingError(EngineError):
    """The service is stopping or stopped."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """The request was tokenized and queued in the core."""

    request_id: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request was refused before it ran (the error says why)."""

    error: EngineError


def failure(event) -> BaseException | None:
    """The error a request's event ends it with, for a client that raises or shows it: a refusal's
    own, or a failed ``Finished`` as :func:`~engine.base.errors.request_failed` words it (its
    run so far in it); ``None`` for any other event."""
    if isinstance(event, Rejected):
        return event.error
    if isinstance(event, Finished) and event.reason == "error":
        return request_failed(event)
    return None


@dataclass(frozen=True, slots=True)
class Token:
    """A generated token, with how it reads on its own (for logprobs)."""

    event: TokenGenerated
    token: str


# -- what the traffic view reads ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestArrived:
    request_id: int
    at_s: float
    """Seconds since the service started."""
    client: str
    endpoint: str
    prompt_tokens: int
    max_tokens: int
    prompt: str
    prompt_ids: tuple[int, ...] = field(repr=False, default=())


@dataclass(frozen=True, slots=True)
class RequestState:
    request_id: int
    phase: str
    """``waiting``, ``prefill`` or ``decode``."""
    kv_bytes: int
    tokens: int
    blocks: int = 0
    """KV blocks it holds (engine/generation/kv_manager.py)."""
    cached_tokens: int = 0
    """Prompt tokens it found in the prefix cache."""
    shared_blocks: int = 0
    """Of its blocks, those other running requests hold too (a common prefix, held once)."""


@dataclass(frozen=True, slots=True)
class TrafficStep:
    """After a core step: the step's figures and every request in the core."""

    step: StepCompleted
    requests: tuple[RequestState, ...]
    kv_budget_bytes: int | None
    at_s: float
    blocks: tuple[int, ...] = ()
    """The pool's blocks after the step, in order: how many running requests hold each (2 or more:
    shared), or -1 for a cached block none holds, 0 for an empty one."""


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A request's own event (``Prefilled``, ``TokenGenerated``, ``Finished``), for listeners."""

    request_id: int
    event: object
    at_s: float


@dataclass
class Ticket:
    """A caller's hold on one submitted request."""

    request: GenerationRequest
    sink: Callable[[object], None]
    client: str = ""
    endpoint: str = ""
    prompt_ids: list[int] | None = None
    cancel: CancelToken = field(default_factory=CancelToken)
    request_id: int | None = None
    arrived: float = field(default_factory=time.perf_counter)
    """When the caller received the request (``time.perf_counter()``): its TTFT and total time
    count from here, the wait before the core takes it included (the HTTP front end sets it as a
    request comes in, as vLLM times from arrival)."""

    token_texts: bool = True
    """Each token as a :class:`Token`, with how it reads alone (an API's logprobs); ``False``: the
    ``TokenGenerated`` as it is (its text piece is enough)."""
    ended: bool = False
    """Its ``Finished`` or ``Rejected`` was sent."""

    def abort(self) -> None:
        """End the request (thread-safe): it leaves the core before the next step."""
        self.cancel.cancel()
