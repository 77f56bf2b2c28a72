"""Batch-invariant arithmetic: a request's answer the same alone and in any batch (vLLM's
``--batch-invariant``).

A matrix product's kernel is picked by its shape: one row (a request alone) may take a
vector-dot path, sixteen an AMX or blocked path, and they round differently; a prompt read in
other chunks (a server's token budget cuts them) has its attention blocked otherwise. So in bf16
a greedy answer can part from its solo answer once another request joins the batch (fp32 and the
int8 kernels round alike for any rows). Under :func:`fixed_row_products` every ``linear`` is
computed sixteen rows at a time, the last tile padded with zeros: every row goes through the
same kernel with the same shape, whatever the batch. The engine core reads prompts in chunks
aligned to :data:`PROMPT_CHUNK`, and the runners do the rest: each row attends over its own keys
(the fast path's ``attend_paged`` for every batch size, the reference runner one forward per
request), never over a batch padded to its longest row.

The price is measured by benchmarks/batch_invariant.py: a lone request's products computed for
sixteen rows, the compiled steps left out, and on the reference precisions no batched forward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.models.model import LoadedModel

ROW_TILE = 16
"""Rows every product is computed in (an AMX tile's height)."""
PROMPT_CHUNK = 64
"""Prompts are read in chunks that end at multiples of this many tokens (and a prefix found in the
cache is used up to such a multiple), alone or beside others: a chunk's attention rounds by its
shape, so a prompt read in other chunks (a server's token budget cuts them) answers otherwise."""


def fixed_row_products():
    """A context under which ``torch.nn.functional.linear`` runs on tiles of :data:`ROW_TILE` rows."""
    return _mode()()


@functools.cache
def _mode():
    """The mode's class, made on first use (the window starts before torch is imported)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class FixedRowProducts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not torch.nn.functional.linear:
                return func(*args, **kwargs)
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.reshape(-1, x.shape[-1])
            count = rows.shape[0]
            if count % ROW_TILE:
                rows = torch.cat([rows, rows.new_zeros(ROW_TILE - count % ROW_TILE, rows.shape[1])])
            out = torch.cat([func(rows[i:i + ROW_TILE], weight, bias) for i in range(0, rows.shape[0], ROW_TILE)])
            return out[:count].reshape(*x.shape[:-1], out.shape[-1])

    return FixedRowProducts


SAME_IN_A_BATCH = ("fp32", "fp32-fast", "int8-fast", "int4-fast")
"""Precisions whose greedy answers are the same alone and in a batch without batch-invariant
arithmetic (the engine's tests check each: fp32's products and the int8 kernels round alike for
any rows)."""


def answers_note(loaded: "LoadedModel") -> str:
    """Whether ``loaded``'s answers are the same alone and in a batch, in a line."""
    precision = loaded.info.precision
    if loaded.batch_invariant:
        return ("Answers: each the same alone and in any batch (batch-invariant: products in fixed tiles of "
                f"{ROW_TILE} rows, eager steps, prompts in chunks aligned to {PROMPT_CHUNK} tokens).")
    if precision in SAME_IN_A_BATCH:
        return f"Answers: each the same alone and in a batch at {precision}."
    return (f"Answers: at {precision} an answer can differ alone and in a batch (the products round by the "
            "batch's shape); batch-invariant makes them the same, at a price.")
