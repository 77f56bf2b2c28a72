"""Every finished run, kept as one small JSON file each in the user data folder.

Each record is written to a temporary file and renamed into place, so a crash mid-write
never leaves a half record among the others.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.base.events import Finished, Loaded
from engine.runs import COLUMNS, figures

log = logging.getLogger(__name__)


def history_dir() -> Path:
    override = os.environ.get("INFERENCE_WORKBENCH_DATA")
    if override:
        return Path(override).expanduser() / "history"
    import platformdirs

    return Path(platformdirs.user_data_dir("inference-workbench", appauthor=False)) / "history"


@dataclass(frozen=True)
class RunRecord:
    kind: str  # "single", "compare", "sweep", "speculative", "served", "load" (a setting of a load generator run)
    when: str
    model: str
    model_ref: str
    precision: str
    device: str
    device_name: str
    hardware: str
    """The hardware profile it ran on: "this-machine" for the CPU, a profile id for a known GPU."""
    parameters: int | None
    """``None``: a served model's (the server knows)."""
    weights_bytes: int | None
    kv_cache_bytes: int | None
    kv_bytes_per_token: int | None
    prompt_tokens: int
    tokens: int
    batch: int
    decode_tokens_per_s: float | None
    ttft_s: float | None
    peak_memory_bytes: int | None
    extra: dict = field(default_factory=dict)

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.tokens


def hardware_for(device: str, device_name: str) -> str:
    """The profile a measured run belongs to ("remote": a served model, on the server's hardware)."""
    if device == "remote":
        return "remote"
    if not device.startswith("cuda"):
        return "this-machine"
    name = device_name.lower()
    for key, profile in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("l4", "l4"),
                         ("4090", "rtx-4090"), ("3060", "rtx-3060")):
        if key in name:
            return profile
    return "this-machine"


def _model_fields(info: Loaded) -> dict:
    """The fields of a record that describe the model it ran on, and when."""
    return dict(
        when=time.strftime("%Y-%m-%dT%H:%M:%S"), model=info.name,
        model_ref=info.path if info.source != "default" else "default", precision=info.precision, device=info.device,
        device_name=info.device_name, hardware=hardware_for(info.device, info.device_name), parameters=info.parameters,
        weights_bytes=info.weights_bytes, kv_bytes_per_token=info.kv_bytes_per_token,
    )


def record_from(info: Loaded, finished: Finished, kind: str = "single", batch: int = 1, **extra) -> RunRecord:
    return RunRecord(
        kind=kind, **_model_fields(info), kv_cache_bytes=finished.kv_cache_bytes,
        prompt_tokens=finished.prompt_tokens, tokens=finished.tokens, batch=batch,
        decode_tokens_per_s=finished.decode_tokens_per_s, ttft_s=finished.ttft_s,
        peak_memory_bytes=finished.peak_memory_bytes, extra=extra,
    )


def series_from(tokens) -> dict[str, list]:
    """The per-token figures of a run's :class:`TokenGenerated` events (or a sweep's per-step
    ``BatchStep`` events, which carry the same fields), one list per column of the run store
    (``engine.runs.COLUMNS``), so a reopened run redraws the plots the window showed; absent
    figures are left out."""
    columns = zip(*(figures(t) for t in tokens))
    return {name: list(values) for name, values in zip(COLUMNS, columns) if any(v is not None for v in values)}


def record_point(info: Loaded, point, prompt_tokens: int, steps=()) -> RunRecord:
    """A batch-sweep point (``engine.measure.sweep.SweepPoint``): per-request figures in the common
    fields, the aggregate and every other figure of the point in ``extra``."""
    per_request = point.aggregate_tokens_per_s / point.batch if point.aggregate_tokens_per_s else None
    return RunRecord(
        kind="sweep", **_model_fields(info), kv_cache_bytes=point.kv_cache_bytes, prompt_tokens=prompt_tokens,
        tokens=point.generated_tokens // point.batch, batch=point.batch, decode_tokens_per_s=per_request,
        ttft_s=point.mean_ttft_s, peak_memory_bytes=point.peak_memory_bytes,
        extra={"aggregate_tokens_per_s": point.aggregate_tokens_per_s, "point": asdict(point),
               **({"series": series_from(steps)} if steps else {})},
    )


def save(record: RunRecord, folder: Path | None = None) -> Path:
    folder = folder or history_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # the save's whole nanosecond clock after the readable time: two runs within one second still sort in
    # order (its sub-second part alone wraps when the second ticks between making a record and saving it)
    name = f"{record.when.replace(':', '')}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=1), encoding="utf-8")
    os.replace(tmp, folder / name)
    return folder / name


_parsed: dict[Path, tuple[int, int, RunRecord]] = {}
"""Records already read, by file: (mtime_ns, size, record). A reload parses only what is new."""
_parsed_lock = threading.Lock()


def load_all(folder: Path | None = None) -> list[RunRecord]:
    """Every readable record, oldest first; unreadable files are skipped, not fatal. A file read
    before (same size and modification time) is not parsed again."""
    folder = folder or history_dir()
    records = []
    try:
        entries = sorted((e for e in os.scandir(folder) if e.name.endswith(".json")), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        path = Path(entry.path)
        try:
            stat = entry.stat()
            with _parsed_lock:
                known = _parsed.get(path)
            if known is not None and known[:2] == (stat.st_mtime_ns, stat.st_size):
                records.append(known[2])
                continue
            record = RunRecord(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        with _parsed_lock:
            _parsed[path] = (stat.st_mtime_ns, stat.st_size, record)
        records.append(record)
    return records


def delete(records: list[RunRecord]) -> int:
    """Remove these records' files from the history (the files :func:`load_all` read them from);
    returns how many went (a file already gone counts as gone)."""
    with _parsed_lock:
        paths = {id(known): path for path, (_, _, known) in _parsed.items()}
    gone = 0
    for record in records:
        path = paths.get(id(record))
        if path is None:
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete %s: %s", path, exc)
            continue
        with _parsed_lock:
            _parsed.pop(path, None)
        gone += 1
    return gone


@dataclass(frozen=True)
class ServedRun:
    """A server run's requests, listed as one entry (each request stays a record of its own)."""

    requests: tuple[RunRecord, ...]
    """Oldest first."""

    @property
    def latest(self) -> RunRecord:
        return self.requests[-1]


def entries(records: list[RunRecord]) -> list["RunRecord | ServedRun"]:
    """The history as it is listed, newest first: every record, except that a server run's
    requests (kind ``served``, one ``serving`` id) are one :class:`ServedRun` where the newest of
    them is. ``records``: oldest first, as :func:`load_all` gives them."""
    groups: dict[tuple, list[RunRecord]] = {}
    listed: list = []
    for record in reversed(records):
        serving = record.extra.get("serving") if record.kind == "served" else None
        if serving is None:
            listed.append(record)
            continue
        key = (serving, record.model_ref, record.precision)
        if key not in groups:
            groups[key] = []
            listed.append(key)
        groups[key].append(record)
    return [ServedRun(tuple(reversed(groups[item]))) if isinstance(item, tuple) else item for item in listed]


def remember(info: Loaded | None, finished: Finished, kind: str, transcript: str | None = None,
             tokens=(), error: str | None = None, **more) -> None:
    """Add a finished run to the history (for the cost explorer and File → Run history, which
    shows ``transcript``, Markdown, and redraws the plots from the ``tokens``' figures); a
    history that can't be written never fails a run (it is logged). ``error``: the run ended in
    one (it is kept, marked failed). ``more``: more of the run's figures, kept in ``extra``
    (a speculative run's draft counts)."""
    if info is None or (finished.tokens == 0 and not error):  # a failed run is listed, even one with no token
        return
    extra = {**more, **({"transcript_markdown": transcript} if transcript else {})}
    if tokens:
        extra["series"] = series_from(tokens)
    if error:
        extra["error"] = error
    try:
        save(record_from(info, finished, kind, **extra))
    except OSError as exc:
        log.warning("could not save the run to the history: %s", exc)
