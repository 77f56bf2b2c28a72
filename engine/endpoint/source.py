"""Connect to a served model and stream its answers as the engine's events.

The key is read from ``INFERENCE_WORKBENCH_API_KEY`` (else ``OPENAI_API_KEY``) or given by the
caller; it lives in this object only and is never written anywhere. Every time stamp is taken
as a server-sent event arrives, before it is parsed.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.endpoint.stream import FINISH, StreamReader, spread
from engine.base.errors import EndpointAuthError, EndpointError, InvalidRequestError, CancelledError
from engine.base.events import (
    EndpointAnswered,
    Finished,
    Loaded,
    LoadProgress,
    MemorySample,
    ServerSampled,
    TokenGenerated,
)
from engine.base.cancel import CancelToken
from engine.base.request import MAX_LOGPROBS, GenerationRequest
from engine.endpoint.scrape import ServerState, metrics_url, scrape_once_sync, read_slots

PREFIX = "endpoint:"
KEY_ENV = ("INFERENCE_WORKBENCH_API_KEY", "OPENAI_API_KEY")
CONNECT_TIMEOUT_S = 5.0
"""How long an unreachable host may take to say so."""
READ_TIMEOUT_S = 300.0
"""The longest silence between two chunks before the answer counts as broken off."""
SCRAPE_INTERVAL_S = 0.5

SERVERS = {"vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp", "ollama": "Ollama",
           "workbench": "Inference Workbench", "transformers": "transformers serve"}
OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp", "library": "ollama",
          "ollama": "ollama", "inference-workbench": "workbench", "huggingface": "transformers"}
"""``owned_by`` of ``/models`` → the server kind (Ollama says ``library``)."""
TOKEN_IDS = ("vllm", "workbench")
"""Servers that take vLLM's ``return_tokens_as_token_ids`` and ``continuous_usage_stats``."""
REMOTE = MemorySample(rss_bytes=None, device="remote")


@dataclass(frozen=True)
class EndpointSpec:
    url: str
    """The API's base URL, ``http(s)://HOST:PORT/v1``."""
    model: str | None = None
    """``None``: the first model the server lists."""

    @property
    def text(self) -> str:
        return PREFIX + self.url + (f"#{self.model}" if self.model else "")


def is_endpoint(text: object) -> bool:
    return isinstance(text, str) and text.startswith(PREFIX)


def parse_endpoint(text: str) -> EndpointSpec:
    """``endpoint:http://HOST:PORT/v1#MODEL`` (the ``endpoint:`` and ``#MODEL`` may be left out;
    a URL without a path gets ``/v1``)."""
    import httpx

    rest = text[len(PREFIX):] if text.startswith(PREFIX) else text
    url, _, model = rest.strip().partition("#")
    url = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidRequestError(f"{url!r} is not an http(s) URL of an API, e.g. http://127.0.0.1:8000/v1.")
    if parsed.path in ("", "/"):
        url += "/v1"
    return EndpointSpec(url, model.strip() or None)


def api_key_from_env() -> str | None:
    return next((os.environ[name] for name in KEY_ENV if os.environ.get(name)), None)


def _message(response) -> str:
    try:
        body = json.loads(response.text)
        error = body.get("error", body)
        return (error.get("message") if isinstance(error, dict) else str(error)) or response.text[:200]
    except (ValueError, AttributeError):
        return response.text[:200] or response.reason_phrase


def http_error(where: str, response) -> EndpointError:
    """The error for a non-200 answer: 401/403 as a key problem, others with the server's words."""
    status = response.status_code
    if status in (401, 403):
        return EndpointAuthError(
            f"{where} answered {status} {response.reason_phrase}: the API key is wrong or missing "
            f"({_message(response)}). Type it in, or set {KEY_ENV[0]}.", status=status)
    return EndpointError(f"{where} answered {status} {response.reason_phrase}: {_message(response)}", status=status)


def unreachable(url: str, exc: Exception) -> EndpointError:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        why = f"no answer within {CONNECT_TIMEOUT_S:g} s"
    elif isinstance(exc, httpx.ConnectError):
        why = "nothing listens there, or the host can't be reached"
    else:
        why = f"{type(exc).__name__}: {exc}"
    return EndpointError(f"Can't reach {url}: {why}.")


def _listed(client, url: str) -> list[dict]:
    """``GET /models``'s entries (each with an ``id``), or the error that says why not."""
    import httpx

    try:
        response = client.get("/models", timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from None
    if response.status_code != 200:
        raise http_error(f"{url}/models", response)
    try:
        listed = [m for m in response.json().get("data") or [] if isinstance(m, dict) and m.get("id")]
    except (ValueError, AttributeError):
        raise EndpointError(f"{url}/models did not answer a model list: is this an OpenAI-compatible API?") from None
    if not listed:
        raise EndpointError(f"{url}/models lists no model.")
    return listed


def _client(url: str, api_key: str | None, timeout, **more):
    """An httpx client for the API at ``url``, with the key given or read from the environment."""
    import httpx

    key = api_key or api_key_from_env()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=timeout,
                        **more)


def list_models(url: str, api_key: str | None = None) -> list[str]:
    """The model names a server lists (the key as :func:`connect` takes it)."""
    spec = parse_endpoint(url)
    with _client(spec.url, api_key, CONNECT_TIMEOUT_S) as client:
        return [m["id"] for m in _listed(client, spec.url)]


def connect(spec: EndpointSpec, api_key: str | None = None,
            progress: Callable[[LoadProgress], None] | None = None,
            cancel: CancelToken | None = None) -> "EndpointModel":
    """List the server's models, pick ``spec.model``, find out what the server is: a model
    ready to generate. Raises :class:`EndpointError` (:class:`EndpointAuthError` for a key)."""
    import httpx


    report = progress or (lambda event: None)
    started = time.perf_counter()
    report(LoadProgress("resolve", 0, 0, f"Asking {spec.url}/models"))
    client = _client(spec.url, api_key, httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                     limits=httpx.Limits(max_connections=8))
    try:
        listed = _listed(client, spec.url)
        names = [m["id"] for m in listed]
        if spec.model is not None and spec.model not in names:
            raise EndpointError(f"{spec.url} serves {', '.join(names)}, not {spec.model!r}.")
        entry = listed[names.index(spec.model)] if spec.model else listed[0]
        if cancel is not None and cancel.cancelled:
            raise CancelledError("Connecting was cancelled.")
        state = ServerState()
        report(LoadProgress("resolve", 0, 0, "Looking for the server's /metrics"))
        scrape_once_sync(client, metrics_url(spec.url), state, time.perf_counter())
        kind = OWNERS.get(str(entry.get("owned_by", "")).lower()) or state.kind
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}  # llama.cpp says a little more
        context = entry.get("max_model_len") or entry.get("context_length") or meta.get("n_ctx")
        server = SERVERS.get(kind, "OpenAI-compatible API")
        info = Loaded(
            name=entry["id"], source="endpoint", path=spec.url, precision="served", device="remote",
            device_name=f"{SERVERS.get(kind, 'an OpenAI-compatible server')} at {httpx.URL(spec.url).netloc.decode()}",
            architecture="", model_type="", parameters=_int(meta.get("n_params")), weights_bytes=_int(meta.get("size")),
            load_s=time.perf_counter() - started, context_length=_int(context),
            num_layers=None, num_kv_heads=None, head_dim=None, vocab_size=_int(meta.get("n_vocab")), compute_dtype="",
            kv_bytes_per_token=None, original_format=f"{server} {meta['ftype']}" if meta.get("ftype") else server,
        )
    except BaseException:
        client.close()
        raise
    report(LoadProgress("ready", 1, 1, f"Connected to {info.device_name}"))
    return EndpointModel(EndpointSpec(spec.url, entry["id"]), client, info, kind,
                         state.kind if state.samples else None, models=tuple(names))


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class EndpointModel:
    """A served model in the place of a loaded one: generates the same events; what only the
    server knows (weights, KV bytes, memory) is ``None``."""

    fast = None
    model = None

    def __init__(self, spec: EndpointSpec, client, info: Loaded, kind: str | None, metrics_kind: str | None,
                 models: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.info = info
        self.kind = kind
        """``vllm``, ``sglang``, ``llama.cpp``, ``ollama``, ``workbench``… or ``None`` (unknown)."""
        self.metrics_kind = metrics_kind
        """The kind its ``/metrics`` names say, when it has them: samples come with each answer."""
        self.models = models
        self._client = client

    @property
    def server(self) -> str:
        return SERVERS.get(self.kind, "OpenAI-compatible server")

    @property
    def client(self):
        """The ``httpx.Client`` on the server's API root that this model's requests go through
        (its key and timeouts set; safe to share between threads): for requests of other shapes
        (engine/measure/served_quality.py's prompt scoring)."""
        return self._client

    def encode(self, request: GenerationRequest) -> None:
        """The server tokenizes: the prompt's ids are not known here (its ``usage`` counts them)."""
        request.validated()
        return None

    def token_text(self, token_id: int) -> str:
        return ""

    def check_prompt(self, ids) -> None:
        pass

    def predicted_kv_bytes(self, tokens: int, batch: int = 1) -> None:
        return None

    def close(self) -> None:
        self._client.close()

    # -- one answer --------------------------------------------------------------------------
    def body(self, request: GenerationRequest) -> tuple[str, dict]:
        """The path and JSON body of ``request`` (streamed, with usage and logprobs)."""
        s = request.sampling
        body: dict = {"model": self.spec.model, "max_tokens": request.max_new_tokens, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": s.temperature}
        if s.top_p != 1.0:
            body["top_p"] = s.top_p
        if s.seed is not None:
            body["seed"] = s.seed
        if request.stop:
            body["stop"] = list(request.stop)
        # vLLM's extensions (SGLang, llama.cpp and ours take them too); sent only when asked for
        for name, default in (("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            if getattr(s, name) != default:
                body[name] = getattr(s, name)
        if request.ignore_eos:
            body["ignore_eos"] = True
        if self.kind in TOKEN_IDS:
            body["stream_options"]["continuous_usage_stats"] = True
            body["return_tokens_as_token_ids"] = True
        top = min(request.top_alternatives, MAX_LOGPROBS)
        if request.mode == "raw":
            return "/completions", {**body, "prompt": request.prompt, "logprobs": top}
        return "/chat/completions", {**body, "messages": request.messages(), "logprobs": True, "top_logprobs": top}

    def generate(self, request: GenerationRequest, cancel: CancelToken | None = None) -> Iterator[object]:
        request = request.validated()
        return self._stream(request, cancel or CancelToken())

    def _stream(self, request: GenerationRequest, cancel: CancelToken) -> Iterator[object]:
        import httpx
        from httpx_sse import SSEError, connect_sse

        path, body = self.body(request)
        reader = StreamReader()
        tokens: list[TokenGenerated] = []
        chunks = 0
        arrivals: list[float] = []
        sent = time.perf_counter()
        first_at = last_at = None
        done = False
        watcher = _Watcher(self, cancel, sent)
        try:
            with connect_sse(self._client, "POST", path, json=body) as source:
                response = source.response
                watcher.watch(response)
                if response.status_code != 200:
                    response.read()
                    raise http_error(f"{self.spec.url}{path}", response)
                for event in source.iter_sse():
                    now = time.perf_counter()  # on arrival, before parsing
                    yield from watcher.samples()
                    if cancel.cancelled:
                        break
                    if event.data.strip() == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(event.data)
                    except ValueError:
                        raise EndpointError(f"The server sent a chunk that is not JSON: {event.data[:120]!r}") from None
                    pieces = reader.read(chunk)
                    if not pieces:
                        continue
                    chunks += 1
                    arrivals.append(now - sent)
                    latencies = spread(len(pieces), now - (last_at or now), first_at is None, now - sent)
                    first_at = first_at or now
                    last_at = now
                    for piece, latency in zip(pieces, latencies):
                        token = TokenGenerated(
                            index=len(tokens), token_id=piece.token_id, text=piece.text,
                            logprob=piece.logprob,
                            top_alternatives=piece.alternatives, latency_s=latency, elapsed_s=now - sent,
                            kv_cache_bytes=None, kv_cache_bytes_predicted=None, memory=REMOTE, special=piece.special)
                        tokens.append(token)
                        yield token
                done = done or reader.finish_reason is not None  # some servers send no [DONE] (transformers)
                if not done and not cancel.cancelled:
                    raise EndpointError("The server closed the stream before the answer ended (no [DONE]).")
        except (httpx.HTTPError, SSEError, EndpointError) as exc:
            if cancel.cancelled:  # the watcher closed the connection: a cancel, not a failure
                pass
            elif isinstance(exc, EndpointError) and not tokens:
                raise
            else:
                if isinstance(exc, httpx.TimeoutException):
                    message = f"The server went silent for {READ_TIMEOUT_S:g} s mid-answer."
                elif isinstance(exc, EndpointError):
                    message = str(exc)
                elif isinstance(exc, httpx.ConnectError):
                    raise unreachable(self.spec.url, exc) from None
                else:
                    message = f"The connection broke mid-answer ({type(exc).__name__}: {exc or 'closed'})."
                finished = self._finished(request, reader, tokens, sent, first_at, last_at, "error", message)
                raise EndpointError(f"{message} The {len(tokens)} tokens that arrived are kept, marked incomplete.",
                                    finished=finished) from None
        finally:
            watcher.stop()
        yield from watcher.samples()
        reason = "cancelled" if cancel.cancelled and not done else FINISH.get(reader.finish_reason or "stop", "eos")
        if reason == "eos" and request.stop and isinstance(reader.stop_reason, str):
            reason = "stop_string"
        usage = reader.usage or {}
        yield EndpointAnswered(reader.counted_by, chunks, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                               self.server, reader.timings, chunk_times_s=tuple(arrivals))
        yield self._finished(request, reader, tokens, sent, first_at, last_at, reason)

    def _finished(self, request, reader: StreamReader, tokens, sent: float, first_at, last_at, reason: str,
                  error: str | None = None) -> Finished:
        usage = reader.usage or {}
        count = usage.get("completion_tokens") if reason != "error" else None
        count = count if isinstance(count, int) else len(tokens)
        decode_s = (last_at - first_at) if first_at is not None else 0.0
        ids = tuple(t.token_id for t in tokens)
        text = "".join(t.text for t in tokens) + reader.rest()
        return Finished(
            reason=reason, tokens=count, prompt_tokens=usage.get("prompt_tokens") or 0,
            ttft_s=(first_at - sent) if first_at is not None else None, decode_s=decode_s,
            decode_tokens_per_s=(count - 1) / decode_s if count > 1 and decode_s > 0 else None,
            total_s=time.perf_counter() - sent, peak_memory_bytes=None, peak_rss_bytes=None,
            kv_cache_bytes=None, kv_cache_bytes_predicted=None,
            token_ids=ids if ids and min(ids) >= 0 else (), text=text, error=error)


class _Watcher:
    """Beside one streamed answer: closes its connection as soon as it is cancelled (a server
    thinking about a long prompt sends nothing to wake the reader), and reads the server's
    ``/metrics`` every half second when it has them."""

    def __init__(self, model: EndpointModel, cancel: CancelToken, origin: float) -> None:
        self._model, self._cancel, self._origin = model, cancel, origin
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0.0
        self._slots = True

    def watch(self, response) -> None:
        self._thread = threading.Thread(target=self._run, args=(response,), name="endpoint-watch", daemon=True)
        self._thread.start()

    def _run(self, response) -> None:
        while not self._ended.is_set():
            if self._cancel.cancelled:
                response.close()
                return
            now = time.perf_counter()
            if now >= self._next:
                self._next = now + SCRAPE_INTERVAL_S
                sampled = self._sample()
                if sampled is not None:
                    self._queue.put(sampled)
            self._ended.wait(0.05)

    def _sample(self) -> ServerSampled | None:
        """One reading of the server's ``/metrics`` (and llama.cpp's ``/slots``), if it has them."""
        import httpx


        model = self._model
        sample, at = None, time.perf_counter() - self._origin
        if model.metrics_kind is not None:
            state = ServerState(kind=model.metrics_kind)
            if scrape_once_sync(model._client, metrics_url(model.spec.url), state, self._origin) and state.samples:
                sample = state.samples[-1]
        busy = total = None
        if model.kind == "llama.cpp" and self._slots:
            try:
                response = model._client.get(metrics_url(model.spec.url).removesuffix("/metrics") + "/slots",
                                             timeout=5.0)
                found = read_slots(response.text) if response.status_code == 200 else None
            except httpx.HTTPError:
                found = None
            if found is None:
                self._slots = False  # not offered (--no-slots): asked once
            else:
                busy, total = found
        if sample is None and busy is None:
            return None
        return ServerSampled(sample.at_s if sample else at, model.metrics_kind or model.kind or "",
                             sample.running if sample else float(busy), sample.waiting if sample else None,
                             sample.kv_usage if sample else None, sample.preemptions if sample else None,
                             slots_busy=busy, slots_total=total)

    def samples(self) -> Iterator[ServerSampled]:
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def stop(self) -> None:
        self._ended.set()
        if self._thread is not None:
            self._thread.join(timeout=6.0)
