"""What runs the engine core's forward passes: the reference runner (transformers' own forward,
one DynamicCache per request, every architecture) or the fast path's slot cache (engine/fast.py,
one batched decode step). Both hold a cache per request (``add``/``remove``), read prompt chunks
(``prefill``), decode one token for several requests (``decode``), report each request's KV
bytes and roll a request back (``crop``, for speculation)."""

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
    the fast runner (engine/fast.py ``SlotCache``) runs them in one forward pass."""

    def __init__(self, loaded: "LoadedModel") -> None:
        self.model = loaded.model
        self.keep = {"logits_to_keep": 1} if loaded.supports_logits_to_keep else {}
        self.caches: dict[int, object] = {}

    def add(self, seq: int, tokens: int = 0) -> None:
        from transformers import DynamicCache

        self.caches[seq] = DynamicCache(config=self.model.config)

    def remove(self, seq: int) -> None:
        del self.caches[seq]

    def prefill(self, seq: int, ids: "torch.Tensor") -> "torch.Tensor":
        return self.model(input_ids=ids, cache=self.caches[seq], use_cache=True, **self.keep).logits[0, -1]

    def decode(self, seqs: list[int], tokens: list[int]) -> "torch.Tensor":
        import torch

        device = self.model.device
        rows = [self.prefill(seq, torch.tensor([[token]], device=device)) for seq, token in zip(seqs, tokens)]
        return torch.stack(rows)

    def kv_bytes(self, seq: int) -> int:
        return cache_bytes(self.caches[seq])

    def __len__(self) -> int:
        """Sequences holding a cache."""
        return len(self.caches)

    def crop(self, seq: int, length: int) -> None:
        self.caches[seq].crop(length)


def batch_runner_for(loaded: "LoadedModel"):
    """The engine core's runner for ``loaded``: the fast path's slot cache, or the reference runner."""
    if loaded.fast is not None:
        from engine.fast import SlotCache

        return SlotCache(loaded.fast)
    return ReferenceBatchRunner(loaded)
