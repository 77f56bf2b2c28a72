"""Where a model comes from: ``default``, a local folder, a ``.gguf`` file, or a hub id.

Every source ends as a local Hugging Face-style folder (config, safetensors, tokenizer)
that :mod:`engine.models.loading` reads; GGUF files are converted into such a folder once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from engine.models import default_model
from engine.base.errors import (
    CorruptModelError,
    HubModelUnavailableError,
    ModelNotFoundError,
    NotAModelError,
    UnsafeCheckpointError,
)
from engine.models.gguf_files import ensure_converted, read_provenance
from engine.base.progress import ProgressReporter

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ResolvedModel:
    folder: Path
    """A folder with config.json, weights and tokenizer."""
    source: str
    """``default``, ``folder``, ``gguf`` or ``hub``."""
    name: str
    original_format: str
    """``GGUF Q4_1``, ``safetensors``, ``pickle``…"""
    use_safetensors: bool


@dataclass(frozen=True)
class ModelEntry:
    """A model the user can pick without typing a path."""

    ref: str
    """What to pass as ``--model``."""
    name: str
    source: str
    path: str
    size_bytes: int | None
    ready: bool
    """Loadable without a download."""


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def reference_weights(original_format: str, precision: str, served: bool = False) -> str:
    """Where a reference precision's weights came from, in a sentence, for quality figures read
    against it. A quantized GGUF's "fp32" is its 4-bit (or 8-bit…) values dequantized: a precision
    near that grid can land nearer it than a finer one, and no figure measures the loss against
    the original training weights."""
    if served:
        return f"The reference is a served model ({original_format or 'its server says no more'})."
    kind = original_format.split(" ", 1)[1].strip() if original_format.startswith("GGUF ") else ""
    if kind and kind.upper() not in _FLOAT_TYPES:
        regrid = " (int4-fast re-grids Q4_1's own values)" if kind.upper() == "Q4_1" else ""
        return (f"{precision} here is the {kind} GGUF's weights dequantized, not the original training weights: "
                f"a lower-bit precision can land nearer it than a higher one{regrid}.")
    if kind:
        return f"{precision} here is the GGUF's {kind} weights, as published."
    return f"{precision} here is the model's {original_format or 'own'} weights, as published."


def classify(ref: str) -> tuple[str, str]:
    """``(kind, value)`` for a model reference, without touching disk contents or network."""
    ref = (ref or "").strip()
    if not ref:
        raise ModelNotFoundError("No model given: pass 'default', a folder, a .gguf file or a hub id (org/name).")
    if ref.lower() == "default":
        return "default", ref
    path = Path(ref).expanduser()
    if path.exists():
        if path.is_dir():
            return "folder", str(path)
        if path.suffix.lower() == ".gguf":
            return "gguf", str(path)
        if path.name == "config.json":
            return "folder", str(path.parent)
        raise NotAModelError(f"{ref} is a file but not a .gguf model; pass its folder or a .gguf file.")
    looks_like_path = (ref.startswith(("/", ".", "~")) or "\\" in ref or ref.lower().endswith(".gguf")
                       or ref.count("/") > 1 and "@" not in ref)
    if not looks_like_path and _HUB_ID.fullmatch(ref):
        return "hub", ref
    raise ModelNotFoundError(f"No such file or folder: {ref}")


def inspect_folder(folder: Path, allow_pickle: bool = False) -> tuple[str, Path | None]:
    """``("safetensors" | "pickle" | "gguf", gguf_file)`` for a folder, or a typed error."""
    folder = Path(folder)
    if not folder.exists():
        raise ModelNotFoundError(f"No such folder: {folder}")
    if not folder.is_dir():
        raise NotAModelError(f"{folder} is not a folder.")
    config = folder / "config.json"
    if not config.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        if len(ggufs) > 1:
            names = ", ".join(p.name for p in ggufs[:6])
            raise NotAModelError(f"{folder} holds several GGUF files ({names}); pick one file.")
        raise NotAModelError(
            f"{folder} holds no model: expected config.json with .safetensors weights "
            "(a Hugging Face folder) or a .gguf file."
        )
    _readable(config)
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{config} is not valid JSON ({exc}).") from exc
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        for path in safetensors:
            _readable(path)
        _check_safetensors(safetensors)
        return "safetensors", None
    pickles = [p for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES]
    if pickles:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{folder} has only pickle weights ({pickles[0].name}). Loading pickle can run "
                "arbitrary code: opt in with allow_pickle (CLI: --allow-pickle) only if you trust it."
            )
        return "pickle", None
    raise NotAModelError(f"{folder} has config.json but no weights (.safetensors).")


def _readable(path: Path) -> None:
    """A file we may not read is a permission problem, not a corrupt model: say which."""
    import os

    if not os.access(path, os.R_OK):
        raise NotAModelError(f"Permission denied reading {path}: this user may not read it "
                             f"(chmod u+r, or copy the model somewhere readable).")


def _check_safetensors(files: list[Path]) -> None:
    """Read each file's header; safetensors rejects truncated or damaged files here."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as exc:
            raise CorruptModelError(f"{path.name} is truncated or corrupt ({exc}).") from exc


def resolve(ref: str, reporter: ProgressReporter | None = None, *, allow_pickle: bool = False,
            offline: bool | None = None, hub_cache: Path | None = None) -> ResolvedModel:
    """Turn a reference into a local folder, downloading/converting if needed."""
    reporter = reporter or ProgressReporter()
    kind, value = classify(ref)
    reporter.report("resolve", 0, 0, f"Finding {ref}")
    if kind == "default":
        folder = default_model.ensure(reporter)
        return ResolvedModel(folder, "default", default_model.NAME, "GGUF Q4_1", True)
    if kind == "gguf":
        return _from_gguf(Path(value), "gguf", reporter)
    if kind == "hub":
        folder = _hub_snapshot(value, allow_pickle, offline, hub_cache)
        fmt, gguf = inspect_folder(folder, allow_pickle)
        if gguf is not None:
            return _from_gguf(gguf, "hub", reporter, name=value)
        return ResolvedModel(folder, "hub", value, fmt, fmt == "safetensors")
    folder = Path(value)
    fmt, gguf = inspect_folder(folder, allow_pickle)
    if gguf is not None:
        return _from_gguf(gguf, "gguf", reporter)
    provenance = read_provenance(folder)
    original = f"GGUF {provenance['file_type']}" if provenance else fmt
    return ResolvedModel(folder, "folder", folder.resolve().name, original, fmt == "safetensors")


def _from_gguf(path: Path, source: str, reporter: ProgressReporter, name: str | None = None) -> ResolvedModel:
    folder = ensure_converted(path, reporter)
    provenance = read_provenance(folder) or {}
    return ResolvedModel(folder, source, name or path.stem, f"GGUF {provenance.get('file_type', '?')}", True)


def _hub_snapshot(ref: str, allow_pickle: bool, offline: bool | None, hub_cache: Path | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import constants as hub_constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = ref.partition("@")
    cache = hub_cache or Path(hub_constants.HF_HUB_CACHE)
    patterns = _HUB_PATTERNS + (["*.bin"] if allow_pickle else [])
    try:
        folder = snapshot_download(
            repo_id, revision=revision or None, cache_dir=str(cache), allow_patterns=patterns,
            local_files_only=bool(offline),
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise HubModelUnavailableError(
            f"{repo_id} is not in the Hugging Face cache ({cache}) and the hub can't be reached. "
            "Download it on a connected machine, or load a local folder or .gguf file."
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise HubModelUnavailableError(f"The hub has no accessible model {ref}: {exc}") from exc
    return Path(folder)


def list_models(hub_cache: Path | None = None) -> list[ModelEntry]:
    """The default model, then the models already in the Hugging Face cache."""
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    entries = [ModelEntry(
        ref="default", name=f"{default_model.NAME} (Q4_1 GGUF, default)", source="default",
        path=str(default_model.model_dir()), size_bytes=None, ready=default_model.is_ready(),
    )]
    try:
        # The cache named as _hub_snapshot names it: scan_cache_dir's own default is the value
        # when huggingface_hub first imported it, whatever the constant says now.
        info = scan_cache_dir(hub_cache or hub_constants.HF_HUB_CACHE)
    except (CacheNotFound, OSError):
        return entries
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)
        files = {f.file_name for f in revision.files}
        if "config.json" not in files and not any(n.endswith(".gguf") for n in files):
            continue
        entries.append(ModelEntry(
            ref=repo.repo_id, name=repo.repo_id, source="hub", path=str(revision.snapshot_path),
            size_bytes=revision.size_on_disk, ready=True,
        ))
    return entries
