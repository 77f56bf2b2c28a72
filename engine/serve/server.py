"""A running server: the engine core's thread (engine/generation/service.py) and uvicorn serving the
API (engine/serve/api.py) for one loaded model, started and stopped as one.

The socket is bound before anything else (port 0 picks a free one, which :attr:`Server.url`
then names); binding anywhere but loopback needs an API key. Stopping first ends the core's
requests (drained, or cancelled so every open stream gets its last chunk and ``[DONE]``), then
uvicorn closes the connections.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn

from engine.base.errors import InvalidRequestError
from engine.base.events import Finished, TokenGenerated
from engine.base.memory import default_kv_budget
from engine.generation.service import RequestArrived, RequestEvent, EngineService
from engine.generation.core import CoreSettings
from engine.serve.protocol import model_defaults

if TYPE_CHECKING:
    from engine.models.model import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    """0: any free port."""
    api_key: str | None = None
    max_batch: int = 16
    kv_budget_bytes: int | None = None
    """``None``: engine/base/memory.py's :func:`default_kv_budget`."""
    max_waiting: int = 256
    token_budget: int = 128
    """Tokens one step may put through the model (a decode token per running request, the rest
    prompt chunks): larger reads prompts sooner, smaller keeps the others' tokens coming."""
    max_body_bytes: int = 4 * 1024 * 1024
    history: bool = True
    """Every served request becomes a run in the history."""
    model_name: str | None = None
    """The name clients use; ``None``: the model's own."""
    stream_interval: int = 1
    """Tokens per streamed chunk, as vLLM's ``--stream-interval``: fewer events (less work per
    token on both sides) for coarser arrival times; clients count them from ``usage``."""
    prefix_caching: bool = True
    """Keep computed prompt blocks for later requests that begin the same way (vLLM's default);
    ``serve --no-prefix-caching`` turns it off."""
    default_max_tokens: int | None = None
    """Answer limit of a request without ``max_tokens``; ``None``: the model's generation_config
    ``max_new_tokens``, else :data:`engine.serve.protocol.DEFAULT_MAX_TOKENS`."""
    batch_invariant: bool = False
    """Every answer the one it gets alone, whatever else is in the batch (vLLM's
    ``--batch-invariant``; engine/generation/invariant.py), while the server runs; at a price."""

    def validated(self) -> "ServeSettings":
        if not is_loopback(self.host) and not self.api_key:
            raise InvalidRequestError(
                f"Serving on {self.host} lets other machines in: give an API key (--api-key) to do that, or "
                "serve on 127.0.0.1.")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"The port must be between 0 and 65535, not {self.port}.")
        if self.max_batch < 1 or self.max_waiting < 1 or self.token_budget < 1 or self.stream_interval < 1:
            raise InvalidRequestError("The batch size, the waiting queue and the token budget must be at least 1.")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise InvalidRequestError("The default answer limit (--default-max-tokens) must be at least 1 token.")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise InvalidRequestError("The KV budget must be more than 0 bytes.")
        return self


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``host`` answers to: loopback names and ``host`` itself
    on loopback (no DNS-rebinding page gets in), any name elsewhere (``None``; a key guards it)."""
    from engine.serve.api import LOOPBACK_NAMES, host_name  # lazy: importing it loads fastapi, prometheus_client, starlette

    if not is_loopback(host):
        return None
    return LOOPBACK_NAMES | {host_name(f"[{host}]" if ":" in host else host)}


class Server:
    """The API for ``loaded`` on a socket bound now; :meth:`start` serves from a thread,
    :meth:`serve_forever` from this one (the CLI: Ctrl-C stops it)."""

    def __init__(self, loaded: "LoadedModel", settings: ServeSettings | None = None,
                 service: "EngineService | None" = None) -> None:
        """``service``: the model's own idle engine service to serve through (the window's, its
        prefix cache kept), under the server's limits; ``None``: a new one."""
        from engine.serve.api import create_app  # lazy: importing it loads fastapi, prometheus_client, starlette

        self.settings = settings = (settings or ServeSettings()).validated()
        self.loaded = loaded
        budget = settings.kv_budget_bytes or default_kv_budget(loaded.device)
        limits = CoreSettings(token_budget=settings.token_budget, max_batch=settings.max_batch, kv_budget_bytes=budget,
                              prefix_caching=settings.prefix_caching)
        if service is not None:
            service.reconfigure(limits, settings.max_waiting)
            service.reopen()
        self.service: EngineService = service or EngineService(loaded, limits, max_waiting=settings.max_waiting)
        self.model_name = settings.model_name or loaded.info.name
        self.drain = True
        """What stopping does with requests in flight: finish them (``True``) or cancel them."""
        self.defaults = model_defaults(getattr(loaded.model, "generation_config", None), settings.default_max_tokens)
        """What requests that leave sampling or ``max_tokens`` out get."""
        self.app = create_app(self.service, self.model_name, settings.api_key, settings.max_body_bytes,
                              stream_interval=settings.stream_interval, defaults=self.defaults,
                              allowed_hosts=allowed_hosts(settings.host))
        self._history = _HistoryWriter(loaded, self.service) if settings.history else None
        config = uvicorn.Config(self.app, host=settings.host, port=settings.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=30, access_log=False)
        self.socket = _bind(settings.host, settings.port)
        self.port = self.socket.getsockname()[1]
        self._uvicorn = _Uvicorn(config, self)
        self._thread: threading.Thread | None = None
        self._core_thread = False
        self._invariant_before = loaded.batch_invariant  # set once nothing above can fail; stop() restores it
        loaded.batch_invariant = settings.batch_invariant or loaded.batch_invariant

    @property
    def url(self) -> str:
        host = self.settings.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/v1"

    def start(self, core_thread: bool = True) -> "Server":
        """Serve HTTP from a thread of its own; the engine core steps on another (``core_thread``)
        or on the caller's, which then calls :meth:`run_core` (best where the model was loaded:
        see :meth:`run_core`)."""
        self._core_thread = core_thread
        if core_thread:
            self.service.start()
        self._thread = threading.Thread(target=self._run, name="api-server", daemon=True)
        self._thread.start()
        return self

    def run_core(self) -> None:
        """Step the engine core on this thread until the service stops, then stop HTTP.

        The thread that loaded the model is the best place: PyTorch's CPU kernels run on an
        OpenMP team per calling thread, and once two teams exist (more threads than cores),
        libgomp cuts how long idle workers spin, so each parallel region waits for its workers
        to wake: decoding on a thread of its own, beside the team of the thread that loaded the
        model, took half as long again a token (benchmarks/serve.py)."""
        try:
            self.service.run()
        finally:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(60)

    def serve_forever(self) -> None:
        """HTTP on a thread, the core on this one, until Ctrl-C (which cancels the requests in
        flight, each stream ending with its last chunk; a second Ctrl-C interrupts)."""
        import signal

        def interrupted(signum, frame) -> None:
            signal.signal(signal.SIGINT, previous)
            self.drain = False
            self.service.stop(drain=False)

        previous = signal.signal(signal.SIGINT, interrupted)
        try:
            self.start(core_thread=False)
            self.run_core()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _run(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.service.stop(drain=False)
            self.service.join(30)
            if self._history is not None:
                self._history.close()
            self.app.state.metrics.close()
            self.socket.close()

    def stop(self, drain: bool = True, timeout: float = 60.0) -> bool:
        """End the requests in flight (``drain``: let them finish; else cancel them) and the
        server; ``True`` if it ended within ``timeout``."""
        self.drain = drain
        self.service.stop(drain)
        self._uvicorn.should_exit = True
        ended = True
        if self._thread is not None:
            self._thread.join(timeout)
            ended = not self._thread.is_alive()
        if self._core_thread:  # the service's own thread ends once its requests have
            ended = self.service.join(timeout) and ended
        if ended:
            self.loaded.batch_invariant = self._invariant_before
        return ended

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidRequestError(f"Can't serve on {host}:{port}: {exc.strerror or exc}.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn, whose shutdown first ends the core's requests, so open streams finish (with their
    last chunk and ``[DONE]``) before it waits for connections to close."""

    def __init__(self, config, owner: Server) -> None:
        super().__init__(config)
        self.owner = owner

    async def shutdown(self, sockets=None) -> None:
        self.owner.service.stop(self.owner.drain)
        await super().shutdown(sockets)


class _HistoryWriter:
    """Every finished served request as a run in the history (kind ``served``, the client's
    address and the endpoint kept; never a key), written on a thread of its own."""

    def __init__(self, loaded: "LoadedModel", service: "EngineService") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.info = loaded.info
        self.serving = time.strftime("%Y-%m-%dT%H:%M:%S")
        """This server's run: its requests are one entry of the history, listed together."""
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="served-history")
        self.open: dict[int, tuple] = {}
        self.stop_listening = service.listen(self.on_event)

    def on_event(self, event) -> None:  # on the core's thread, for every token: no imports here
        if isinstance(event, RequestArrived):
            if event.client != "window":  # the app's own requests: the window keeps those
                self.open[event.request_id] = (event, [])
        elif isinstance(event, RequestEvent) and event.request_id in self.open:
            arrived, tokens = self.open[event.request_id]
            if isinstance(event.event, TokenGenerated):
                tokens.append(event.event)
            elif isinstance(event.event, Finished):
                del self.open[event.request_id]
                self.pool.submit(self._save, arrived, tokens, event.event)

    def _save(self, arrived, tokens, finished) -> None:
        from engine.storage import history  # lazy: importing it loads numpy

        history.remember(self.info, finished, "served", tokens=tokens, client=arrived.client,
                         endpoint=arrived.endpoint, error=finished.error, serving=self.serving)

    def close(self) -> None:
        self.stop_listening()
        self.pool.shutdown(wait=True)
