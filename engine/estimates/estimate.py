"""Predict a model's memory from its config and a precision, without reading any weight.

Parameters are counted exactly by building the model on the meta device (accelerate's
``init_empty_weights``): no memory, any architecture transformers knows. Bytes per
precision follow what the loaders actually store:

- fp32 / bf16 / fp16: every parameter at 4 / 2 / 2 bytes;
- int8 (bitsandbytes LLM.int8): linear weights at 1 byte plus one fp32 scale per output row;
  everything else (embeddings, norms, the output head) in fp16;
- nf4 / fp4 (bitsandbytes 4-bit): linear weights at ½ byte plus one absmax per block of 64
  (fp32 on a GPU; on a CPU with AVX-512 BF16 bitsandbytes repacks it to bf16 at the first forward
  pass, elsewhere it stays fp32) and a
  16-entry fp32 code book per layer; everything else in bf16.

bitsandbytes leaves the output head (``lm_head``) unquantized, so it counts as "other".

The fast path's int8 / int4 (engine/models/quantize.py) quantize every linear layer, the head
included (a head tied to the embeddings gets its own quantized copy; the table stays bf16):
where its int8-activation kernels run (engine/models/kernels), int8 at 1 byte plus an fp16
scale per block of 32 inputs (Q8_0), int4 at ½ byte plus an fp16 scale and minimum per block
(Q4_1); elsewhere int8 at 1 byte plus a bf16 scale per row and int4 at ½ byte plus a bf16 scale
and zero per group of 32; the head in int8 under both. (Rows are padded to a multiple of 16
for the kernels: not counted, as no common model has such a layer.) Its fp32 / bf16 store
every parameter as the plain precisions do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.base.kv import kv_layout
from engine.storage.paths import resource_dir
from engine.models.precision import get_precision, dtype_bytes
from engine.models.load_lock import exclusive
from engine.base.imports import heavy_imports
from engine.models.kernels import cpu_flags, expected as kernels_expected
from engine.endpoint.source import is_endpoint
from engine.models import default_model, sources
from engine.models.gguf_files import converted_dir_for, is_converted
from engine.models.devices import resolve_device

BNB_BLOCK = 64
"""bitsandbytes' 4-bit block size (its default; we don't change it)."""

_SKIPPED_BY_BNB = ("lm_head",)


@dataclass(frozen=True)
class ParameterCount:
    total: int
    linear: int
    """In the linear layers bitsandbytes quantizes."""
    linear_rows: int
    """Their output rows (int8 keeps one scale per row)."""
    linear_layers: int
    head: int = 0
    """Weights of the output head (``lm_head``)."""
    head_rows: int = 0
    tied: bool = False
    """The head shares its weights with the input embeddings."""
    embedding: int = 0
    """Weights of the input embedding table (``get_input_embeddings``)."""
    embedding_dim: int = 0
    """Its row's length: what looking up one token reads."""

    @property
    def other(self) -> int:
        return self.total - self.linear


def count_parameters(config) -> ParameterCount:
    """Exact counts from the model built on the meta device (tied weights counted once)."""
    heavy_imports()
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM


    with exclusive():  # init_empty_weights patches torch for the whole process
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # on the meta device transformers leaves tying to the weight loader
    linear = rows = layers = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in _SKIPPED_BY_BNB:
            linear += module.weight.numel()
            rows += module.out_features
            layers += 1
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    table = getattr(embed, "weight", None)
    return ParameterCount(total=total, linear=linear, linear_rows=rows, linear_layers=layers,
                          head=head.weight.numel() if head is not None else 0,
                          head_rows=head.weight.shape[0] if head is not None else 0, tied=tied,
                          embedding=table.numel() if table is not None else 0,
                          embedding_dim=table.shape[-1] if table is not None else 0)


def weights_bytes(count: ParameterCount, precision: str, device_type: str = "cpu",
                  int8_blocks: bool | None = None) -> int:
    """Bytes the weights take once loaded in ``precision`` (see the module docstring);
    ``int8_blocks``: whether the fast path's int8 is in blocks of 32 (its int8-activation
    kernels), ``None``: as it will be on this machine."""
    name = get_precision(precision).name
    if name in ("fp32", "fp32-fast"):
        return 4 * count.total
    if name in ("bf16", "fp16", "bf16-fast"):
        return 2 * count.total
    if name in ("int8-fast", "int4-fast"):
        if int8_blocks is None:
            int8_blocks = kernels_expected()
        if int8_blocks:  # Q8_0 blocks: an fp16 scale per 32
            head = count.head + count.head // 16  # int8 under both (see engine/models/quantize.py)
            int8 = count.linear + count.linear // 16
        else:  # a bf16 scale per row
            head = count.head + 2 * count.head_rows
            int8 = count.linear + 2 * count.linear_rows
        quantized = int8 + head if name == "int8-fast" else count.linear // 2 + count.linear // 8 + head
        # the bf16 rest: embeddings (kept even when the head was tied to them), norms, biases
        return quantized + 2 * (count.other - (0 if count.tied else count.head))
    if name == "int8":
        return count.linear + 4 * count.linear_rows + 2 * count.other
    # nf4 / fp4
    blocks = -(-count.linear // BNB_BLOCK)
    absmax = 2 if device_type == "cpu" and "avx512_bf16" in cpu_flags() else 4  # bitsandbytes' CPU layout
    return count.linear // 2 + absmax * blocks + 16 * 4 * count.linear_layers + 2 * count.other


def looked_up_bytes(count: ParameterCount, precision: str) -> tuple[int, int]:
    """The input embedding table's bytes and one row's, where the table is only looked up, a row
    per token, with no head reading it whole: untied from the head, or tied to one that the fast
    path's int8 / int4 quantize into a copy of their own (the table stays bf16 beside it).
    ``(0, 0)`` where a head reads it whole."""
    name = get_precision(precision).name
    if not count.embedding or (count.tied and name not in ("int8-fast", "int4-fast")):
        return 0, 0
    element = 4 if name in ("fp32", "fp32-fast") else 2  # as the module docstring says each loads it
    return element * count.embedding, element * count.embedding_dim


@dataclass(frozen=True)
class MemoryPrediction:
    weights_bytes: int
    kv_bytes_per_token: int | None
    context_tokens: int
    kv_bytes: int
    """The KV cache for ``context_tokens`` tokens."""
    total_bytes: int
    available_bytes: int | None
    """Free memory on the device now (RAM on the CPU); None if unknown."""

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.total_bytes <= self.available_bytes


def config_for(ref: str):
    """The config of a model reference, from disk only (never downloads); None if not on disk.

    ``default`` uses the config shipped in ``resources/configs`` until the model is fetched;
    a hub id not in the Hugging Face cache falls back to a shipped config of that id; a served
    model's config is the server's (None).
    """

    if is_endpoint(ref):
        return None
    heavy_imports()
    from transformers import AutoConfig

    try:
        kind, value = sources.classify(ref)
    except Exception:
        return None
    folder: Path | None = None
    if kind == "default":
        folder = default_model.model_dir() if default_model.is_ready() else None
        if folder is None:
            return shipped_config(DEFAULT_HUB_ID)
    elif kind == "folder":
        folder = Path(value)
    elif kind == "gguf":
        converted = converted_dir_for(Path(value))
        folder = converted if is_converted(converted) else None
    elif kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        repo_id, _, revision = value.partition("@")
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
        folder = Path(cached).parent if isinstance(cached, str) else None
        if folder is None:
            return shipped_config(repo_id)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception:
        return None


DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def shipped_models() -> list[str]:
    """Hub ids of the configs shipped in resources/configs (usable offline)."""
    return sorted(p.stem.replace("--", "/", 1) for p in (resource_dir() / "configs").glob("*.json"))


def shipped_config(hub_id: str):
    """The shipped config of a hub id, or None."""
    heavy_imports()
    from transformers import AutoConfig

    data = _shipped(hub_id.replace("/", "--", 1))
    return None if data is None else AutoConfig.for_model(**data)


@lru_cache(maxsize=None)
def _shipped(name: str) -> dict | None:
    path = resource_dir() / "configs" / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}


def available_bytes(device: str) -> int | None:
    """Free memory for a new model: RAM available on the CPU (and MPS), free memory on a GPU."""
    import psutil

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(torch.device(device if ":" in device else "cuda:0"))
        return int(free)
    return int(psutil.virtual_memory().available)


def predict(config, precision: str, device: str = "cpu", context_tokens: int = 2048) -> MemoryPrediction:
    """Weights + KV cache for ``context_tokens`` tokens, against free memory on ``device``."""

    count = count_parameters(config)
    weights = weights_bytes(count, precision, device.split(":")[0])
    layout = kv_layout(config)
    element = dtype_bytes(get_precision(precision).kv_dtype(device.split(":")[0]))
    per_token = layout.bytes_per_token(element) if layout else None
    kv = layout.bytes_for(context_tokens, element) if layout else 0
    try:
        resolved = str(resolve_device(device))
    except Exception:
        resolved = None
    return MemoryPrediction(
        weights_bytes=weights, kv_bytes_per_token=per_token, context_tokens=context_tokens, kv_bytes=kv,
        total_bytes=weights + kv, available_bytes=available_bytes(resolved) if resolved else None,
    )


LOAD_HEADROOM = 1.5
"""A load briefly needs more than the weights it ends with (fp32 before quantizing, buffers)."""


def fits_beside_loaded(model_ref: str, precision: str, device: str = "auto") -> bool:
    """Whether a model can load while the current one stays in memory (so a failed load keeps
    it): its predicted weights and a 2,048-token cache, with headroom, against free memory now.
    Unknown configs or free memory count as fitting; the load's own OOM handling remains."""
    try:
        config = config_for(model_ref)
        if config is None:
            return True
        prediction = predict(config, precision, device)
    except Exception:
        return True
    available = prediction.available_bytes
    return available is None or prediction.total_bytes * LOAD_HEADROOM <= available
