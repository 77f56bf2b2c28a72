"""The events every consumer reads: CLI, window, comparison, benchmarks, tests.

Small frozen dataclasses, no torch and no Qt, so any thread or process can hold them.
Sizes are bytes, times are seconds. A field that a backend cannot measure is ``None``
(absent), never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

FinishReason = Literal["eos", "length", "stop_string", "cancelled", "context"]


@dataclass(frozen=True, slots=True)
class MemorySample:
    """One reading of process and device memory."""

    rss_bytes: int | None
    """Resident set size of this process (psutil)."""
    device: str
    """``cpu``, ``cuda:0``, ``mps``…"""
    device_allocated_bytes: int | None = None
    """Tensors held by the framework's allocator (CUDA/MPS)."""
    device_reserved_bytes: int | None = None
    """Memory the allocator holds from the driver (CUDA ``memory_reserved``, MPS driver memory)."""
    device_peak_bytes: int | None = None
    """Peak allocated since the generation started (CUDA)."""
    device_used_bytes: int | None = None
    """Used memory of the whole device as the driver reports it (NVML), all processes."""
    device_total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """Loading advanced. ``total`` is 0 when the stage has no known length."""

    stage: str
    """``resolve``, ``download``, ``convert``, ``tokenizer``, ``weights``, ``ready``."""
    done: int
    total: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model is loaded and ready: the facts the UI shows next to it."""

    name: str
    source: str
    """How it was found: ``default``, ``folder``, ``gguf``, ``hub``."""
    path: str
    """The folder the weights were read from (for GGUF: the converted safetensors copy)."""
    precision: str
    device: str
    device_name: str
    architecture: str
    model_type: str
    parameters: int
    weights_bytes: int
    """Bytes of the weights as stored in memory: parameters, buffers and quantization state."""
    load_s: float
    context_length: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    compute_dtype: str
    kv_bytes_per_token: int | None
    """Predicted KV-cache bytes per token while no sliding window has filled; ``None`` if unknown."""
    original_format: str = ""
    """e.g. ``GGUF Q4_1`` or ``safetensors BF16``."""
    has_chat_template: bool = True


@dataclass(frozen=True, slots=True)
class Alternative:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prompt went through the model; the first token is being picked."""

    prompt_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float
    kv_cache_bytes: int
    kv_cache_bytes_predicted: int | None
    memory: MemorySample


@dataclass(frozen=True, slots=True)
class TokenGenerated:
    """One generated token and what it cost."""

    index: int
    """0 for the first generated token."""
    token_id: int
    text: str
    """The text this token adds; all pieces concatenate to ``tokenizer.decode(ids)``."""
    logprob: float
    """log p(token) under the model's raw distribution (before temperature and filters)."""
    top_alternatives: tuple[Alternative, ...]
    latency_s: float
    """Time for this token: TTFT for index 0, one decode step after that."""
    elapsed_s: float
    """Time since the request started."""
    kv_cache_bytes: int
    """Bytes of the key/value tensors the cache holds now (measured)."""
    kv_cache_bytes_predicted: int | None
    """The same, predicted from the model config."""
    memory: MemorySample
    special: bool = False
    """A special token (end of turn, BOS…)."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation ended; totals for the whole request."""

    reason: FinishReason
    tokens: int
    prompt_tokens: int
    ttft_s: float | None
    """Request start to first token; ``None`` if cancelled before it."""
    decode_s: float
    """First token to last token."""
    decode_tokens_per_s: float | None
    """(tokens − 1) / decode_s: the speed of the decode loop alone; ``None`` under 2 tokens."""
    total_s: float
    peak_memory_bytes: int | None
    """Peak device memory on a GPU, peak process RSS on the CPU."""
    peak_rss_bytes: int | None
    kv_cache_bytes: int
    kv_cache_bytes_predicted: int | None
    token_ids: tuple[int, ...] = field(repr=False, default=())
    text: str = field(repr=False, default="")
    stop_string: str | None = None


GenerationEvent = Union[Prefilled, TokenGenerated, Finished]
