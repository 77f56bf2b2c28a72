"""Which device to run on, and what to call it."""

from __future__ import annotations

import os
import platform
from functools import lru_cache

from engine.base.errors import DeviceUnavailableError


def available_devices() -> list[str]:
    """Device types this machine and torch build can run: always ``cpu``, then GPUs."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def resolve_device(name: str = "auto") -> "torch.device":  # noqa: F821
    """``auto`` picks cuda > mps > cpu; an explicit device must exist."""
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceUnavailableError(f"Unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps.") from exc
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                "CUDA was requested but this torch build sees no CUDA GPU "
                f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch."
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"cuda:{index} does not exist: this machine has {torch.cuda.device_count()} GPU(s).")
        return torch.device("cuda", index)
    if device.type == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise DeviceUnavailableError("MPS (Apple GPU) was requested but is not available on this machine.")
        return device
    raise DeviceUnavailableError(f"Device type {device.type!r} is not supported: use auto, cpu, cuda or mps.")


@lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_name(device: "torch.device") -> str:  # noqa: F821
    """A human name: ``NVIDIA H100 80GB HBM3``, ``Apple GPU (MPS)``, ``Intel Xeon … (2 threads)``."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (MPS) on {platform.machine()}"
    threads = torch.get_num_threads()
    return f"{_cpu_model()} ({threads} thread{'s' if threads != 1 else ''}, {os.cpu_count()} cores)"
