"""The fast path: a lean decoder for Llama-family models over a preallocated KV cache.

transformers' forward is general: per layer it builds masks, dispatches attention backends,
concatenates a growing cache and checks options, and on two CPU cores that bookkeeping is a
large share of a small model's decode step. For the architectures it knows (Llama, Qwen2,
Mistral without a window in play) this path runs the same modules' weights with only the
arithmetic: norms, projections (optionally weight-only int8/int4, engine/quantize.py),
rotary embedding, attention over a static cache written in place, the MLP, the head.

It emits exactly the events of the reference path (engine/generate.py drives both through a
runner); fp32 and bf16 give the reference path's greedy tokens (tested). Everything it can't
run goes back to the reference path (the load says so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from engine.loading import LoadedModel

SUPPORTED = ("llama", "qwen2", "mistral")
MIN_CAPACITY = 256


def unsupported_reason(model) -> str | None:
    """Why this model can't take the fast path, or ``None`` if it can."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"the fast path runs {', '.join(SUPPORTED)} models, not {config.model_type}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            and config.model_type == "mistral":
        return "sliding-window attention is not on the fast path"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "its layers are not laid out as the fast path expects"
    return None


class _Layer:
    """One decoder layer's pieces, with q/k/v and gate/up fused where the scheme allows."""

    def __init__(self, layer) -> None:
        from engine.quantize import fuse_rows

        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps = float(getattr(self.norm1, "variance_epsilon", getattr(self.norm1, "eps", 1e-6)))
        self.qkv = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = attn.o_proj
        self.scaling = attn.scaling
        self.gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = mlp.act_fn
        self.intermediate = mlp.gate_proj.out_features


class FastDecoder:
    """Holds the model's modules (fusing some of them in place); makes one
    :class:`FastRunner` per generation."""

    def __init__(self, model) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        base = model.model
        config = model.config
        self.embed = base.embed_tokens
        self.layers = [_Layer(layer) for layer in base.layers]
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device

    def runner(self, capacity: int) -> "FastRunner":
        return FastRunner(self, capacity)


def _rms(x: torch.Tensor, norm, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm (in fp32, back to the input's dtype, times the weight) as one op."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class FastRunner:
    """One generation: a static KV cache (grown by doubling if the answer outruns it) and the
    rotary cos/sin for every position in it, computed once."""

    def __init__(self, decoder: FastDecoder, capacity: int) -> None:
        self.d = decoder
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(max(MIN_CAPACITY, min(capacity, 1 << 16)))

    def _grow(self, capacity: int) -> None:
        d = self.d
        shape = (1, d.kv_heads, capacity, d.head_dim)
        keys = [torch.empty(shape, dtype=d.dtype, device=d.device) for _ in d.layers]
        values = [torch.empty(shape, dtype=d.dtype, device=d.device) for _ in d.layers]
        for old, new in zip(self.keys + self.values, keys + values):
            new[:, :, :self.length] = old[:, :, :self.length]
        self.keys, self.values, self.capacity = keys, values, capacity
        positions = torch.arange(capacity, device=d.device).unsqueeze(0)
        cos, sin = d.rotary(torch.zeros(1, dtype=d.dtype, device=d.device), positions)
        self.cos, self.sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, capacity, head_dim]

    def kv_bytes(self) -> int:
        """Bytes of the cache slots holding tokens (the rest is reserved, see ``reserved_bytes``)."""
        per_token = 2 * len(self.d.layers) * self.d.kv_heads * self.d.head_dim * self.keys[0].element_size()
        return per_token * self.length

    def reserved_bytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits after the last of ``ids`` ([1, n]); the n tokens join the cache."""
        d = self.d
        count = ids.shape[1]
        start = self.length
        end = start + count
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        heads, kv_heads, dim = d.heads, d.kv_heads, d.head_dim
        rotated = heads + kv_heads
        cos, sin = self.cos[:, :, start:end], self.sin[:, :, start:end]
        half = dim // 2
        mask = None
        if count > 1:  # prefill: each new token sees the cache and the new tokens up to itself
            mask = torch.ones(count, end, dtype=torch.bool, device=d.device).tril(diagonal=start)
        hidden = d.embed(ids)
        for layer, keys, values in zip(d.layers, self.keys, self.values):
            x = _rms(hidden, layer.norm1, layer.eps)
            if layer.qkv is not None:
                qkv = layer.qkv(x)
            else:
                qkv = torch.cat([p(x) for p in layer.projections], dim=-1)
            qkv = qkv.view(1, count, rotated + kv_heads, dim).transpose(1, 2)
            qk = qkv[:, :rotated]  # queries and keys get the rotary embedding together
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            keys[:, :, start:end] = qk[:, heads:]
            values[:, :, start:end] = qkv[:, rotated:]
            out = F.scaled_dot_product_attention(qk[:, :heads], keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                                 scale=layer.scaling, enable_gqa=kv_heads != heads)
            hidden = hidden + layer.o(out.transpose(1, 2).reshape(1, count, heads * dim))
            x = _rms(hidden, layer.norm2, layer.eps)
            if layer.gate_up is not None:
                gate_up = layer.gate_up(x)
                gate, up = gate_up[..., :layer.intermediate], gate_up[..., layer.intermediate:]
            else:
                gate, up = layer.gate(x), layer.up(x)
            hidden = hidden + layer.down(layer.act(gate) * up)
        self.length = end
        return d.head(d.norm(hidden[:, -1:]))[0, -1]


def attach(loaded: "LoadedModel") -> str | None:
    """Give ``loaded`` the fast path if its model can take it; the reason if not."""
    reason = unsupported_reason(loaded.model)
    if reason is None:
        loaded.fast = FastDecoder(loaded.model)
    return reason
