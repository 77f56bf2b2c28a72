"""The project's own server on a free loopback port, for tests that need a real one."""

from __future__ import annotations


def serve(loaded, service=None, **settings):
    """A started :class:`engine.serve.server.Server` for ``loaded`` (no history, a 1 GiB KV budget,
    batch 8), ``settings`` overriding; ``service``: the model's idle engine service to serve through.
    The caller stops it."""
    from engine.serve.server import Server, ServeSettings

    base = dict(port=0, max_batch=8, history=False, kv_budget_bytes=1 << 30)
    return Server(loaded, ServeSettings(**{**base, **settings}), service=service).start()


class ThirdPartyServer:
    """An OpenAI-compatible server the project did not write, imitated: it streams the way
    `transformers serve` does (a role chunk, then text chunks of several tokens each with no token
    ids and no logprobs, `usage` only on the finishing chunk, no `[DONE]`, no `/metrics`), on a free
    loopback port, each request answered in a thread of its own. ``error_on``: the numbers (from 0,
    in arrival order) of the requests that get transformers' mid-stream error (``{"error": "…"}``)
    after their first text chunk."""

    def __init__(self, tokens_per_chunk: int = 3, error_on: tuple[int, ...] = ()) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.tokens_per_chunk = tokens_per_chunk
        self.error_on = set(error_on)
        self.requests = 0
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._http.serve_forever, name="third-party-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10)

    def __enter__(self) -> "ThirdPartyServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def answer(self, body: dict):
        """The SSE events of one streamed answer: a token is a word; ``max_tokens`` of them, or the
        words there are."""
        import json

        with self._lock:
            number, self.requests = self.requests, self.requests + 1
        words = [f"word{i} " for i in range(40)]
        tokens = words[:body.get("max_tokens") or len(words)]
        prompt = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])

        def chunk(delta: dict, **more) -> str:
            choice = {"delta": delta, "index": 0} if "messages" in body else {"text": delta.get("content", ""),
                                                                              "index": 0}
            return "data: " + json.dumps({"id": f"req-{number}", "object": "chat.completion.chunk",
                                          "model": body.get("model"), "choices": [{**choice, **more}],
                                          "system_fingerprint": ""}) + "\n\n"

        yield chunk({"role": "assistant"})
        for start in range(0, len(tokens), self.tokens_per_chunk):
            yield chunk({"content": "".join(tokens[start:start + self.tokens_per_chunk])})
            if number in self.error_on:
                yield 'data: {"error": "the model ran out of memory"}\n\n'
                return
        final = json.loads(chunk({}, finish_reason="length" if len(tokens) < len(words) else "stop")[6:])
        final["usage"] = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt.split()) + len(tokens)}
        yield "data: " + json.dumps(final) + "\n\n"


def _handler(server: ThirdPartyServer):
    import json
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _json(self, status: int, value: dict) -> None:
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "imitated-model", "object": "model",
                                                             "owned_by": "huggingface"}]})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                self._json(404, {"detail": "Not Found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("stream") is False and "prompt" in body:  # a whole completion; unknown fields ignored
                self._json(200, {"id": "req", "object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": "word0", "logprobs": None,
                                              "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            for event in server.answer(body):
                self.wfile.write(event.encode())
                self.wfile.flush()

    return Handler
