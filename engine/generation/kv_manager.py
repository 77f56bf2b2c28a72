"""The KV cache manager: the one place that knows KV blocks, who holds them, and their bytes.

The cache is counted in blocks of :data:`BLOCK_TOKENS` tokens, as vLLM and nano-vllm count it, out
of one pool per model (engine/generation/block_pool.py). A request holds a **block table**: the
blocks of its tokens in order, taken as it grows (admission takes its prompt's, each decode step
one more when the last is full) and given back when it ends, so nothing is reserved for an
answer's ``max_tokens`` up front. When no block is left for a running request, the scheduler
(engine/generation/scheduler.py) preempts one: its blocks come back here and it is computed again
later.

**Prefix caching.** A full block of a sequence's tokens, once computed, is remembered under a key
that is a hash of its tokens and of every token before it (a chain: block *i*'s key covers blocks
0…*i*). A later request whose prompt starts with the same tokens puts those very blocks at the
start of its table and skips computing them. A cached block no request holds stays in the pool
until its room is needed (least recently used first): a cache, never a reason to wait.

**Where the bytes live.** The fast path's runner (engine/generation/paged_cache.py) keeps the
keys and values in the pool's own storage, so a block several requests hold exists once and is
read in place through each one's table. The reference runner keeps each request's cache in
transformers' own tensors; for it a cached block is a copy taken out of the request that computed
it (``copy``), copied into a request that finds it: a prefix two of its requests use exists three
times, and the counts say so (:attr:`copies`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import Protocol

from engine.generation.block_pool import BlockPool

BLOCK_TOKENS = 16
"""Tokens per block (vLLM's default block size)."""


class Storage(Protocol):
    """A runner that keeps the pool's keys and values itself (engine/generation/paged_cache.py)."""

    def resize(self, blocks: int, block_tokens: int) -> None: ...

    def copy_block(self, source: int, target: int) -> None: ...

    def block_nbytes(self) -> int: ...

    def storage_nbytes(self) -> int: ...

    def held_nbytes(self) -> int: ...

    def kept_nbytes(self) -> int: ...

    def forget_block(self, block: int) -> None: ...


def block_keys(tokens: list[int], blocks: int, block_tokens: int = BLOCK_TOKENS, parent: bytes = b"",
               first: int = 0) -> list[bytes]:
    """The keys of full blocks ``first`` … ``blocks`` − 1 of ``tokens``: SHA-256 over the previous
    block's key (``parent``: block ``first`` − 1's) and this block's token ids, so a key names
    the whole prefix up to its block."""
    keys = []
    for i in range(first, blocks):
        chunk = array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


class KVCacheManager:
    """Block tables per request over one pool of ``total_blocks`` (``None``: no limit; then
    nothing is cached, there being no budget to evict against). ``storage``: the runner that
    keeps the blocks' bytes (``None``: a copying runner; cached blocks then hold copies made by
    :meth:`keep`'s ``copy``, measured with ``sizer``)."""

    def __init__(self, bytes_per_token: int | None, total_blocks: int | None, prefix_caching: bool = False,
                 block_tokens: int = BLOCK_TOKENS, sizer: Callable[[object], int] | None = None,
                 storage: Storage | None = None, sliding_tokens: int | None = None,
                 lacks_window: Callable[[object], bool] | None = None) -> None:
        if block_tokens < 1:
            raise ValueError("a block holds at least one token")
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self.total_blocks = total_blocks
        self.prefix_caching = prefix_caching and total_blocks is not None
        self.storage = storage
        self.pool = self._new_pool()
        self.tables: dict[int, list[int]] = {}
        """Each running request's blocks, in the order of its tokens."""
        self._chains: dict[int, tuple[int, bytes]] = {}
        """Per request: how many of its full blocks were offered to the cache, and the last one's key."""
        self.copies: dict[int, object] = {}
        """A copying runner's copies of cached blocks, by block."""
        self.sizer = sizer
        self.copied_bytes = 0
        """Bytes of :attr:`copies` (measured with ``sizer``)."""
        self.sliding_tokens = sliding_tokens
        """The most tokens a sliding-window layer keeps (``None``: no such layer)."""
        self.lacks_window = lacks_window
        """Whether a block lacks its sliding-window layers' part (it had left their window): asked of
        a copying runner's copy of it, or of a block of the ``storage``'s."""
        self.windowless: set[int] = set()
        """Cached blocks whose copies lack the sliding-window layers' part: a hit may hold them only
        before its last :attr:`sliding_tokens` tokens (as vLLM's hybrid allocator keeps only a
        window's blocks for those layers)."""
        self.queries = 0
        """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
        self.hits = 0
        """Of those, tokens found (``prefix_cache_hits``)."""

    def _new_pool(self) -> BlockPool:
        grow = None if self.storage is None else (lambda blocks: self.storage.resize(blocks, self.block_tokens))
        return BlockPool(self.total_blocks, grow=grow, forget=self._forget)

    def _forget(self, block: int) -> None:
        self.windowless.discard(block)
        if self.storage is not None:
            self.storage.forget_block(block)
        data = self.copies.pop(block, None)
        if data is not None and self.sizer is not None:
            self.copied_bytes -= self.sizer(data)

    # -- counting ----------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-max(0, tokens) // self.block_tokens)

    @property
    def held(self) -> dict[int, int]:
        """Blocks each running request holds."""
        return {rid: len(table) for rid, table in self.tables.items()}

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (a shared block once)."""
        return self.pool.held

    @property
    def kept_blocks(self) -> int:
        """Cached blocks no running request holds (they wait for a request that begins the same way)."""
        return self.pool.cached_free

    @property
    def shared_blocks(self) -> int:
        """Blocks more than one running request holds (read in place by each)."""
        return self.pool.shared

    @property
    def free_blocks(self) -> int | None:
        """Blocks neither held nor cached, grown or not (``None``: no limit)."""
        return self.pool.unused()

    @property
    def evicted(self) -> int:
        return self.pool.evicted

    def block_bytes(self, blocks: int) -> int | None:
        """Bytes of ``blocks`` blocks: read from the storage's tensors where the runner keeps the
        pool, else the config's bytes per token (``None``: unknown)."""
        if self.storage is not None and self.pool.allocated:
            return blocks * self.storage.block_nbytes()
        return None if self.bytes_per_token is None else blocks * self.block_tokens * self.bytes_per_token

    @property
    def kept_bytes(self) -> int:
        """Bytes of the cached blocks no request holds: the storage's, or a copying runner's copies."""
        if self.storage is not None:
            return self.storage.kept_nbytes()
        return self.copied_bytes

    def table_bytes(self, rid: int) -> int:
        """Bytes of the blocks ``rid`` holds (its last one maybe partly filled; shared ones included)."""
        return self.block_bytes(len(self.tables.get(rid, ()))) or 0

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens fits the whole budget (so it can always finish)."""
        return self.total_blocks is None or self.blocks_for(tokens) <= self.total_blocks

    # -- requests' blocks --------------------------------------------------------------
    def can_hold(self, rid: int, tokens: int) -> bool:
        """Whether ``rid`` can hold blocks for ``tokens`` tokens, evicting cached blocks if need be."""
        available = self.pool.available()
        if available is None:
            return True
        return self.blocks_for(tokens) - len(self.tables.get(rid, ())) <= available

    def hold(self, rid: int, tokens: int) -> bool:
        """Make ``rid`` hold blocks for ``tokens`` tokens (more blocks, never fewer), evicting cached
        blocks least recently used first; ``False``, and nothing changed, if they don't fit."""
        if not self.can_hold(rid, tokens):
            return False
        table = self.tables.setdefault(rid, [])
        while len(table) < self.blocks_for(tokens):
            block = self.pool.take()
            if block is None:  # can_hold said they fit: a storage that could not grow
                raise RuntimeError("the KV block pool could not give a block it counted as free")
            table.append(block)
        return True

    def release(self, rid: int) -> int:
        """``rid`` ended or was preempted: its references are dropped (the last block first, so a
        long answer's tail is evicted before the prefix others may share). Returns how many it held."""
        table = self.tables.pop(rid, [])
        self._chains.pop(rid, None)
        for block in reversed(table):
            self.pool.unref(block)
        return len(table)

    def crop(self, rid: int, tokens: int) -> list[tuple[int, int]]:
        """``rid`` keeps only its first ``tokens`` tokens (speculation rolled back): the blocks it
        will write again are made its own (copy on write where another request shares one, which the
        runner copies: the pairs returned) and forgotten by the cache."""
        table = self.tables.get(rid, [])
        copies = []
        for index in range(tokens // self.block_tokens, len(table)):
            block = table[index]
            if self.pool.refs[block] > 1:
                fresh = self.pool.take()
                if fresh is None:
                    raise RuntimeError("no KV block is left to copy a shared block into")
                copies.append((block, fresh))
                self.pool.unref(block)
                table[index] = fresh
            else:
                self.pool.uncache(block)
        done, _ = self._chains.get(rid, (0, b""))
        if done * self.block_tokens > tokens:
            self._chains.pop(rid, None)
        if copies and self.storage is not None:
            for source, target in copies:
                self.storage.copy_block(source, target)
        return copies

    # -- the prefix cache -------------------------------------------------------------
    def prefix_keys(self, tokens: list[int]) -> list[bytes]:
        """The keys of the blocks :meth:`lookup` would look for in ``tokens``."""
        return block_keys(tokens, (len(tokens) - 1) // self.block_tokens, self.block_tokens)

    def kept_run(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are cached (nothing counted, nothing moved)."""
        n = 0
        while n < len(keys) and keys[n] in self.pool.cached:
            n += 1
        return n

    def lookup(self, rid: int, tokens: list[int], keys: list[bytes] | None = None) -> list[int]:
        """The cached blocks that begin ``tokens``, first to last, put at the start of ``rid``'s
        (empty) table; counted as a query of ``len(tokens)`` tokens. At least one token is always
        left to compute (its scores pick the next token), as vLLM leaves it. ``keys``: their
        :meth:`prefix_keys`, if made."""
        if not self.prefix_caching:
            return []
        self.queries += len(tokens)
        found: list[int] = []
        for key in keys if keys is not None else self.prefix_keys(tokens):
            block = self.pool.find(key)
            if block is None:
                break
            found.append(block)
        if self.windowless and self.sliding_tokens:  # the hit's last window of tokens must be whole
            need = -(-self.sliding_tokens // self.block_tokens)
            while found and any(block in self.windowless for block in found[-need:]):
                found.pop()
        for block in found:
            self.pool.ref(block)
            self.pool.touch(block)
        if found:
            self.tables[rid] = found + self.tables.get(rid, [])
            self._chains[rid] = (len(found), self.pool.key_of[found[-1]])
        self.hits += len(found) * self.block_tokens
        return found

    def keep(self, rid: int, tokens: list[int], computed: int,
             copy: Callable[[int, int], object] | None = None) -> int:
        """Cache ``rid``'s full blocks among the first ``computed`` tokens of ``tokens`` (its feed,
        computed): each under its key, unless the same tokens are cached already. ``copy(start,
        end)``: a copying runner takes the block's keys and values out of the request's cache.
        Returns how many blocks were cached now."""
        if not self.prefix_caching:
            return 0
        table = self.tables.get(rid, [])
        done, parent = self._chains.get(rid, (0, b""))
        full = min(computed // self.block_tokens, len(table))
        if full <= done:
            return 0
        cached = 0
        for i, key in enumerate(block_keys(tokens, full, self.block_tokens, parent, done), start=done):
            block = table[i]
            if self.pool.key_of[block] is None and key not in self.pool.cached:
                if self.storage is None and copy is not None:
                    start = i * self.block_tokens
                    data = self.copies[block] = copy(start, start + self.block_tokens)
                    if self.sizer is not None:
                        self.copied_bytes += self.sizer(data)
                    if self.lacks_window is not None and self.lacks_window(data):
                        self.windowless.add(block)
                elif self.storage is not None and self.lacks_window is not None and self.lacks_window(block):
                    self.windowless.add(block)  # its window part went back before it was cached
                self.pool.cache(block, key)
                cached += 1
            parent = key
        self._chains[rid] = (full, parent)
        return cached

    def copy_of(self, block: int) -> object:
        """A copying runner's copy of cached ``block``."""
        return self.copies[block]

    def adopt(self, other: "KVCacheManager") -> None:
        """Take ``other``'s pool (idle: nobody holds a block), its cached blocks and its counts:
        the same model's cache under new limits. Cached blocks above a smaller limit are dropped,
        all of them with another block size (then the pool starts anew). Without prefix caching
        here they wait untouched (nothing is looked up or added) until their room is needed."""
        if other.tables:
            raise ValueError("a KV cache is adopted only when no request holds blocks")
        self.queries, self.hits = other.queries, other.hits
        if other.block_tokens != self.block_tokens or other.storage is not self.storage:
            other.pool.clear_cached()
            self.pool.evicted = other.pool.evicted
            return
        self.pool, self.copies, self.copied_bytes = other.pool, other.copies, other.copied_bytes
        self.windowless = other.windowless
        self.pool._forget = self._forget
        shrink = None if self.storage is None else (lambda blocks: self.storage.resize(blocks, self.block_tokens))
        self.pool.set_limit(self.total_blocks, shrink)
        self.pool._grow = None if self.storage is None else (
            lambda blocks: self.storage.resize(blocks, self.block_tokens))

    def pool_bytes(self) -> dict[str, int]:
        """The pool's bytes by state (used, cached, free: blocks grown but empty) and the storage's
        own, read from its tensors (``storage`` is 0 for a copying runner: its caches are its own)."""
        per = self.block_bytes(1) or 0
        pool = self.pool
        if self.storage is None:
            return {"used": pool.held * per, "cached": pool.cached_free * per, "free": len(pool.empty) * per,
                    "storage": 0}
        # the storage's own count of what is held (sliding-window layers keep only their windows'
        # blocks, engine/generation/paged_cache.py); free is the rest of its tensors
        storage = self.storage.storage_nbytes()
        used, cached = self.storage.held_nbytes(), self.storage.kept_nbytes()
        return {"used": used, "cached": cached, "free": storage - used - cached, "storage": storage}
