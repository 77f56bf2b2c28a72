"""The KV block pool: which blocks exist, who references each, and which full blocks are cached.

Blocks are numbered 0 … ``allocated`` − 1, the rows of the runner's storage (engine/generation/paged_cache.py
keeps per layer keys and values of ``[blocks, KV heads, block tokens, head dim]``; the reference
runner, which keeps each request's cache itself, copies a block's keys and values out when it is
cached). Each block is in exactly one state:

- **held**: one request or more reference it (``refs`` > 0); a block several requests reference
  is **shared** (a prefix they have in common, read in place);
- **cached**: no request references it, but it is full and its key (a hash of its tokens and of
  every token before it) is remembered, so a later request that begins the same way takes it
  back instead of computing it; cached blocks are evicted least recently used first;
- **empty**: neither.

The pool grows in chunks of :data:`GROW_BLOCKS` (its storage with it) while below ``limit`` (the
KV budget in blocks; ``None``: no limit), never past it. A block is taken empty first; then, while
the cached blocks no request holds are fewer than the held ones, from growth (a cached prefix is
worth more than memory left unused); else by evicting the least recently used cached block. So
the pool grows with the requests running at once, the cache may take as much again and no more,
and a server that has seen its busiest moment grows no further, however many distinct prompts
pass through it. The shape is vLLM v1's ``BlockPool`` (free queue, cached-block map, ``touch``) and
nano-vllm's ``BlockManager``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

GROW_BLOCKS = 64
"""Blocks the pool grows by at a time (at most to its limit): 1,024 tokens of a 16-token block."""


class BlockPool:
    def __init__(self, limit: int | None, grow: Callable[[int], None] | None = None,
                 forget: Callable[[int], None] | None = None, chunk: int = GROW_BLOCKS) -> None:
        if limit is not None and limit < 0:
            raise ValueError("a pool's limit is at least 0 blocks")
        self.limit = limit
        """Most blocks the pool may have (``None``: no limit)."""
        self.allocated = 0
        """Blocks that exist (the storage's rows)."""
        self.chunk = max(1, chunk)
        self._grow = grow
        """Called with the new number of blocks when the pool grows (the storage grows with it)."""
        self._forget = forget
        """Called with a block's id when its cached contents are dropped (a copying runner frees its copy)."""
        self.refs: list[int] = []
        self.key_of: list[bytes | None] = []
        self.cached: dict[bytes, int] = {}
        """Key → block, for every block whose key is remembered (held or not)."""
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request references, least recently used first."""
        self.empty: list[int] = []
        """Blocks neither held nor cached (taken from the end)."""
        self.held = 0
        """Blocks with at least one reference."""
        self.shared = 0
        """Blocks with more than one reference."""
        self.evicted = 0

    # -- counts ---------------------------------------------------------------------------
    @property
    def cached_free(self) -> int:
        """Cached blocks no request references (evictable)."""
        return len(self.lru)

    def available(self) -> int | None:
        """Blocks a request could still take: empty, not yet grown, or cached and unreferenced
        (``None``: no limit)."""
        if self.limit is None:
            return None
        return len(self.empty) + (self.limit - self.allocated) + len(self.lru)

    def unused(self) -> int | None:
        """Blocks neither held nor cached, grown or not (``None``: no limit)."""
        return None if self.limit is None else len(self.empty) + self.limit - self.allocated

    # -- taking and giving back -------------------------------------------------------------
    def take(self) -> int | None:
        """A block for a request to write (referenced once); ``None`` if none is left."""
        if self.empty:
            block = self.empty.pop()
        elif (self.limit is None or self.allocated < self.limit) and len(self.lru) < max(self.held, 1):
            self._grow_by_chunk()
            block = self.empty.pop()
        elif self.lru:
            block, _ = self.lru.popitem(last=False)
            self._uncache(block)
            self.evicted += 1
        else:
            return None
        self.refs[block] = 1
        self.held += 1
        return block

    def _grow_by_chunk(self) -> None:
        new = self.allocated + self.chunk if self.limit is None else min(self.limit, self.allocated + self.chunk)
        if self._grow is not None:
            self._grow(new)  # first: a storage that can't grow leaves the pool as it was
        self.refs.extend([0] * (new - self.allocated))
        self.key_of.extend([None] * (new - self.allocated))
        self.empty.extend(range(new - 1, self.allocated - 1, -1))  # the lowest ids taken first
        self.allocated = new

    def ref(self, block: int) -> None:
        """One more reference to ``block`` (a request shares it, or takes a cached one back)."""
        if self.refs[block] == 0:
            if block in self.lru:
                del self.lru[block]
            else:
                raise ValueError(f"block {block} is neither held nor cached")
            self.held += 1
        elif self.refs[block] == 1:
            self.shared += 1
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        """One reference fewer; at none, a cached block waits in the LRU (most recent last), an
        uncached one is empty again."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} has no reference to drop")
        self.refs[block] -= 1
        if self.refs[block] == 1:
            self.shared -= 1
        elif self.refs[block] == 0:
            self.held -= 1
            if self.key_of[block] is not None:
                self.lru[block] = None
            else:
                self.empty.append(block)

    # -- the cache ------------------------------------------------------------------------
    def cache(self, block: int, key: bytes) -> bool:
        """Remember ``block`` (full, computed) under ``key``; ``False`` where another block already
        holds that key (two requests computed the same tokens at once: this one stays private)."""
        if self.key_of[block] is not None:
            return self.key_of[block] == key
        if key in self.cached:
            return False
        self.cached[key] = block
        self.key_of[block] = key
        return True

    def find(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def touch(self, block: int) -> None:
        """``block`` was just used: last in line for eviction (if unreferenced)."""
        if block in self.lru:
            self.lru.move_to_end(block)

    def uncache(self, block: int) -> None:
        """Forget ``block``'s key (its contents are about to change)."""
        if self.key_of[block] is None:
            return
        self._uncache(block)
        if self.refs[block] == 0:
            del self.lru[block]
            self.empty.append(block)

    def _uncache(self, block: int) -> None:
        key = self.key_of[block]
        if key is not None:
            del self.cached[key]
            self.key_of[block] = None
            if self._forget is not None:
                self._forget(block)

    def clear_cached(self) -> None:
        """Drop every unreferenced cached block (held blocks keep their keys)."""
        while self.lru:
            block, _ = self.lru.popitem(last=False)
            self._uncache(block)
            self.empty.append(block)

    def set_limit(self, limit: int | None, shrink: Callable[[int], None] | None = None) -> None:
        """A new limit. Shrinking needs no block above it held; cached ones above it are dropped,
        and the storage is cut to the new size (``shrink``)."""
        if limit is not None and limit < self.allocated:
            if any(self.refs[b] for b in range(limit, self.allocated)):
                raise ValueError("blocks above the new limit are held")
            for block in range(limit, self.allocated):
                if self.key_of[block] is not None:
                    self.lru.pop(block, None)
                    self._uncache(block)
            self.empty = [b for b in self.empty if b < limit]
            del self.refs[limit:], self.key_of[limit:]
            self.allocated = limit
            if shrink is not None:
                shrink(limit)
        self.limit = limit

    def check(self) -> None:
        """Every block in exactly one state (for tests)."""
        held = {b for b in range(self.allocated) if self.refs[b] > 0}
        lru, empty = set(self.lru), set(self.empty)
        assert len(empty) == len(self.empty), "a block is empty twice"
        assert not (held & lru) and not (held & empty) and not (lru & empty), "a block in two states"
        assert held | lru | empty == set(range(self.allocated)), "a block in no state"
        assert len(held) == self.held and sum(1 for r in self.refs if r > 1) == self.shared
        assert all(self.key_of[b] is not None for b in lru) and all(self.key_of[b] is None for b in empty)
        assert {b: k for k, b in self.cached.items()} == {b: k for b, k in enumerate(self.key_of) if k is not None}
