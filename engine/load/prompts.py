"""The prompts a load sends: the shipped set (short questions and long documents to work on,
resources/prompts/load.jsonl) or the user's own file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.base.errors import InvalidRequestError
from engine.storage.paths import resource_dir


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str = ""
    """``short``, ``long`` or the file's own label."""


def shipped_path() -> Path:
    return resource_dir() / "prompts" / "load.jsonl"


def read_prompts(path: Path | None = None) -> list[Prompt]:
    """One prompt per line: a JSON object with ``prompt`` (and optionally ``kind``), or plain text."""
    path = Path(path) if path is not None else shipped_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"Can't read the prompts file {path}: {exc.strerror or exc}.") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                prompts.append(Prompt(str(item["prompt"]), str(item.get("kind", ""))))
            except (ValueError, KeyError, TypeError):
                raise InvalidRequestError(f"{path}, line {number}: not a JSON object with a 'prompt'.") from None
        else:
            prompts.append(Prompt(line))
    if not prompts:
        raise InvalidRequestError(f"{path} holds no prompts.")
    return prompts
