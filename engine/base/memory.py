"""Memory probes: process RSS everywhere, allocator figures on CUDA and MPS, NVML when present.

A backend this machine lacks is reported as absent (``None``), never as zero.
"""

from __future__ import annotations

import os
import sys
import threading

from engine.base.events import MemorySample


class _Nvml:
    """NVML through nvidia-ml-py, if installed and a driver answers."""

    def __init__(self) -> None:
        self._handles: dict[int, object] = {}
        self._lib = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._lib = pynvml
        except Exception:  # no package, no driver, no GPU: NVML is absent
            self._lib = None

    def used_total(self, index: int) -> tuple[int | None, int | None]:
        if self._lib is None:
            return None, None
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._handles[index] = self._handle_for(index)
            info = self._lib.nvmlDeviceGetMemoryInfo(handle)
            return int(info.used), int(info.total)
        except Exception:
            return None, None

    def _handle_for(self, index: int):
        """NVML numbers GPUs by PCI order, CUDA by speed and CUDA_VISIBLE_DEVICES: match by bus id."""
        import torch

        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            domain = getattr(props, "pci_domain_id", 0)
            device = getattr(props, "pci_device_id", 0)
            try:
                return self._lib.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{device:02x}.0".encode())
            except Exception:
                pass
        return self._lib.nvmlDeviceGetHandleByIndex(index)


_nvml: _Nvml | None = None


class _StatmRss:
    """RSS from /proc/self/statm through a file descriptor kept open: a fraction of psutil's
    reading (which opens the file each time), so sampling every token costs next to nothing."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._open()

    def _open(self) -> None:
        self._pid = os.getpid()
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)  # "self" is resolved at open time

    def __call__(self) -> int:
        if os.getpid() != self._pid:  # a forked child must read its own file
            self._open()
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page


_rss_reader = None


def rss_reader():
    """One process-wide RSS reader (the fast one on Linux, psutil elsewhere)."""
    global _rss_reader
    if _rss_reader is None:
        try:
            _rss_reader = _StatmRss() if sys.platform.startswith("linux") else None
        except (OSError, ValueError):
            _rss_reader = None
        if _rss_reader is None:
            import psutil

            process = psutil.Process()
            _rss_reader = lambda: int(process.memory_info().rss)  # noqa: E731
    return _rss_reader


class MemoryProbe:
    """Samples memory for one device; ``reset_peak`` starts a new peak window."""

    def __init__(self, device: "torch.device") -> None:  # noqa: F821
        self.device = device
        self._rss = rss_reader()
        self._peak_rss = 0
        if device.type == "cuda":
            global _nvml
            if _nvml is None:
                _nvml = _Nvml()

    def rss(self) -> int | None:
        try:
            return self._rss()
        except Exception:
            return None

    def reset_peak(self) -> None:
        import torch

        self._peak_rss = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def peak_rss(self) -> int | None:
        return self._peak_rss or None

    def sample(self) -> MemorySample:
        import torch

        rss = self.rss()
        if rss is not None and rss > self._peak_rss:
            self._peak_rss = rss
        kind = self.device.type
        if kind == "cuda":
            used, total = _nvml.used_total(self.device.index or 0) if _nvml else (None, None)
            if total is None:
                total = torch.cuda.get_device_properties(self.device).total_memory
            return MemorySample(
                rss_bytes=rss,
                device=str(self.device),
                device_allocated_bytes=int(torch.cuda.memory_allocated(self.device)),
                device_reserved_bytes=int(torch.cuda.memory_reserved(self.device)),
                device_peak_bytes=int(torch.cuda.max_memory_allocated(self.device)),
                device_used_bytes=used,
                device_total_bytes=int(total),
            )
        if kind == "mps":
            return MemorySample(
                rss_bytes=rss,
                device="mps",
                device_allocated_bytes=int(torch.mps.current_allocated_memory()),
                device_reserved_bytes=int(torch.mps.driver_allocated_memory()),
                device_total_bytes=_mps_recommended_max(),
            )
        return MemorySample(rss_bytes=rss, device=str(self.device))

    def peak_device(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def _mps_recommended_max() -> int | None:
    import torch

    try:
        return int(torch.mps.recommended_max_memory())
    except Exception:
        return None


DEFAULT_KV_BUDGET_CAP = 4 << 30
"""The most a server's KV pool may hold by default on a CPU (a desktop's memory is shared with
everything else the user runs)."""


def default_kv_budget(device) -> int:
    """KV-cache bytes the running requests and the prefix cache may hold together on ``device``
    (the block pool's budget; the pool grows to it only as requests need): a quarter of the memory
    free now, at most :data:`DEFAULT_KV_BUDGET_CAP`, on a desktop's CPU; 90% of a GPU's free memory,
    as vLLM sizes its cache from ``--gpu-memory-utilization``."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    import psutil

    return min(int(psutil.virtual_memory().available * 0.25), DEFAULT_KV_BUDGET_CAP)


_CPU_WATCH = threading.Lock()
"""Held while a :class:`StepAllocations` profiles the CPU's allocations (the profiler is the
process's)."""


class StepAllocations:
    """A step's activations: the most it held in tensors above what it started with, less what it
    kept at its end (its KV cache's growth), read from PyTorch's allocator.

    On a GPU from the caching allocator's own counters (``max_memory_allocated`` after a reset:
    free); on the CPU, where PyTorch keeps no count, from the allocation records of its profiler
    (``profile_memory``: every tensor allocated and freed through the CPU allocator, in order),
    which makes the watched step several times slower, so a caller leaves its time out. MPS:
    ``None`` (no peak counter)."""

    def __init__(self, device: "torch.device") -> None:  # noqa: F821
        self.device = device
        self.peak_bytes: int | None = None
        """The most the step held above its start."""
        self.kept_bytes: int | None = None
        """What it held above its start at its end."""
        self._profile = None
        self._before = 0

    @property
    def activation_bytes(self) -> int | None:
        if self.peak_bytes is None or self.kept_bytes is None:
            return None
        return max(0, self.peak_bytes - max(0, self.kept_bytes))

    def __enter__(self) -> "StepAllocations":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu" and _CPU_WATCH.acquire(blocking=False):
            # one profiler in the process at a time (two at once crash it: Compare's concurrent lanes
            # each read their model's); a watch that finds another running reads nothing this time
            from torch.profiler import ProfilerActivity, profile

            try:
                self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self._profile.__enter__()
            except BaseException:
                self._profile = None
                _CPU_WATCH.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, int(torch.cuda.max_memory_allocated(self.device)) - self._before)
            self.kept_bytes = int(torch.cuda.memory_allocated(self.device)) - self._before
        elif self._profile is not None:
            try:
                self._profile.__exit__(*exc)
                if exc[0] is None:
                    self.peak_bytes, self.kept_bytes = allocation_peak(self._profile)
            finally:
                self._profile = None
                _CPU_WATCH.release()


def allocation_peak(profile) -> tuple[int, int]:
    """The highest running total of a profiler's CPU allocation records (allocations positive,
    frees negative, in time order) above where it started, and the total at its end. (Tensors
    allocated before it began are freed unseen: it counts only what is allocated inside.)"""
    records = sorted((e.start_ns(), e.nbytes()) for e in profile.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type().name == "CPU")
    total = peak = 0
    for _, size in records:
        total += size
        peak = max(peak, total)
    return peak, total
