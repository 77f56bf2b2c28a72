"""What runs the engine core's forward passes: the reference runner (transformers' own forward,
one DynamicCache per request, every architecture) or the fast path's slot cache (engine/fast.py,
one batched decode step). Both hold a cache per request (``add``/``remove``), read prompt chunks
(``prefill``, which can return the scores after each of its last tokens: speculation verifies
with it), decode one token for several requests (``decode``), report each request's KV bytes
and roll a request back (``crop``, for speculation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv import cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.model import LoadedModel


class ReferenceBatchRunner:
    """The engine core's reference runner: transformers' forward with one DynamicCache per
    sequence. A decode step runs the sequences one after another, so each sees exactly what it
    would alone (every architecture, sliding windows included), without batching's speed-up;
    the fast runner (engine/fast.py ``SlotCache``) runs them in one forward pass.

    ``rollback``: the caches keep what a sliding-window layer would drop until :meth:`crop`
    says how much of it stays (speculation rolls rejected guesses back)."""

    def __init__(self, model, supports_logits_to_keep: bool = True, rollback: bool = False) -> None:
        self.model = model
        self.keeps_logits = supports_logits_to_keep
        self.rollback = rollback
        self.caches: dict[int, object] = {}
        self.lengths: dict[int, int] = {}

    def add(self, seq: int, tokens: int = 0) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if self.rollback:
            cache.activate_past_recording()
        self.caches[seq], self.lengths[seq] = cache, 0

    def remove(self, seq: int) -> None:
        del self.caches[seq], self.lengths[seq]

    def prefill(self, seq: int, ids: "torch.Tensor", rows: int = 1) -> "torch.Tensor":
        """Put ``ids`` ([1, n]) into ``seq``'s cache; the scores after the last of them
        ([vocab]), or after each of the last ``rows`` ([rows, vocab])."""
        keep = {"logits_to_keep": rows} if self.keeps_logits else {}
        logits = self.model(input_ids=ids, cache=self.caches[seq], use_cache=True, **keep).logits[0]
        self.lengths[seq] += ids.shape[1]
        return logits[-1] if rows == 1 else logits[-rows:]

    def decode(self, seqs: list[int], tokens: list[int]) -> "torch.Tensor":
        import torch

        device = self.model.device
        rows = [self.prefill(seq, torch.tensor([[token]], device=device)) for seq, token in zip(seqs, tokens)]
        return torch.stack(rows)

    def kv_bytes(self, seq: int) -> int:
        return cache_bytes(self.caches[seq])

    def length(self, seq: int) -> int:
        """Tokens ``seq`` has been given (a sliding-window layer may hold fewer)."""
        return self.lengths[seq]

    def __len__(self) -> int:
        """Sequences holding a cache."""
        return len(self.caches)

    def crop(self, seq: int, length: int) -> None:
        """Forget ``seq``'s tokens after the first ``length``; sliding-window layers trim back to
        their window (so this is called even when nothing is forgotten)."""
        self.caches[seq].crop(-(self.lengths[seq] - length))
        self.lengths[seq] = min(self.lengths[seq], length)


def batch_runner_for(loaded: "LoadedModel", rollback: bool = False):
    """The engine core's runner for ``loaded``: the fast path's slot cache, or the reference runner."""
    if loaded.fast is not None:
        from engine.fast import SlotCache

        return SlotCache(loaded.fast)
    return ReferenceBatchRunner(loaded.model, loaded.supports_logits_to_keep, rollback)
