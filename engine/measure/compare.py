"""Compare: one prompt through 2–4 lanes (model × precision × device × sampling), and where
their answers differ.

Against lane 1, each lane gets:

- ``token_agreement``: the share of positions where its token equals lane 1's, over the longer
  of the two answers;
- ``first_divergence``: the first position where they differ (None when identical);
- ``mean_abs_logprob_delta``: lane 1's answer scored by this lane's model (teacher forcing:
  one forward pass over prompt + answer), compared token by token with lane 1's own model
  scoring it the same way. 0 for an identical lane; it grows as a precision bends the model.

Token metrics need the lanes to share a tokenizer (same prompt ids); otherwise they are None.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from engine.measure.bench import report as bench_report, versions
from engine.base.cancel import CancelToken
from engine.base.errors import InvalidRequestError
from engine.base.events import Loaded
from engine.base.request import GenerationRequest
from engine.runs import Run
from engine.base.sampling import SamplingParams
from engine.generation.generate import generate as engine_generate
from engine.endpoint import is_endpoint, parse_endpoint
from engine.models.precision import KV_DTYPES, PRECISIONS
from engine.storage.serialize import event_to_dict, event_from_dict
from engine.models.loading import LoadRequest, load_model

SCHEDULES = ("fair", "concurrent")


@dataclass(frozen=True)
class LaneSpec:
    model: str = "default"
    precision: str = "fp32"
    device: str = "auto"
    sampling: SamplingParams | None = None
    """None: the comparison's sampling."""
    kv_dtype: str = "auto"
    """What the lane's KV cache keeps keys and values in (``--kv-dtype``)."""

    @property
    def label(self) -> str:
        if is_endpoint(self.model):
            spec = parse_endpoint(self.model)
            return f"{spec.model or 'first model'} · served at {spec.url}"
        return (f"{self.model} · {self.precision}" + (f" · {self.kv_dtype} KV" if self.kv_dtype != "auto" else "")
                + (f" · {self.device}" if self.device != "auto" else ""))


def parse_lane(text: str) -> LaneSpec:
    """``MODEL:PRECISION[@KV][:DEVICE]`` (the model part may itself contain ':', a Windows path;
    ``@KV`` a KV-cache dtype, ``default:int8-fast@int8``), or ``endpoint:URL#MODEL``, a served
    model (its precision is the server's)."""

    if is_endpoint(text):
        return LaneSpec(model=parse_endpoint(text).text, precision="served", device="remote")
    parts = text.rsplit(":", 2)

    def precision(part: str) -> tuple[str, str] | None:
        name, _, kv = part.partition("@")
        return (name, kv or "auto") if name in PRECISIONS and (kv or "auto") in KV_DTYPES else None

    if len(parts) >= 2 and precision(parts[-1]):
        name, kv = precision(parts[-1])
        return LaneSpec(model=":".join(parts[:-1]), precision=name, kv_dtype=kv)
    if len(parts) == 3 and precision(parts[1]):
        name, kv = precision(parts[1])
        return LaneSpec(model=parts[0], precision=name, device=parts[2], kv_dtype=kv)
    raise InvalidRequestError(f"A lane is MODEL:PRECISION[@KV][:DEVICE], e.g. default:nf4 or default:int8-fast@int8; "
                              f"got {text!r}.")


def agreement(reference: Sequence[int], other: Sequence[int]) -> tuple[float, int | None]:
    """``(share of equal positions, first differing position or None)``."""
    longest = max(len(reference), len(other))
    if longest == 0:
        return 1.0, None
    same = sum(a == b for a, b in zip(reference, other))
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if first is None and len(reference) != len(other):
        first = min(len(reference), len(other))
    return same / longest, first


def teacher_forced_logprobs(loaded, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
    """log p(token_i | prompt, tokens_<i) under ``loaded``'s model, in one forward pass."""
    import torch

    if not token_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=loaded.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0]
    start = len(prompt_ids) - 1
    scores = torch.log_softmax(logits[start:start + len(token_ids)].float(), dim=-1)
    picked = scores.gather(1, torch.tensor(list(token_ids), device=scores.device).unsqueeze(1))
    return picked.squeeze(1).tolist()


class LaneRun(Run):
    """One lane's run (its events and series, as every run): what the lane was, the model it
    loaded, and lane 1's answer scored by its model."""

    def __init__(self, spec: LaneSpec, loaded: dict | None = None) -> None:
        super().__init__(None if loaded is None else loaded.get("weights_bytes"))
        self.spec = spec
        self.loaded = loaded
        self.prompt_ids: list[int] | None = []
        """``None``: a served model's (the server tokenizes)."""
        self.reference_scores: list[float] | None = None
        """Lane 1's answer scored by this lane's model."""

    def set_loaded(self, loaded: dict) -> None:
        self.loaded = loaded
        self.weights_bytes = loaded.get("weights_bytes")


def same_prompt(reference: LaneRun, lane: LaneRun) -> bool:
    """Whether both lanes read the same prompt tokens: the same ids, or, for a served model (whose
    ids the server keeps), as many as its ``usage`` counted."""
    if reference.prompt_ids is not None and lane.prompt_ids is not None:
        return reference.prompt_ids == lane.prompt_ids
    known = reference.prompt_ids if reference.prompt_ids is not None else lane.prompt_ids
    other = lane.finished if reference.prompt_ids is not None else reference.finished
    return known is not None and other is not None and other.prompt_tokens == len(known)


def lane_metrics(reference: LaneRun, lane: LaneRun) -> dict:
    """The comparison keys of one lane against lane 1 (None where they can't apply: other prompt
    tokens, or a server that doesn't say its tokens' ids)."""
    ref_done, done = reference.finished, lane.finished
    if (ref_done is None or done is None or not same_prompt(reference, lane)
            or any(d.tokens and not d.token_ids for d in (ref_done, done))):
        return {"token_agreement": None, "first_divergence": None, "mean_abs_logprob_delta": None}
    share, first = agreement(ref_done.token_ids, done.token_ids)
    delta = None
    if reference.reference_scores is not None and lane.reference_scores is not None and reference.reference_scores:
        pairs = list(zip(reference.reference_scores, lane.reference_scores))
        delta = sum(abs(a - b) for a, b in pairs) / len(pairs)
    return {"token_agreement": share, "first_divergence": first, "mean_abs_logprob_delta": delta}


@dataclass(frozen=True)
class LaneSummary:
    """One lane's row of the comparison's summary: the table, the CSV and the JSON's ``summary``."""

    lane: int
    label: str
    load_s: float | None
    weights_bytes: int | None
    model_memory_bytes: int | None
    """The lane's own model: its weights and its KV cache at the end, both read from their tensors."""
    peak_memory_bytes: int | None
    """The process's peak (every lane's model is loaded in it) or, on a GPU, the device's."""
    ttft_s: float | None
    decode_tokens_per_s: float | None
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    tokens: int | None
    kv_cache_bytes: int | None
    finish_reason: str | None
    token_agreement: float | None
    first_divergence: int | None
    mean_abs_logprob_delta: float | None


def summary_rows(runs: Sequence[LaneRun]) -> list[LaneSummary]:
    """One row per lane, against lane 1."""
    rows = []
    for index, lane in enumerate(runs):
        done, info = lane.finished, lane.loaded or {}
        rows.append(LaneSummary(
            lane=index + 1, label=lane.spec.label, load_s=info.get("load_s"), weights_bytes=info.get("weights_bytes"),
            model_memory_bytes=(info["weights_bytes"] + done.kv_cache_bytes
                                if done and info.get("weights_bytes") and done.kv_cache_bytes is not None else None),
            peak_memory_bytes=done.peak_memory_bytes if done else None,
            ttft_s=done.ttft_s if done else None,
            decode_tokens_per_s=done.decode_tokens_per_s if done else None,
            **lane.latency_stats(),
            tokens=done.tokens if done else None,
            kv_cache_bytes=done.kv_cache_bytes if done else None,
            finish_reason=done.reason if done else (f"error: {lane.error}" if lane.error else None),
            **lane_metrics(runs[0], lane),
        ))
    return rows


def lane_report(lane: LaneRun, request: GenerationRequest, reference: LaneRun) -> dict:
    """The bench JSON keys of one lane, plus the comparison keys."""
    data = {"lane": lane.spec.label, "spec": {**asdict(lane.spec), "sampling": None if lane.spec.sampling is None
                                              else asdict(lane.spec.sampling)}}
    if lane.loaded is not None and lane.finished is not None:
        data.update(bench_report(Loaded(**lane.loaded), request, lane))
        data.pop("versions", None)
    data.update(lane.latency_stats())
    data.update(lane_metrics(reference, lane))
    data["error"] = lane.error
    return data


def request_to_dict(request: GenerationRequest) -> dict:
    return {"prompt": request.prompt, "mode": request.mode, "system_prompt": request.system_prompt,
            "max_new_tokens": request.max_new_tokens, "ignore_eos": request.ignore_eos, "stop": list(request.stop),
            "sampling": asdict(request.sampling)}


def request_from_dict(data: dict) -> GenerationRequest:
    return GenerationRequest(prompt=data["prompt"], mode=data["mode"], system_prompt=data["system_prompt"],
                             max_new_tokens=data["max_new_tokens"], ignore_eos=data["ignore_eos"],
                             stop=tuple(data.get("stop", ())), sampling=SamplingParams(**data["sampling"]))


FORMAT = "inference-workbench/compare"


def to_record(runs: Sequence[LaneRun], request: GenerationRequest, schedule: str) -> dict:
    """Everything needed to show the run again without any model: the report (the headless
    JSON contract) plus every event of every lane."""

    data = report(runs, request, schedule)
    data["format"] = FORMAT
    data["format_version"] = 1
    data["runs"] = [{
        "spec": {**asdict(run.spec), "sampling": None if run.spec.sampling is None else asdict(run.spec.sampling)},
        "loaded": run.loaded, "events": [event_to_dict(e) for e in run.events],
        "prompt_ids": None if run.prompt_ids is None else list(run.prompt_ids),
        "reference_scores": run.reference_scores, "error": run.error,
    } for run in runs]
    return data


def from_record(data: dict) -> tuple[list[LaneRun], GenerationRequest, str]:
    if data.get("format") != FORMAT:
        raise InvalidRequestError("This file is not a saved comparison of Inference Workbench.")
    runs = []
    for item in data["runs"]:
        spec = dict(item["spec"])
        spec["sampling"] = None if spec.get("sampling") is None else SamplingParams(**spec["sampling"])
        run = LaneRun(LaneSpec(**spec), item["loaded"])
        run.extend(event_from_dict(e) for e in item["events"])
        ids = item["prompt_ids"]
        run.prompt_ids = None if ids is None else list(ids)
        run.reference_scores, run.error = item["reference_scores"], item["error"]
        runs.append(run)
    return runs, request_from_dict(data["request"]), data["schedule"]


def report(runs: Sequence[LaneRun], request: GenerationRequest, schedule: str) -> dict:
    return {
        "prompt": request.prompt,
        "schedule": schedule,
        "request": request_to_dict(request),
        "lanes": [lane_report(lane, request, runs[0]) for lane in runs],
        "summary": [asdict(row) for row in summary_rows(runs)],
        "versions": versions(),
    }


def run_comparison(specs: Sequence[LaneSpec], request: GenerationRequest, schedule: str = "fair",
                   on_event: Callable[[int, object], None] | None = None,
                   cancel: CancelToken | None = None) -> list[LaneRun]:
    """Load each lane, generate the same request on each, score lane 1's answer with each model.

    ``fair``: lanes run one after another, each model unloaded before the next loads, so their
    timings don't disturb each other. ``concurrent``: all loaded, all generating at once, each
    in its own thread, to show contention.
    """

    if not 1 <= len(specs) <= 4:
        raise InvalidRequestError("A comparison has 1 to 4 lanes.")
    if schedule not in SCHEDULES:
        raise InvalidRequestError(f"schedule must be one of {SCHEDULES}, not {schedule!r}.")
    request = request.validated()
    cancel = cancel or CancelToken()
    runs = [LaneRun(spec) for spec in specs]
    emit = on_event or (lambda index, event: None)

    def lane_request(spec: LaneSpec) -> GenerationRequest:
        from dataclasses import replace

        return replace(request, sampling=spec.sampling) if spec.sampling is not None else request

    def load(index: int):
        spec = runs[index].spec
        loaded = load_model(LoadRequest(spec.model, spec.precision, spec.device, kv_dtype=spec.kv_dtype),
                            progress=lambda event: emit(index, event), cancel=cancel)
        runs[index].set_loaded(asdict(loaded.info))
        emit(index, loaded.info)
        return loaded

    def generate(index: int, loaded) -> None:
        run = runs[index]
        wanted = lane_request(run.spec)
        run.prompt_ids = loaded.encode(wanted)
        for event in engine_generate(loaded, wanted, cancel):
            run.extend([event])
            emit(index, event)

    def score(index: int, loaded) -> None:
        reference = runs[0]
        if loaded.model is None:  # a served model: the server has the weights
            return
        if reference.finished is not None and runs[index].prompt_ids == reference.prompt_ids:
            runs[index].reference_scores = teacher_forced_logprobs(
                loaded, reference.prompt_ids, reference.finished.token_ids)

    if schedule == "fair":
        for index in range(len(runs)):
            loaded = load(index)
            try:
                generate(index, loaded)
                score(index, loaded)
            finally:
                loaded.close()
        return runs

    models = [load(index) for index in range(len(runs))]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            generate(index, models[index])
        except BaseException as exc:  # reported after the join, in the caller's thread
            errors.append(exc)
            cancel.cancel()

    threads = [threading.Thread(target=worker, args=(i,), name=f"lane-{i + 1}") for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        for index, loaded in enumerate(models):
            score(index, loaded)
    finally:
        for loaded in models:
            loaded.close()
    return runs


def write_csv(path, rows: Sequence[LaneSummary]) -> None:
    import csv
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
