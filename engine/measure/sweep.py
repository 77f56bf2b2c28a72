"""A batch-size sweep: the same request at B = 1, 2, 4, 8…, throughput against latency.

Each point runs B copies of the prompt together. The CLI and the window set ``ignore_eos``
so every sequence makes the same number of tokens, as llama-bench does; a caller that leaves
it off gets batches whose sequences may end early. Before each batch size the memory it would add (KV cache
for B sequences, activations) is predicted against free memory; the sweep stops before a
batch that would not fit instead of finding out by running out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

from engine.measure.batch import stream_batch
from engine.base.cancel import CancelToken
from engine.base.events import BatchEvent, BatchFinished
from engine.base.request import GenerationRequest
from engine.base.units import format_bytes
from engine.estimates.costs import activation_bytes, estimate, kv_dtype_name
from engine.models.precision import dtype_bytes
from engine.estimates import hardware
from engine.estimates.estimate import available_bytes
from engine.base.errors import InvalidRequestError

MEMORY_HEADROOM = 0.8
"""Run a batch only if its predicted extra memory is under this share of free memory."""


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    aggregate_tokens_per_s: float | None
    end_to_end_tokens_per_s: float | None
    mean_ttft_s: float | None
    mean_per_token_latency_s: float | None
    peak_memory_bytes: int | None
    kv_cache_bytes: int
    kv_cache_bytes_predicted: int | None
    predicted_extra_bytes: int
    generated_tokens: int
    total_s: float
    predicted_tokens_per_s_ceiling: float | None = None
    """Decode ceiling of the cost model for this batch on the hardware it ran on."""
    ceiling_note: str | None = None
    """Why the measured rate is above its ceiling, where it is (``None``: it is not)."""
    weights_bytes: int | None = None
    """The model's weights, measured from its tensors at load: with ``kv_cache_bytes``, the
    memory that is the model's at this batch (the process's peak holds much else)."""
    activation_bytes: int | None = None
    """A decode step's activations at this batch, read from the allocator (``None``: not
    readable on this device)."""

    def to_dict(self) -> dict:
        return asdict(self)


def above_ceiling(loaded, rate: float | None, batch: int, context: int) -> tuple[float | None, str | None]:
    """The ceiling for a measured ``rate``, and why the rate beats it where it does. A rate above
    the ceiling measures the bandwidth again (this machine's speed moves with its load): the new
    ceiling stands where it holds; where even that is beaten, the note says so instead of a share
    over 100%."""
    profile = profile_for(loaded)
    e = estimate_for(loaded, batch, context, profile)
    ceiling = None if e is None else e.decode_tokens_per_s_ceiling
    if ceiling is None or not rate or rate <= ceiling or profile.id != hardware.THIS_MACHINE:
        return ceiling, None
    e = estimate_for(loaded, batch, context, hardware.this_machine(bandwidth=True))
    ceiling = None if e is None else e.decode_tokens_per_s_ceiling
    if ceiling is None or rate <= ceiling:
        return ceiling, None
    where = f"the {e.bandwidth_level}" if e.bandwidth_level == "L3" else "memory"
    return ceiling, (f"above the ceiling: {rate:,.1f} tok/s against {ceiling:,.1f} from {where}'s "
                     f"{e.bandwidth_bytes_per_s / 1e9:,.1f} GB/s, measured again just now. The bandwidth is "
                     "measured with one reduction; a step that streams its weights across both cores' caches, "
                     "or a host whose neighbours went quiet, can read faster.")


@dataclass(frozen=True)
class SweepSkip:
    batch: int
    predicted_extra_bytes: int
    available_bytes: int | None
    reason: str


def predicted_extra_bytes(loaded, batch: int, prompt_tokens: int, new_tokens: int) -> int:
    """Memory a batch adds on top of the loaded weights: its KV cache at the end, the decode
    activations, and the prefill's hidden states for all prompts at once."""

    config = loaded.model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    element = dtype_bytes(loaded.info.compute_dtype)
    context = prompt_tokens + new_tokens
    kv = loaded.predicted_kv_bytes(context, batch) or 0
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    prefill = batch * min(prompt_tokens, 512) * (4 * hidden + 2 * intermediate) * element
    return kv + activation_bytes(text, batch, context, element) + prefill


def profile_for(loaded) -> hardware.Hardware:
    """The hardware profile a loaded model runs on: this machine's (measured once, then cached) or
    a known GPU's."""
    from engine.storage.history import hardware_for  # lazy: importing it loads numpy

    profile_id = hardware_for(loaded.info.device, loaded.info.device_name)
    return hardware.this_machine() if profile_id == hardware.THIS_MACHINE else hardware.get(profile_id)


def estimate_for(loaded, batch: int, context: int, profile: hardware.Hardware | None = None):
    """The cost model's estimate for this model on this machine (the hardware profile the run
    belongs to: ``profile``, or :func:`profile_for`'s); ``None`` if that profile isn't measured
    yet or the model's layout is unknown."""
    try:
        profile = profile or profile_for(loaded)
        kv_dtype = kv_dtype_name(loaded.info.kv_dtype) or "fp32"
        return estimate(loaded.model.config, profile, loaded.info.precision, kv_dtype, context, batch)
    except Exception:
        return None


def ceiling_for(loaded, batch: int, context: int, profile: hardware.Hardware | None = None) -> float | None:
    """The cost model's decode ceiling (tok/s, all sequences): :func:`estimate_for`'s."""
    result = estimate_for(loaded, batch, context, profile)
    return None if result is None else result.decode_tokens_per_s_ceiling


def run_sweep(loaded, request: GenerationRequest, batches: Iterable[int], cancel: CancelToken | None = None,
              on_event: Callable[[int, BatchEvent], None] | None = None,
              on_point: Callable[[SweepPoint], None] | None = None,
              available: Callable[[], int | None] | None = None,
              with_ceiling: bool = True, service=None) -> tuple[list[SweepPoint], list[SweepSkip]]:
    """Run the batch sizes in order; stop at the first one predicted not to fit (it and every
    larger one are reported as skipped) or when cancelled. ``service``: the model's own engine
    service (idle), lent to each batch in turn; ``None``: one of each batch's own."""

    cancel = cancel or CancelToken()
    request = request.validated()
    prompt_ids = loaded.encode(request)
    def free_now() -> int | None:
        if loaded.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # memory the last batch left in PyTorch's pool is free for the next
        return available_bytes(str(loaded.device))

    available = available or free_now
    points: list[SweepPoint] = []
    skipped: list[SweepSkip] = []
    sizes = sorted({int(b) for b in batches})
    if not sizes or sizes[0] < 1:
        raise InvalidRequestError("Batch sizes must be whole numbers of 1 or more.")
    for position, batch in enumerate(sizes):
        extra = predicted_extra_bytes(loaded, batch, len(prompt_ids), request.max_new_tokens)
        free = available()
        if free is not None and extra > MEMORY_HEADROOM * free:
            for later in sizes[position:]:
                need = predicted_extra_bytes(loaded, later, len(prompt_ids), request.max_new_tokens)
                skipped.append(SweepSkip(later, need, free, f"batch {later} would add about {format_bytes(need)} "
                                         f"(KV cache and activations) but only {format_bytes(free)} is free"))
            break
        if cancel.cancelled:
            break
        finished: BatchFinished | None = None
        for event in stream_batch(loaded, request, [prompt_ids] * batch, cancel, service=service):
            if on_event is not None:
                on_event(batch, event)
            if isinstance(event, BatchFinished):
                finished = event
        if finished is None or finished.cancelled:
            break
        point = SweepPoint(
            batch=batch, aggregate_tokens_per_s=finished.aggregate_tokens_per_s,
            end_to_end_tokens_per_s=finished.end_to_end_tokens_per_s, mean_ttft_s=finished.mean_ttft_s,
            mean_per_token_latency_s=finished.mean_per_token_latency_s,
            peak_memory_bytes=finished.peak_memory_bytes, kv_cache_bytes=finished.kv_cache_bytes,
            kv_cache_bytes_predicted=finished.kv_cache_bytes_predicted, predicted_extra_bytes=extra,
            generated_tokens=finished.generated_tokens, total_s=finished.total_s,
            weights_bytes=loaded.info.weights_bytes, activation_bytes=finished.activation_bytes,
        )
        if with_ceiling:
            ceiling, note = above_ceiling(loaded, point.aggregate_tokens_per_s, batch,
                                          len(prompt_ids) + request.max_new_tokens)
            point = replace(point, predicted_tokens_per_s_ceiling=ceiling, ceiling_note=note)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points, skipped


def record_points(loaded, points: list[SweepPoint], prompt_tokens: int, steps: dict | None = None) -> None:
    """Keep each point in the run history, so the cost explorer shows it beside its prediction
    and File → Run history reopens it with the figures the window showed (``steps``: each batch
    size's :class:`BatchStep` events, kept as per-step series)."""
    from engine.storage.history import record_point, save  # lazy: importing it loads numpy

    for point in points:
        save(record_point(loaded.info, point, prompt_tokens, (steps or {}).get(point.batch, ())))
