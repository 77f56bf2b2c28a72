"""KV cache: the bytes a cache holds (measured) and the bytes the config predicts.

Per layer and token the cache keeps one key and one value vector per KV head:
``2 × kv_heads × head_dim × element_bytes``. Full-attention layers keep every token.
Sliding-window layers keep at most ``window − 1`` tokens: transformers' dynamic
sliding cache stores the last W−1 keys and attends to them plus the new token's,
which makes a window of W.
"""

from __future__ import annotations

from dataclasses import dataclass

_FULL = ("full_attention",)
_SLIDING = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How a model's cache grows, read from its config."""

    num_layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]
    """Per layer: ``None`` for full attention, else the sliding window W."""

    def bytes_per_token_per_layer(self, element_bytes: float) -> int:
        return round(2 * self.kv_heads * self.head_dim * element_bytes)

    def bytes_per_token(self, element_bytes: float) -> int:
        """Bytes one more token costs while no sliding window has filled."""
        return self.num_layers * self.bytes_per_token_per_layer(element_bytes)

    def tokens_held(self, tokens: int) -> int:
        """Token slots held over all layers after ``tokens`` tokens went through."""
        full = self.windows.count(None)
        if full == len(self.windows):  # no sliding window, the common case (asked per token of a step)
            return tokens * full
        return sum(tokens if w is None else min(tokens, w - 1) for w in self.windows)

    def bytes_for(self, tokens: int, element_bytes: float, batch: int = 1) -> int:
        return batch * self.tokens_held(tokens) * self.bytes_per_token_per_layer(element_bytes)


def kv_layout(config) -> KVLayout | None:
    """The cache layout of a transformers config, or ``None`` when we can't predict it
    (state-space layers, compressed latent attention, KV shared across layers…)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None) or getattr(text, "kv_sharing_modes", None):
        return None
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not layers or not heads:  # state-space models (Mamba…) have no attention heads
        return None
    layers, heads = int(layers), int(heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden else None)
    if not head_dim:
        return None
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    if types is None:
        if window is not None:
            types = ["sliding_attention"] * layers
        elif chunk is not None:
            types = ["chunked_attention"] * layers
        else:
            types = ["full_attention"] * layers
    windows: list[int | None] = []
    for kind in types:
        if kind in _FULL:
            windows.append(None)
        elif kind == "sliding_attention" and window:
            windows.append(int(window))
        elif kind == "chunked_attention" and chunk:
            windows.append(int(chunk))
        else:
            return None
    if len(windows) != layers:
        return None
    return KVLayout(num_layers=layers, kv_heads=int(kv_heads), head_dim=int(head_dim), windows=tuple(windows))


def cache_bytes(cache) -> int:
    """Bytes of the key/value tensors a transformers ``Cache`` holds right now."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.nbytes
    return total
