"""The HTTP side of the server: a FastAPI app that turns OpenAI-style requests into tickets for the
engine core (engine/generation/service.py) and the core's events back into OpenAI responses, streamed
as server-sent events or whole. Nothing here decodes: the core does, for every caller at once.

Errors are OpenAI-style JSON bodies with the matching status, never a traceback: 400 malformed
JSON or parameter, 401 key, 403 a Host name this loopback server does not answer to, 404 unknown
model or path, 413 body or prompt too long, 415 a body that is not ``application/json``, 429
queue full, 503 shutting down, 500 the engine failed on that request. A client that goes away
cancels its request.

A server on loopback answers only requests addressed to it by a loopback name (localhost,
127.0.0.1, [::1] or the host it was bound to): a web page the user visits can make the browser
send requests to 127.0.0.1, but through a name it controls (DNS rebinding, Ollama's
CVE-2024-28224) its requests carry that name. And a POST must say ``application/json``: a
page's cross-origin "simple" request (``text/plain``) needs no preflight, so without that rule
any page could make a keyless server work.

A request is timed from the moment it reaches its handler (vLLM's arrival time): the wait before
the engine core picks it up is part of its TTFT and end-to-end time in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.base.errors import InvalidRequestError, PromptTooLongError
from engine.base.events import Finished, PromptScored
from engine.generation.output import StopTrimmer
from engine.serve import protocol
from engine.serve.metrics import ServerMetrics
from engine.generation.service import (
    Accepted,
    EngineService,
    NotServingError,
    QueueFullError,
    Rejected,
    Ticket,
    Token,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


class _BodyTooLarge(Exception):
    pass


class _Refused(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code=None, param=None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers


def _error(status: int, message: str, kind: str = "invalid_request_error", code=None, param=None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, param, code), status_code=status, headers=headers)


class _BodyLimit:
    """Refuse request bodies over ``limit`` bytes (413) before they are read whole."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _error(413, f"The request body is over {self.limit:,} bytes.")(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message
        await self.app(scope, counted, send)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def engine_limits(service: EngineService) -> dict:
    """The engine's limits as ``/v1/models`` lists them: what a serving simulator needs to plan as
    this server schedules (engine/estimates/simulator.py ``EngineLimits``)."""
    settings, kv = service.settings, service.core.kv
    return {"max_batch": settings.max_batch, "token_budget": settings.token_budget,
            "prefill_chunk": settings.prefill_chunk, "chunked_prefill": settings.chunked_prefill,
            "kv_blocks": kv.total_blocks, "block_tokens": kv.block_tokens, "prefix_caching": kv.prefix_caching,
            "kv_bytes_per_token": service.loaded.info.kv_bytes_per_token, "kv_dtype": service.loaded.info.kv_dtype,
            "batch_invariant": bool(getattr(service.loaded, "batch_invariant", False)),
            "lookahead": service.core.proposer.lookahead}


def host_name(header: str) -> str:
    """The name part of a ``Host`` header (``[::1]:8000`` → ``::1``, ``LocalHost:80`` → ``localhost``)."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")  # "localhost." is localhost


class _HostCheck:
    """Refuse (403) requests whose ``Host`` names none of ``allowed``."""

    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope.get("headers") or ()).get(b"host")
            name = host_name(given.decode("latin-1")) if given is not None else None
            if name is not None and name not in self.allowed:
                shown = ", ".join(sorted(self.allowed))
                return await _error(403, f"This server answers only requests addressed to {shown}, not "
                                         f"'{name[:100]}' (a web page can reach a loopback server through a name "
                                         "of its own: DNS rebinding).", code="host_not_allowed")(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(service: EngineService, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, metrics: ServerMetrics | None = None,
               stream_interval: int = 1, defaults: protocol.Defaults | None = None,
               allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """The ASGI app serving ``service``'s model as ``model_name``; a stream sends a chunk every
    ``stream_interval`` tokens. ``defaults``: what requests that leave fields out get (none:
    :func:`protocol.model_defaults` of the model). ``allowed_hosts``: the only names the ``Host``
    header may give (``None``: any; a server bound to loopback passes its names)."""
    app = FastAPI(title="Inference Workbench", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = metrics or ServerMetrics(service, model_name)
    if defaults is None:
        defaults = protocol.model_defaults(getattr(service.loaded.model, "generation_config", None))
    context = service.loaded.info.context_length
    created = int(time.time())

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused):
        return _error(exc.status, exc.message, exc.kind, exc.code, exc.param, exc.headers)

    @app.exception_handler(_BodyTooLarge)
    async def too_large(_: Request, __: _BodyTooLarge):
        return _error(413, f"The request body is over {max_body_bytes:,} bytes.")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        message = "No such endpoint." if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message, code=exc.status_code)

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception):
        log.exception("request failed")
        return _error(500, f"The server failed: {type(exc).__name__}.", "server_error")

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise _Refused(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read(request: Request, kind):
        authorize(request)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise _Refused(415, f"The request body must be sent as application/json, not {media[:100] or 'untyped'} "
                                "(set the Content-Type header).", code="unsupported_media_type")
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise _Refused(400, "The request body is not valid JSON.") from None
        except RecursionError:
            raise _Refused(400, "The request body nests JSON too deeply to read.") from None
        try:
            parsed = protocol.parse(kind, body)
        except InvalidRequestError as exc:
            raise _Refused(400, str(exc)) from None
        if parsed.model != model_name:
            raise _Refused(404, f"The model '{parsed.model}' does not exist; this server serves '{model_name}'.",
                           code="model_not_found", param="model")
        return parsed

    async def start(request: Request, engine_request, ids, endpoint: str,
                    arrived: float) -> tuple[Ticket, asyncio.Queue, Accepted]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (server stopped): nobody to tell
                pass

        client = f"{request.client.host}:{request.client.port}" if request.client else ""
        ticket = Ticket(engine_request, sink, client, endpoint, ids, arrived=arrived)
        try:
            service.submit(ticket)
        except QueueFullError as exc:
            raise _Refused(429, str(exc), "rate_limit_exceeded",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except NotServingError as exc:
            raise _Refused(503, str(exc), "server_error") from None
        first = await queue.get()
        if isinstance(first, Rejected):
            status = 413 if isinstance(first.error, PromptTooLongError) else 400
            raise _Refused(status, str(first.error), code="context_length_exceeded" if status == 413 else None)
        return ticket, queue, first

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def scrape():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        info = service.loaded.info  # what runs it, as llama.cpp's `meta` says of its model
        meta = {"precision": info.precision, "device": info.device, "device_name": info.device_name,
                "n_params": info.parameters, "size": info.weights_bytes, "engine": engine_limits(service)}
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "inference-workbench", "max_model_len": context,
                                            "meta": meta}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrived = time.perf_counter()
        parsed = await read(request, protocol.ChatRequest)
        try:
            engine_request = protocol.chat_to_engine(parsed, defaults)
        except InvalidRequestError as exc:
            raise _Refused(400, str(exc)) from None
        ticket, queue, accepted = await start(request, engine_request, None, "/v1/chat/completions", arrived)
        top = engine_request.top_alternatives
        reply = _Reply("chat.completion", protocol.new_id("chatcmpl"), model_name, parsed, accepted, queue, ticket,
                       logprobs=parsed.logprobs, top=top, interval=stream_interval)
        if parsed.stream:
            return _stream(reply)
        return await reply.whole(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrived = time.perf_counter()
        parsed = await read(request, protocol.CompletionRequest)
        try:
            engine_request, ids = protocol.completion_to_engine(parsed, defaults)
        except InvalidRequestError as exc:
            raise _Refused(400, str(exc)) from None
        ticket, queue, accepted = await start(request, engine_request, ids, "/v1/completions", arrived)
        reply = _Reply("text_completion", protocol.new_id("cmpl"), model_name, parsed, accepted, queue, ticket,
                       logprobs=parsed.logprobs is not None, top=parsed.logprobs or 0, interval=stream_interval)
        if parsed.stream:
            return _stream(reply)
        return await reply.whole(request)

    app.state.metrics = metrics
    app.state.service = service
    app.state.defaults = defaults
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, allowed=frozenset(allowed_hosts))
    return app


class _Reply:
    """One request's answer, built from its events: whole, or chunk by chunk."""

    def __init__(self, kind: str, rid: str, model: str, parsed, accepted: Accepted, queue: asyncio.Queue,
                 ticket: Ticket, logprobs: bool, top: int, interval: int = 1) -> None:
        self.chat = kind == "chat.completion"
        self.kind, self.rid, self.model, self.parsed = kind, rid, model, parsed
        self.accepted, self.queue, self.ticket = accepted, queue, ticket
        self.logprobs, self.top, self.interval = logprobs, top, interval
        self.generated = 0
        self.trimmer = StopTrimmer(ticket.request.stop)
        self.created = int(time.time())
        self.items: list[protocol.TokenLogprob] = []
        self.prompt_scores: list | None = None
        """vLLM's ``prompt_logprobs`` once the prompt is scored (asked for: ``PromptScored``)."""

    def _scored(self, event: PromptScored) -> None:
        self.prompt_scores = protocol.prompt_logprobs(event, self.parsed.return_tokens_as_token_ids)

    def _with_prompt_scores(self, body: dict) -> dict:
        """``body`` with the prompt's scores where vLLM puts them (the first chunk, or the whole
        answer): in the choice for completions, beside the choices for chat."""
        if self.prompt_scores is not None:
            if self.chat:
                body["prompt_logprobs"] = self.prompt_scores
            else:
                body["choices"][0]["prompt_logprobs"] = self.prompt_scores
            self.prompt_scores = None
        return body

    def _logprobs(self, items, offset: int = 0):
        if not self.logprobs:
            return None
        if self.chat:
            return protocol.chat_logprobs(items, self.top)
        return protocol.completion_logprobs(items, self.top, offset)

    def _item(self, token: Token) -> protocol.TokenLogprob:
        if self.parsed.return_tokens_as_token_ids:
            return protocol.TokenLogprob(token.token, token.event.logprob, token.event.top_alternatives,
                                         token_id=token.event.token_id)
        return protocol.TokenLogprob(token.token, token.event.logprob, token.event.top_alternatives)

    def _piece(self, token: Token) -> str:
        """What ``token`` lets the client see now (a special token adds no text; the stop trimmer
        holds back what may begin a stop string)."""
        return self.trimmer.add("" if token.event.special else token.event.text)

    def _choice(self, content, logprobs, reason, whole: bool = False) -> dict:
        """A choice of an answer (``whole``) or of a chunk: chat's message or delta, completions' text."""
        if not self.chat:
            return {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": reason}

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    async def whole(self, request: Request) -> dict:
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            finished = None
            async for event in self._until(watch):
                if isinstance(event, Token):
                    self._piece(event)
                    self.items.append(self._item(event))
                elif isinstance(event, PromptScored):
                    self._scored(event)
                elif isinstance(event, Finished):
                    finished = event
            if finished is None:  # the client left: nobody to answer
                return Response(status_code=499)
            if finished.reason == "error":
                raise _Refused(500, finished.error or "The engine failed.", "server_error")
            text = self.trimmer.final(finished.reason, finished.stop_string)
            choice = self._choice(text, self._logprobs(self.items), protocol.FINISH_REASONS[finished.reason],
                                  whole=True)
            return self._with_prompt_scores(
                {**protocol.envelope(self.kind, self.rid, self.model, self.created), "choices": [choice],
                 "usage": protocol.usage(self.accepted.prompt_tokens, finished.tokens, finished.cached_tokens)})
        finally:
            watch.cancel()
            self.ticket.abort()  # no-op once finished; frees the cache if the client left

    async def _until(self, watch: asyncio.Future | None = None) -> AsyncIterator[object]:
        """The request's events until it finishes, or ``watch`` (the client leaving) ends first. A
        stream needs no watch: Starlette cancels it when its client leaves."""
        while True:
            if watch is None:
                event = await self.queue.get()
            else:
                getter = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter, watch}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                event = getter.result()
            yield event
            if isinstance(event, Finished):
                return

    def _chunk(self, delta_or_text, logprobs=None, reason=None) -> str:
        body = self._with_prompt_scores({**protocol.envelope(self.chunk_kind, self.rid, self.model, self.created),
                                         "choices": [self._choice(delta_or_text, logprobs, reason)]})
        if self.parsed.continuous_usage:
            body["usage"] = protocol.usage(self.accepted.prompt_tokens, self.generated)
        elif self.parsed.include_usage:
            body["usage"] = None
        return _sse(body)

    async def chunks(self) -> AsyncIterator[str]:
        try:
            role = self.chat  # chat's role chunk goes with the first token, as vLLM's does: a client
            # that times its first chunk then times the first token, not the request's acceptance
            offset = 0
            text, items = "", []  # held until ``interval`` tokens are in hand (or the answer ends)
            async for event in self._until():
                if isinstance(event, PromptScored):
                    self._scored(event)  # sent with the first chunk
                elif isinstance(event, Token):
                    if role:
                        yield self._chunk({"role": "assistant", "content": ""})
                        role = False
                    self.generated += 1
                    text += self._piece(event)
                    items.append(self._item(event))
                    if len(items) < self.interval:
                        continue
                    if not text and not self.logprobs:  # nothing to show yet (a special token, held text)
                        items = []
                        continue
                    yield self._chunk({"content": text} if self.chat else text, self._logprobs(items, offset))
                    offset += len(text)
                    text, items = "", []
                elif isinstance(event, Finished):
                    if role:
                        yield self._chunk({"role": "assistant", "content": ""})
                        role = False
                    if event.reason == "error":
                        yield _sse(protocol.error_body(event.error or "The engine failed.", "server_error",
                                                       code=500))
                        yield "data: [DONE]\n\n"
                        return
                    rest = text + self.trimmer.finish(event.reason, event.stop_string)
                    if rest or items and self.logprobs:
                        yield self._chunk({"content": rest} if self.chat else rest, self._logprobs(items, offset))
                    reason = protocol.FINISH_REASONS[event.reason]
                    yield self._chunk({} if self.chat else "", None, reason)
                    if self.parsed.include_usage:
                        yield _sse({**protocol.envelope(self.chunk_kind, self.rid, self.model, self.created),
                                    "choices": [],
                                    "usage": protocol.usage(self.accepted.prompt_tokens, event.tokens,
                                                            event.cached_tokens)})
                    yield "data: [DONE]\n\n"
        finally:
            self.ticket.abort()  # the client left mid-stream (or the stream ended): free its cache


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(reply: _Reply) -> StreamingResponse:
    return StreamingResponse(reply.chunks(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


