"""The fast path: a lean decoder for Llama-family models over a preallocated KV cache.

transformers' forward is general: per layer it builds masks, dispatches attention backends,
concatenates a growing cache and checks options, and on two CPU cores that bookkeeping is a
large share of a small model's decode step. For the architectures it knows (Llama, Qwen2 and
Mistral without a window in play, and those :class:`_Layer` describes: Qwen3, SmolLM3, Phi-3/4)
this path runs the same modules' weights with only the arithmetic: norms, projections (optionally weight-only int8/int4, engine/models/quantize.py),
rotary embedding, attention over a static cache written in place, the MLP, the head.

It emits exactly the events of the reference path (the engine core, engine/generation/core.py, drives both
through a runner: the paged cache, engine/generation/paged_cache.py, runs this decoder); fp32 and
bf16 give the reference path's greedy tokens (tested). The compiled step and the batched step attend in fp32 (:func:`_attend_one`), so
in bf16 they round less than the reference path and may part from its tokens where it parts
from fp32's (README: the fast path). A model it can't run is refused with a clear message (no silent fall-back),
from the config or the GGUF header before any weight is read where they already say so; the
reference precisions run every model.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from torch.nn import functional as F
from engine.models.quantize import fuse_rows, has_int8_activations

from engine.models.precision import unsupported_type_reason

MIN_CAPACITY = 64
"""The shortest rotary table (positions) a cache starts with; it doubles from there as sequences
grow (engine/generation/paged_cache.py)."""
MAX_COMPILED_CAPACITY = 1 << 16
"""The most positions the compiled steps are built for (the rotary tables' length and the block
tables' width are dynamic up to this)."""
CPU_COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       "size_asserts": False}
"""Inductor's options for the decode step on a CPU (engine/generation/compiled_step.py builds it
with them): the weights frozen into the step as constants (prepacked), and its matrix products
generated as C++ micro-kernels (AVX-512/AMX where the CPU has them) picked by timing on this
machine, instead of calls into oneDNN/MKL. Measured here (2 cores, default model, the compiled
step alone, under torch.compile): bf16 28.6 → 62.9 tok/s, fp32 ~24 → 42.5, int8 65 → 102, int4
73 → 106 (benchmarks/fast_path.py has the side-by-side figures). The price: a few minutes of building
in a background process (the batched step too: about four minutes for both on two cores), once
per model, precision and thread count, and packed copies of the
weights beside them. ``size_asserts`` off: the generated code checked ~1,000 tensor shapes a step
(0.6 ms of a 12 ms int4 step) that the fixed shapes of the step already guarantee."""


def _bucket(tokens: int, smallest: int = MIN_CAPACITY) -> int:
    """The cache size for ``tokens``: a power of two from ``smallest`` (64), so compiled sizes get reused."""
    size = smallest
    while size < tokens:
        size *= 2
    return size


def unsupported_reason(model) -> str | None:
    """Why this model can't take the fast path, or ``None`` if it can."""
    config = model.config
    reason = unsupported_type_reason(config.model_type)
    if reason:
        return reason
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None) or float("inf")
    if window and window < longest and getattr(config, "use_sliding_window", True) \
            and config.model_type in ("mistral", "phi3") \
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention is not on the fast path"
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind in ("longrope", "dynamic"):
        # their frequencies change with the sequence's length: one table for every position is wrong
        return f"its rotary embedding ({kind}) changes with the length"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "its layers are not laid out as the fast path expects"
    return None


class _Layer:
    """One decoder layer's pieces, with q/k/v and gate/up fused where the scheme allows; what an
    architecture does otherwise than Llama is said here, not in a decoder of its own:

    - Qwen3: an RMSNorm over each head of the queries and of the keys, before the rotary embedding;
    - SmolLM3: some layers without the rotary embedding (``no_rope_layers``);
    - Phi-3/4: q/k/v and gate/up already one projection each (``qkv_proj``, ``gate_up_proj``), and
      the rotary embedding on the first part of each head only (``partial_rotary_factor``, the
      tables' width says how much)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps = float(getattr(self.norm1, "variance_epsilon", getattr(self.norm1, "eps", 1e-6)))
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_eps = float(getattr(self.q_norm, "variance_epsilon", self.eps))
        self.rope = bool(getattr(attn, "use_rope", True))
        fused = []
        if hasattr(attn, "qkv_proj"):
            self.qkv, self.projections = attn.qkv_proj, (attn.qkv_proj,)
        else:
            self.qkv = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            self.projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            fused.append(self.qkv)
        self.o = attn.o_proj
        self.scaling = attn.scaling
        self.down = mlp.down_proj
        self.act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        if hasattr(mlp, "gate_up_proj"):
            self.gate_up = mlp.gate_up_proj
            self.gate = self.up = None
            self.intermediate = mlp.gate_up_proj.out_features // 2
        else:
            self.gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj])
            fused.append(self.gate_up)
            self.gate, self.up = mlp.gate_proj, mlp.up_proj
            self.intermediate = mlp.gate_proj.out_features
        self.fused: list[nn.Module] = [part for part in fused if part is not None]
        """The projections this made by fusing the model's (not the model's own modules; none where
        the scheme keeps them apart)."""


class FastDecoder:
    """Holds the model's modules (fusing some of them in place) and the compiled decode step;
    the cache that runs it is engine/generation/paged_cache.py's (the engine core's runner)."""

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
        table = next(self.embed.parameters(), None)
        table = table if table is not None else next(self.embed.buffers())  # blocks shared with the head
        self.dtype, self.device = table.dtype, table.device
        self.kv_dtype = self.dtype
        """What the KV cache keeps keys and values in (the precision's ``kv_dtype``)."""
        if has_int8_activations(model):
            self.dtype = torch.float32  # int8 activations: the rest computes in fp32, as llama.cpp's does
            self.kv_dtype = torch.float16  # and the cache is fp16, as llama.cpp's F16 cache
        self.compiled = None
        """The compiled decode step, once engine/generation/compiled_step.py has made it ready:
        called as :func:`_decode_step` is, for any cache size."""
        self.compiled_rows = None
        """The compiled batched step (two sequences or more), once ready: called as
        :func:`_decode_rows` is, for any batch and cache size."""
        self.rows_attention = attention_op()
        """Whether eager batched steps run :func:`_decode_rows` (the kernels' attention, loaded
        before this decoder was made: the quantized precisions load them first, and the compiled
        batched step's build loads them) or :func:`_decode_batch`."""
        self.step_attention = False
        """Whether :func:`_decode_step` attends with the kernels' ``attend_rows``: set in the
        build process (engine/generation/compiled_step.py) wherever the kernels load, so the
        compiled step is exported with it."""
        self.compiled_threads: int | None = None
        """PyTorch threads the step was built for: its generated code runs that many, so at another
        count (the thread count adapts to the machine's load) the eager step runs instead."""
        self.request = None
        """The :class:`~engine.models.loading.LoadRequest` that loaded these weights: a child process
        loads them again to build the compiled step."""
        self._stop_compile = threading.Event()
        self._compile_thread: threading.Thread | None = None
        self.huge_page_bytes = 0
        """The weights' bytes on huge pages (engine/models/huge_pages.py: int8-fast and int4-fast
        on Linux), 0 where they stay in ordinary pages."""

    def modules(self) -> list[nn.Module]:
        """Every module whose weights a step reads: the model's, and the fused q/k/v and gate/up
        layers (which are not the model's submodules)."""
        fused = [part for layer in self.layers for part in layer.fused]
        return [*self.model.modules(), *(m for part in fused for m in part.modules())]


def _rotary_tables(d: "FastDecoder", capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin of every position of a cache, [1, 1, capacity, head_dim] each."""
    positions = torch.arange(capacity, device=d.device).unsqueeze(0)
    cos, sin = d.rotary(torch.zeros(1, dtype=d.dtype, device=d.device), positions)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def _rms(x: torch.Tensor, norm, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm (in fp32, back to the input's dtype, times the weight) as one op."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _attention_inputs(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys (both with the rotary embedding, applied in one go) and values of a layer."""
    batch, count = hidden.shape[:2]
    heads, kv_heads, dim = d.heads, d.kv_heads, d.head_dim
    rotated = heads + kv_heads
    x = _rms(hidden, layer.norm1, layer.eps)
    qkv = layer.qkv(x) if layer.qkv is not None else torch.cat([p(x) for p in layer.projections], dim=-1)
    qkv = qkv.view(batch, count, rotated + kv_heads, dim)
    if layer.q_norm is not None:  # per head, on the head dim
        qkv = torch.cat((_rms(qkv[:, :, :heads], layer.q_norm, layer.qk_eps),
                         _rms(qkv[:, :, heads:rotated], layer.k_norm, layer.qk_eps), qkv[:, :, rotated:]), dim=2)
    qkv = qkv.transpose(1, 2)
    qk = qkv[:, :rotated]
    if layer.rope:
        turned = cos.shape[-1]  # the whole head, or its first part (partial rotary)
        qk = _rotate(qk, cos, sin) if turned == dim else torch.cat(
            (_rotate(qk[..., :turned], cos, sin), qk[..., turned:]), dim=-1)
    return qk[:, :heads], qk[:, heads:], qkv[:, rotated:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on ``x`` (its last dim as wide as the tables: halves rotated, as
    transformers' ``rotate_half``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rest_of_layer(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Output projection and residual, then the MLP and its residual."""
    batch, count = hidden.shape[:2]
    hidden = hidden + layer.o(attended.transpose(1, 2).reshape(batch, count, d.heads * d.head_dim))
    x = _rms(hidden, layer.norm2, layer.eps)
    if layer.gate_up is not None:
        gate_up = layer.gate_up(x)
        gate, up = gate_up[..., :layer.intermediate], gate_up[..., layer.intermediate:]
    else:
        gate, up = layer.gate(x), layer.up(x)
    return hidden + layer.down(layer.act(gate) * up)


def _slots(table: torch.Tensor, positions: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where positions live in the block pool: each row's block (``table`` [B, W] of the rows'
    blocks) and the slot in it, for ``positions`` [B]."""
    blocks = table.gather(1, torch.div(positions, block_tokens, rounding_mode="floor").unsqueeze(1)).squeeze(1)
    return blocks, positions % block_tokens


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of each row's cache from the pool: [B, KV heads, W × block tokens, dim]
    for ``table`` [B, W] (the paths that attend without the kernels, and long prompt chunks)."""
    batch, width = table.shape
    blocks = pool.index_select(0, table.reshape(-1)).view(batch, width, *pool.shape[1:])
    return blocks.transpose(1, 2).reshape(batch, pool.shape[1], width * pool.shape[2], pool.shape[3])


def _forward(d: FastDecoder, key_pools: list[torch.Tensor], value_pools: list[torch.Tensor], table: torch.Tensor,
             cos_table: torch.Tensor, sin_table: torch.Tensor, ids: torch.Tensor, start: int,
             rows: int = 1, in_place: bool = False) -> torch.Tensor:
    """One forward pass of ``ids`` ([1, n]) at positions ``start…`` of the sequence whose blocks
    are ``table`` ([W], int64, enough for ``start + n`` tokens): writes their keys and values into
    its blocks of the pool, returns the logits after the last one (prefill, and the eager decode
    step), or after each of the last ``rows`` ([rows, vocab]: speculation's verify pass).

    Attention reads the blocks where they lie. A chunk from position 0 attends over its own new
    keys and values, as the pool keeps them (there is nothing before them to read), with PyTorch's
    flash kernel, as transformers' attention does. A later chunk (after a cached prefix, a chunk
    before it, or speculation's guesses) attends through the block table with the kernels'
    ``attend_chunk``: each new token over its blocks up to itself, as a decode step's row. With
    ``in_place`` a chunk from position 0 does too (every token's attention the same function, in
    any chunk: the batch-invariant mode). Only where the kernels aren't loaded does a later chunk
    attend over a copy of its blocks."""
    count = ids.shape[1]
    end = start + count
    block_tokens = key_pools[0].shape[2]
    cos, sin = cos_table[:, :, start:end], sin_table[:, :, start:end]
    positions = torch.arange(start, end, device=d.device)
    blocks, slots = _slots(table.view(1, -1).expand(count, -1), positions, block_tokens)
    paged = d.rows_attention and (start > 0 or in_place)
    mask = None
    if start > 0 and not paged:  # each new token sees the cache and the new tokens up to itself
        mask = torch.ones(count, end, dtype=torch.bool, device=d.device).tril(diagonal=start)
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        keys[blocks, :, slots] = k[0].transpose(0, 1).to(keys.dtype)
        values[blocks, :, slots] = v[0].transpose(0, 1).to(values.dtype)
        if paged:  # a row per new token: [count, heads, 1, dim]
            attended = torch.ops.workbench.attend_chunk(q[0].transpose(0, 1).unsqueeze(2), keys, values, table,
                                                        start, layer.scaling)
            attended = attended.squeeze(2).transpose(0, 1).unsqueeze(0)
        else:
            if start == 0:  # the new keys and values are the whole cache
                mine_k, mine_v = k.to(keys.dtype), v.to(values.dtype)
            else:
                used = table[:-(-end // block_tokens)].view(1, -1)
                mine_k = gather_blocks(keys, used)[:, :, :end]
                mine_v = gather_blocks(values, used)[:, :, :end]
            # from position 0, plainly causal: the flash kernel skips the blocks above the diagonal
            # (half the work) and reads no mask (prefill of 507 tokens, int4-fast: attention was
            # 25% of the time with the mask)
            attended = F.scaled_dot_product_attention(q, mine_k.to(q.dtype), mine_v.to(q.dtype), attn_mask=mask,
                                                      is_causal=start == 0 and count > 1, scale=layer.scaling,
                                                      enable_gqa=d.kv_heads != d.heads)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    logits = d.head(d.norm(hidden[:, -rows:]))[0]
    return logits[-1] if rows == 1 else logits


def chunk_logits(d: FastDecoder, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits at the last ``keep`` positions of each row of ``ids`` ([batch, count]), read from
    position 0 without a cache (a perplexity chunk): [batch, keep, vocab]."""
    count = ids.shape[1]
    cos, sin = _rotary_tables(d, count)
    hidden = d.embed(ids).to(d.dtype)
    for layer in d.layers:
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        if d.kv_dtype != k.dtype:  # what a cache would have kept (a step reads them from it)
            k, v = k.to(d.kv_dtype).to(k.dtype), v.to(d.kv_dtype).to(v.dtype)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling,
                                                  enable_gqa=d.kv_heads != d.heads)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return d.head(d.norm(hidden[:, -keep:]))


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of one query token over a whole cache, as two small matmuls and a softmax in fp32,
    the query heads of a KV head side by side (GQA without copying K and V). PyTorch's CPU flash
    kernel blocks for long queries: for a single one it cost ~0.1 ms (fp32) to ~0.3 ms (bf16) a
    layer, ~40% of a quantized decode step; this costs a few µs once compiled."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float()).reshape(batch, heads, 1, dim).to(q.dtype)


def _decode_step(d: FastDecoder, key_pools: list[torch.Tensor], value_pools: list[torch.Tensor],
                 cos_table: torch.Tensor, sin_table: torch.Tensor, ids: torch.Tensor,
                 position: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One decode step of one sequence (one token at ``position``, a 1-element tensor), its cache
    the blocks ``table`` [1, W] names in the pool. What the compiled step is exported from
    (engine/generation/compiled_step.py): the pool's blocks, the table's width and the rotary
    tables' length are its varying sizes, dynamic dimensions of one build. With
    ``d.step_attention`` the attention is the kernels' (it reads the blocks up to ``position``
    only; measured eager on the default model's layer shapes, 20-26 µs a layer against 72-79 µs
    for the matmuls); else two matmuls over a copy of the table's blocks, masked past ``position``."""
    block_tokens = key_pools[0].shape[2]
    cos, sin = cos_table.index_select(2, position), sin_table.index_select(2, position)
    blocks, slots = _slots(table, position, block_tokens)
    span = table.shape[1] * block_tokens
    mask = (torch.arange(span, device=position.device) <= position).view(1, 1, 1, span)
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        keys[blocks, :, slots] = k[:, :, 0].to(keys.dtype)
        values[blocks, :, slots] = v[:, :, 0].to(values.dtype)
        if d.step_attention:
            attended = torch.ops.workbench.attend_paged(q, keys, values, table, position, layer.scaling)
        else:
            attended = _attend_one(q, gather_blocks(keys, table), gather_blocks(values, table), mask, layer.scaling)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return d.head(d.norm(hidden))[0, -1]


ATTENTION_BUCKET = 64
"""Rows of a batched decode step attend over their own length rounded up to a power of two
from this, grouped, rather than all over the longest row's."""


def _length_groups(positions: list[int], device) -> list[tuple[object, int, torch.Tensor]]:
    """Rows grouped by the span they attend over: (rows as a slice or an index tensor, span,
    the group's mask [rows, 1, 1, span])."""
    spans: dict[int, list[int]] = {}
    for row, position in enumerate(positions):
        spans.setdefault(_bucket(position + 1, ATTENTION_BUCKET), []).append(row)
    groups = []
    for span, rows in sorted(spans.items()):
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        selector = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
        at = torch.tensor([positions[r] for r in rows], device=device).view(len(rows), 1)
        mask = (torch.arange(span, device=device) <= at).view(len(rows), 1, 1, span)
        groups.append((selector, span, mask))
    return groups


def _row_tables(cos_table: torch.Tensor, sin_table: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batched step's rotary cos and sin, each row at its own position ([B, 1, 1, head_dim]),
    and the rows' indices."""
    batch = positions.shape[0]
    cos = cos_table[0, 0].index_select(0, positions).view(batch, 1, 1, -1)
    sin = sin_table[0, 0].index_select(0, positions).view(batch, 1, 1, -1)
    return cos, sin, torch.arange(batch, device=positions.device)


def _rows_attention_inputs(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """A batched step's queries, each row's new key and value written into its block at its slot."""
    q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
    keys[blocks, :, slots] = k[:, :, 0].to(keys.dtype)
    values[blocks, :, slots] = v[:, :, 0].to(values.dtype)
    return q


def _decode_batch(d: FastDecoder, key_pools: list[torch.Tensor], value_pools: list[torch.Tensor],
                  cos_table: torch.Tensor, sin_table: torch.Tensor, ids: torch.Tensor,
                  positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One decode step of B sequences at once: ``ids`` [B, 1], each at its own ``positions[b]``,
    its blocks ``table[b]``. The projections and the MLP run on all rows in one go; attention
    runs over a copy of each row's blocks, per group of rows of a similar length, each over its
    own span with the unwritten positions masked out (a 2,000-token request in the batch costs
    only its own row the long attention). Returns the logits [B, vocab]. Where the kernels'
    attention is loaded, :func:`_decode_rows` runs instead (it reads the blocks in place)."""
    capacity = table.shape[1] * key_pools[0].shape[2]
    cos, sin, _ = _row_tables(cos_table, sin_table, positions)
    blocks, slots = _slots(table, positions, key_pools[0].shape[2])
    groups = [(selector, min(span, capacity), mask[..., :capacity])
              for selector, span, mask in _length_groups(positions.tolist(), positions.device)]
    hidden = d.embed(ids).to(d.dtype)
    for layer, key_pool, value_pool in zip(d.layers, key_pools, value_pools):
        q = _rows_attention_inputs(d, layer, hidden, cos, sin, key_pool, value_pool, blocks, slots)
        keys, values = gather_blocks(key_pool, table), gather_blocks(value_pool, table)
        attended = q.new_empty(q.shape) if len(groups) > 1 else None
        for selector, span, mask in groups:
            if isinstance(selector, slice):
                part_q, part_k, part_v = q[selector], keys[selector, :, :span], values[selector, :, :span]
            else:
                part_q = q.index_select(0, selector)
                part_k = keys[:, :, :span].index_select(0, selector)
                part_v = values[:, :, :span].index_select(0, selector)
            out = _attend_one(part_q, part_k, part_v, mask, layer.scaling)
            if attended is None:
                attended = out
            elif isinstance(selector, slice):
                attended[selector] = out
            else:
                attended.index_copy_(0, selector, out)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return d.head(d.norm(hidden))[:, -1]


def attention_op() -> bool:
    """Whether the kernels' attention (``torch.ops.workbench.attend_paged`` and ``attend_chunk``)
    is loaded: with it a batched step reads each row's blocks in place up to its own position
    (:func:`_decode_rows`), and a later prompt chunk its blocks (:func:`_forward`). Where they
    were built on this machine already (a quantized precision's load, or a compiled step's build,
    compiles them once) they are loaded here: a moment, not a minute."""
    from engine.models import kernels  # lazy: kernels imports torch's extension tools

    if kernels.loaded() is None and kernels.unavailable() is None and kernels.expected() and kernels.is_built():
        kernels.kernels()
    return kernels.loaded() is not None


def _decode_rows(d: FastDecoder, key_pools: list[torch.Tensor], value_pools: list[torch.Tensor],
                 cos_table: torch.Tensor, sin_table: torch.Tensor, ids: torch.Tensor,
                 positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One decode step of B sequences, as :func:`_decode_batch`, with the kernels' attention
    (:func:`attention_op`): each row attends over its own blocks, read in place through its row of
    ``table``, up to its own position, so no grouping by length is needed and every shape is fixed
    by B, the table's width and the pool. What the compiled batched step is exported from
    (engine/generation/compiled_step.py: those its dynamic dimensions); it also runs eagerly where
    it isn't built yet. Returns the logits [B, vocab]."""
    cos, sin, _ = _row_tables(cos_table, sin_table, positions)
    blocks, slots = _slots(table, positions, key_pools[0].shape[2])
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        q = _rows_attention_inputs(d, layer, hidden, cos, sin, keys, values, blocks, slots)
        attended = torch.ops.workbench.attend_paged(q, keys, values, table, positions, layer.scaling)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return d.head(d.norm(hidden))[:, -1]


def early_exit_decoder(d: FastDecoder, layers: int) -> FastDecoder:
    """A view of ``d`` that runs only its first ``layers`` layers, then the final norm and the
    head (speculation's early-exit draft on the fast path). It shares every weight with ``d``;
    it runs the eager step (the compiled one is the whole model's)."""
    view = copy.copy(d)
    view.layers = d.layers[:layers]
    view.compiled, view.compiled_rows, view.compiled_threads, view._compile_thread = None, None, None, None
    return view
