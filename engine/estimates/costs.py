"""The cost model: memory, the decode speed ceiling, and money, from a config and a hardware profile.

Decoding one step of a batch of B sequences reads every weight once (but an input embedding
table no head reads whole, of which each sequence reads one row) and each sequence's KV cache,
and does about 2·N FLOPs per sequence (N parameters) plus the attention over the context. So,
per step:

    memory time  = (weight bytes read + B × KV bytes) / bandwidth
    compute time = B × FLOPs per token / peak FLOP/s

The step takes at least the larger of the two: tok/s ceiling = B / max(memory time, compute
time). Small batches are memory-bound (the weights are read for only a few tokens), large
ones compute-bound; the **ridge** is the batch where the two times are equal.

$ per 1M output tokens = $/hour ÷ (tok/s × 3600) × 10⁶; Wh per 1M tokens = watts × 10⁶ ÷ tok/s ÷ 3600.
Training costs ≈ 6·N·D FLOPs for D tokens, serving 2·N per token: after 3·D served tokens,
serving has used as much compute as training did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.estimates.estimate import ParameterCount, count_parameters, looked_up_bytes, weights_bytes
from engine.base.errors import InvalidRequestError
from engine.estimates.hardware import Hardware
from engine.base.kv import kv_layout
from engine.models.precision import PRECISIONS, Q8_BLOCK, Q8_BLOCK_BYTES

GGUF_BITS = {  # bits per weight of llama.cpp's block formats, scales included
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q4_k": 4.5, "q4_1": 5.0, "q4_0": 4.5, "q3_k": 3.4375, "q2_k": 2.625,
}
KV_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": Q8_BLOCK_BYTES / Q8_BLOCK, "int4": 18 / 32}
"""Bytes a cached key or value takes: int8 and int4 in 32-value blocks with an fp16 scale each,
as llama.cpp's q8_0 and q4_0 caches (and this workbench's int8 cache) keep them."""
_TORCH_KV_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}


def kv_dtype_name(torch_dtype: str) -> str | None:
    """The cost model's name (:data:`KV_DTYPES`) for a KV cache's torch dtype, as a loaded model
    reports it (``Loaded.kv_dtype``: ``bfloat16``…); ``None`` for one it doesn't know."""
    return _TORCH_KV_DTYPES.get(torch_dtype)
ALL_PRECISIONS = tuple(PRECISIONS) + tuple(GGUF_BITS)


def all_weights_bytes(count: ParameterCount, precision: str, device_type: str = "cuda") -> int:
    """Weights in any precision we load, or a GGUF block format (every matrix at its bits per
    weight, the small vectors in fp32: a simplification of llama.cpp's per-tensor mixes)."""
    key = precision.lower()
    if key in GGUF_BITS:
        return int(count.total * GGUF_BITS[key] / 8)
    if key not in PRECISIONS:
        raise InvalidRequestError(f"Unknown precision {precision!r}: choose one of {', '.join(ALL_PRECISIONS)}.")
    return weights_bytes(count, key, device_type)


def all_looked_up_bytes(count: ParameterCount, precision: str) -> tuple[int, int]:
    """:func:`looked_up_bytes` for any precision :func:`all_weights_bytes` takes: a GGUF's table
    at the format's bits per weight, looked up only where untied (llama.cpp's tied head reads it
    whole)."""
    key = precision.lower()
    if key not in GGUF_BITS:
        return looked_up_bytes(count, key)
    if not count.embedding or count.tied:
        return 0, 0
    return int(count.embedding * GGUF_BITS[key] / 8), int(count.embedding_dim * GGUF_BITS[key] / 8)


TABLE_LOOKUP = "all but the input embedding table: each token looks up one row of it"
"""Why a step reads less than the weights, where it does (the CLI and the cost explorer say it)."""


@dataclass(frozen=True)
class Estimate:
    model: str
    precision: str
    kv_dtype: str
    context: int
    batch: int
    hardware: str
    parameters: int
    weights_bytes: int
    weights_read_bytes: int
    """Of the weights, what one decode step reads (all but a table only looked up: ``all_looked_up_bytes``)."""
    kv_bytes_per_token: int | None
    kv_bytes_total: int
    activation_bytes: int
    total_bytes: int
    device_memory_bytes: int
    fits: bool
    flops_per_token: float
    memory_bound_tokens_per_s: float
    compute_bound_tokens_per_s: float
    decode_tokens_per_s_ceiling: float
    per_request_tokens_per_s: float
    bound: str
    ridge_batch: float | None
    prefill_s: float
    usd_per_million_tokens: float | None
    wh_per_million_tokens: float | None
    training_flops: float | None
    training_breakeven_tokens: float | None
    bandwidth_bytes_per_s: float = 0.0
    """The read bandwidth the memory-bound line uses: the memory's, or the last-level cache's where
    a step's bytes fit in it (``bandwidth_level``)."""
    bandwidth_level: str = "memory"

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(config, hardware: Hardware, precision: str = "bf16", kv_dtype: str = "bf16", context: int = 4096,
             batch: int = 1, training_tokens: float | None = None, model: str = "",
             count: ParameterCount | None = None) -> Estimate:
    """Everything the cost explorer shows, for one point (``count`` skips the meta-device build)."""
    if kv_dtype not in KV_DTYPES:
        raise InvalidRequestError(f"Unknown KV dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}.")
    if context < 1 or batch < 1:
        raise InvalidRequestError("context and batch must be at least 1.")
    text = config.get_text_config(decoder=True)
    count = count or count_parameters(config)
    device_type = "cpu" if hardware.kind == "cpu" else "cuda"
    weights = all_weights_bytes(count, precision, device_type)
    table, row = all_looked_up_bytes(count, precision)
    read = weights - table + batch * row  # each sequence looks up its own row
    layout = kv_layout(config)
    element = KV_DTYPES[kv_dtype]
    per_token = int(layout.bytes_per_token(1) * element) if layout else None
    kv_per_sequence = int(layout.bytes_for(context, 1) * element) if layout else 0
    kv_total = batch * kv_per_sequence
    activation = activation_bytes(text, batch, context)
    total = weights + kv_total + activation
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    # 2 FLOPs per weight a token multiplies by (not an untied input table's: a lookup), and
    # attention: q·k and p·v over the context, 2 FLOPs each
    attention = 4 * int(text.num_hidden_layers) * heads * head_dim * context
    flops = 2.0 * (count.total - (0 if count.tied else count.embedding)) + attention
    bandwidth, level = hardware.bandwidth_for(read + kv_total)
    memory_time = (read + kv_total) / bandwidth
    memory_rate = batch / memory_time
    compute_rate = hardware.bf16_flops / flops
    ceiling = min(memory_rate, compute_rate)
    # a step reads weights − table once and a row and a KV cache per sequence: the two times are
    # equal where B × (FLOPs / peak − (row + KV) / bandwidth) = (weights − table) / bandwidth
    denominator = flops / hardware.bf16_flops - (kv_per_sequence + row) / bandwidth
    ridge = ((weights - table) / bandwidth) / denominator if denominator > 0 else None
    fits = total <= hardware.memory_bytes
    # no price without a price per hour (this machine has none), and none for a setup that doesn't fit
    usd = (hardware.usd_per_hour / (ceiling * 3600) * 1e6) if hardware.usd_per_hour and fits else None
    wh = (hardware.watts * 1e6 / ceiling / 3600) if hardware.watts and fits else None
    training = 6.0 * count.total * training_tokens if training_tokens else None
    return Estimate(
        model=model, precision=precision, kv_dtype=kv_dtype, context=context, batch=batch, hardware=hardware.id,
        parameters=count.total, weights_bytes=weights, weights_read_bytes=read, kv_bytes_per_token=per_token,
        kv_bytes_total=kv_total,
        activation_bytes=activation, total_bytes=total, device_memory_bytes=hardware.memory_bytes,
        fits=fits, flops_per_token=flops, memory_bound_tokens_per_s=memory_rate,
        compute_bound_tokens_per_s=compute_rate, decode_tokens_per_s_ceiling=ceiling,
        per_request_tokens_per_s=ceiling / batch, bound="memory" if memory_rate <= compute_rate else "compute",
        ridge_batch=ridge, prefill_s=context * flops / hardware.bf16_flops, usd_per_million_tokens=usd,
        wh_per_million_tokens=wh, training_flops=training,
        training_breakeven_tokens=(training / (2.0 * count.total)) if training else None,
        bandwidth_bytes_per_s=bandwidth, bandwidth_level=level,
    )


def activation_bytes(text_config, batch: int, context: int, element: int = 2) -> int:
    """Working memory of a decode step besides weights and cache: the hidden state and MLP
    intermediates (bf16), the fp32 logits over the vocabulary, and fp32 attention scores
    over the context. Rough, and small next to the weights until batch × context grows."""
    hidden = int(text_config.hidden_size)
    intermediate = int(getattr(text_config, "intermediate_size", None) or 4 * hidden)
    heads = int(text_config.num_attention_heads)
    per_sequence = (4 * hidden + 2 * intermediate) * element + 4 * int(text_config.vocab_size) + 4 * heads * context
    return batch * per_sequence


def shared_prefix_kv(kv_of, context: int, batch: int, prefix: int) -> tuple[int, int]:
    """KV bytes of ``batch`` sequences of ``context`` tokens whose first ``prefix`` tokens are the
    same (a system prompt): (each holding its own copy, the prefix held once). ``kv_of(tokens)``:
    one sequence's KV bytes at that length. The second is what a paged cache that shares blocks
    holds (vLLM, SGLang); the workbench's own engine copies a cached prefix into each request's
    cache, so it saves the prefix's compute, not its memory (engine/generation/kv_manager.py)."""
    prefix = max(0, min(prefix, context))
    whole, shared = kv_of(context), kv_of(prefix) if prefix else 0
    return batch * whole, shared + batch * max(0, whole - shared)
