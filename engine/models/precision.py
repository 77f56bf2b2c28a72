"""Precisions: one handler per scheme, each knowing which devices can run it and how to load it.

Importable without torch (the UI lists the names); torch and bitsandbytes are imported
only when a handler builds its loading arguments.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from engine.base.errors import UnsupportedPrecisionError

SUPPORTED = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "mistral", "gemma2", "gemma3")
"""The model types the fast path (engine/models/fast.py) runs (GGUF's architecture names)."""
SAME_TYPES = {"gemma3_text": "gemma3"}
"""A config's model type where it is not the GGUF's name (Gemma 3's text-only model)."""


def unsupported_type_reason(model_type: str) -> str | None:
    """Why a model of this type can't take the fast path (from a config or a GGUF header,
    before any weight is read), or ``None`` if it may."""
    if SAME_TYPES.get(model_type, model_type) not in SUPPORTED:
        return f"the fast path runs {', '.join(SUPPORTED)} models, not {model_type}"
    return None


@dataclass(frozen=True)
class Precision:
    name: str
    label: str
    bits: float
    """Nominal bits per weight of the linear layers."""

    def check_device(self, device_type: str) -> None:
        """Raise :class:`UnsupportedPrecisionError` if ``device_type`` can't run this precision."""

    def compute_dtype(self, device_type: str) -> str:
        """The dtype activations use, as a torch dtype name."""
        raise NotImplementedError

    def kv_dtype(self, device_type: str) -> str:
        """The dtype the KV cache keeps keys and values in: the activations' unless a precision
        says otherwise."""
        return self.compute_dtype(device_type)

    def load_kwargs(self, device_type: str) -> dict:
        """Keyword arguments for ``from_pretrained``."""
        raise NotImplementedError


@dataclass(frozen=True)
class FloatPrecision(Precision):
    dtype: str = "float32"

    def check_device(self, device_type: str) -> None:
        import torch

        if self.dtype == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UnsupportedPrecisionError(
                f"{torch.cuda.get_device_name()} has no bf16 support: use fp16 or fp32."
            )

    def compute_dtype(self, device_type: str) -> str:
        return self.dtype

    def load_kwargs(self, device_type: str) -> dict:
        import torch

        return {"dtype": getattr(torch, self.dtype)}


@dataclass(frozen=True)
class BitsAndBytesPrecision(Precision):
    """bitsandbytes LLM.int8 (``int8``) or 4-bit NF4/FP4 with bf16 compute."""

    scheme: str = "int8"

    def check_device(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise UnsupportedPrecisionError(
                f"{self.name} (bitsandbytes) runs on CPU and CUDA, not on {device_type}: "
                "choose fp32, bf16 or fp16 there."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UnsupportedPrecisionError(
                f"{self.name} needs the bitsandbytes package: pip install bitsandbytes"
            )

    def compute_dtype(self, device_type: str) -> str:
        # LLM.int8 casts activations to fp16 (it warns on every call otherwise);
        # the 4-bit schemes compute in bf16.
        return "float16" if self.scheme == "int8" else "bfloat16"

    def load_kwargs(self, device_type: str) -> dict:
        import torch
        from transformers import BitsAndBytesConfig

        # bitsandbytes logs a line per matmul on CPU and a hint about an optional
        # kernels package it can't fetch offline; neither is actionable here.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        compute = getattr(torch, self.compute_dtype(device_type))
        if self.scheme == "int8":
            quant = BitsAndBytesConfig(load_in_8bit=True)
        else:
            quant = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=self.scheme,
                bnb_4bit_compute_dtype=compute,
            )
        return {"dtype": compute, "quantization_config": quant}


@dataclass(frozen=True)
class FastPrecision(Precision):
    """The fast path (engine/models/fast.py): a lean decoder over a static KV cache, with int8 / int4
    linears (engine/models/quantize.py: int8 activations on this project's CPU kernels where the CPU
    has AVX-512 VNNI or AVX2, else PyTorch's weight-only ones) or plain fp32 / bf16 weights. CPU only."""

    scheme: str = "int8"

    def check_device(self, device_type: str) -> None:
        if device_type != "cpu":
            raise UnsupportedPrecisionError(
                f"{self.name} (the fast path) runs on the CPU for now, not on {device_type}: choose fp32, bf16, "
                "int8 or nf4 there."
            )

    def compute_dtype(self, device_type: str) -> str:
        if self.scheme == "fp32":
            return "float32"
        if self.scheme in ("int8", "int4"):
            from engine.models.kernels import expected  # lazy: it reads /proc/cpuinfo

            # int8 activations (engine/models/kernels): the rest computes in fp32
            return "float32" if expected() else "bfloat16"
        return "bfloat16"

    def kv_dtype(self, device_type: str) -> str:
        compute = self.compute_dtype(device_type)
        # int8 activations: keys and values kept in fp16, as llama.cpp's F16 cache (half of fp32's
        # bytes, read by every token's attention; its 11-bit significand where bf16 has 8)
        return "float16" if self.scheme in ("int8", "int4") and compute == "float32" else compute

    def load_kwargs(self, device_type: str) -> dict:
        import torch

        # int8/int4 quantize from fp32 weights (from bf16 ones they'd round twice), then the
        # rest of the model drops to bf16
        return {"dtype": torch.bfloat16 if self.scheme == "bf16" else torch.float32}


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        FloatPrecision("fp32", "fp32 (full precision)", 32, dtype="float32"),
        FloatPrecision("bf16", "bf16 (bfloat16)", 16, dtype="bfloat16"),
        FloatPrecision("fp16", "fp16 (float16)", 16, dtype="float16"),
        BitsAndBytesPrecision("int8", "int8 (bitsandbytes LLM.int8)", 8, scheme="int8"),
        BitsAndBytesPrecision("nf4", "nf4 (bitsandbytes 4-bit NormalFloat)", 4, scheme="nf4"),
        BitsAndBytesPrecision("fp4", "fp4 (bitsandbytes 4-bit float)", 4, scheme="fp4"),
        FastPrecision("fp32-fast", "fp32 (fast path)", 32, scheme="fp32"),
        FastPrecision("bf16-fast", "bf16 (fast path)", 16, scheme="bf16"),
        FastPrecision("int8-fast", "int8 (fast path)", 8, scheme="int8"),
        FastPrecision("int4-fast", "int4 (fast path, blocks of 32)", 4, scheme="int4"),
    )
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name.strip().lower()]
    except KeyError:
        raise UnsupportedPrecisionError(
            f"Unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}."
        ) from None


KV_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8",
             "fp8_e4m3": "float8_e4m3fn"}
"""What ``--kv-dtype`` takes, and the dtype (a torch name) each keeps keys and values in. ``auto``:
the precision's own (:meth:`Precision.kv_dtype`); ``int8``: llama.cpp's q8_0 blocks, 32 codes and
an fp16 scale per 32 values of a slot's head (``-ctk q8_0 -ctv q8_0``)."""

Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34
"""An int8 (q8_0) cache's block: 32 values, kept as 32 one-byte codes and a 2-byte (fp16) scale."""


def kv_cache_dtype(precision: Precision, device_type: str, choice: str = "auto") -> str:
    """The dtype (a torch name) ``precision`` keeps its KV cache in on ``device_type`` when the user
    asks for ``choice`` (one of :data:`KV_DTYPES`). Raises :class:`UnsupportedPrecisionError` with
    the reason where no path here runs that choice."""
    key = (choice or "auto").strip().lower()
    if key not in KV_DTYPES:
        raise UnsupportedPrecisionError(f"Unknown KV-cache dtype {choice!r}: choose one of {', '.join(KV_DTYPES)}.")
    own = precision.kv_dtype(device_type)
    if key == "auto" or KV_DTYPES[key] == own:
        return own
    if key == "fp8_e4m3":
        raise UnsupportedPrecisionError(
            "An fp8_e4m3 KV cache needs a GPU with fp8 arithmetic (compute capability 8.9 or newer, as vLLM's "
            "--kv-cache-dtype fp8), and the KV-cache dtype is the fast path's choice, which runs on the CPU: "
            "choose int8 (llama.cpp's q8_0 cache), fp16 or bf16.")
    if not isinstance(precision, FastPrecision):
        raise UnsupportedPrecisionError(
            f"{precision.name} runs on transformers' own cache, kept in {own}: the KV-cache dtype is the fast "
            f"path's choice. Choose a fast precision (fp32-fast, bf16-fast, int8-fast, int4-fast) for a KV cache in "
            f"{key}.")
    compute = precision.compute_dtype(device_type)
    if key == "fp32" and compute != "float32":
        raise UnsupportedPrecisionError(
            f"{precision.name} computes in {compute}: an fp32 cache would keep nothing its keys and values had "
            "beyond that. Choose bf16, fp16 or int8.")
    return KV_DTYPES[key]


def dtype_bytes(dtype_name: str) -> float:
    """Bytes a value of this dtype (a torch name, or ``int8``: a q8_0 cache's) takes."""
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int8": Q8_BLOCK_BYTES / Q8_BLOCK,
            "float8_e4m3fn": 1}[dtype_name]
