"""The engine service: one per loaded model, the only thing that drives its engine core. Every
client submits requests to it (the window, a comparison's lanes, ``bench``, sweeps, speculative
runs, the HTTP server) and gets each request's events through its own callback.

Who steps the core: a thread of the service's own (:meth:`EngineService.start`, or the caller of
:meth:`run`: a server), or, where none runs, the client itself on its own thread
(:meth:`answer`, :meth:`turn`: the window's prompts between two servings, the CLI, a sweep).
Either way a request takes the same road: it is tokenized on the stepping thread (the tokenizer
is not shared across threads), then refused (:class:`Rejected`: too long, malformed) or taken
(:class:`Accepted`), after which its ``Prefilled``/``TokenGenerated`` (wrapped as
:class:`Token`, with how the token reads alone, where the client asks)/``Finished`` follow; a
request that fails ends with ``Finished(reason="error")``, which :meth:`answer` raises as
:class:`~engine.base.errors.RequestFailedError` with the run so far. Cancelling a ticket ends its
request before the next step and frees its cache. More requests than a full batch and
``max_waiting`` behind it raise :class:`QueueFullError` at once, in the caller's thread. Listeners
(:meth:`listen`: the traffic view, the server's metrics) hear every request's events and steps.

Whatever goes wrong with one request (its prompt, its sampling, a caller's callback failing)
ends that request alone; only a failing batched step or running out of memory ends them all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engine.base.cancel import CancelToken
from engine.base.errors import OUT_OF_MEMORY, EngineError, InvalidRequestError, is_out_of_memory
from engine.base.events import Finished, GenerationEvent, StepCompleted, TokenGenerated
from engine.base.request import GenerationRequest
from engine.base.units import format_bytes, kv_dtype_label
from engine.generation.core import CoreSettings, EngineCore
from engine.generation.decoding import failed_event
from engine.generation.invariant import answers_note
from engine.generation.tickets import (
    Accepted,
    NotServingError,
    QueueFullError,
    Rejected,
    RequestArrived,
    RequestEvent,
    RequestState,
    Ticket,
    Token,
    TrafficStep,
    failure,
    retry_after,
)

if TYPE_CHECKING:
    from engine.generation.proposer import Proposer
    from engine.models.model import LoadedModel

log = logging.getLogger(__name__)


class EngineService:
    """A loaded model's :class:`~engine.generation.core.EngineCore` and the requests submitted to it."""

    def __init__(self, loaded: "LoadedModel", settings: "CoreSettings | None" = None, max_waiting: int = 256,
                 core: "EngineCore | None" = None) -> None:

        self.loaded = loaded
        self.core = core if core is not None else EngineCore(loaded, settings)
        self.settings = self.core.settings
        self.max_waiting = max_waiting
        self.started = time.perf_counter()
        self._lock = threading.Condition()
        self._inbox: list[Ticket] = []
        self._tickets: dict[int, Ticket] = {}
        self._waiting = 0
        self._accepting = True
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        """A thread runs :meth:`run` (a server): clients submit and wait, never step."""
        self._under_way: Iterator[None] | None = None
        """A step paused while a client on this thread reads its events one by one."""
        self._listeners: list[Callable[[object], None]] = []
        self._kv = 0
        self._ends: deque[float] = deque(maxlen=32)
        """When the last requests ended (monotonic): how soon a full server has room."""
        self._blocks: tuple[int, int, int | None] = (0, 0, self.core.kv.total_blocks)
        self._pool: tuple[int, int] = (0, 0)
        self.served = 0
        """Requests finished since the start."""

    # -- callers' side (any thread) -----------------------------------------------------------
    def submit(self, ticket: Ticket) -> Ticket:
        """Queue ``ticket``'s request: taken while a full batch (``max_batch``) and ``max_waiting``
        behind it leave room, counting requests the core has not picked up yet."""
        with self._lock:
            if not self._accepting:
                raise NotServingError("The server is shutting down and takes no new requests.")
            if len(self._inbox) + len(self._tickets) >= self.settings.max_batch + self.max_waiting:
                wait = retry_after(list(self._ends), time.monotonic())
                raise QueueFullError(f"{self.settings.max_batch} requests are running and {self.max_waiting} "
                                     f"waiting, as many as this server takes; try again in {wait} s.", wait)
            self._inbox.append(ticket)
            self._lock.notify_all()  # the core, and never only a caller of wait_until
        return ticket

    def listen(self, listener: Callable[[object], None]) -> Callable[[], None]:
        """Call ``listener`` on the core's thread with every :class:`RequestArrived`,
        :class:`RequestEvent` and :class:`TrafficStep`; returns a function that stops it."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

        def stop() -> None:
            with self._lock:
                self._listeners = [fn for fn in self._listeners if fn is not listener]
        return stop

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._inbox) + self._waiting

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return len(self._inbox) + len(self._tickets)

    def start(self) -> "EngineService":
        self._thread = threading.Thread(target=self.run, name="engine-core", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True) -> None:
        """Take no new requests; ``drain``: finish those in flight, else cancel them (each still
        gets its ``Finished``). The thread ends once the core is empty."""
        with self._lock:
            self._accepting = False
            if not drain:
                for ticket in [*self._inbox, *self._tickets.values()]:
                    ticket.cancel.cancel()
            self._lock.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; ``True`` if it did."""
        return self._stopped.wait(timeout)

    def wait_until(self, condition: Callable[["EngineService"], bool], timeout: float) -> bool:
        """Wait (on the core's steps, not by polling) until ``condition(self)`` holds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not condition(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def kv_bytes(self) -> int:
        """KV-cache bytes the running requests held after the last step (measured)."""
        with self._lock:
            return self._kv

    def describe_kv(self) -> str:
        """The KV cache's blocks and prefix caching, in a line."""

        kv, core = self.core.kv, self.core
        info, layout = self.loaded.info, self.loaded.kv_layout
        size = (f"{kv.total_blocks:,} blocks of {kv.block_tokens} tokens ({format_bytes(kv.block_bytes(kv.total_blocks))})"
                if kv.total_blocks is not None else f"blocks of {kv.block_tokens} tokens, no budget")
        size += f" in {kv_dtype_label(info.kv_dtype)}" if info.kv_dtype else ""
        if info.kv_dtype == "int8" and kv.total_blocks is not None and layout is not None:
            # what fewer bits buy: the tokens this budget holds, against a 16-bit cache's
            tokens = kv.total_blocks * kv.block_tokens
            sixteen = kv.block_bytes(kv.total_blocks) // layout.bytes_per_token(2)
            size += (f" ({tokens:,} tokens: {tokens / sixteen:.2f}× the {sixteen:,} a 16-bit cache holds in these "
                     "bytes)")
        if kv.prefix_caching:
            caching = "prefix caching on: " + ("cached blocks shared in place (one block pool)" if core.paged else
                                               "cached blocks copied into each request's cache")
            if kv.sliding_tokens:
                caching += (f"; sliding-window layers need only their window's last {kv.sliding_tokens} tokens of "
                            "a cached prefix")
        elif core.prefix_caching_off:
            caching = f"prefix caching off: {core.prefix_caching_off}"
        else:
            caching = "prefix caching off"
        return f"KV cache: {size}, taken as requests grow; {caching}. {answers_note(self.loaded)}"

    def kv_blocks(self) -> tuple[int, int, int | None]:
        """KV blocks after the last step: held by running requests, kept for prefix reuse, and
        the budget's total (``None``: no budget)."""
        with self._lock:
            return self._blocks

    def kv_pool(self) -> tuple[int, int]:
        """After the last step: the blocks several running requests share, and the bytes the KV
        pool's storage holds, read from its tensors (the reference runner: its cached blocks'
        copies; its requests' own caches are ``kv_bytes``)."""
        with self._lock:
            return self._pool

    # -- the core's thread ------------------------------------------------------------------
    def run(self) -> None:
        """Step the core until stopped. Should the core itself fail beyond repair (a fresh one can't
        be made), the service stops taking requests and every caller hears so, never left waiting."""
        self._end_step_under_way()
        with self._lock:
            self._running = True
        try:
            while True:
                with self._lock:
                    while not self._inbox and self.core.idle and self._accepting:
                        self._lock.wait()
                    incoming = list(self._inbox)  # each leaves the inbox as the core takes it: never
                    # out of both (in_flight 0 while a prompt is tokenized would end a caller's wait early)
                    if not incoming and self.core.idle and not self._accepting:
                        return
                for ticket in incoming:
                    self._accept(ticket)
                if not self.core.idle:
                    self._step()
        except Exception as exc:  # logged and told to every caller; the thread ends here
            log.exception("the engine core stopped")
            self._abandon(exc)
        finally:
            with self._lock:
                self._running = False
                self._stopped.set()
                self._lock.notify_all()

    def reopen(self) -> None:
        """Take requests again after a stop (a server's start on a model's service, the window's
        prompts once it has stopped); what it counts (requests served, the traffic's clock)
        starts again."""
        with self._lock:
            if self._running:
                raise EngineError("The engine service still runs: stop it first.")
            self._accepting = True
            self._stopped.clear()
            self._ends.clear()
        self.started, self.served = time.perf_counter(), 0  # a server's figures count from its start

    def reconfigure(self, settings: CoreSettings, max_waiting: int | None = None) -> None:
        """New limits for this idle service's core (a server's batch and budget, or the window's
        one request at a time): the same runner and caches, the prefix cache's kept blocks kept."""
        self._end_step_under_way()
        self.core.reconfigure(settings)
        self.settings = self.core.settings
        self.max_waiting = max_waiting or self.max_waiting
        with self._lock:
            self._blocks = (0, 0, self.core.kv.total_blocks)

    @contextmanager
    def borrowed(self, settings: CoreSettings | None = None, proposer: "Proposer | None" = None):
        """This idle service under other limits (a batch sweep) or with a proposer (a speculative
        run) for a while, then back as it was (:meth:`EngineCore.borrowed`); never while a server
        runs it. Requests a client left behind are dropped."""
        with self._lock:
            if self._running:
                raise EngineError("The model is serving: its core is lent only when the server has stopped.")
        self._end_step_under_way()
        core, before, ahead = self.core, self.settings, self.core.proposer
        with core.borrowed(settings, proposer):  # a busy core raises here, and nothing is lent
            try:
                self.settings = core.settings
                yield self
            finally:
                self.settings = before
                with self._lock:  # (their requests are dropped from the core: nothing more comes)
                    for ticket in [*self._inbox, *self._tickets.values()]:
                        ticket.ended = True
                    self._inbox.clear()
                    self._tickets.clear()
                    self._waiting = 0
                if self.core is not None and self.core is not core:  # a failed step replaced it: the
                    self.core.reconfigure(before, proposer=ahead)  # fresh one, back to the model's limits

    # -- a client stepping the core on its own thread ----------------------------------------
    def answer(self, request: GenerationRequest, cancel: CancelToken | None = None,
               prompt_ids: list[int] | None = None, client: str = "") -> Iterator[GenerationEvent]:
        """``request``'s events for a client on its own thread: ``Prefilled``, ``TokenGenerated`` …
        and its ``Finished``. A refused request raises its error (now, where no thread runs the
        service: it is tokenized and checked before this returns); a failed one raises
        :class:`~engine.base.errors.RequestFailedError` with the run so far. Where no thread runs
        the service, the core steps on the caller's thread as the events are read (other
        requests submitted meanwhile share its steps), else the caller waits for them."""
        events: deque = deque()
        ticket = self.submit(Ticket(request, events.append, client=client, endpoint=client,
                                    prompt_ids=None if prompt_ids is None else list(prompt_ids),
                                    cancel=cancel or CancelToken(), token_texts=False))
        if not self.running:
            self._take()  # tokenized and checked now: a bad request raises here
            if events and isinstance(events[0], Rejected):
                raise events[0].error
        return self._events(ticket, events)

    def _events(self, ticket: Ticket, events: deque) -> Iterator[GenerationEvent]:
        def read(ending: bool) -> Iterator[GenerationEvent]:
            """The events so far; the request's end only when ``ending`` (its step is over)."""
            while events and (ending or not isinstance(events[0], Finished)):
                event = events.popleft()
                error = failure(event)
                if error is not None:
                    raise error
                if isinstance(event, Finished):
                    yield event
                    return
                if not isinstance(event, Accepted):
                    yield event  # (its tokens as they are: the ticket asks for no texts)

        step = None  # a step under way on this thread, paused while its events are read
        try:
            while not ticket.ended or events:
                yield from read(ending=True)
                if ticket.ended:
                    continue
                if self.running:  # a server's thread steps: wait for it
                    with self._lock:
                        self._lock.wait_for(lambda: events or not self._running, timeout=1.0)
                    continue
                self._end_step_under_way()
                self._take()
                if self.core.idle and not events:
                    raise EngineError("The engine service lost this request.")
                step = self._under_way = self._stepping(one_by_one=True)
                for _ in step:  # each event read as the core makes it
                    yield from read(ending=False)
                if self._under_way is step:  # (another reader may have finished it and begun its own)
                    self._under_way = None
                step = None
        finally:
            if step is not None:  # the reader left mid-step: its step ends for every request in it
                for _ in step:
                    pass
                if self._under_way is step:
                    self._under_way = None
            if not ticket.ended:  # the client stopped reading: its request ends, its cache freed
                ticket.abort()
                while not ticket.ended and not self.running and self.turn() is not None:
                    pass

    @property
    def ready(self) -> bool:
        """Idle, open and whole: its core holds no request, takes new ones, and no thread runs it."""
        with self._lock:
            return (self._accepting and not self._running and not self._inbox and not self._tickets
                    and self.core is not None and self.core.idle)

    @property
    def running(self) -> bool:
        """A thread runs the service (a server): clients wait for their events."""
        with self._lock:
            return self._running

    def turn(self, watch: bool = False) -> StepCompleted | None:
        """One turn of the service's loop on the calling thread, for a client while no thread runs
        it: what was submitted is taken, then the core steps once (``watch``: the step's
        activations read from the allocator, :attr:`StepCompleted.activation_bytes`). Returns the
        step's figures (``None``: there was nothing to step, or the step failed)."""
        if self.running:
            raise EngineError("A server steps this model's core: submit to it and wait.")
        self._end_step_under_way()
        self._take()
        if self.core.idle:
            return None
        self.core.watch_next = watch
        return self._step()

    def _end_step_under_way(self) -> None:
        """A step another reader paused (each event read as it was made) runs to its end before
        anything else is stepped: its events go to their requests' clients, to be read later."""
        step, self._under_way = self._under_way, None
        if step is not None:
            for _ in step:
                pass

    def _take(self) -> None:
        """The submitted requests into the core (tokenized and checked, or refused)."""
        with self._lock:
            incoming = list(self._inbox)
        for ticket in incoming:
            self._accept(ticket)

    def _now(self) -> float:
        return time.perf_counter() - self.started

    def _tell(self, event) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug never stops the server
                log.exception("traffic listener failed")

    def _accept(self, ticket: Ticket) -> None:
        try:
            ids = ticket.prompt_ids if ticket.prompt_ids is not None else self.loaded.encode(ticket.request)
        except EngineError as exc:
            self._refuse(ticket, exc)
            return
        except Exception:  # a tokenizer failing on odd input: the caller's problem, said in its terms
            log.exception("a prompt could not be tokenized")
            self._refuse(ticket, InvalidRequestError(
                "The model's tokenizer could not read this prompt as text; check that it is plain Unicode "
                "text (no control or invalid characters)."))
            return
        try:
            rid = self.core.submit(ticket.request, ticket.cancel, ids, arrived=ticket.arrived)
        except EngineError as exc:
            self._refuse(ticket, exc)
            return
        except Exception as exc:  # the engine's fault, not the request's: said as such, this request alone
            log.exception("a request could not be queued")
            self._refuse(ticket, EngineError(f"The engine failed on this request: {type(exc).__name__}: {exc}"))
            return
        ticket.request_id = rid
        with self._lock:
            self._tickets[rid] = ticket
            self._inbox.remove(ticket)
            self._waiting = len(self.core.waiting)
        self._send(ticket, Accepted(rid, len(ids)))
        if self._listeners:
            self._tell(RequestArrived(rid, ticket.arrived - self.started, ticket.client, ticket.endpoint, len(ids),
                                      ticket.request.max_new_tokens, ticket.request.prompt, tuple(ids)))

    def _abandon(self, exc: BaseException) -> None:
        """The core is gone: take nothing more, and end every request in flight with why."""

        message = f"The server's engine stopped: {type(exc).__name__}: {exc}"
        with self._lock:
            self._accepting = False
            waiting = list(self._inbox)
            self._inbox.clear()
        for ticket in waiting:
            self._send(ticket, Rejected(NotServingError(message)))
            ticket.ended = True
        now, clock = self._now(), time.perf_counter()
        for rid, ticket in list(self._tickets.items()):  # ended as a step ends them: callers, listeners, the count
            self._deliver(failed_event(rid, message, total_s=clock - ticket.arrived), now)

    def _refuse(self, ticket: Ticket, error: EngineError) -> None:
        with self._lock:
            self._inbox.remove(ticket)
            self._lock.notify_all()
        self._send(ticket, Rejected(error))
        ticket.ended = True

    def _step(self) -> StepCompleted | None:
        """One step, every event delivered after it (the server's loop, a batch's turn)."""
        stepping = self._stepping(one_by_one=False)
        while True:
            try:
                next(stepping)
            except StopIteration as done:
                return done.value

    def _stepping(self, one_by_one: bool) -> Iterator[None]:
        """One step of the core, its events delivered; returns the step's figures (``None``: it
        failed). ``one_by_one``: each event delivered as the core makes it, and this generator
        pauses after it, so a reader sees a token before the next is made (a cancel pressed
        between two of a step's tokens stops the rest); else the step's cache figures first,
        then its events, so a caller who sees a request finished (``in_flight`` 0) reads the
        cache after its end (its blocks freed), never the step before's."""
        now, step = self._now(), None
        try:
            made = self.core.stepping()
            if not one_by_one:
                made = list(made)
                step = next((event for event in made if isinstance(event, StepCompleted)), None)
                self._figures(step)
            for event in made:
                if isinstance(event, StepCompleted):
                    step = event
                    continue
                self._deliver(event, now)
                if one_by_one:
                    yield
        except Exception as exc:
            self._fail_all(exc)
            return None
        if one_by_one:
            self._figures(step)
        states = self._states() if self._listeners else ()
        with self._lock:
            self._lock.notify_all()
        if step is not None and self._listeners:
            self._tell(TrafficStep(step, states, self.settings.kv_budget_bytes, now, self._block_map()))
        return step

    def _figures(self, step: StepCompleted | None) -> None:
        """What the step left in the cache, for :meth:`kv_bytes`, :meth:`kv_blocks`, :meth:`kv_pool`."""
        with self._lock:
            self._waiting = len(self.core.waiting)
            self._kv = step.kv_cache_bytes if step is not None else 0
            if step is not None:
                self._blocks = (step.kv_blocks_used, step.kv_blocks_kept, step.kv_blocks_total)
                self._pool = (step.kv_blocks_shared, step.kv_pool_bytes + step.kv_kept_bytes * (not self.core.paged))

    def _deliver(self, event, now: float) -> None:
        """A request's event to its caller and the listeners; its end frees its ticket."""
        rid = event.request_id
        ticket = self._tickets.get(rid)
        if ticket is None:
            return
        if isinstance(event, Finished):  # listeners hear it, then it leaves the count, then its caller
            # hears (and may send the next): in_flight 0 means told everywhere, a closed loop never 429
            if self._listeners:
                self._tell(RequestEvent(rid, event, now))
            with self._lock:
                self._tickets.pop(rid, None)
                self._ends.append(time.monotonic())
            self.served += 1
            self._send(ticket, event)
            ticket.ended = True  # (after: a reader on another thread stops once it has its end)
            return
        if isinstance(event, TokenGenerated) and ticket.token_texts:
            try:
                token = Token(event, self.loaded.token_text(event.token_id))
            except Exception:  # this token won't read alone: its request ends, not the core
                log.exception("request %d: token %d could not be read", rid, event.token_id)
                ticket.abort()
                token = Token(event, "")
            self._send(ticket, token)
        else:
            self._send(ticket, event)
        if self._listeners:
            self._tell(RequestEvent(rid, event, now))

    def _send(self, ticket: Ticket, event) -> None:
        """``event`` to ``ticket``'s caller; a caller whose callback fails loses its request (ended
        before the next step), never the core."""
        try:
            ticket.sink(event)
        except Exception:
            log.exception("a caller's callback failed; its request ends")
            ticket.abort()

    def _states(self) -> tuple[RequestState, ...]:
        core = self.core
        out = [RequestState(r.rid, "waiting", 0, len(r.tokens)) for r in core.waiting]
        tables, refs = core.kv.tables, core.kv.pool.refs
        for r in core.running:
            phase = "prefill" if r.prefilled < len(r.feed) else "decode"  # or computing again after a preemption
            table = tables.get(r.rid, ())
            out.append(RequestState(r.rid, phase, core.runner.kv_bytes(r.rid) if r.in_runner else 0, len(r.tokens),
                                    len(table), r.cached_tokens, sum(1 for b in table if refs[b] > 1)))
        return tuple(out)

    def _block_map(self) -> tuple[int, ...]:
        """Each pool block's holders (-1: cached, 0: empty), for the traffic view's map."""
        pool = self.core.kv.pool
        return tuple(-1 if refs == 0 and key is not None else refs for refs, key in zip(pool.refs, pool.key_of))

    def _fail_all(self, exc: Exception) -> None:
        """A batched step failed (out of memory, a bug): every request in the core ends with the
        error, and a fresh core takes the next ones (the old one's state is not to be trusted)."""

        log.exception("engine step failed")
        message = (f"{OUT_OF_MEMORY} {self.loaded.device}: the requests in flight were too many or too long for "
                   "this machine; shorten them, run fewer at once, or pick a smaller precision."
                   if is_out_of_memory(exc) else f"The engine failed: {type(exc).__name__}: {exc}")
        now, clock = self._now(), time.perf_counter()
        for rid, ticket in list(self._tickets.items()):  # ended as a step ends them: callers, listeners, the count
            self._deliver(failed_event(rid, message, total_s=clock - ticket.arrived), now)
        proposer, self.core = self.core.proposer, None  # the old core's cache goes before a new one is made
        self.core = EngineCore(self.loaded, self.settings, proposer=proposer)
        with self._lock:
            self._waiting, self._kv = 0, 0
            self._lock.notify_all()


__all__ = ["Accepted", "EngineService", "NotServingError", "QueueFullError", "Rejected",
           "RequestArrived", "RequestEvent", "RequestState", "Ticket", "Token", "TrafficStep", "failure"]
