"""The events every consumer reads: CLI, window, comparison, benchmarks, tests.

Small frozen dataclasses, no torch and no Qt, so any thread or process can hold them.
Sizes are bytes, times are seconds. A field that a backend cannot measure is ``None``
(absent), never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

FinishReason = Literal["eos", "length", "stop_string", "cancelled", "context", "error"]
"""``error``: stopped by the engine (non-finite scores); the run up to there is kept."""


@dataclass(frozen=True, slots=True)
class MemorySample:
    """One reading of process and device memory."""

    rss_bytes: int | None
    """Resident set size of this process (psutil)."""
    device: str
    """``cpu``, ``cuda:0``, ``mps``…, ``remote`` (a model served elsewhere: nothing to read here)."""
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
    """How it was found: ``default``, ``folder``, ``gguf``, ``hub``, ``endpoint`` (a server's model:
    the figures below that only the server knows are ``None``)."""
    path: str
    """The folder the weights were read from (for GGUF: the converted safetensors copy)."""
    precision: str
    device: str
    device_name: str
    architecture: str
    model_type: str
    parameters: int | None
    weights_bytes: int | None
    """Bytes of the weights as stored in memory: parameters, buffers and quantization state."""
    load_s: float
    context_length: int | None
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    compute_dtype: str
    kv_bytes_per_token: int | None
    """Predicted KV-cache bytes per token while no sliding window has filled; ``None`` if unknown."""
    original_format: str = ""
    """e.g. ``GGUF Q4_1`` or ``safetensors BF16``."""
    has_chat_template: bool = True
    chat_template: str = ""
    """Which chat template chat requests use, in words: the model's own, or the family's the load
    recognised where the model ships without one."""
    kv_dtype: str = ""
    """The dtype the KV cache keeps (``kv_bytes_per_token`` counts it); left empty (a record from
    before the two could differ), ``compute_dtype``."""
    kv_shared: bool | None = None
    """Whether the KV cache is one pool of blocks that requests with a common prefix share in place
    (the fast path's), or a cache per request that cached prefix blocks are copied into (the
    reference runner's); ``None``: not this engine's (a served model)."""

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.compute_dtype)


@dataclass(frozen=True, slots=True)
class Alternative:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class PromptTokenScore:
    """One prompt token as the model scored it, given every token before it."""

    token_id: int
    text: str
    logprob: float
    rank: int
    """1 + how many tokens the model found likelier (1: its top choice), as vLLM counts."""
    top_alternatives: tuple[Alternative, ...]
    """The likeliest tokens at this position, best first (the request's ``prompt_logprobs``)."""


@dataclass(frozen=True, slots=True)
class PromptScored:
    """The prompt's tokens scored (a request with ``prompt_logprobs``): every token after the
    first, in order; it comes before the request's ``Prefilled``."""

    scores: tuple[PromptTokenScore, ...]
    request_id: int = 0


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prompt went through the model; the first token is being picked."""

    prompt_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float
    kv_cache_bytes: int | None
    kv_cache_bytes_predicted: int | None
    memory: MemorySample
    request_id: int = 0
    cached_tokens: int = 0
    """Prompt tokens copied from the prefix cache instead of computed (``prefill_s`` is the rest's)."""
    activation_bytes: int | None = None
    """As :attr:`Finished.activation_bytes` (known from the start: the memory plot adds it)."""


@dataclass(frozen=True, slots=True)
class TokenGenerated:
    """One generated token and what it cost."""

    index: int
    """0 for the first generated token."""
    token_id: int
    text: str
    """The text this token adds; all pieces concatenate to ``tokenizer.decode(ids)``."""
    logprob: float | None
    """log p(token) under the model's raw distribution (before temperature and filters); ``None``
    when a server didn't send it."""
    top_alternatives: tuple[Alternative, ...]
    latency_s: float
    """Time for this token: TTFT for index 0, one decode step after that."""
    elapsed_s: float
    """Time since the request started."""
    kv_cache_bytes: int | None
    """Bytes of the key/value tensors the cache holds now (measured); ``None`` where they can't be
    seen (a model served elsewhere)."""
    kv_cache_bytes_predicted: int | None
    """The same, predicted from the model config."""
    memory: MemorySample
    special: bool = False
    """A special token (end of turn, BOS…)."""
    drafted: bool | None = None
    """Speculative decoding only: ``True`` when a draft proposed this token and the target
    accepted it, ``False`` when the target produced it (a correction or the bonus token);
    ``None`` in plain decoding."""
    request_id: int = 0
    """Which request of the engine core (engine/generation/core.py) this token belongs to; 0 outside it."""


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
    kv_cache_bytes: int | None
    kv_cache_bytes_predicted: int | None
    token_ids: tuple[int, ...] = field(repr=False, default=())
    text: str = field(repr=False, default="")
    stop_string: str | None = None
    drafted_tokens: int | None = None
    """Speculative decoding only: tokens the draft proposed in all."""
    accepted_tokens: int | None = None
    """Speculative decoding only: proposed tokens the target accepted."""
    request_id: int = 0
    error: str | None = None
    """``reason == "error"``: what went wrong (the engine core ends one request, not the others)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at its first admission (not computed)."""
    activation_bytes: int | None = None
    """A decode step's activations for this model at one sequence, read from the allocator once
    per loaded model, outside every request's clock (engine/generation/generate.decode_activations);
    ``None``: not readable here (MPS) or not this engine's."""
    preemptions: int = 0
    """Times it was preempted (its cache freed, later computed again) for lack of KV blocks."""
    prefix_cache_bytes: int | None = None
    """Bytes the core's prefix cache keeps once this request's blocks are in it (measured);
    ``None``: no prefix cache."""
    prompt_ids: tuple[int, ...] = field(repr=False, default=())
    """The prompt's token ids as the model read them (a chat's next turn continues from them
    and ``token_ids``: :attr:`~engine.base.request.GenerationRequest.continues`)."""
    continued: bool | None = None
    """A chat turn asked to continue from the last exchange's tokens: whether it did (``False``:
    the template can't be split that way, so the history's text was tokenized again); ``None``: not asked."""


@dataclass(frozen=True, slots=True)
class DraftVerified:
    """Speculative decoding: the draft proposed some tokens and the target checked them all in
    one forward pass. The accepted ones (and the target's own next token) follow as
    :class:`TokenGenerated` events; the rejected ones exist only here."""

    step: int
    drafted_ids: tuple[int, ...]
    drafted_text: tuple[str, ...]
    accepted: int
    """How many of ``drafted_ids``, from the start, the target accepted."""
    draft_s: float
    """Time the draft took to propose them."""
    verify_s: float
    """Time the target took to check them (one forward pass over all of them)."""
    elapsed_s: float
    request_id: int = 0
    step_s: float = 0.0
    """The step's own clock: the draft, the target's pass, the acceptance rule and the caches'
    rollback to what was kept (its tokens' events follow it)."""


@dataclass(frozen=True, slots=True)
class Preempted:
    """The engine core ran out of KV blocks and took this request's back: it waits at the front
    of the queue and, admitted again, computes its prompt and the tokens it has so far once more
    (vLLM's recompute); its answer goes on where it stopped."""

    step: int
    tokens: int
    """Tokens it had generated (kept; recomputed into the cache when it runs again)."""
    blocks_freed: int
    elapsed_s: float
    request_id: int = 0


GenerationEvent = Union[PromptScored, Prefilled, TokenGenerated, DraftVerified, Preempted, Finished]


@dataclass(frozen=True, slots=True)
class BatchStep:
    """Batched decoding: one forward pass produced one token for every unfinished sequence."""

    step: int
    token_ids: tuple[int | None, ...]
    """Per sequence, the new token, or ``None`` for a sequence that had already finished."""
    texts: tuple[str, ...]
    latency_s: float
    """Time of this step (the first step includes the prefill of all prompts)."""
    elapsed_s: float
    active: int
    """Sequences that were still generating in this step."""
    kv_cache_bytes: int
    kv_cache_bytes_predicted: int | None
    memory: MemorySample


@dataclass(frozen=True, slots=True)
class SequenceResult:
    """One request of a batch, as its caller would have seen it."""

    index: int
    reason: FinishReason
    tokens: int
    prompt_tokens: int
    ttft_s: float | None
    mean_token_latency_s: float | None
    """Mean time between this sequence's tokens after the first."""
    token_ids: tuple[int, ...] = field(repr=False, default=())
    text: str = field(repr=False, default="")


@dataclass(frozen=True, slots=True)
class BatchFinished:
    """A batch ended; totals for all its sequences."""

    batch: int
    sequences: tuple[SequenceResult, ...]
    prefill_s: float
    total_s: float
    generated_tokens: int
    aggregate_tokens_per_s: float | None
    """Decode throughput of the whole batch: tokens after each sequence's first, over the time
    from the first decode step to the last. Comparable to the cost explorer's decode ceiling."""
    end_to_end_tokens_per_s: float | None
    """All generated tokens over the whole wall time, prefill included."""
    mean_ttft_s: float | None
    mean_per_token_latency_s: float | None
    peak_memory_bytes: int | None
    peak_rss_bytes: int | None
    kv_cache_bytes: int
    kv_cache_bytes_predicted: int | None
    cancelled: bool = False
    activation_bytes: int | None = None
    """The first decode step's activations with every sequence in it, read from the allocator
    (that step is left out of the decode timing: watching the CPU's allocations slows it)."""


BatchEvent = Union[BatchStep, BatchFinished]


@dataclass(frozen=True, slots=True)
class StepCompleted:
    """The engine core ran one step: some requests' decode tokens and some prompt chunks in
    one go (engine/generation/core.py). What the traffic plots read."""

    step: int
    batch: int
    """Requests that got a token in this step."""
    decode_tokens: int
    prefill_tokens: int
    """Prompt tokens that went into the cache in this step (chunks of one or more prompts)."""
    waiting: int
    """Requests submitted but not yet admitted (over the batch size or the KV budget)."""
    running: int
    """Requests admitted and not yet finished, after this step."""
    kv_cache_bytes: int
    """Bytes the cache holds for every running request together (measured)."""
    kv_cache_bytes_predicted: int | None
    step_s: float
    elapsed_s: float
    """Time since the core started."""
    memory: MemorySample
    preempted: int = 0
    """Requests preempted before this step (KV blocks ran out)."""
    cached_tokens: int = 0
    """Prompt tokens copied from the prefix cache into requests admitted in this step."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache in this step (0 when it is off)."""
    kv_blocks_used: int = 0
    """KV blocks the running requests hold, a shared block once (engine/generation/kv_manager.py)."""
    kv_blocks_kept: int = 0
    """Cached blocks no running request holds (the prefix cache's, waiting for a request that
    begins the same way)."""
    kv_kept_bytes: int = 0
    """Bytes of those cached blocks (beside ``kv_cache_bytes``, the running requests')."""
    kv_blocks_total: int | None = None
    """Blocks the KV budget holds (``None``: no budget)."""
    kv_block_tokens: int = 16
    kv_blocks_shared: int = 0
    """Held blocks more than one running request reads (a common prefix, held once)."""
    kv_pool_bytes: int = 0
    """The block pool's storage, read from its tensors (0 where the runner keeps a cache per
    request instead: the reference runner)."""
    activation_bytes: int | None = None
    """A watched step only (``EngineCore.watch_next``): the most its forward passes held in
    intermediate tensors at once, read from the allocator (engine/base/memory.StepAllocations);
    on the CPU its ``step_s`` is the watch's, not the model's."""
    kv_tokens_read: int = 0
    """Cache tokens the decode rows attended over, each row its whole context (what the
    step-cost model of engine/estimates/step_cost.py reads)."""
    prompt_pairs: float = 0.0
    """Token pairs the prompt chunks attended over: each chunk token over the tokens before it."""
    prompt_chunks: int = 0
    """Prompt chunks read in this step (one forward pass each)."""

    def parts(self) -> tuple[float, ...]:
        """What the step held, by :data:`STEP_PARTS`."""
        return step_parts(self.decode_tokens, self.prompt_chunks, self.prefill_tokens, self.kv_tokens_read,
                          self.prompt_pairs)


STEP_PARTS = ("steps", "batched_passes", "decode_rows", "kv_tokens_read", "prompt_chunks", "prompt_tokens",
              "prompt_pairs", "lone_row_passes")
"""What a step is paid for, in the serving simulator's step cost (engine/estimates/step_cost.py:
a figure for each, in this order); a server sums them on its ``/metrics``."""


def step_parts(rows: int, chunks: int, prompt_tokens: int, kv_tokens: int, pairs: float) -> tuple[float, ...]:
    """A step's :data:`STEP_PARTS`: itself, a batched decode pass (several rows), its decode rows,
    the cached tokens they read, its prompt chunks, their tokens and pairs, a lone row's pass."""
    return (1.0, float(rows > 1), float(rows), float(kv_tokens), float(chunks), float(prompt_tokens), float(pairs),
            float(rows == 1))


@dataclass(frozen=True, slots=True)
class ServerSampled:
    """What a server said about itself (its ``/metrics``) while it answered a request: its own
    figures, drawn where a local model's KV and memory go. ``None``: the server doesn't say."""

    at_s: float
    """Seconds since the request was sent."""
    kind: str
    """``vllm``, ``sglang``, ``llama.cpp`` (read from the metric names, or its ``/slots``)."""
    running: float | None
    waiting: float | None
    kv_usage: float | None
    """Fraction (0-1) of the server's KV cache in use, all its requests together."""
    preemptions: float | None
    request_id: int = 0
    slots_busy: int | None = None
    """llama.cpp's ``/slots``: slots decoding a request now, of ``slots_total`` (its ``-np``)."""
    slots_total: int | None = None


@dataclass(frozen=True, slots=True)
class EndpointAnswered:
    """How a served answer was counted (just before its ``Finished``): the tokens by the server's
    own count where it gave one, else by its chunks, which may hold several tokens each."""

    counted_by: Literal["logprobs", "usage per chunk", "chunks"]
    """``logprobs``: one entry per token; ``usage per chunk``: vLLM's ``continuous_usage_stats``;
    ``chunks``: a chunk counted as a token (the server said no more)."""
    chunks: int
    """Server-sent events that carried answer text or tokens."""
    usage_prompt_tokens: int | None
    usage_completion_tokens: int | None
    """The final ``usage`` (``None``: the server sent none)."""
    server: str
    """What answered: ``vLLM``, ``llama.cpp``, ``Inference Workbench``…"""
    timings: dict | None = None
    """llama.cpp's own ``timings`` (prompt and predicted ms and tokens/s), when it sends them."""
    request_id: int = 0
    chunk_times_s: tuple[float, ...] = ()
    """When each chunk with tokens arrived, seconds after the request was sent (per-chunk latency:
    the gaps between them; the tokens' own latencies share each gap)."""
