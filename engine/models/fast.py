"""The fast path: a lean decoder for Llama-family models over a paged KV cache.

transformers' forward is general: per layer it builds masks, dispatches attention backends,
concatenates a growing cache and checks options, and on two CPU cores that bookkeeping is a
large share of a small model's decode step. For the architectures it knows (Llama, Qwen2 and
Mistral, and those :class:`_Layer` describes: Qwen3, SmolLM3, Phi-3/4, Gemma 2 and 3)
this path runs the same modules' weights with only the arithmetic: norms, projections (optionally
weight-only int8/int4, engine/models/quantize.py), rotary embedding, attention over the cache's
blocks written in place, the MLP, the head.

It emits exactly the events of the reference path (the engine core, engine/generation/core.py,
drives both through a runner: the paged cache, engine/generation/paged_cache.py, runs this
decoder); fp32 and bf16 give the reference path's greedy tokens (tested). The compiled step and
the batched step attend in fp32 (:func:`_attend_one`), so in bf16 they round less than the
reference path and may part from its tokens where it parts from fp32's (docs/benchmarks.md: the
fast path against llama.cpp). A model it can't run is refused with a clear message (no silent
fall-back), from the config or the GGUF header before any weight is read where they already say
so; the reference precisions run every model.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from torch.nn import functional as F
from engine.models.quantize import fuse_rows, has_int8_activations

from engine.base.kv import kv_layout
from engine.base.errors import UnsupportedPrecisionError
from engine.models.precision import Q8_BLOCK, Q8_BLOCK_BYTES, unsupported_type_reason

OFFSET_NORMS = ("gemma2", "gemma3_text")
"""Model types whose RMSNorm weights are offsets from 1 (``x · (1 + w)``, in fp32), as Gemma's are."""

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
    if kv_layout(config) is None or any(kind not in ("full_attention", "sliding_attention")
                                        for kind in getattr(config, "layer_types", None) or ()):
        return "its attention layers are not all full or sliding-window ones"
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
      tables' width says how much);
    - Gemma 2 and 3: norms of ``x · (1 + w)``, a norm after attention and another around the MLP
      (four a layer); Gemma 2's attention scores soft-capped (``cap · tanh(score / cap)``, and its
      logits, :func:`_logits`); Gemma 3's query/key norms and the rotary base of the layer's kind
      (local or global);
    - sliding-window layers (Gemma 3's local layers, Mistral's and Phi-3's windows, Qwen2's where
      the config turns them on): each token attends to the last ``window`` positions only, the
      same window the KV prediction counts (engine/base/kv.py)."""

    def __init__(self, layer, window: int | None, kind: int, offset_norms: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm
        self.after_attention = self.after_mlp = None
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: norms around attention and the MLP
            self.after_attention, self.norm2 = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            self.after_mlp = layer.post_feedforward_layernorm
        else:
            self.norm2 = layer.post_attention_layernorm
        self.eps = float(getattr(self.norm1, "variance_epsilon", getattr(self.norm1, "eps", 1e-6)))
        self.offset = offset_norms
        """Whether the norms multiply by ``1 + w`` in fp32 (Gemma) rather than by ``w`` after the cast."""
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_eps = float(getattr(self.q_norm, "variance_epsilon", getattr(self.q_norm, "eps", self.eps)))
        self.rope = bool(getattr(attn, "use_rope", True))
        self.window = window
        """The positions a token attends to (itself and those before it), ``None`` for all."""
        self.cap = float(getattr(attn, "attn_logit_softcapping", None) or 0.0)
        """Where the attention scores are soft-capped (Gemma 2's 50), else 0."""
        self.kind = kind
        """Which of the decoder's rotary tables this layer reads (its attention kind's)."""
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
        windows = kv_layout(config).windows
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(windows))
        self.rope_kinds: tuple[str | None, ...] = tuple(sorted(set(types))) if _rotary_per_kind(base.rotary_emb) else (None,)
        """The rotary tables the layers read, by attention kind where the model has one per kind
        (Gemma 3: local layers a base of 10,000, global ones their own), else the one table."""
        offset = config.model_type in OFFSET_NORMS
        self.layers = [_Layer(layer, window, self.rope_kinds.index(kind) if kind in self.rope_kinds else 0, offset)
                       for layer, window, kind in zip(base.layers, windows, types)]
        self.final_cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        """Where the logits are soft-capped (Gemma 2's 30), else 0."""
        self.windowed = any(layer.window for layer in self.layers)
        """Whether some layers slide a window: the cache keeps only the window's blocks for them, in a
        pool of their own, and a step's block table lists the full layers' blocks, then theirs."""
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
        self.kv_row = self.head_dim
        """A slot's row of one KV head in the cache: ``head_dim`` values, or an int8 cache's bytes
        (:func:`use_kv_dtype`)."""
        self.kv_turns: tuple[torch.Tensor, torch.Tensor] | None = None
        """With an int8 cache whose heads are a multiple of 64 values: the Walsh-Hadamard rotations
        (fp32, [head_dim, head_dim]) that queries and keys, and values, are turned by before the
        cache keeps them (:func:`kv_turns`)."""
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
        self.dense = dense_op()
        """Whether a decode step's fp32 and bf16 products run the kernels' ``dense_linear``
        (:func:`_project`): where their AVX-512 build is loaded (set again once a compiled step's
        build has loaded them). The eager steps and the compiled batched step use it; the compiled
        one-sequence step is built without it (its products are Inductor's, on weights it packs
        for them, which measured faster for one row): docs/benchmarks.md, "The dense products"."""
        self.compiled_threads: int | None = None
        """PyTorch threads the step was built for: its generated code runs that many, so at another
        count (the thread count adapts to the machine's load) the eager step runs instead."""
        self.request = None
        """The :class:`~engine.models.loading.LoadRequest` that loaded these weights: a child process
        loads them again to build the compiled step."""
        self.exit_layers: int | None = None
        """An early-exit view's layer count (:func:`early_exit_decoder`): the child takes the same view."""
        self._stop_compile = threading.Event()
        self._compile_thread: threading.Thread | None = None
        self.huge_page_bytes = 0
        """The weights' bytes on huge pages (engine/models/huge_pages.py: every fast precision on
        the CPU, on Linux), 0 where they stay in ordinary pages."""

    def modules(self) -> list[nn.Module]:
        """Every module whose weights a step reads: the model's, and the fused q/k/v and gate/up
        layers (which are not the model's submodules)."""
        fused = [part for layer in self.layers for part in layer.fused]
        return [*self.model.modules(), *(m for part in fused for m in part.modules())]


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size ``n`` (a power of two): symmetric, its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n ** 0.5


def kv_turns(head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotations an int8 cache's heads are turned by, as llama.cpp turns its quantized caches'
    (heads of a multiple of 64 values): keys and queries by a Walsh-Hadamard matrix as wide as
    the largest power of two that divides the head, values by 64-wide ones, one after another
    along the head. A turn spreads a head's few large dimensions (keys have some: 10× the others
    on the default model) over every value of a 32-value block, so one scale fits them all:
    attention is unchanged (the scores' dot products and the weighted values' sum both turn
    with it), the rounding's error smaller (on the default model the KL divergence an int8 cache
    costs falls by more than half: docs/benchmarks.md). ``None`` for other head sizes: kept as
    they are."""
    if head_dim % 64:
        return None
    wide = 64
    while head_dim % (2 * wide) == 0:
        wide *= 2
    return (torch.block_diag(*[hadamard(wide)] * (head_dim // wide)),
            torch.block_diag(*[hadamard(64)] * (head_dim // 64)))


def use_kv_dtype(d: FastDecoder, dtype: torch.dtype) -> None:
    """Keep ``d``'s keys and values in ``dtype`` from now on (before any cache is made). int8 is
    llama.cpp's q8_0 cache: a slot's head in blocks of 32 values, each block its fp16 scale and 32
    codes; written by the kernels' ``write_q8``, read by their attention, which then runs every
    step (prompt chunks from position 0 included: every token's attention reads what the cache
    kept)."""
    if dtype == torch.int8:
        if d.head_dim % Q8_BLOCK:
            raise UnsupportedPrecisionError(f"An int8 KV cache keeps blocks of {Q8_BLOCK} values: it needs a head size "
                                            f"that is a multiple of {Q8_BLOCK}, and this model's is {d.head_dim}. "
                                            "Choose bf16 or fp16.")
        if not attention_op():
            raise UnsupportedPrecisionError("An int8 KV cache is read by the kernels' attention, which isn't loaded.")
        d.kv_row = d.head_dim // Q8_BLOCK * Q8_BLOCK_BYTES
        d.rows_attention = d.step_attention = True
        turns = kv_turns(d.head_dim)
        d.kv_turns = None if turns is None else tuple(t.to(d.device) for t in turns)
    else:
        d.kv_row = d.head_dim
        d.kv_turns = None
    d.kv_dtype = dtype


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an int8 (q8_0) cache gives back for ``x`` (its last dimension in blocks of 32): the
    kernels' ``write_q8`` then their attention's reading, in PyTorch (a perplexity chunk's keys
    and values, read without a cache)."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
    top = blocks.abs().amax(-1, keepdim=True)
    scale = top / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    codes = scaled.sign() * (scaled.abs() + 0.5).floor()  # half away from zero, as C's round
    return (codes * scale.half().float()).flatten(-2).to(x.dtype)


def write_cache(pool: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows' new keys (or values) ``x`` [R, KV heads, D] into ``pool`` at ``blocks`` and ``slots`` [R]:
    converted to the pool's dtype, or quantized into an int8 pool's q8_0 blocks."""
    if pool.dtype == torch.int8:
        torch.ops.workbench.write_q8(pool, blocks, slots, x)
    else:
        pool[blocks, :, slots] = x.to(pool.dtype)


def _rotary_per_kind(rotary) -> bool:
    """Whether a model's rotary embedding takes the layer's attention kind (one table per kind)."""
    import inspect

    return "layer_type" in inspect.signature(rotary.forward).parameters


def _rotary_tables(d: "FastDecoder", capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin of every position of a cache, [kinds, 1, capacity, head_dim] each:
    one table per rotary kind (:attr:`FastDecoder.rope_kinds`, usually one)."""
    positions = torch.arange(capacity, device=d.device).unsqueeze(0)
    x = torch.zeros(1, dtype=d.dtype, device=d.device)
    tables = [d.rotary(x, positions) if kind is None else d.rotary(x, positions, kind) for kind in d.rope_kinds]
    return torch.cat([cos for cos, _ in tables]).unsqueeze(1), torch.cat([sin for _, sin in tables]).unsqueeze(1)


def _rms(x: torch.Tensor, norm, eps: float, offset: bool = False) -> torch.Tensor:
    """transformers' Llama RMSNorm (in fp32, back to the input's dtype, times the weight) as one op;
    ``offset``: Gemma's (times ``1 + w`` in fp32, then back to the input's dtype)."""
    if offset:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + norm.weight.float())).to(x.dtype)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _project(d: "FastDecoder", module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a decode step's rows (one position each, ``x`` [B, 1, K]: an eager step's, or
    the compiled batched step's as it is exported) through
    the kernels' ``dense_linear`` where the decoder uses it (:attr:`FastDecoder.dense`) and
    ``module`` is a plain fp32 or bf16 ``nn.Linear`` with contiguous weights (a view of a tied
    table may not be). A prompt's positions keep ``module``."""
    if (d.dense and type(module) is nn.Linear and x.dim() == 3 and x.shape[1] == 1 and module.weight.dtype == x.dtype
            and module.weight.is_contiguous()):
        out = torch.ops.workbench.dense_linear(x.reshape(x.shape[0], x.shape[2]), module.weight)
        if module.bias is not None:
            out = out + module.bias
        return out.view(x.shape[0], 1, out.shape[-1])
    return module(x)


def _logits(d: "FastDecoder", hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and the head (soft-capped where the model caps its logits)."""
    logits = _project(d, d.head, d.norm(hidden))
    if d.final_cap:
        logits = torch.tanh(logits / d.final_cap) * d.final_cap
    return logits


def _attend_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores (PyTorch's kernels can't cap), the queries ``[B, H, n,
    D]`` over ``k``/``v`` ``[B, KV heads, m, D]``: ``mask`` [n, m] (``None``: causal, the
    queries the last ``n`` positions); as transformers' eager attention for Gemma 2 computes it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        n, m = q.shape[2], k.shape[2]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def split_table(d: "FastDecoder", table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's block table ([..., W]) as the full layers' and the sliding-window layers' tables:
    halves of it where some layers slide a window (their blocks are a pool of their own), else the
    same table twice."""
    if not d.windowed:
        return table, table
    half = table.shape[-1] // 2
    return table[..., :half], table[..., half:]


def _window_mask(count: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """Which of positions 0 … ``end`` − 1 each of the last ``count`` attends to ([count, end]):
    those up to itself, and within ``window`` of it (``None``: a plainly causal chunk from
    position 0 of no window, the flash kernel's own ``is_causal``)."""
    start = end - count
    if window is None and start == 0:
        return None
    at = torch.arange(start, end, device=device).view(count, 1)
    slots = torch.arange(end, device=device)
    mask = slots <= at
    return mask if window is None else mask & (slots > at - window)


def _attention_inputs(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys (both with the rotary embedding, applied in one go) and values of a layer;
    ``cos`` and ``sin`` hold every rotary kind's table on their first dimension."""
    batch, count = hidden.shape[:2]
    heads, kv_heads, dim = d.heads, d.kv_heads, d.head_dim
    rotated = heads + kv_heads
    x = _rms(hidden, layer.norm1, layer.eps, layer.offset)
    qkv = _project(d, layer.qkv, x) if layer.qkv is not None else torch.cat(
        [_project(d, p, x) for p in layer.projections], dim=-1)
    qkv = qkv.view(batch, count, rotated + kv_heads, dim)
    if layer.q_norm is not None:  # per head, on the head dim
        qkv = torch.cat((_rms(qkv[:, :, :heads], layer.q_norm, layer.qk_eps, layer.offset),
                         _rms(qkv[:, :, heads:rotated], layer.k_norm, layer.qk_eps, layer.offset),
                         qkv[:, :, rotated:]), dim=2)
    qkv = qkv.transpose(1, 2)
    qk = qkv[:, :rotated]
    if layer.rope:
        cos, sin = cos[layer.kind], sin[layer.kind]  # the layer's kind's table
        turned = cos.shape[-1]  # the whole head, or its first part (partial rotary)
        qk = _rotate(qk, cos, sin) if turned == dim else torch.cat(
            (_rotate(qk[..., :turned], cos, sin), qk[..., turned:]), dim=-1)
    v = qkv[:, rotated:]
    if d.kv_turns is not None:  # an int8 cache: queries and keys turned alike, values their own way
        qk, v = _turn(qk, d.kv_turns[0]), _turn(v, d.kv_turns[1])
    return qk[:, :heads], qk[:, heads:], v


def _turn(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """``x``'s heads (its last dimension) times an orthonormal ``turn`` (fp32)."""
    return x @ turn if x.dtype == turn.dtype else (x.float() @ turn).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on ``x`` (its last dim as wide as the tables: halves rotated, as
    transformers' ``rotate_half``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rest_of_layer(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """Output projection and residual, then the MLP and its residual."""
    batch, count = hidden.shape[:2]
    if d.kv_turns is not None:  # the values were turned: the weighted sum turns back (the turn is its own inverse)
        attended = _turn(attended, d.kv_turns[1])
    out = _project(d, layer.o, attended.transpose(1, 2).reshape(batch, count, d.heads * d.head_dim))
    if layer.after_attention is not None:
        out = _rms(out, layer.after_attention, layer.eps, layer.offset)
    hidden = hidden + out
    x = _rms(hidden, layer.norm2, layer.eps, layer.offset)
    if layer.gate_up is not None:
        gate_up = _project(d, layer.gate_up, x)
        gate, up = gate_up[..., :layer.intermediate], gate_up[..., layer.intermediate:]
    else:
        gate, up = _project(d, layer.gate, x), _project(d, layer.up, x)
    out = _project(d, layer.down, layer.act(gate) * up)
    if layer.after_mlp is not None:
        out = _rms(out, layer.after_mlp, layer.eps, layer.offset)
    return hidden + out


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
    tables = split_table(d, table)
    places = [_slots(t.view(1, -1).expand(count, -1), positions, block_tokens) for t in tables]
    paged = d.rows_attention and (start > 0 or in_place or d.kv_dtype == torch.int8)
    masks: dict[int | None, torch.Tensor | None] = {}
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        mine = tables[bool(layer.window)]  # the blocks of this layer's pool
        blocks, slots = places[bool(layer.window)]
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        write_cache(keys, blocks, slots, k[0].transpose(0, 1))
        write_cache(values, blocks, slots, v[0].transpose(0, 1))
        if paged:  # a row per new token: [count, heads, 1, dim]
            attended = torch.ops.workbench.attend_chunk(q[0].transpose(0, 1).unsqueeze(2), keys, values, mine,
                                                        start, layer.scaling, layer.window or 0, layer.cap)
            attended = attended.squeeze(2).transpose(0, 1).unsqueeze(0)
        else:
            # a window layer reads from the first token's window on (the blocks before may be given back)
            first = max(0, start - layer.window + 1) if layer.window else 0
            if start == 0:  # the new keys and values are the whole cache
                mine_k, mine_v = k.to(keys.dtype), v.to(values.dtype)
            else:
                used = mine[first // block_tokens:-(-end // block_tokens)].view(1, -1)
                skip = first - first // block_tokens * block_tokens
                mine_k = gather_blocks(keys, used)[:, :, skip:end - first + skip]
                mine_v = gather_blocks(values, used)[:, :, skip:end - first + skip]
            if layer.window not in masks:  # each new token sees the tokens up to itself (in its window)
                whole = _window_mask(count, end, layer.window, d.device)
                part = None if whole is None else whole[:, first:]
                # one token over its window alone: no mask (PyTorch's flash kernel, as transformers' attention)
                masks[layer.window] = None if part is None or count == 1 and bool(part.all()) else part
            mask = masks[layer.window]
            # from position 0 and no window, plainly causal: the flash kernel skips the blocks above
            # the diagonal (half the work) and reads no mask (prefill of 507 tokens, int4-fast:
            # attention was 25% of the time with the mask)
            if layer.cap:
                attended = _attend_capped(q, mine_k.to(q.dtype), mine_v.to(q.dtype), mask, layer.scaling, layer.cap)
            else:
                attended = F.scaled_dot_product_attention(q, mine_k.to(q.dtype), mine_v.to(q.dtype), attn_mask=mask,
                                                          is_causal=mask is None and count > 1, scale=layer.scaling,
                                                          enable_gqa=d.kv_heads != d.heads)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    logits = _logits(d, hidden[:, -rows:])[0]
    return logits[-1] if rows == 1 else logits


def chunk_logits(d: FastDecoder, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits at the last ``keep`` positions of each row of ``ids`` ([batch, count]), read from
    position 0 without a cache (a perplexity chunk): [batch, keep, vocab]."""
    count = ids.shape[1]
    cos, sin = _rotary_tables(d, count)
    hidden = d.embed(ids).to(d.dtype)
    for layer in d.layers:
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        if d.kv_dtype == torch.int8:  # what a cache would have kept (a step reads them from it)
            k, v = q8_round_trip(k), q8_round_trip(v)
        elif d.kv_dtype != k.dtype:
            k, v = k.to(d.kv_dtype).to(k.dtype), v.to(d.kv_dtype).to(v.dtype)
        mask = _window_mask(count, count, layer.window, d.device)
        if layer.cap:
            attended = _attend_capped(q, k, v, mask, layer.scaling, layer.cap)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      scale=layer.scaling, enable_gqa=d.kv_heads != d.heads)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return _logits(d, hidden[:, -keep:])


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float, cap: float = 0.0) -> torch.Tensor:
    """Attention of one query token over a whole cache, as two small matmuls and a softmax in fp32,
    the query heads of a KV head side by side (GQA without copying K and V). PyTorch's CPU flash
    kernel blocks for long queries: for a single one its set-up outweighed the work, a large
    share of a quantized decode step; this is a few small kernels once compiled."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale
    if cap:  # soft-capped (Gemma 2)
        scores = torch.tanh(scores / cap) * cap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float()).reshape(batch, heads, 1, dim).to(q.dtype)


def _decode_step(d: FastDecoder, key_pools: list[torch.Tensor], value_pools: list[torch.Tensor],
                 cos_table: torch.Tensor, sin_table: torch.Tensor, ids: torch.Tensor,
                 position: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One decode step of one sequence (one token at ``position``, a 1-element tensor), its cache
    the blocks ``table`` [1, W] names in the pool. What the compiled step is exported from
    (engine/generation/compiled_step.py): the pool's blocks, the table's width and the rotary
    tables' length are its varying sizes, dynamic dimensions of one build. With ``d.step_attention``
    the attention is the kernels' (it reads the blocks up to ``position`` only, in a fraction of the
    matmuls' time: docs/benchmarks.md, "A batched step's parts"); else two matmuls over a copy of
    the table's blocks, masked past ``position``."""
    block_tokens = key_pools[0].shape[2]
    cos, sin = cos_table.index_select(2, position), sin_table.index_select(2, position)
    tables = split_table(d, table)
    places = [_slots(t, position, block_tokens) for t in tables]
    span = tables[0].shape[1] * block_tokens
    slots_at = torch.arange(span, device=position.device)
    masks = {window: ((slots_at <= position) & (slots_at > position - (window or span + 1))).view(1, 1, 1, span)
             for window in {layer.window for layer in d.layers}}
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        mine = tables[bool(layer.window)]
        blocks, slots = places[bool(layer.window)]
        q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
        write_cache(keys, blocks, slots, k[:, :, 0])
        write_cache(values, blocks, slots, v[:, :, 0])
        if d.step_attention:
            attended = torch.ops.workbench.attend_paged(q, keys, values, mine, position, layer.scaling,
                                                        layer.window or 0, layer.cap)
        else:
            attended = _attend_one(q, gather_blocks(keys, mine), gather_blocks(values, mine), masks[layer.window],
                                   layer.scaling, layer.cap)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return _logits(d, hidden)[0, -1]


ATTENTION_BUCKET = 64
"""Rows of a batched decode step attend over their own length rounded up to a power of two
from this, grouped, rather than all over the longest row's."""


def _length_groups(positions: list[int], device) -> list[tuple[object, int, torch.Tensor, torch.Tensor]]:
    """Rows grouped by the span they attend over: (rows as a slice or an index tensor, span,
    the group's mask [rows, 1, 1, span], the rows' positions [rows, 1])."""
    spans: dict[int, list[int]] = {}
    for row, position in enumerate(positions):
        spans.setdefault(_bucket(position + 1, ATTENTION_BUCKET), []).append(row)
    groups = []
    for span, rows in sorted(spans.items()):
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        selector = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
        at = torch.tensor([positions[r] for r in rows], device=device).view(len(rows), 1)
        mask = (torch.arange(span, device=device) <= at).view(len(rows), 1, 1, span)
        groups.append((selector, span, mask, at))
    return groups


def _row_tables(cos_table: torch.Tensor, sin_table: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batched step's rotary cos and sin, each row at its own position ([kinds, B, 1, 1,
    head_dim]), and the rows' indices."""
    batch, kinds = positions.shape[0], cos_table.shape[0]
    cos = cos_table[:, 0].index_select(1, positions).view(kinds, batch, 1, 1, -1)
    sin = sin_table[:, 0].index_select(1, positions).view(kinds, batch, 1, 1, -1)
    return cos, sin, torch.arange(batch, device=positions.device)


def _rows_attention_inputs(d: FastDecoder, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """A batched step's queries, each row's new key and value written into its block at its slot."""
    q, k, v = _attention_inputs(d, layer, hidden, cos, sin)
    write_cache(keys, blocks, slots, k[:, :, 0])
    write_cache(values, blocks, slots, v[:, :, 0])
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
    tables = split_table(d, table)
    capacity = tables[0].shape[1] * key_pools[0].shape[2]
    cos, sin, _ = _row_tables(cos_table, sin_table, positions)
    places = [_slots(t, positions, key_pools[0].shape[2]) for t in tables]
    windows = {layer.window for layer in d.layers}
    groups = []
    for selector, span, mask, at in _length_groups(positions.tolist(), positions.device):
        span = min(span, capacity)
        slots_at = torch.arange(span, device=positions.device)
        groups.append((selector, span, {window: (mask[..., :span] if window is None else
                                                 mask[..., :span] & (slots_at > at - window).view(mask.shape[0], 1, 1, span))
                                        for window in windows}))
    hidden = d.embed(ids).to(d.dtype)
    for layer, key_pool, value_pool in zip(d.layers, key_pools, value_pools):
        mine = tables[bool(layer.window)]
        q = _rows_attention_inputs(d, layer, hidden, cos, sin, key_pool, value_pool, *places[bool(layer.window)])
        keys, values = gather_blocks(key_pool, mine), gather_blocks(value_pool, mine)
        attended = q.new_empty(q.shape) if len(groups) > 1 else None
        for selector, span, masks in groups:
            mask = masks[layer.window]
            if isinstance(selector, slice):
                part_q, part_k, part_v = q[selector], keys[selector, :, :span], values[selector, :, :span]
            else:
                part_q = q.index_select(0, selector)
                part_k = keys[:, :, :span].index_select(0, selector)
                part_v = values[:, :, :span].index_select(0, selector)
            out = _attend_one(part_q, part_k, part_v, mask, layer.scaling, layer.cap)
            if attended is None:
                attended = out
            elif isinstance(selector, slice):
                attended[selector] = out
            else:
                attended.index_copy_(0, selector, out)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return _logits(d, hidden)[:, -1]


def attention_op() -> bool:
    """Whether the kernels' attention (``torch.ops.workbench.attend_paged`` and ``attend_chunk``)
    is loaded: with it a batched step reads each row's blocks in place up to its own position
    (:func:`_decode_rows`), and a later prompt chunk its blocks (:func:`_forward`). Where they
    were built on this machine already (a quantized precision's load, or a compiled step's build,
    compiles them once) they are loaded here: a moment, not a minute."""
    from engine.models import kernels  # lazy: kernels imports torch's extension tools

    return kernels.load_if_built() is not None


NO_DENSE_ENV = "INFERENCE_WORKBENCH_NO_DENSE_KERNELS"
"""Set (to anything): the eager steps' and the compiled batched step's fp32 and bf16 products are
PyTorch's and Inductor's, not the kernels' ``dense_linear`` (for comparisons)."""


def dense_op() -> bool:
    """Whether decode steps multiply fp32 and bf16 weights with the kernels' ``dense_linear`` (the
    eager ones, and the compiled batched step where it is built):
    where the kernels are loaded (:func:`attention_op`) in an AVX-512 build (the AVX2 build's is
    PyTorch's own product) and :data:`NO_DENSE_ENV` isn't set."""
    import os

    from engine.models import kernels  # lazy: as above

    return attention_op() and kernels.loaded().name != "avx2" and not os.environ.get(NO_DENSE_ENV)


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
    tables = split_table(d, table)
    places = [_slots(t, positions, key_pools[0].shape[2]) for t in tables]
    hidden = d.embed(ids).to(d.dtype)
    for layer, keys, values in zip(d.layers, key_pools, value_pools):
        q = _rows_attention_inputs(d, layer, hidden, cos, sin, keys, values, *places[bool(layer.window)])
        attended = torch.ops.workbench.attend_paged(q, keys, values, tables[bool(layer.window)], positions,
                                                    layer.scaling, layer.window or 0, layer.cap)
        hidden = _rest_of_layer(d, layer, hidden, attended)
    return _logits(d, hidden)[:, -1]


def early_exit_decoder(d: FastDecoder, layers: int) -> FastDecoder:
    """A view of ``d`` that runs only its first ``layers`` layers, then the final norm and the
    head (speculation's early-exit draft on the fast path). It shares every weight with ``d``;
    its compiled step is its own (engine/generation/compiled_step.py builds it from the same view),
    the eager step until then."""
    view = copy.copy(d)
    view.layers = d.layers[:layers]
    view.exit_layers = layers
    view.compiled, view.compiled_rows, view.compiled_threads, view._compile_thread = None, None, None, None
    view._stop_compile = threading.Event()
    return view
