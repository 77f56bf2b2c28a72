"""The fast path's KV cache for the engine core (its fast runner): the storage of the KV manager's
block pool, run by the lean decoder (engine/models/fast.py).

Per layer, keys and values of ``[blocks, KV heads, block tokens, head dim]``: the pool's blocks,
grown with it (engine/generation/block_pool.py) and never past the KV budget. Each running sequence
reads and writes its blocks through its block table (engine/generation/kv_manager.py): a decode
step hands the kernels' attention every row's table, and a prefix several sequences share is one
set of blocks that each reads in place. Nothing is laid out per sequence, so a 4,096-token request
among short ones holds its own blocks and nobody else's room.

Sliding-window layers (Gemma 3's local layers, Mistral's window) keep only their window's blocks,
as vLLM's hybrid allocator does: their keys and values live in a pool of their own, a block of it
the window part of one KV manager block, and a step's table lists a sequence's blocks, then their
window parts (the kernels' attention reads only a window's). A sequence reads the window parts of
its blocks from its window's start on; once no sequence reads one, it goes back to the window pool,
unless its block is in the prefix cache: then it stays with it (a later prompt that ends there
needs its window whole; the KV manager trims a hit to where the window parts are there), until the
block leaves the cache. The KV manager charges each block for every layer, so its budget always
covers both pools.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.generation.block_pool import GROW_BLOCKS
from engine.generation.kv_manager import BLOCK_TOKENS, KVCacheManager
from engine.generation.proposer import MAX_DRAFT_TOKENS
from engine.models.fast import (MAX_COMPILED_CAPACITY, MIN_CAPACITY, FastDecoder, _bucket, _decode_batch, _decode_rows,
                                _forward, _rotary_tables)


GIVEN_BACK = 0
"""What a step's table names for a window part a sequence no longer reads (a block of the window
pool the kernels' attention never reads for it: it lies before the window)."""


class PagedCache:
    """The fast path's runner: sequences by id, their tokens in the pool's blocks."""

    paged = True
    """Keys and values live in the KV manager's pool (the engine core shares blocks in place)."""
    rollback = False
    """Set while a proposer runs (speculation): :meth:`crop` always works, and the window layers
    keep :meth:`margin` positions more."""
    batch_invariant = False
    """Every decode step, one sequence or many, through the same eager step whose attention reads
    each row's own blocks (engine/generation/invariant.py); the compiled steps are left out."""

    def __init__(self, d: FastDecoder, block_tokens: int = BLOCK_TOKENS) -> None:
        self.d = d
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        """Per layer, the pool its keys and values live in (a sliding-window layer's: the window pool)."""
        self.window = max((layer.window for layer in d.layers if layer.window), default=0)
        """The widest sliding window (0: no such layer)."""
        self.window_of: dict[int, int] = {}
        """KV manager block → its window part (a block of the window pool)."""
        self.readers: dict[int, int] = {}
        """KV manager block → how many sequences read its window part."""
        self._parts_read = 0
        """How many of :attr:`readers` are read by one sequence or more (the rest are kept for the
        prefix cache): counted as they change, not by a walk over them at every token's event."""
        self.reading: dict[int, tuple[int, list[int]]] = {}
        """Per sequence: the index in its table from which it reads window parts, and those blocks."""
        self.window_free: list[int] = []
        self.window_blocks = 0
        """Blocks of the window pool that exist."""
        self.lengths: dict[int, int] = {}
        self.rotary = 0
        self.cos = self.sin = None
        self._rotary(MIN_CAPACITY)
        self._inputs: dict[tuple[int, int], tuple[tuple, tuple]] = {}
        self.resize(0, block_tokens)  # no block yet: the tensors' shapes say what one costs
        self.kv = KVCacheManager(self.per_token_bytes, None, block_tokens=block_tokens, storage=self)
        """The manager whose pool this storage is: a private, unbounded one until the engine core
        binds its own (:meth:`bind`; a speculative draft keeps its private one)."""

    def bind(self, kv: KVCacheManager) -> None:
        """Take block tables from ``kv`` (the engine core's manager, whose pool this storage is)."""
        self.kv = kv

    # -- the pool's storage -------------------------------------------------------------
    @torch.inference_mode()  # every cache tensor an inference tensor, wherever it grows
    def resize(self, blocks: int, block_tokens: int) -> None:
        """The pool now has ``blocks`` blocks of ``block_tokens`` tokens: the storage follows, its
        first blocks kept (a shrink drops only blocks above the pool's new size). The window pool
        grows on its own (:meth:`_window_block`); another block size starts it anew."""
        same = bool(self.keys) and self.keys[0].shape[2] == block_tokens
        full = [not layer.window for layer in self.d.layers]
        self._store(full, blocks, block_tokens, same)
        if not same:  # a new pool (idle): the window parts start anew too
            self.window_free, self.window_blocks = [], 0
            self.window_of, self.readers, self.reading = {}, {}, {}
            self._parts_read = 0
            self._store([not f for f in full], 0, block_tokens, False)

    def _store(self, which: list[bool], blocks: int, block_tokens: int, same: bool) -> None:
        """Storage of ``blocks`` blocks for the layers ``which`` names, their first blocks kept."""
        d = self.d
        shape = (blocks, d.kv_heads, block_tokens, d.kv_row)
        keys = self.keys or [None] * len(d.layers)
        values = self.values or [None] * len(d.layers)
        for i, mine in enumerate(which):
            if not mine:
                continue
            for tensors in (keys, values):
                old, tensors[i] = tensors[i], torch.zeros(shape, dtype=d.kv_dtype, device=d.device)
                kept = min(blocks, old.shape[0]) if same and old is not None else 0
                if kept:
                    tensors[i][:kept] = old[:kept]
        self.keys, self.values = keys, values
        if any(t is None for t in keys):
            return
        # read from the new tensors once here (a token's event asks for a block's bytes, 60 tensors
        # each time: 0.5 ms of a 16-row step)
        windowed = [layer.window is not None for layer in d.layers]
        self._window_block_nbytes = sum(t.element_size() * t.stride(0)
                                        for t, w in zip(keys + values, windowed + windowed) if w)
        self._block_nbytes = sum(t.element_size() * t.stride(0) for t in keys + values)
        self._full_block_nbytes = self._block_nbytes - self._window_block_nbytes
        """A block's bytes in the full layers (the KV manager's block, less its window part)."""
        self._storage_nbytes = sum(t.untyped_storage().nbytes() for t in keys + values)

    @torch.inference_mode()
    def _window_block(self) -> int:
        """A free block of the window pool, grown by a chunk where none is left."""
        if not self.window_free:
            grown = self.window_blocks + GROW_BLOCKS
            self._store([layer.window is not None for layer in self.d.layers], grown, self.keys[0].shape[2], True)
            self.window_free = list(range(grown - 1, self.window_blocks - 1, -1))
            self.window_blocks = grown
        return self.window_free.pop()

    @torch.inference_mode()
    def copy_block(self, source: int, target: int) -> None:
        """A KV manager block copied (copy on write), its window part too (into a new block of the
        window pool, read by nobody yet: the sequence that asked takes it in :meth:`crop`)."""
        part = self.window_of.get(source)
        fresh = None if part is None else self._window_block()
        for layer, keys, values in zip(self.d.layers, self.keys, self.values):
            if not layer.window:
                keys[target], values[target] = keys[source], values[source]
            elif fresh is not None:
                keys[fresh], values[fresh] = keys[part], values[part]
        if fresh is not None:
            self.window_of[target], self.readers[target] = fresh, 0

    def forget_block(self, block: int) -> None:
        """The KV manager's cache dropped ``block``: its window part goes back if nobody reads it."""
        if self.readers.get(block, 0) == 0:
            self._drop_part(block)

    def _drop_part(self, block: int) -> None:
        part = self.window_of.pop(block, None)
        self.readers.pop(block, None)
        if part is not None:
            self.window_free.append(part)

    def lacks_window(self, block: int) -> bool:
        """Whether ``block`` has no window part (it went back before the block was cached)."""
        return bool(self.window) and block not in self.window_of

    def sliding_tokens(self) -> int | None:
        """The most tokens before a position a sliding-window layer reads (``None``: no such layer)."""
        return self.window - 1 if self.window else None

    def block_nbytes(self) -> int:
        """One block's keys and values over every layer (the window pool's part included: what a
        block costs until the windows move past it), read from the storage's tensors (when they
        were made: they change only then)."""
        return self._block_nbytes

    def held_nbytes(self) -> int:
        """Bytes of the blocks the running sequences hold: the KV manager's (a shared one once),
        their window parts only where a sequence reads them."""
        if not self.window:
            return self.kv.block_bytes(self.kv.used_blocks) or 0
        return self.kv.used_blocks * self._full_block_nbytes + self._parts_read * self._window_block_nbytes

    def kept_nbytes(self) -> int:
        """Bytes of the cached blocks no sequence holds, with the window parts kept for them."""
        if not self.window:
            return self.kv.block_bytes(self.kv.kept_blocks) or 0
        parked = len(self.readers) - self._parts_read
        return self.kv.kept_blocks * self._full_block_nbytes + parked * self._window_block_nbytes

    def storage_nbytes(self) -> int:
        """The storage's bytes, read from its tensors' storages (when they were made)."""
        return self._storage_nbytes

    @property
    def per_token_bytes(self) -> int:
        """A token's keys and values over every layer: a block's bytes, read from the storage, over
        its tokens (the config's formula, engine/base/kv.py, is the prediction it is checked against)."""
        return self._block_nbytes // self.keys[0].shape[2]

    def _rotary(self, tokens: int) -> None:
        """Rotary tables for positions up to ``tokens`` (doubling)."""
        if tokens > self.rotary:
            self.rotary = _bucket(tokens)
            self.cos, self.sin = _rotary_tables(self.d, self.rotary)

    # -- sequences ------------------------------------------------------------------------
    def add(self, seq: int, tokens: int = 1, hoped: int = 0) -> None:
        """``seq`` starts with no tokens (its blocks are the manager's: taken as it grows)."""
        self.lengths[seq] = 0
        self._stop_reading(seq)  # a preempted sequence starts again
        self._rotary(max(tokens, 1))

    def found(self, seq: int, tokens: int) -> None:
        """``seq``'s table begins with ``tokens`` tokens found in the prefix cache: read in place
        (their window parts from its window's start on: the KV manager's hit ends where they are whole)."""
        self.lengths[seq] = tokens
        if self.window:
            table = self.kv.tables[seq][:tokens // self.kv.block_tokens]  # (the blocks held after them are new)
            start = max(0, tokens - self.window + 1 - self.margin()) // self.kv.block_tokens
            while start < len(table) and any(block not in self.window_of for block in table[start:]):
                start += 1  # only before the window (a hit is trimmed to whole windows)
            for block in table[start:]:
                self._read(block)
            self.reading[seq] = (start, list(table[start:]))

    def remove(self, seq: int) -> None:
        del self.lengths[seq]
        self.kv.release(seq)  # where the core's scheduler released it first, nothing is left
        self._stop_reading(seq)

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def __len__(self) -> int:
        """Sequences holding blocks."""
        return len(self.lengths)

    def kv_bytes(self, seq: int) -> int:
        """Bytes of the blocks ``seq`` holds (its last one maybe partly filled, shared ones included;
        their window parts only while it reads them)."""
        if not self.window:
            return self.kv.table_bytes(seq)
        return (len(self.kv.tables.get(seq, ())) * self._full_block_nbytes
                + len(self.reading.get(seq, (0, []))[1]) * self._window_block_nbytes)

    def _room(self, seq: int, tokens: int) -> None:
        if not self.kv.hold(seq, tokens):
            raise RuntimeError(f"no KV block is left for {tokens} tokens (the scheduler holds them before a step)")
        self._rotary(tokens)
        if self.window:
            self._slide(seq)

    def _slide(self, seq: int) -> None:
        """``seq`` reads the window parts of its table's blocks from its next token's window on
        (less :attr:`margin`): a new block gets a window part, and those before the window are let go."""
        table = self.kv.tables[seq]
        start, blocks = self.reading.get(seq, (0, []))
        for block in table[start + len(blocks):]:
            if block not in self.window_of:
                self.window_of[block], self.readers[block] = self._window_block(), 0
            self._read(block)
            blocks.append(block)
        past = max(0, self.lengths[seq] - self.window + 1 - self.margin()) // self.kv.block_tokens
        while start < past and blocks:
            self._let_go(blocks.pop(0))
            start += 1
        self.reading[seq] = (start, blocks)

    def _let_go(self, block: int) -> None:
        """One sequence fewer reads ``block``'s window part: at none it goes back to the window pool,
        unless the block is cached (it stays with it, for a hit that ends there)."""
        self.readers[block] -= 1
        if self.readers[block] == 0:
            self._parts_read -= 1
            if self.kv.pool.key_of[block] is None:
                self._drop_part(block)

    def _read(self, block: int) -> None:
        """One sequence more reads ``block``'s window part."""
        self.readers[block] += 1
        if self.readers[block] == 1:
            self._parts_read += 1

    def margin(self) -> int:
        """Positions kept before a window's start: while guesses are verified (:attr:`rollback`) a
        sequence is rolled back this far at most, and its window must still be whole."""
        return MAX_DRAFT_TOKENS if self.rollback else 0

    def _stop_reading(self, seq: int) -> None:
        for block in self.reading.pop(seq, (0, []))[1]:
            self._let_go(block)

    def _table(self, seq: int) -> list[int]:
        """The blocks a step reads for ``seq``: its KV manager table, then their window parts
        (:data:`GIVEN_BACK` before its window, never read)."""
        table = self.kv.tables[seq]
        if not self.window:
            return table
        start, blocks = self.reading[seq]
        return table + [GIVEN_BACK] * start + [self.window_of[block] for block in blocks]

    def prefill(self, seq: int, ids: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Put ``ids`` ([1, n]) into ``seq``'s blocks; the logits after the last of them ([vocab]),
        or after each of the last ``rows`` ([rows, vocab]).

        A few tokens after the first that all want their scores (speculation's last token and its
        guesses) are one batched decode step's rows, one sequence's consecutive positions through
        the same blocks: the compiled step where it is ready (each row writes its key and value
        before any row attends, and attends up to its own position, so the rows see each other
        as a prompt chunk's tokens do). The chunk's pass runs otherwise."""
        start, count = self.lengths[seq], ids.shape[1]
        self._room(seq, start + count)
        d = self.d
        if (rows == count and 1 < count <= MAX_DRAFT_TOKENS + 1 and start and not self.batch_invariant
                and d.compiled_rows is not None and self._compiled_ready()):
            positions, table = self._step_inputs([seq] * count, ids[0].tolist(), consecutive=True)[1:]
            logits = d.compiled_rows(d, self.keys, self.values, self.cos, self.sin, ids.view(count, 1), positions,
                                     table)
        else:
            table = torch.tensor(self._table(seq), dtype=torch.long, device=d.device)
            logits = _forward(d, self.keys, self.values, table, self.cos, self.sin, ids, start, rows,
                              in_place=self.batch_invariant)
        self.lengths[seq] = start + count
        if self.window:
            self._slide(seq)
        return logits

    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``seqs`` in one step; logits [len(seqs), vocab] in the order given."""
        for seq in seqs:
            self._room(seq, self.lengths[seq] + 1)
        ids, positions, table = self._step_inputs(seqs, tokens)
        d = self.d
        compiled = self._compiled_ready()
        if self.batch_invariant:
            if d.rows_attention:
                logits = _decode_rows(d, self.keys, self.values, self.cos, self.sin, ids, positions, table)
            else:  # no kernels: each sequence's own pass
                logits = torch.stack([_forward(d, self.keys, self.values, table[row], self.cos, self.sin,
                                               ids[row:row + 1], int(positions[row])) for row in range(len(seqs))])
        elif len(seqs) == 1:  # one sequence: the single-sequence step (compiled when ready)
            if compiled and d.compiled is not None:
                logits = d.compiled(d, self.keys, self.values, self.cos, self.sin, ids, positions, table).unsqueeze(0)
            else:  # eager: the prompt's pass, one token long (through the block table, as a chunk's token)
                position = self.lengths[seqs[0]]
                logits = _forward(d, self.keys, self.values, table[0], self.cos, self.sin, ids, position).unsqueeze(0)
        elif compiled and d.compiled_rows is not None:  # the compiled batched step
            logits = d.compiled_rows(d, self.keys, self.values, self.cos, self.sin, ids, positions, table)
        elif d.rows_attention:  # the same step, eager, while it is built (or where it can't be)
            logits = _decode_rows(d, self.keys, self.values, self.cos, self.sin, ids, positions, table)
        else:  # no kernels: attention over a copy of each row's blocks, per group of similar lengths
            logits = _decode_batch(d, self.keys, self.values, self.cos, self.sin, ids, positions, table)
        for seq in seqs:
            self.lengths[seq] += 1
            if self.window:
                self._slide(seq)
        return logits

    def _compiled_ready(self) -> bool:
        """Whether the compiled steps run: built for this many threads (the count adapts to the
        machine's load) and for the rotary tables' size."""
        return torch.get_num_threads() == self.d.compiled_threads and self.rotary <= MAX_COMPILED_CAPACITY

    def _step_inputs(self, seqs: list[int], tokens: list[int], consecutive: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's token ids [B, 1], positions [B] and block tables [B, W] (the widest row's
        blocks; a shorter row's table is padded with its own first block, never read): numpy-backed
        tensors kept per batch size and width and filled in place (three new tensors a step
        cost more than the copy), copied to the device where the model isn't on the CPU. ``consecutive``: the rows
        are one sequence's next positions (a row after its length's), not each its own."""
        tables = [self._table(seq) for seq in seqs]
        width = max(len(t) for t in tables)
        kept = self._inputs.get((len(seqs), width))
        if kept is None:
            if len(self._inputs) >= 64:  # a long-running server meets many (batch, width) pairs: keep few
                self._inputs.clear()
            arrays = (np.zeros((len(seqs), 1), dtype=np.int64), np.zeros(len(seqs), dtype=np.int64),
                      np.zeros((len(seqs), width), dtype=np.int64))
            kept = self._inputs[len(seqs), width] = (arrays, tuple(torch.from_numpy(a) for a in arrays))
        (ids, positions, table), tensors = kept
        for row, (seq, blocks) in enumerate(zip(seqs, tables)):
            if self.window:  # the full layers' half and the window layers' half, each padded
                half, own = width // 2, len(blocks) // 2
                table[row, :own] = blocks[:own]
                table[row, own:half] = blocks[0]
                table[row, half:half + own] = blocks[own:]
                table[row, half + own:] = blocks[own]
            else:
                table[row, :len(blocks)] = blocks
                table[row, len(blocks):] = blocks[0]
            positions[row] = self.lengths[seq] + (row if consecutive else 0)
        ids[:, 0] = tokens
        if self.d.device.type != "cpu":
            return tuple(t.to(self.d.device) for t in tensors)
        return tensors

    def prefix_cache_reason(self) -> str | None:
        return None

    def crop(self, seq: int, length: int) -> None:
        """Forget ``seq``'s tokens after the first ``length`` (speculation rolls back); the blocks
        it will write again are its own (the engine core asks the manager first: copy on write; a
        copied block's window part is read from its copy now)."""
        self.lengths[seq] = min(self.lengths[seq], length)
        if self.window and seq in self.reading:
            start, blocks = self.reading[seq]
            for i, block in enumerate(self.kv.tables[seq][start:start + len(blocks)]):
                if block != blocks[i]:
                    self._read(block)
                    self._let_go(blocks[i])
                    blocks[i] = block
