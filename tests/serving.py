"""The project's own server on a free loopback port, for tests that need a real one."""

from __future__ import annotations


def serve(loaded, **settings):
    """A started :class:`engine.serve.server.Server` for ``loaded`` (no history, a 1 GiB KV budget,
    batch 8), ``settings`` overriding; the caller stops it."""
    from engine.serve.server import Server, ServeSettings

    base = dict(port=0, max_batch=8, history=False, kv_budget_bytes=1 << 30)
    return Server(loaded, ServeSettings(**{**base, **settings})).start()
