"""GGUF files: check them, and convert them once into a safetensors folder.

transformers reads GGUF (through the ``gguf`` package) by de-quantizing every tensor,
which takes seconds; the converted copy then loads in a fraction of that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.base.errors import CorruptModelError, EngineError, ModelNotFoundError, NotAModelError
from engine.storage.paths import cache_dir
from engine.base.progress import ProgressReporter, reporting

PROVENANCE = "workbench-source.json"


@dataclass(frozen=True)
class GGUFSummary:
    architecture: str
    name: str
    file_type: str
    """e.g. ``Q4_1``."""
    tensor_types: dict[str, int]
    key_length: int | None = None
    """``{architecture}.attention.key_length``: the heads' width, where the file says it."""
    rope_dimensions: int | None = None
    """``{architecture}.rope.dimension_count``: how much of each head the rotary embedding turns."""
    rope_scaling: float | None = None
    """``{architecture}.rope.scaling.factor`` where ``rope.scaling.type`` is linear (Gemma 3 4B and
    up: their global layers' positions divided by it)."""
    softcaps: dict[str, float] | None = None
    """``{architecture}.attn_logit_softcapping`` and ``final_logit_softcapping`` (Gemma 2), by
    transformers' names, where the file says them."""


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each GGUF scalar value type (8: string, 9: array are sized by their contents)."""


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` from a GGUF's header, read up to that key and no further (a
    tokenizer's vocabulary of 262k strings follows it in the header: the ``gguf`` reader parses
    all of it, seconds for a refusal that needs one string). A damaged header raises here."""
    import struct

    path = _gguf_file(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        def read(n: int) -> bytes:
            if n > size - fh.tell():  # a damaged length would ask for gigabytes
                raise CorruptModelError(f"{path.name} is truncated or corrupt: its header runs past the file's end.")
            return fh.read(n)

        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, read(struct.calcsize(fmt)))[0]

        def string() -> bytes:
            return read(number("Q"))

        def seek(n: int) -> None:
            if n > size - fh.tell():
                raise CorruptModelError(f"{path.name} is truncated or corrupt: its header runs past the file's end.")
            fh.seek(n, 1)

        def skip(kind: int) -> None:
            if kind == 8:
                seek(number("Q"))
            elif kind == 9:
                inner, count = number("I"), number("Q")
                if inner in _SCALAR_BYTES:
                    seek(count * _SCALAR_BYTES[inner])
                else:
                    for _ in range(count):
                        skip(inner)
            elif kind in _SCALAR_BYTES:
                seek(_SCALAR_BYTES[kind])
            else:
                raise CorruptModelError(f"{path.name} has a header value of unknown type {kind}.")

        read(4)  # the magic, checked
        if number("I") < 2:  # version 1 counted in 32 bits: the library reads it
            return summarize_gguf(path).architecture
        number("Q")  # tensors
        for _ in range(number("Q")):
            key, kind = string(), number("I")
            if key == b"general.architecture" and kind == 8:
                return string().decode("utf-8", "replace")
            skip(kind)
    raise CorruptModelError(f"{path.name} has no general.architecture in its header.")


def _gguf_file(path: Path) -> Path:
    """``path``, if it is a file that begins as a GGUF does; else the typed error saying what it is."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"No such file: {path}")
    if not path.is_file():
        raise NotAModelError(f"{path} is not a file.")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise CorruptModelError(f"{path.name} is not a GGUF file (it does not start with 'GGUF').")
    return path


def summarize_gguf(path: Path) -> GGUFSummary:
    """Read a GGUF's header and tensor table; raise a typed error if it is not a whole GGUF file."""
    path = _gguf_file(path)
    try:
        from gguf import GGUFReader, LlamaFileType

        reader = GGUFReader(str(path))
        arch = reader.fields["general.architecture"].contents()
        name_field = reader.fields.get("general.name")
        ftype_field = reader.fields.get("general.file_type")
        numbers = {key: int(field.contents()) for key in ("attention.key_length", "rope.dimension_count")
                   if (field := reader.fields.get(f"{arch}.{key}")) is not None}
        caps = {key: float(field.contents()) for key in ("attn_logit_softcapping", "final_logit_softcapping")
                if (field := reader.fields.get(f"{arch}.{key}")) is not None}
        scaling = reader.fields.get(f"{arch}.rope.scaling.factor")
        kind = reader.fields.get(f"{arch}.rope.scaling.type")
        linear = scaling is not None and (kind is None or str(kind.contents()) == "linear")
        counts = Counter(t.tensor_type.name for t in reader.tensors)
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError on damage
        raise CorruptModelError(
            f"{path.name} is truncated or corrupt and can't be read as GGUF ({type(exc).__name__}: {exc})."
        ) from exc
    if not counts:
        raise CorruptModelError(f"{path.name} holds no tensors.")
    file_type = counts.most_common(1)[0][0]
    if ftype_field is not None:
        try:
            file_type = LlamaFileType(int(ftype_field.contents())).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    return GGUFSummary(
        architecture=str(arch),
        name=str(name_field.contents()) if name_field is not None else path.stem,
        file_type=file_type,
        tensor_types=dict(counts),
        key_length=numbers.get("attention.key_length"),
        rope_dimensions=numbers.get("rope.dimension_count"),
        rope_scaling=float(scaling.contents()) if linear else None,
        softcaps=caps or None,
    )


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache folder for a GGUF's converted copy, keyed by its path, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{digest}"


def is_converted(folder: Path) -> bool:
    return (folder / PROVENANCE).is_file() and (folder / "config.json").is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, reporter: ProgressReporter,
                 extra_provenance: dict | None = None) -> Path:
    """De-quantize ``gguf_path`` with transformers and save it as fp32 safetensors in ``out_dir``.

    Written to a temporary sibling and renamed, so an interrupted conversion leaves nothing half-done.
    """
    gguf_path = Path(gguf_path)
    summary = summarize_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _one_conversion(out_dir, reporter) as waited:
        if waited and is_converted(out_dir):  # another process converted it while this one waited
            return out_dir
        reporter.report("convert", 0, 0, f"Reading {gguf_path.name} ({summary.file_type})")
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        return _convert(gguf_path, out_dir, reporter, summary, extra_provenance)


@contextmanager
def _one_conversion(out_dir: Path, reporter: ProgressReporter):
    """Hold the lock file beside ``out_dir`` while converting into it: one conversion of a folder
    at a time across processes (two windows opened at once on a first run, two test workers).
    Without it the second removed the first's temporary folder as a killed conversion's and the
    first failed. Yields whether it had to wait (the other may have finished the work); checks
    for a cancel while waiting."""
    from filelock import FileLock, Timeout  # lazy: only conversions need it

    lock = FileLock(str(out_dir.parent / f".{out_dir.name}.lock"))
    waited = False
    while True:
        try:
            lock.acquire(timeout=0.1)
            break
        except Timeout:
            if not waited:
                reporter.report("convert", 0, 0, f"Waiting for another process converting into {out_dir.name}")
            waited = True
            reporter.check()
    try:
        yield waited
    finally:
        lock.release()


def _gguf_config(gguf_path: Path, summary: GGUFSummary):
    """transformers' config for a GGUF, and what its GGUF reading lacks, supplied from the header
    (in words, kept with the conversion): the heads' width where it is not the hidden size over the
    heads (``attention.key_length``: Qwen3's, Gemma's), the share of each head the rotary
    embedding turns (``rope.dimension_count``: Phi-4-mini's three quarters), and for Gemma 2 and 3
    the queries' scale (no field says it: llama.cpp's rule, the head width, or hidden ÷ heads for
    the 27B models, 46 and 62 layers), Gemma 2's soft-caps (``attn_logit_softcapping``,
    ``final_logit_softcapping``) and Gemma 3's global layers' linear rotary scaling
    (``rope.scaling.factor``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    supplied = []
    heads = getattr(config, "num_attention_heads", None)
    width = summary.key_length
    if width and heads and getattr(config, "head_dim", None) != width:
        config.head_dim = width
        supplied.append(f"head_dim {width} (attention.key_length)")
    head = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    turned = summary.rope_dimensions
    rope = getattr(config, "rope_parameters", None)
    if turned and head and turned < head and isinstance(rope, dict) \
            and rope.get("partial_rotary_factor", 1.0) != turned / head:
        rope["partial_rotary_factor"] = turned / head
        if hasattr(config, "partial_rotary_factor"):
            config.partial_rotary_factor = turned / head
        supplied.append(f"partial_rotary_factor {turned}/{head} (rope.dimension_count)")
    if summary.architecture in ("gemma2", "gemma3") and head:
        big = {"gemma2": 46, "gemma3": 62}[summary.architecture]  # the 27B's layers
        scalar = config.hidden_size // heads if config.num_hidden_layers == big else head
        if getattr(config, "query_pre_attn_scalar", None) != scalar:
            config.query_pre_attn_scalar = scalar
            supplied.append(f"query_pre_attn_scalar {scalar} (llama.cpp's rule)")
        full = rope.get("full_attention") if isinstance(rope, dict) else None
        if summary.rope_scaling and isinstance(full, dict) and full.get("factor") != summary.rope_scaling:
            full.update(rope_type="linear", factor=summary.rope_scaling)
            supplied.append(f"global layers' rotary scaling linear ×{summary.rope_scaling:g} (rope.scaling.factor)")
    for key, value in (summary.softcaps or {}).items():
        if getattr(config, key, None) != value:
            setattr(config, key, value)
            supplied.append(f"{key} {value:g}")
    return config, supplied


def _convert(gguf_path: Path, out_dir: Path, reporter: ProgressReporter, summary: GGUFSummary,
             extra_provenance: dict | None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        with reporting(reporter):
            reporter.report("tokenizer", 0, 0, "Converting the GGUF tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            config, supplied = _gguf_config(gguf_path, summary)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32,
                use_kernels=False,
            )
            reporter.report("save", 0, 0, "Saving a safetensors copy for fast loads")
            # The GGUF "quantizer" only marks where the weights came from; they are plain
            # float tensors now, and transformers refuses to save while it is attached.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        provenance = {
            "format": "GGUF",
            "file": gguf_path.name,
            "file_type": summary.file_type,
            "name": summary.name,
            "architecture": summary.architecture,
            "tensor_types": summary.tensor_types,
            **({"supplied": supplied} if supplied else {}),
            **(extra_provenance or {}),
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2), encoding="utf-8")
        reporter.check()
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except EngineError:
        raise
    except Exception as exc:
        raise CorruptModelError(f"transformers could not read {gguf_path.name}: {exc}") from exc
    finally:  # also on KeyboardInterrupt: never leave half a conversion behind
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_converted(gguf_path: Path, reporter: ProgressReporter) -> Path:
    """The converted folder for ``gguf_path``, converting it the first time."""
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise ModelNotFoundError(f"No such file: {gguf_path}")
    folder = converted_dir_for(gguf_path)
    if is_converted(folder):
        return folder
    return convert_gguf(gguf_path, folder, reporter)


def read_provenance(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
