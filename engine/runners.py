"""What runs the forward passes of a generation: the reference runner (transformers' own forward
over a DynamicCache, every architecture) or the fast path's static-cache decoder (engine/fast.py).
Both take token ids and return the logits after the last one, and report the KV bytes they hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv import cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.model import LoadedModel


def runner_for(loaded: "LoadedModel", capacity: int):
    """The runner of one generation of up to ``capacity`` tokens on ``loaded``."""
    if loaded.fast is not None:
        return loaded.fast.runner(capacity)
    return ReferenceRunner(loaded)


class ReferenceRunner:
    """transformers' own forward over a DynamicCache: one decode step of the reference path."""

    def __init__(self, loaded: "LoadedModel") -> None:
        from transformers import DynamicCache

        self.model = loaded.model
        self.cache = DynamicCache(config=loaded.model.config)
        self.keep = {"logits_to_keep": 1} if loaded.supports_logits_to_keep else {}

    def forward(self, ids: "torch.Tensor") -> "torch.Tensor":
        """Logits after the last of ``ids`` (shape [1, n]), which join the cache."""
        return self.model(input_ids=ids, cache=self.cache, use_cache=True, **self.keep).logits[0, -1]

    def kv_bytes(self) -> int:
        return cache_bytes(self.cache)
