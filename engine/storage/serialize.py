"""Events to and from plain JSON-able dicts, so a run can be saved and shown again exactly."""

from __future__ import annotations

from dataclasses import asdict, fields

from engine.base.events import (Alternative, BatchFinished, BatchStep, DraftVerified, EndpointAnswered, Finished, Loaded,
                           LoadProgress, MemorySample, Prefilled, SequenceResult, ServerSampled, TokenGenerated)

_TYPES = {cls.__name__: cls for cls in (Loaded, LoadProgress, Prefilled, TokenGenerated, DraftVerified, Finished,
                                        BatchStep, BatchFinished, EndpointAnswered, ServerSampled)}


def event_to_dict(event) -> dict:
    data = asdict(event)
    data["type"] = type(event).__name__
    return data


def event_from_dict(data: dict):
    data = dict(data)
    cls = _TYPES[data.pop("type")]
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in data.items() if k in known}
    if "memory" in values:
        values["memory"] = MemorySample(**values["memory"])
    if "top_alternatives" in values:
        values["top_alternatives"] = tuple(Alternative(**a) for a in values["top_alternatives"])
    if "sequences" in values:
        values["sequences"] = tuple(SequenceResult(**{**r, "token_ids": tuple(r["token_ids"])})
                                    for r in values["sequences"])
    for name in ("token_ids", "prompt_ids", "drafted_ids", "drafted_text", "texts"):
        if name in values:
            values[name] = tuple(values[name])
    return cls(**values)
