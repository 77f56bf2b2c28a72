"""Past one device: how many GPUs a model and context need with tensor parallelism, what each
holds, the interconnect traffic it implies, the ceiling, and the command that serves it.

Tensor parallelism (Megatron-style, as vLLM and SGLang do it) splits every layer's matrices
across N GPUs: each holds 1/N of the weights and the KV cache of 1/N of the KV heads (a KV
head is never split: with more GPUs than KV heads, heads are copied and a GPU holds one).
Each layer then ends its attention and its MLP with an all-reduce of the hidden state, so per
token and GPU a ring all-reduce sends 2·(N−1)/N × hidden × 2 bytes, twice a layer.

A decode step on N GPUs therefore takes at least

    max(memory time, compute time) + interconnect time
    memory time        = (weights/N + KV per GPU) / bandwidth
    compute time       = B × FLOPs per token / (N × peak FLOP/s)
    interconnect time  = B × all-reduce bytes per token per GPU / link bandwidth (one direction)
                         + 2 × layers × the fixed cost of one all-reduce

and the plan picks the smallest N (a power of two dividing the attention heads, as both
servers require) whose per-GPU memory fits the share of the device the server may use
(``--gpu-memory-utilization``, vLLM's default 0.9).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.base.errors import InvalidRequestError
from engine.estimates.costs import estimate
from engine.estimates.hardware import Hardware

SIZES = (1, 2, 4, 8, 16, 32)
MEMORY_UTILIZATION = 0.9
RUNTIME_BYTES = 2 * 2**30
"""Per GPU besides weights, cache and activations: the CUDA context, captured CUDA graphs and NCCL's
buffers (an assumption: about what vLLM's start-up leaves outside its KV cache on an H100)."""
PREFILL_CHUNK_TOKENS = 8192
"""Prompt tokens a step may read (vLLM's chunked-prefill batch): their activations are the peak."""
ALLREDUCE_BYTES = 2
"""The hidden state crosses the link in bf16."""
ALLREDUCE_LATENCY_S = 5e-6
"""Fixed cost of one small all-reduce over NVLink (an assumption, NCCL's order of magnitude): two a
layer, so it, not the bytes, is the link's share of a small batch's step."""


@dataclass(frozen=True)
class ParallelOption:
    gpus: int
    weights_per_gpu_bytes: int
    kv_per_gpu_bytes: int
    activation_per_gpu_bytes: int
    """Decode working memory and a prefill chunk's, split N ways."""
    runtime_per_gpu_bytes: int
    total_per_gpu_bytes: int
    usable_per_gpu_bytes: int
    fits: bool
    allreduce_bytes_per_token: int
    """Bytes each GPU sends over its link per generated token (all layers)."""
    memory_time_s: float
    interconnect_time_s: float | None
    """``None``: the profile gives no link bandwidth."""
    compute_time_s: float
    decode_tokens_per_s_ceiling: float
    """All sequences of the batch together."""
    bound: str


@dataclass(frozen=True)
class ParallelPlan:
    model: str
    hardware: str
    precision: str
    kv_dtype: str
    context: int
    batch: int
    memory_utilization: float
    options: tuple[ParallelOption, ...]
    """Every size tried, smallest first."""
    chosen: ParallelOption | None
    """The smallest that fits; ``None`` if none does."""
    vllm_command: str | None
    sglang_command: str | None
    usd_per_million_tokens: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def prefill_activation_bytes(text_config, tokens: int = PREFILL_CHUNK_TOKENS, element: int = 2) -> int:
    """The hidden state and MLP intermediates of a prefill chunk (bf16)."""
    hidden = int(text_config.hidden_size)
    intermediate = int(getattr(text_config, "intermediate_size", None) or 4 * hidden)
    return tokens * (4 * hidden + 2 * intermediate) * element


def _sizes(heads: int, largest: int) -> list[int]:
    return [n for n in SIZES if n <= largest and heads % n == 0]


def plan_tensor_parallel(config, hardware: Hardware, precision: str = "bf16", kv_dtype: str = "bf16",
                         context: int = 4096, batch: int = 1, model: str = "",
                         memory_utilization: float = MEMORY_UTILIZATION, largest: int = 8,
                         token_budget: int | None = None) -> ParallelPlan:
    """The tensor-parallel sizes of ``hardware`` for this model and setup, the fewest GPUs that fit
    chosen, and both servers' commands for it (``token_budget``: the prompt and decode tokens one
    step may take, where it is set)."""
    if hardware.kind == "cpu":
        raise InvalidRequestError("Tensor parallelism plans GPUs: choose a GPU profile.")
    if not 0 < memory_utilization <= 1:
        raise InvalidRequestError("The memory utilization must be in (0, 1].")
    one = estimate(config, hardware, precision, kv_dtype, context, batch, model=model)
    text = config.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
    usable = int(hardware.memory_bytes * memory_utilization)
    options = []
    for n in _sizes(heads, largest):
        weights = -(-one.weights_bytes // n)
        kv = one.kv_bytes_total // min(n, kv_heads)
        activation = -(-(one.activation_bytes + prefill_activation_bytes(text)) // n)
        total = weights + kv + activation + RUNTIME_BYTES
        allreduce = int(layers * 2 * 2 * (n - 1) / n * hidden * ALLREDUCE_BYTES)
        memory_time = (-(-one.weights_read_bytes // n) + kv) / hardware.bandwidth_bytes_per_s
        link = getattr(hardware, "interconnect_bytes_per_s", None)
        link_time = (batch * allreduce / link + layers * 2 * ALLREDUCE_LATENCY_S if link and n > 1
                     else (0.0 if n == 1 else None))
        compute_time = batch * one.flops_per_token / (n * hardware.bf16_flops)
        work = max(memory_time, compute_time)
        step = work + (link_time or 0.0)  # the all-reduces wait for the layer's work (not overlapped)
        bound = "interconnect" if (link_time or 0.0) > work else ("memory" if memory_time >= compute_time
                                                                  else "compute")
        options.append(ParallelOption(
            gpus=n, weights_per_gpu_bytes=weights, kv_per_gpu_bytes=kv, activation_per_gpu_bytes=activation,
            runtime_per_gpu_bytes=RUNTIME_BYTES, total_per_gpu_bytes=total, usable_per_gpu_bytes=usable, fits=total <= usable,
            allreduce_bytes_per_token=allreduce, memory_time_s=memory_time, interconnect_time_s=link_time,
            compute_time_s=compute_time, decode_tokens_per_s_ceiling=batch / step, bound=bound))
    chosen = next((o for o in options if o.fits), None)
    usd = None
    if chosen is not None and hardware.usd_per_hour:
        usd = chosen.gpus * hardware.usd_per_hour / (chosen.decode_tokens_per_s_ceiling * 3600) * 1e6
    return ParallelPlan(
        model=model, hardware=hardware.id, precision=precision, kv_dtype=kv_dtype, context=context, batch=batch,
        memory_utilization=memory_utilization, options=tuple(options), chosen=chosen,
        vllm_command=vllm_command(model, chosen.gpus, context, batch, precision, kv_dtype, memory_utilization,
                                  token_budget) if chosen else None,
        sglang_command=sglang_command(model, chosen.gpus, context, batch, precision, kv_dtype, memory_utilization,
                                      token_budget) if chosen else None,
        usd_per_million_tokens=usd)


def ceiling_for(config, hardware: Hardware, precision: str, kv_dtype: str, context: int, batch: int,
                gpus: int = 1) -> float:
    """The decode ceiling (tok/s of all requests) at ``batch`` on ``gpus`` of ``hardware`` with tensor
    parallelism: what a load sweep's point against a server of that size is a share of."""
    if gpus <= 1 or hardware.kind == "cpu":
        return estimate(config, hardware, precision, kv_dtype, context, batch).decode_tokens_per_s_ceiling
    plan = plan_tensor_parallel(config, hardware, precision, kv_dtype, context, batch, largest=gpus)
    option = next((o for o in plan.options if o.gpus == gpus), None)
    if option is None:
        raise InvalidRequestError(f"{gpus} GPUs can't split this model's attention heads evenly.")
    return option.decode_tokens_per_s_ceiling


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _weight_flags(precision: str, fp8_dtype: bool) -> tuple[list[str], str]:
    """Both servers' weight flags (``fp8_dtype``: name the activations' dtype beside fp8 weights, as
    vLLM's command does), and a note when the weights need a checkpoint quantized to ``precision``."""
    if precision in _DTYPES:
        return ["--dtype", _DTYPES[precision]], ""
    if precision == "fp8":
        return (["--dtype", "bfloat16"] if fp8_dtype else []) + ["--quantization", "fp8"], ""
    return ["--quantization", "awq"], f"a checkpoint quantized to {precision}"


def _command(parts: list[str], note: str) -> str:
    """A command line; the note last, as a shell comment, so pasting it loses no flag."""
    return " ".join(parts) + (f"  # {note}" if note else "")


def vllm_command(model: str, gpus: int, context: int, batch: int, precision: str, kv_dtype: str,
                 memory_utilization: float, token_budget: int | None = None) -> str:
    """``vllm serve`` for this plan."""
    weights, note = _weight_flags(precision, fp8_dtype=True)
    parts = ["vllm", "serve", model or "MODEL", "--tensor-parallel-size", str(gpus), "--max-model-len", str(context),
             "--gpu-memory-utilization", f"{memory_utilization:.2f}", "--max-num-seqs", str(batch), *weights]
    if kv_dtype in ("fp8", "int8"):
        parts += ["--kv-cache-dtype", "fp8"]
    if token_budget:
        parts += ["--max-num-batched-tokens", str(token_budget)]
    return _command(parts, note)


def sglang_command(model: str, gpus: int, context: int, batch: int, precision: str, kv_dtype: str,
                   memory_utilization: float, token_budget: int | None = None) -> str:
    """``python -m sglang.launch_server`` for this plan."""
    weights, note = _weight_flags(precision, fp8_dtype=False)
    parts = ["python", "-m", "sglang.launch_server", "--model-path", model or "MODEL", "--tp", str(gpus),
             "--context-length", str(context), "--mem-fraction-static", f"{memory_utilization:.2f}",
             "--max-running-requests", str(batch), *weights]
    if kv_dtype in ("fp8", "int8"):
        parts += ["--kv-cache-dtype", "fp8_e5m2"]
    if token_budget:
        parts += ["--chunked-prefill-size", str(token_budget)]
    return _command(parts, note)


__all__ = ["ParallelOption", "ParallelPlan", "plan_tensor_parallel", "sglang_command", "vllm_command"]
