"""Load a model in a chosen precision on a chosen device, and report what it costs.

Everything that can be refused (unknown precision, missing device, a precision the
device can't run) is refused before any weight is read.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.models import sources, default_model
from engine.base.cancel import CancelToken
from engine.models.devices import device_name, resolve_device
from engine.base import heap
from engine.base.imports import heavy_imports
from engine.base.errors import (
    CorruptModelError, EngineError, NotAModelError, OutOfMemoryError, UnsafeCheckpointError, is_out_of_memory,
    UnsupportedPrecisionError)
from engine.base.events import Loaded, LoadProgress
from engine.base.kv import KVLayout, kv_layout
from engine.models.model import LoadedModel
from engine.models.templates import ensure_template
from engine.models.precision import (FastPrecision, Precision, dtype_bytes, get_precision, kv_cache_dtype,
                                    unsupported_type_reason)
from engine.base.progress import ProgressReporter, reporting
from engine.models.load_lock import exclusive
from engine.endpoint import connect, is_endpoint, parse_endpoint
from engine.models.gguf_files import gguf_architecture


@dataclass(frozen=True)
class LoadRequest:
    model: str = "default"
    """``default``, a folder, a ``.gguf`` file, a hub id, or ``endpoint:URL#MODEL`` (a served model:
    engine/endpoint)."""
    precision: str = "fp32"
    device: str = "auto"
    trust_remote_code: bool = False
    """Run Python code shipped with a hub model. Off unless the user opts in."""
    allow_pickle: bool = False
    """Read pickle (``.bin``) checkpoints, which can run code. Off unless the user opts in."""
    offline: bool | None = None
    """Never contact the hub; ``None`` follows ``HF_HUB_OFFLINE``."""
    api_key: str | None = field(default=None, repr=False, compare=False)
    """An endpoint's key as typed in (else read from the environment); never saved, never shown."""
    kv_dtype: str = "auto"
    """What the KV cache keeps keys and values in (engine/models/precision.py's ``KV_DTYPES``):
    ``auto`` is the precision's own; another is the fast path's choice."""


def load_model(request: LoadRequest, progress: Callable[[LoadProgress], None] | None = None,
               cancel: CancelToken | None = None) -> LoadedModel:
    """Resolve, fetch or convert if needed, then load; ``progress`` gets :class:`LoadProgress`.

    ``Loaded.load_s`` counts from here, after the one-time import of torch and transformers'
    loading machinery (seconds in a fresh process, which no model load should be charged).
    """

    if is_endpoint(request.model):  # a served model: nothing to import or read here
        return connect(parse_endpoint(request.model), request.api_key, progress, cancel)
    reporter = ProgressReporter(progress, cancel)
    precision = get_precision(request.precision)
    preflight(request, precision)  # what the header rules out is said before seconds of imports
    reporter.report("imports", 0, 0, "Importing torch and transformers")
    heavy_imports()  # one thread at a time (engine/base/imports.py)

    device = resolve_device(request.device)
    precision.check_device(device.type)

    def waiting() -> None:
        reporter.report("queued", 0, 0, "Waiting for another model to finish loading")

    with exclusive(reporter.cancel, waiting), heap.settling():
        # a load makes ~1e5 long-lived objects: no collection walks them meanwhile, then they are frozen
        return _load(request, reporter, precision, device)


def model_type_on_disk(ref: str) -> str | None:
    """The model type a reference names, read from what is already on this machine (a GGUF
    header, a config.json) without converting or downloading anything; ``None`` if unknown.
    A missing path or a corrupt GGUF header raises its typed error here."""
    import json
    from pathlib import Path


    kind, value = sources.classify(ref)
    if kind == "default":
        return "llama"
    if kind == "gguf":
        return gguf_architecture(Path(value))
    folder = Path(value)
    if kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        repo_id, _, revision = value.partition("@")
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    config = folder / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None  # the load itself names what is wrong with it
    ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return gguf_architecture(ggufs[0]) if len(ggufs) == 1 else None


def preflight(request: LoadRequest, precision: Precision) -> None:
    """Refuse what the header already rules out, before any download, conversion or weight read:
    a fast-path precision for an architecture the fast path doesn't run, a KV-cache dtype no path
    here runs (:func:`~engine.models.precision.kv_cache_dtype`)."""

    kv_cache_dtype(precision, "cpu" if isinstance(precision, FastPrecision) else "cuda", request.kv_dtype)
    if not isinstance(precision, FastPrecision):
        return
    model_type = model_type_on_disk(request.model)
    reason = unsupported_type_reason(model_type) if model_type else None
    if reason:
        raise UnsupportedPrecisionError(
            f"{request.model} can't use {precision.name}: {reason}. Choose fp32, bf16, int8 or nf4 (the reference "
            "path runs every model).")


def _load(request: LoadRequest, reporter: ProgressReporter, precision: Precision, device) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    resolved = sources.resolve(request.model, reporter, allow_pickle=request.allow_pickle,
                               offline=request.offline)
    reporter.report("config", 0, 0, f"Reading {resolved.name}'s config")
    config = _load_config(resolved, request.trust_remote_code)
    model = None
    try:
        reporter.report("tokenizer", 0, 0, "Loading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.folder), trust_remote_code=request.trust_remote_code)
        template = ensure_template(tokenizer, config.model_type)
        reporter.check()
        with reporting(reporter):
            # use_kernels=False: transformers (5.x) otherwise swaps layers for kernels it downloads
            # from the hub ("hub kernels") on CUDA: code the user never chose, a load that fails
            # offline (seen on an H200), and figures that would no longer be PyTorch's.
            model = AutoModelForCausalLM.from_pretrained(
                str(resolved.folder), config=config, device_map=str(device),
                use_safetensors=resolved.use_safetensors, trust_remote_code=request.trust_remote_code,
                use_kernels=False, **precision.load_kwargs(device.type),
            )
        model.eval()
        if resolved.source == "default" and getattr(model, "generation_config", None) is not None:
            default_model.apply_sampling(model.generation_config)
        fast = _prepare_fast(model, precision, resolved.name, reporter, request.kv_dtype)
        reporter.report("warmup", 0, 1, "Warming up (one short forward pass)")
        _warm_up(model, device)
        layout = kv_layout(model.config)
        info = _describe(model, tokenizer, resolved, precision, device, layout, time.perf_counter() - start, fast,
                         template)
    except BaseException as exc:
        model = None
        error = _typed_load_error(exc, resolved.name, precision.name, device)
        _release(exc, device)
        if error is exc:
            raise
        raise error from exc
    reporter.report("ready", 1, 1, "Ready")
    loaded = LoadedModel(model, tokenizer, info, device, precision, layout)
    loaded.fast = fast
    if fast is not None:  # what a child process loads again to build the compiled step: the same folder
        fast.request = dataclasses.replace(request, model=str(resolved.folder), device=str(device), offline=True,
                                           api_key=None)
    return loaded


def _prepare_fast(model, precision: Precision, name: str, reporter: ProgressReporter, kv_dtype: str = "auto"):
    """For a fast-path precision: quantize the linears in place and build the decoder, its KV cache
    in ``kv_dtype`` (a choice of ``--kv-dtype``)."""

    if not isinstance(precision, FastPrecision):
        return None
    from engine.models import fast  # lazy: importing it loads numpy, torch
    from engine.models.quantize import has_int8_activations, quantize_linears  # lazy: importing it loads torch

    reason = fast.unsupported_reason(model)
    if reason:
        raise UnsupportedPrecisionError(f"{name} can't use {precision.name}: {reason}. Choose fp32, bf16, int8 or "
                                        "nf4 (the reference path runs every model).")
    reporter.report("quantize", 0, 0, f"Preparing the fast path ({precision.label})")
    # the fast path runs on the CPU (its precisions' check_device)
    wanted = kv_cache_dtype(precision, "cpu", kv_dtype) if kv_dtype != "auto" else None
    if precision.scheme in ("int8", "int4") or wanted == "int8":  # int8 products, or an int8 cache's attention
        from engine.models import kernels  # lazy: it reads /proc/cpuinfo

        if kernels.expected() and not kernels.is_built():
            reporter.report("quantize", 0, 0, f"Compiling the int8 kernels for this CPU ({kernels.isa().name}; once "
                                              "on this machine, about a minute)")
        if wanted == "int8" and not kernels.kernels():
            raise UnsupportedPrecisionError(f"An int8 KV cache is read by the fast path's own attention kernels, "
                                            f"which can't run here: {kernels.unavailable()}.")
    import torch

    model._workbench_parameters = count_parameters(model)  # the quantized weights become buffers
    with torch.inference_mode():
        quantize_linears(model, precision.scheme)
    if precision.scheme in ("int8", "int4"):
        for param in model.parameters():  # embeddings, norms, biases: stored in bf16
            if param.dtype == torch.float32:  # (buffers such as rotary frequencies stay fp32)
                param.data = param.data.to(torch.bfloat16)
        if has_int8_activations(model):
            # int8 activations: the activations between the layers stay fp32, as llama.cpp's do (the
            # fast decoder casts the looked-up rows; this makes transformers' own forward, which
            # teacher forcing and speculation use, do the same)
            model.get_input_embeddings().register_forward_hook(_fp32_output)
    decoder = fast.FastDecoder(model)
    if wanted is not None:
        fast.use_kv_dtype(decoder, getattr(torch, wanted))
    if decoder.device.type == "cpu":
        from engine.models.huge_pages import move_to_huge_pages  # lazy: as fast above (torch)

        decoder.huge_page_bytes = move_to_huge_pages(decoder.modules())
    return decoder


def _fp32_output(module, args, output):
    return output.float()


def _typed_load_error(exc: BaseException, name: str, precision: str, device) -> BaseException:
    """The engine error a failed load becomes (``exc`` itself when it already is one)."""
    if isinstance(exc, (EngineError, KeyboardInterrupt, SystemExit)):
        return exc
    if is_out_of_memory(exc):
        return OutOfMemoryError(
            f"Not enough memory on {device} to load {name} in {precision}. "
            "Try a smaller precision (nf4, int8) or another device."
        )
    if isinstance(exc, (RuntimeError, OSError, ValueError, KeyError, TypeError, AttributeError)):
        return CorruptModelError(f"Could not load {name}: {type(exc).__name__}: {exc}")
    return EngineError(f"Could not load {name}: {type(exc).__name__}: {exc}")


def _release(exc: BaseException, device) -> None:
    """Let go of a half-loaded model: the traceback's frames hold it (and its device memory)."""
    import traceback

    import torch

    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm_up(model, device) -> None:
    """Run a 2-token prefill and a decode step once, so the first real request doesn't pay
    for lazy initialisation (kernel selection, allocator growth) inside its TTFT."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        model(input_ids=ids, cache=cache, use_cache=True)
        model(input_ids=ids[:, :1], cache=cache, use_cache=True)


def _load_config(resolved: sources.ResolvedModel, trust_remote_code: bool):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = AutoConfig.from_pretrained(str(resolved.folder), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        text = str(exc)
        if "trust_remote_code" in text:
            raise UnsafeCheckpointError(
                f"{resolved.name} ships its own Python code. Loading it runs that code: opt in with "
                "trust_remote_code (CLI: --trust-remote-code) only if you trust its author."
            ) from exc
        raise NotAModelError(f"{resolved.name}: transformers does not know this model ({text}).") from exc
    except OSError as exc:
        raise CorruptModelError(f"{resolved.name}: its config can't be read ({exc}).") from exc
    if getattr(config, "auto_map", None) and config.model_type not in CONFIG_MAPPING and not trust_remote_code:
        raise UnsafeCheckpointError(
            f"{resolved.name} needs its own Python code (trust_remote_code), which is off."
        )
    return config


def count_parameters(model) -> int:
    """Parameters as trained: a 4-bit packed weight counts its original shape; a model whose
    linears the fast path quantized counts what it had before (noted on the model then)."""
    before = getattr(model, "_workbench_parameters", None)
    if before is not None:
        return before
    total = 0
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None and getattr(state, "shape", None) is not None:
            n = 1
            for dim in state.shape:
                n *= int(dim)
            total += n
        else:
            total += param.numel()
    return total


def weights_bytes(model) -> int:
    """Bytes the weights occupy in memory: every distinct storage behind the parameters, the
    buffers and the quantization state bitsandbytes keeps beside its weights (4-bit absmax and
    code books, int8 row scales).

    Not ``model.state_dict()``: for bitsandbytes 4-bit on the CPU that repacks the weights in
    place and leaves a model that generates garbage.
    """
    import torch

    seen: set[tuple[str, int]] = set()
    total = 0

    def add(tensor) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()

    for param in model.parameters():
        add(param)
        add(getattr(param, "SCB", None))  # int8 row scales
        state = getattr(param, "quant_state", None)
        while state is not None:  # 4-bit: absmax, code book, and a nested state for double quantization
            for name in ("absmax", "code", "offset"):
                add(getattr(state, name, None))
            state = getattr(state, "state2", None)
    for module in model.modules():  # LLM.int8 moves its row scales into module.state after a forward
        state = getattr(module, "state", None)
        if state is not None and type(state).__module__.startswith("bitsandbytes"):
            for value in vars(state).values():
                add(value)
    for buffer in model.buffers():
        add(buffer)
    return total


def weights_read_bytes(model, weights: int) -> int:
    """Of the weights (``weights``: :func:`weights_bytes`, as the model info keeps it), the bytes
    one decode token reads: all of them but the input embedding's own tensors (those no head
    shares), of which a token reads one row. Measured from the loaded modules, where the cost
    model predicts it from the config (``costs.estimate``'s ``weights_read_bytes``)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        return weights
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shared = {t.data_ptr() for t in (*head.parameters(), *head.buffers())} if head is not None else set()
    own = {t.data_ptr(): t for t in (*embed.parameters(), *embed.buffers()) if t.data_ptr() not in shared}
    table = sum(t.numel() * t.element_size() for t in own.values())
    row = sum(t[0].numel() * t.element_size() for t in own.values() if t.dim() == 2)
    return weights - table + row


def _describe(model, tokenizer, resolved: sources.ResolvedModel, precision: Precision, device,
              layout: KVLayout | None, load_s: float, fast=None, template: str = "") -> Loaded:
    config = model.config
    text = config.get_text_config(decoder=True)
    if fast is not None:  # what its decoder computes and caches in, decided once, from the model it got
        compute, kv = (str(dtype).removeprefix("torch.") for dtype in (fast.dtype, fast.kv_dtype))
    else:
        compute, kv = precision.compute_dtype(device.type), precision.kv_dtype(device.type)
    heads = int(text.num_attention_heads)
    return Loaded(
        name=resolved.name,
        source=resolved.source,
        path=str(resolved.folder),
        precision=precision.name,
        device=str(device),
        device_name=device_name(device),
        architecture=(config.architectures or [type(model).__name__])[0],
        model_type=config.model_type,
        parameters=count_parameters(model),
        weights_bytes=weights_bytes(model),
        load_s=load_s,
        context_length=getattr(text, "max_position_embeddings", None),
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=layout.kv_heads if layout else int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=layout.head_dim if layout else int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        vocab_size=int(text.vocab_size),
        compute_dtype=compute,
        kv_bytes_per_token=layout.bytes_per_token(dtype_bytes(kv)) if layout else None,
        original_format=resolved.original_format,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        chat_template=template,
        kv_dtype=kv,
        kv_shared=fast is not None,
    )
