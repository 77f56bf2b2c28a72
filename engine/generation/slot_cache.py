"""The fast path's KV cache for the engine core (its fast runner): a slot per running sequence in
one static tensor per layer, run by the lean decoder (engine/models/fast.py)."""

from __future__ import annotations

import numpy as np
import torch

from engine.models.fast import (MAX_COMPILED_CAPACITY, MIN_CAPACITY, FastDecoder, _bucket, _decode_batch, _decode_rows,
                                _forward, _rotary_tables)

RESERVE_BYTES = 256 << 20
"""How much cache a batch may hold ahead of need. Every slot shares one capacity, so a batch's
request gets room for its whole answer at admission only while all slots at that capacity stay
under this (otherwise the cache doubles as it fills), and when more slots would pass it, room
held ahead goes. Growing mid-answer stalls one step for every row: at 16 rows of int8-fast near
position 64, a ~10 ms step became ~20 ms (47 MB of fresh, zeroed memory and the copy into it)."""


class SlotCache:
    """The fast path's KV cache for many sequences at once (the engine core's fast runner): one
    static tensor per layer, [slots, KV heads, capacity, head dim]. Running sequences occupy the
    first slots, so a batched decode step reads plain views; a sequence that leaves hands its
    slot to the last one (one copy of that sequence's tokens) before the next step, and none
    when the slots after it left too. Capacity and slot count grow by doubling when outgrown."""

    rollback = False
    """Set while a proposer runs (speculation); nothing changes here: :meth:`crop` always works."""

    def __init__(self, d: FastDecoder, slots: int = 4, capacity: int = MIN_CAPACITY) -> None:
        self.d = d
        self.slot_of: dict[int, int] = {}
        self.lengths: list[int] = []
        self._left: set[int] = set()  # slots whose sequences left since the last step (see _pack)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0
        self._views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._inputs: dict[int, tuple[np.ndarray, torch.Tensor, np.ndarray, torch.Tensor]] = {}
        self._resize(slots, _bucket(capacity))

    @torch.inference_mode()  # every cache tensor an inference tensor, wherever it grows
    def _resize(self, slots: int, capacity: int) -> None:
        d = self.d
        shape = (slots, d.kv_heads, capacity, d.head_dim)
        keys = [torch.zeros(shape, dtype=d.kv_dtype, device=d.device) for _ in d.layers]
        values = [torch.zeros(shape, dtype=d.kv_dtype, device=d.device) for _ in d.layers]
        used, longest = min(len(self.lengths), self.slots), max(self.lengths, default=0)
        for old, new in zip(self.keys + self.values, keys + values):
            new[:used, :, :longest] = old[:used, :, :longest]
        self.keys, self.values = keys, values
        self._views.clear()
        if capacity != self.capacity:
            self.cos, self.sin = _rotary_tables(d, capacity)
        self.slots, self.capacity = slots, capacity

    def _slots_for(self, sequences: int) -> int:
        """The slots the cache grows to for ``sequences`` (doubling)."""
        slots = self.slots
        while slots < sequences:
            slots *= 2
        return slots

    def _room(self, tokens: int) -> None:
        """Room for every running sequence, and for ``tokens`` tokens in a slot. When the slots
        grow past :data:`RESERVE_BYTES`, room held ahead of need (:meth:`add`'s ``hoped``) goes."""
        slots = self._slots_for(len(self.lengths))
        capacity = self.capacity if tokens <= self.capacity else _bucket(tokens)
        if slots != self.slots and not self._within_reserve(slots, capacity):
            capacity = min(capacity, _bucket(max(max(self.lengths, default=0) + 1, tokens)))
        if (slots, capacity) != (self.slots, self.capacity):
            self._resize(slots, capacity)

    def _within_reserve(self, slots: int, capacity: int) -> bool:
        """Whether a cache of ``slots`` × ``capacity`` stays within :data:`RESERVE_BYTES`."""
        return slots * capacity * self.per_token_bytes <= RESERVE_BYTES

    @property
    def per_token_bytes(self) -> int:
        return 2 * len(self.d.layers) * self.d.kv_heads * self.d.head_dim * self.keys[0].element_size()

    def add(self, seq: int, tokens: int = 1, hoped: int = 0) -> None:
        """A slot for ``seq``, with room for ``tokens``, and for ``hoped`` (its whole answer) where
        that keeps the cache within :data:`RESERVE_BYTES` and the steps' attention reads each row
        only up to its position (the kernels'; else a single sequence's step attends over the whole
        capacity, so room would cost time); past that it grows as it fills."""
        self._pack()
        self.slot_of[seq] = len(self.lengths)
        self.lengths.append(0)
        tokens, hoped = min(max(tokens, 1), 1 << 16), min(hoped, 1 << 16)
        slots = self._slots_for(len(self.lengths))
        if hoped > tokens and self.d.rows_attention and self._within_reserve(slots, _bucket(hoped)):
            tokens = hoped
        self._room(tokens)

    def remove(self, seq: int) -> None:
        """Free ``seq``'s slot (packed before the next :meth:`add` or :meth:`decode`: see :meth:`_pack`)."""
        self._left.add(self.slot_of.pop(seq))

    @torch.inference_mode()
    def _pack(self) -> None:
        """Running sequences back into the first slots: a slot left free at the end just goes; one
        below a running sequence takes the last running one (one copy of its tokens). So when a
        batch ends together nothing is copied (16 copies, one per sequence, had taken ~5 ms of the
        last step of a 16-row int8-fast batch near position 100)."""
        if not self._left:
            return
        holder = {slot: seq for seq, slot in self.slot_of.items()}
        while self._left:
            last = len(self.lengths) - 1
            if last in self._left:
                self._left.discard(last)
            else:
                hole = min(self._left)
                length = self.lengths[last]
                for tensor in self.keys + self.values:
                    tensor[hole, :, :length] = tensor[last, :, :length]
                self.slot_of[holder[last]], self.lengths[hole] = hole, length
                self._left.discard(hole)
            self.lengths.pop()

    def length(self, seq: int) -> int:
        return self.lengths[self.slot_of[seq]]

    def __len__(self) -> int:
        """Sequences holding a slot."""
        return len(self.slot_of)

    def kv_bytes(self, seq: int) -> int:
        return self.per_token_bytes * self.length(seq)

    def prefill(self, seq: int, ids: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Put ``ids`` ([1, n]) into ``seq``'s cache; the logits after the last of them ([vocab]),
        or after each of the last ``rows`` ([rows, vocab])."""
        start = self.length(seq)
        self._room(start + ids.shape[1])
        slot = self.slot_of[seq]
        mine = slice(slot, slot + 1)
        logits = _forward(self.d, [k[mine] for k in self.keys], [v[mine] for v in self.values], self.cos, self.sin,
                          ids, start, rows)
        self.lengths[slot] = start + ids.shape[1]
        return logits

    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``seqs`` (all running ones or a prefix of the slots), in one
        step; logits [len(seqs), vocab] in the order given."""
        self._pack()
        order = sorted(range(len(seqs)), key=lambda i: self.slot_of[seqs[i]])
        slots = [self.slot_of[seqs[i]] for i in order]
        batch = slots[-1] + 1  # the first ``batch`` slots: a view, no gather (a row not decoding
        # writes a throwaway entry at its next free position, which its own next write replaces)
        self._room(max(self.lengths[:batch]) + 1)
        ids, positions = self._step_inputs(batch, order, slots, tokens)
        keys, values = self._batch_views(batch)
        d = self.d
        compiled = (torch.get_num_threads() == d.compiled_threads and self.capacity <= MAX_COMPILED_CAPACITY)
        if batch == 1:  # one sequence: the single-sequence step (compiled when ready), no mask over idle slots
            if compiled and d.compiled is not None:
                logits = d.compiled(d, keys, values, self.cos, self.sin, ids, positions).unsqueeze(0)
            else:
                logits = _forward(d, keys, values, self.cos, self.sin, ids, int(positions[0])).unsqueeze(0)
        elif compiled and d.compiled_rows is not None:  # the compiled batched step
            logits = d.compiled_rows(d, keys, values, self.cos, self.sin, ids, positions)
        elif d.rows_attention:  # the same step, eager, while it is built (or where it can't be)
            logits = _decode_rows(d, keys, values, self.cos, self.sin, ids, positions)
        else:  # no kernels: attention per group of rows of a similar length
            logits = _decode_batch(d, keys, values, self.cos, self.sin, ids, positions)
        for slot in slots:
            self.lengths[slot] += 1
        if slots == list(range(batch)) and order == list(range(batch)):
            return logits  # every row decoded, in slot order: no reordering copy
        out = torch.empty((len(seqs), logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        for i, slot in zip(order, slots):
            out[i] = logits[slot]
        return out

    def _batch_views(self, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's keys and values of the first ``batch`` slots: views made once per
        batch size and cache (a step right after the model's weights streamed through the CPU's
        caches made 60 fresh views in ~0.13 ms of a ~10 ms step)."""
        views = self._views.get(batch)
        if views is None:
            rows = slice(0, batch)
            views = self._views[batch] = ([k[rows] for k in self.keys], [v[rows] for v in self.values])
        return views

    def _step_inputs(self, batch: int, order: list[int], slots: list[int],
                     tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's token ids [batch, 1] and positions [batch]: numpy-backed tensors kept per
        batch size and filled in place (two new tensors per step took ~60 µs), copied to the
        device where the model isn't on the CPU. A slot not decoding gets token 0 at its next
        free position (see :meth:`decode`)."""
        kept = self._inputs.get(batch)
        if kept is None:
            ids, positions = np.zeros((batch, 1), dtype=np.int64), np.zeros(batch, dtype=np.int64)
            kept = self._inputs[batch] = (ids, torch.from_numpy(ids), positions, torch.from_numpy(positions))
        ids, ids_tensor, positions, positions_tensor = kept
        ids[:, 0] = 0
        for i, slot in zip(order, slots):
            ids[slot, 0] = tokens[i]
        positions[:] = self.lengths[:batch]
        if self.d.device.type != "cpu":
            return ids_tensor.to(self.d.device), positions_tensor.to(self.d.device)
        return ids_tensor, positions_tensor

    def prefix_cache_reason(self) -> str | None:
        return None

    def block_kv(self, seq: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of ``seq``'s keys and values of tokens ``start…end``: [layers, KV heads, n, dim] each."""
        slot = self.slot_of[seq]
        return (torch.stack([k[slot, :, start:end] for k in self.keys]),
                torch.stack([v[slot, :, start:end] for v in self.values]))

    @torch.inference_mode()
    def load_kv(self, seq: int, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``blocks`` (from :meth:`block_kv`, in order) at the start of ``seq``'s empty slot."""
        keys = torch.cat([k for k, _ in blocks], dim=2)
        values = torch.cat([v for _, v in blocks], dim=2)
        length = keys.shape[2]
        self._room(length + 1)
        slot = self.slot_of[seq]
        for index, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slot, :, :length] = keys[index]
            v[slot, :, :length] = values[index]
        self.lengths[slot] = length

    def crop(self, seq: int, length: int) -> None:
        """Forget ``seq``'s tokens after the first ``length`` (speculation rolls back)."""
        slot = self.slot_of[seq]
        self.lengths[slot] = min(self.lengths[slot], length)
