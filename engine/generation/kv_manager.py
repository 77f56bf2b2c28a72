"""The KV cache manager: the one place that knows KV blocks and their bytes.

The cache is counted in blocks of :data:`BLOCK_TOKENS` tokens, as vLLM and nano-vllm count it. A
request holds the blocks its tokens fill, taken as it grows (admission takes its prompt's, each
decode step one more when the last is full) and given back when it ends, so nothing is reserved
for an answer's ``max_tokens`` up front. When no block is left for a running request, the
scheduler (engine/generation/scheduler.py) preempts one: its blocks come back here and it is
computed again later.

**Prefix caching.** A full block of a sequence's tokens, once computed, can be kept under a key
that is a hash of its tokens and of every token before it (a chain: block *i*'s key covers
blocks 0…*i*). A later request whose prompt starts with the same tokens finds those blocks and
skips computing them. Kept blocks count against the same budget as the running requests' and
are evicted least-recently-used when a request needs room: a cache, never a reason to wait.

Where the bytes live: the runners keep each running request's cache contiguous (the compiled
decode step and the CPU attention read one contiguous span per request), so a kept block is a
copy of its keys and values taken from the request that computed it, and a hit copies it into
the new request's cache: a memory copy instead of the forward pass. vLLM's paged attention reads
a shared block in place; here a prefix used by two running requests exists three times (twice
in their caches, once kept), and the counts below say so: each running request's blocks are its
own, kept blocks are counted once more.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BLOCK_TOKENS = 16
"""Tokens per block (vLLM's default block size)."""


@dataclass
class KeptBlock:
    """A full block kept for reuse: its tokens and what the runner copied out of a cache."""

    tokens: tuple[int, ...]
    data: object
    """The runner's copy of the block's keys and values (opaque here)."""
    size: int = 0
    """Its bytes (measured)."""


def block_keys(tokens: list[int], blocks: int, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The keys of the first ``blocks`` full blocks of ``tokens``: SHA-256 over the previous
    block's key and this block's token ids, so a key names the whole prefix up to its block."""
    keys, parent = [], b""
    for i in range(blocks):
        chunk = array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


class KVCacheManager:
    """Blocks held per request and blocks kept for prefix reuse, within ``total_blocks``
    (``None``: no limit; then nothing is kept, there being no budget to evict against)."""

    def __init__(self, bytes_per_token: int | None, total_blocks: int | None, prefix_caching: bool = False,
                 block_tokens: int = BLOCK_TOKENS, sizer: Callable[[object], int] | None = None) -> None:
        if block_tokens < 1:
            raise ValueError("a block holds at least one token")
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self.total_blocks = total_blocks
        self.prefix_caching = prefix_caching and total_blocks is not None
        self.held: dict[int, int] = {}
        """Blocks each running request holds."""
        self.used_blocks = 0
        """Blocks held by running requests (the sum of :attr:`held`, kept as it changes: the
        scheduler asks for it for every decoding request of every step)."""
        self.kept: OrderedDict[bytes, KeptBlock] = OrderedDict()
        """Kept blocks by key, least recently used first."""
        self.queries = 0
        """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
        self.hits = 0
        """Of those, tokens found (``prefix_cache_hits``)."""
        self.evicted = 0
        self.sizer = sizer
        """Bytes of a kept block's data (``None``: not measured)."""
        self.kept_bytes = 0
        """Bytes the kept blocks' copies hold, measured with ``sizer``."""

    # -- counting ----------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-max(0, tokens) // self.block_tokens)

    @property
    def kept_blocks(self) -> int:
        return len(self.kept)

    @property
    def free_blocks(self) -> int | None:
        """Blocks neither held nor kept (``None``: no limit)."""
        if self.total_blocks is None:
            return None
        return self.total_blocks - self.used_blocks - len(self.kept)

    def block_bytes(self, blocks: int) -> int | None:
        return None if self.bytes_per_token is None else blocks * self.block_tokens * self.bytes_per_token

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens fits the whole budget (so it can always finish)."""
        return self.total_blocks is None or self.blocks_for(tokens) <= self.total_blocks

    # -- requests' blocks --------------------------------------------------------------
    def can_hold(self, rid: int, tokens: int) -> bool:
        """Whether ``rid`` can hold blocks for ``tokens`` tokens, evicting kept blocks if need be."""
        if self.total_blocks is None:
            return True
        more = self.blocks_for(tokens) - self.held.get(rid, 0)
        return more <= self.free_blocks + len(self.kept)

    def hold(self, rid: int, tokens: int) -> bool:
        """Make ``rid`` hold blocks for ``tokens`` tokens (more blocks, never fewer), evicting kept
        blocks least recently used first; ``False``, and nothing changed, if they don't fit."""
        if not self.can_hold(rid, tokens):
            return False
        more = self.blocks_for(tokens) - self.held.get(rid, 0)
        if more > 0:
            if self.total_blocks is not None:
                self._evict(more - self.free_blocks)
            self.held[rid] = self.held.get(rid, 0) + more
            self.used_blocks += more
        return True

    def release(self, rid: int) -> int:
        """``rid`` ended or was preempted: its blocks are free. Returns how many it held."""
        freed = self.held.pop(rid, 0)
        self.used_blocks -= freed
        return freed

    def _evict(self, blocks: int) -> None:
        for _ in range(max(0, blocks)):
            _, block = self.kept.popitem(last=False)
            self.kept_bytes -= block.size
            self.evicted += 1

    # -- the prefix cache -------------------------------------------------------------
    def prefix_keys(self, tokens: list[int]) -> list[bytes]:
        """The keys of the blocks :meth:`lookup` would look for in ``tokens``."""
        return block_keys(tokens, (len(tokens) - 1) // self.block_tokens, self.block_tokens)

    def kept_run(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are kept (nothing counted, nothing moved)."""
        n = 0
        while n < len(keys) and keys[n] in self.kept:
            n += 1
        return n

    def lookup(self, tokens: list[int], keys: list[bytes] | None = None) -> list[KeptBlock]:
        """The kept blocks that begin ``tokens``, longest chain first to last; counted as a query
        of ``len(tokens)`` tokens. At least one token is always left to compute (its scores
        pick the next token), as vLLM leaves it. ``keys``: their :meth:`prefix_keys`, if made."""
        if not self.prefix_caching:
            return []
        self.queries += len(tokens)
        found: list[KeptBlock] = []
        n = self.block_tokens
        for i, key in enumerate(keys if keys is not None else self.prefix_keys(tokens)):
            block = self.kept.get(key)
            if block is None or block.tokens != tuple(tokens[i * n:(i + 1) * n]):
                break
            self.kept.move_to_end(key)
            found.append(block)
        self.hits += len(found) * self.block_tokens
        return found

    def keep(self, tokens: list[int], computed: int, copy: Callable[[int, int], object]) -> int:
        """Keep the full blocks among the first ``computed`` tokens of ``tokens`` that are not kept
        yet; ``copy(start, end)`` takes a block's keys and values out of the request's cache.
        Only free blocks are used (keeping never evicts). Returns how many were kept now."""
        if not self.prefix_caching:
            return 0
        kept = 0
        for i, key in enumerate(block_keys(tokens, computed // self.block_tokens, self.block_tokens)):
            if key in self.kept:
                self.kept.move_to_end(key)
                continue
            if not self.free_blocks:
                break
            start = i * self.block_tokens
            data = copy(start, start + self.block_tokens)
            size = self.sizer(data) if self.sizer is not None else 0
            self.kept[key] = KeptBlock(tuple(tokens[start:start + self.block_tokens]), data, size)
            self.kept_bytes += size
            kept += 1
        return kept

    def adopt(self, other: "KVCacheManager") -> None:
        """Take ``other``'s kept blocks (most recently used first, while they fit) and its counts:
        the same model's cache under new limits. Nothing is kept without prefix caching here, or
        with another block size."""
        self.queries, self.hits, self.evicted = other.queries, other.hits, other.evicted
        if not self.prefix_caching or other.block_tokens != self.block_tokens:
            return
        room = self.free_blocks
        for key, block in list(reversed(other.kept.items()))[:room]:
            self.kept[key] = block
            self.kept.move_to_end(key, last=False)  # the oldest stays first in line for eviction
            self.kept_bytes += block.size

    def clear_kept(self) -> None:
        self.kept.clear()
        self.kept_bytes = 0
