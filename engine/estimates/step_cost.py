"""What one step of the engine core costs, for the serving simulator (engine/estimates/simulator.py).

A step puts some decode rows and some prompt chunks through the model: the decode rows in one
batched pass, each prompt chunk in a pass of its own. Its time is modelled from what it does, as
Vidur (MLSys 2024) models a replica's steps:

    seconds = base + decode × (1 if several rows; one_row instead if one) + row × decode rows
              + kv × cache tokens the rows read + chunk × prompt chunks + prompt × prompt tokens
              + pairs × prompt token pairs attended

``base`` is what any step costs (scheduling, sampling); ``decode`` what the batched pass costs
whatever it holds (reading every weight once, where decoding is bound by memory), ``one_row``
what a lone sequence's pass costs instead (the engine runs it through a step of its own, which
may be faster or slower than the batched one); a row and a
prompt token add their share of the products, a chunk its own pass's fixed cost, and the
attention a term in the cache it reads.

**On this machine** the eight figures are fitted (least squares, none below zero) to the engine's
own steps, timed by its clock (``StepCompleted.step_s``) in a short calibration run
(:func:`calibrate`) that the app keeps beside the hardware profile. **For a GPU** they are
predicted from its specifications (:func:`for_gpu`): the weights read once a step at the
bandwidth, the products at the peak FLOP/s, each at an efficiency stated beside the figure,
never measured unless such a GPU is at hand.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.base.errors import InvalidRequestError
from engine.base.events import STEP_PARTS, step_parts
from engine.base.request import GenerationRequest
from engine.estimates.hardware import profile_path

if TYPE_CHECKING:
    from engine.base.events import StepCompleted
    from engine.estimates.hardware import Hardware
    from engine.generation.core import CoreSettings
    from engine.models.model import LoadedModel

FEATURES = ("base_s", "decode_s", "row_s", "kv_token_s", "chunk_s", "prompt_token_s", "pair_s", "one_row_s")
"""A figure for each of a step's parts (engine/base/events.py ``STEP_PARTS``, in that order)."""


@dataclass(frozen=True)
class StepSample:
    """One step as the model reads it: what it held and how long it took."""

    rows: int
    chunks: int
    prompt_tokens: int
    kv_tokens: int
    pairs: float
    seconds: float

    @classmethod
    def of(cls, step: "StepCompleted") -> "StepSample":
        return cls(step.decode_tokens, step.prompt_chunks, step.prefill_tokens, step.kv_tokens_read,
                   step.prompt_pairs, step.step_s)

    def features(self) -> tuple[float, ...]:
        return step_parts(self.rows, self.chunks, self.prompt_tokens, self.kv_tokens, self.pairs)


@dataclass(frozen=True)
class StepCost:
    """A step's seconds from what it holds (the module's formula)."""

    base_s: float
    decode_s: float
    row_s: float
    kv_token_s: float
    chunk_s: float
    prompt_token_s: float
    pair_s: float
    one_row_s: float = 0.0
    source: str = ""
    """Where the figures come from, in a line (measured here, or a GPU's specifications)."""
    samples: int = 0
    """Steps it was fitted to (0: predicted)."""
    error: float | None = None
    """Its median relative error on those steps."""
    front: "FrontEnd | None" = None
    """What a server's front end adds around the engine's steps (``None``: nothing: the engine
    alone, as a library or the window runs it)."""

    def seconds(self, rows: int, chunks: int, prompt_tokens: int, kv_tokens: int, pairs: float) -> float:
        passes = self.decode_s if rows > 1 else self.one_row_s if rows == 1 else 0.0
        return (self.base_s + passes + self.row_s * rows + self.kv_token_s * kv_tokens
                + self.chunk_s * chunks + self.prompt_token_s * prompt_tokens + self.pair_s * pairs)

    def total(self, parts: Iterable[float]) -> float:
        """Seconds of steps whose parts (``STEP_PARTS``) sum to ``parts``: the formula is linear in them."""
        return sum(getattr(self, name) * value for name, value in zip(FEATURES, parts))

    def describe(self) -> str:
        return (f"a step {self.base_s * 1e3:.2f} ms; its decode pass {self.decode_s * 1e3:.2f} ms "
                f"({self.one_row_s * 1e3:.2f} ms for a lone row) + "
                f"{self.row_s * 1e3:.3f} ms a row + {self.kv_token_s * 1e6:.3f} µs a cached token read; a prompt "
                f"chunk {self.chunk_s * 1e3:.2f} ms + {self.prompt_token_s * 1e3:.3f} ms a token "
                f"({self.source})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepCost":
        values = {name: float(data[name]) for name in FEATURES}
        front = data.get("front")
        if front is not None:
            front = FrontEnd(float(front["step_s"]), float(front["token_s"]), float(front["request_s"]),
                             str(front.get("source", "")),
                             tuple(float(v) for v in front.get("request_spread_s") or ()),
                             tuple((float(x), float(y)) for x, y in front.get("client_s") or ()))
        figures = [*values.values(), *((front.step_s, front.token_s, front.request_s) if front else ())]
        spread = [*front.request_spread_s, *(v for point in front.client_s for v in point)] if front else []
        if not all(math.isfinite(v) and v >= 0 for v in figures) or not all(math.isfinite(v) for v in spread):
            raise InvalidRequestError("A step-cost model's figures must be finite and not below zero.")
        return cls(**values, source=str(data.get("source", "")), samples=int(data.get("samples", 0)),
                   error=data.get("error"), front=front)


@dataclass(frozen=True)
class FrontEnd:
    """A server's front end around the engine's steps: the service's loop between steps and each
    token streamed to its client (formatted and sent, and on a machine the load generator shares,
    read there too), on the engine's clock; and each request's latency outside it (its HTTP
    request read and its prompt tokenized), spent before the engine sees the request, so it
    overlaps the step under way. Fitted to short loads against the server
    (``engine/estimates/predict_load.py``)."""

    step_s: float
    token_s: float
    request_s: float
    source: str = ""
    request_spread_s: tuple[float, ...] = ()
    """Each request's latency outside the engine as measured at one user, one a request (their
    median is ``request_s``): the simulated requests take them in turn (shuffled), so the
    prediction keeps their spread (most requests a few ms, a few tens of ms more), not only their
    middle."""
    client_s: tuple[tuple[float, float], ...] = ()
    """The client's part of a request's time to first token (the client's TTFT less the server's
    own, from the request's arrival at its handler, as its ``/metrics`` histogram sums them) at
    each calibration load: (requests in flight when one arrived, on average; seconds), by the
    first. Both sides measured, so no step model's error is in it. A request that arrives with
    more in flight waits longer before the server reads it (its HTTP side shares the engine's
    cores): the simulator has it reach the engine what this gives for its own count over what it
    gives for none later."""

    def client_at(self, in_flight: float) -> float:
        """The client's part for a request arriving with ``in_flight`` others (straight lines
        between the loads it was measured at, level past them; none measured: 0)."""
        import numpy as np

        if not self.client_s:
            return 0.0
        xs, ys = zip(*self.client_s)
        return float(np.interp(in_flight, xs, ys))

    def describe(self) -> str:
        spread = ""
        if self.request_spread_s:
            ordered = sorted(self.request_spread_s)
            spread = (f" (p90 {ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3:.1f} ms, "
                      f"{len(ordered)} requests)")
        client = ""
        if self.client_s:
            client = "; the client's part " + ", ".join(f"{y * 1e3:.1f} ms at {x:.1f} in flight"
                                                        for x, y in self.client_s)
        return (f"front end: {self.step_s * 1e3:.2f} ms a step, {self.token_s * 1e3:.2f} ms a streamed token, "
                f"{self.request_s * 1e3:.1f} ms a request{spread}{client} ({self.source})")


def fit(samples: Iterable[StepSample], source: str = "") -> StepCost:
    """The figures that best give ``samples``' times, none below zero (non-negative least squares,
    Lawson and Hanson's), on relative errors: each step weighted by one over its fitted time,
    fitted again until the weights settle, so short steps count as much as long ones without
    pulling the fit below the times it was given (weighting by the observed times would)."""
    import numpy as np

    samples = [s for s in samples if s.seconds > 0 and math.isfinite(s.seconds) and (s.rows or s.chunks)]
    if len(samples) < len(FEATURES):
        raise InvalidRequestError(f"A step-cost model needs at least {len(FEATURES)} timed steps; "
                                  f"{len(samples)} were given.")
    x = np.array([s.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    weights = 1.0 / y
    for _ in range(4):
        solution = _nnls((x / scale) * weights[:, None], y * weights) / scale
        weights = 1.0 / np.maximum(x @ solution, 0.1 * y)
    errors = np.abs(x @ solution - y) / y
    return StepCost(*(float(v) for v in solution), source=source, samples=len(samples),
                    error=float(np.median(errors)))


def served_work(text: str) -> tuple[float, tuple[float, ...]] | None:
    """A server's steps so far, from its ``/metrics`` text: their seconds and their parts' sums
    (``STEP_PARTS``); ``None`` where it doesn't count them (not this workbench's server)."""
    from prometheus_client.parser import text_string_to_metric_families

    seconds, parts = None, dict.fromkeys(STEP_PARTS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:engine_step_seconds_total":
                seconds = (seconds or 0.0) + sample.value
            elif sample.name == "vllm:engine_step_work_total" and sample.labels.get("part") in parts:
                parts[sample.labels["part"]] += sample.value
    return None if seconds is None else (seconds, tuple(parts.values()))


def _nnls(a, b):
    """``argmin ‖a·x − b‖`` with ``x ≥ 0`` (Lawson and Hanson's active set)."""
    import numpy as np

    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)  # the terms allowed above zero
    tolerance = 1e-10 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max()))
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max() <= tolerance:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            shrinking = free & (z <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + step * (z - x)
            free &= x > tolerance
    return x


@dataclass(frozen=True)
class Efficiency:
    """What share of a GPU's datasheet figures a step reaches: assumptions, said beside the result."""

    bandwidth: float = 0.8
    """Of the memory bandwidth, streaming the weights (vLLM's decode reaches 70-90% on an H100)."""
    compute: float = 0.5
    """Of the peak dense FLOP/s, in the products (prompt-heavy steps)."""
    launch_s: float = 0.004
    """A step's fixed cost: scheduling, launching, sampling (vLLM with CUDA graphs: a few ms)."""


def for_gpu(hardware: "Hardware", weights_bytes: int, parameters: int, kv_bytes_per_token: int,
            gpus: int = 1, efficiency: Efficiency = Efficiency()) -> StepCost:
    """A GPU's (``gpus`` with tensor parallelism) step predicted from its specifications, as the
    linear model: the weights read once a step, each row's and prompt token's products at the
    compute's share, each cached token read at the bandwidth's. A decode step is then bound by the
    weights' bytes; a prompt-heavy one by its FLOPs."""
    bandwidth = hardware.bandwidth_bytes_per_s * efficiency.bandwidth * gpus
    flops = (hardware.bf16_flops or 0) * efficiency.compute * gpus
    if bandwidth <= 0 or flops <= 0:
        raise InvalidRequestError(f"{hardware.name} has no bandwidth or FLOP/s figure to predict its steps from.")
    per_token = 2.0 * parameters / flops
    # one pass a step for decode rows and prompt chunks together (vLLM's): the weights read once
    return StepCost(efficiency.launch_s + weights_bytes / bandwidth, 0.0, per_token, kv_bytes_per_token / bandwidth,
                    0.0, per_token, 0.0,
                    source=(f"predicted for {gpus}× {hardware.name} from its specifications: "
                            f"{efficiency.bandwidth:.0%} of {hardware.bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
                            f"{efficiency.compute:.0%} of {hardware.bf16_flops / 1e12:,.0f} TFLOP/s, "
                            f"{efficiency.launch_s * 1e3:g} ms a step"))


# -- calibration on this machine --------------------------------------------------------------------------------

def calibrate(loaded: "LoadedModel", settings: "CoreSettings", seconds: float = 20.0) -> StepCost:
    """Time the engine's own steps on ``loaded`` under ``settings`` (a server's limits) across the
    shapes serving makes: one to ``max_batch`` requests decoding at short and long contexts, and
    prompts read in chunks beside them; fit the step-cost model to them. Takes about
    ``seconds``."""
    from engine.generation.service import EngineService, Ticket  # lazy: the engine (torch), for a calibration only

    service = EngineService(loaded, settings)
    samples: list[StepSample] = []
    context = loaded.info.context_length or 4096
    vocab = loaded.vocab_size or 1000
    batches = sorted({1, 2, 4, 8, settings.max_batch} & set(range(1, settings.max_batch + 1)))
    prompts = sorted({min(p, context // 4) for p in (16, 128, 1024)})
    deadline = time.perf_counter() + seconds
    shapes = [(b, p) for b in batches for p in prompts]  # every context early: a deadline cuts the largest batches
    budget = max(0.5, seconds / len(shapes))
    for batch, prompt in shapes:
        if time.perf_counter() > deadline:
            break
        request = GenerationRequest("(token ids)", mode="raw", max_new_tokens=64, ignore_eos=True, reuse_prefix=False,
                                    top_alternatives=0)
        request = replace(request, max_new_tokens=max(1, min(64, context - prompt - 1)))
        tickets = [service.submit(Ticket(request, lambda event: None, prompt_ids=_ids(prompt, i, vocab),
                                         token_texts=False)) for i in range(batch)]
        until = time.perf_counter() + budget
        first = True
        while not all(t.ended for t in tickets):
            step = service.turn()
            if step is not None and not first:  # the first step of a shape warms its sizes up
                samples.append(StepSample.of(step))
            first = False
            if time.perf_counter() > until:
                for ticket in tickets:
                    ticket.abort()
    info = loaded.info
    return fit(samples, source=f"fitted to steps timed here: {info.name} in {info.precision}, {len(samples)} steps")


def _ids(tokens: int, salt: int, vocab: int) -> list[int]:
    """A prompt of ``tokens`` ids no other prompt starts with (nothing found in a cache)."""
    return [(salt * 7919 + i * 31 + 3 + int(time.perf_counter_ns() % 997)) % vocab for i in range(tokens)]


def cost_path() -> Path:
    """Where this machine's calibrations are kept, beside its hardware profile."""
    return profile_path().with_name("step-costs.json")


def remember(key: str, cost: StepCost) -> None:
    """Keep ``cost`` for ``key`` (a model, precision and the server's limits) on this machine."""
    path = cost_path()
    try:
        kept = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        kept = {}
    kept[key] = cost.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, indent=1))
    tmp.replace(path)


def remembered(key: str) -> StepCost | None:
    """The calibration kept for ``key`` on this machine (``None``: none yet, or unreadable)."""
    try:
        return StepCost.from_dict(json.loads(cost_path().read_text())[key])
    except (OSError, ValueError, KeyError, TypeError, InvalidRequestError):
        return None


def key_for(loaded: "LoadedModel", settings: "CoreSettings") -> str:
    info = loaded.info
    return (f"{info.name}|{info.precision}|{getattr(info, 'kv_dtype', '')}|batch {settings.max_batch}|"
            f"budget {settings.token_budget}|chunk {settings.prefill_chunk}")
