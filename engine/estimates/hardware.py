"""Hardware profiles: the table shipped in resources/hardware.json, the user's edits, and
"this machine", measured once by a short microbenchmark and cached."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.base.imports import heavy_imports
from engine.storage.paths import cache_dir, resource_dir
from engine.base.errors import InvalidRequestError
from engine.models.devices import _cpu_model

THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class Hardware:
    id: str
    name: str
    kind: str  # gpu, cpu, apple
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    usd_per_hour: float | None
    watts: float | None
    sources: dict = field(default_factory=dict, compare=False)
    interconnect_bytes_per_s: float | None = None
    """GPU-to-GPU link, one direction (NVLink, else PCIe): what tensor parallelism's all-reduces use."""
    cache_bytes: int | None = None
    """A CPU's last-level cache (L3): what a step reads from it instead of memory when it fits."""
    cache_bandwidth_bytes_per_s: float | None = None
    """Read bandwidth from that cache, measured as the memory's is."""

    def to_dict(self) -> dict:
        return asdict(self)

    def bandwidth_for(self, bytes_per_step: float) -> tuple[float, str]:
        """The read bandwidth a step that reads ``bytes_per_step`` gets, and from where: the
        last-level cache's where all of it fits in three quarters of that cache (the rest holds
        activations and code, and other cores share it), else the memory's."""
        if self.cache_bytes and self.cache_bandwidth_bytes_per_s and bytes_per_step <= 0.75 * self.cache_bytes:
            return self.cache_bandwidth_bytes_per_s, "L3"
        return self.bandwidth_bytes_per_s, "memory"


def _user_file() -> Path:
    override = os.environ.get("INFERENCE_WORKBENCH_CONFIG")
    if override:
        return Path(override).expanduser() / "hardware.json"
    import platformdirs

    return Path(platformdirs.user_config_dir("inference-workbench", appauthor=False)) / "hardware.json"


def shipped_profiles() -> list[Hardware]:
    data = json.loads((resource_dir() / "hardware.json").read_text(encoding="utf-8"))
    return [Hardware(**item) for item in data["profiles"]]


def profiles(measure: bool = False) -> list[Hardware]:
    """The shipped profiles with the user's edits applied, then "this machine" (measured on
    first use, or when ``measure`` is set)."""
    edits = {}
    try:
        edits = json.loads(_user_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    result = []
    for profile in shipped_profiles():
        changed = edits.get(profile.id)
        if changed:
            profile = replace(profile, **{k: v for k, v in changed.items() if k in _EDITABLE})
        result.append(profile)
    result.append(this_machine(measure=measure))
    return result


_EDITABLE = ("name", "memory_bytes", "bandwidth_bytes_per_s", "bf16_flops", "usd_per_hour", "watts")


def save_edit(profile_id: str, **values) -> None:
    """Remember the user's value for a profile's field (the shipped table stays as it is)."""
    path = _user_file()
    try:
        edits = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        edits = {}
    edits.setdefault(profile_id, {}).update({k: v for k, v in values.items() if k in _EDITABLE})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(edits, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def get(profile_id: str) -> Hardware:
    for profile in profiles():
        if profile.id == profile_id:
            return profile
    known = ", ".join(p.id for p in profiles())

    raise InvalidRequestError(f"Unknown hardware {profile_id!r}: choose one of {known}.")


def _fingerprint() -> str:
    heavy_imports()
    import torch

    return f"{_cpu_model()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"


def profile_path() -> Path:
    """Where this machine's measured figures are kept: the user cache, or
    ``INFERENCE_WORKBENCH_HARDWARE_PROFILE`` (the tests keep theirs apart from the user's)."""
    override = os.environ.get("INFERENCE_WORKBENCH_HARDWARE_PROFILE")
    return Path(override) if override else cache_dir() / "this-machine.json"


def this_machine(measure: bool = False, bandwidth: bool = False) -> Hardware:
    """This computer's CPU: bandwidth and FLOP/s measured (a few seconds, once), then cached;
    ``bandwidth``: the read bandwidth measured again now (a second or two: a ceiling is drawn
    from the bandwidth the machine has when it is drawn, not on a busier hour)."""
    import psutil

    cache = profile_path()
    fingerprint = _fingerprint()
    measured = None
    if not measure:
        try:
            data = json.loads(cache.read_text(encoding="utf-8"))
            if data.get("fingerprint") == fingerprint:
                measured = data
        except (OSError, ValueError):
            pass
    fresh = measured is None
    if fresh:
        measured = {"fingerprint": fingerprint, **measure_cpu(), "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    elif bandwidth:
        measured = {**measured, **measure_bandwidth()}
    if fresh or bandwidth:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(measured, indent=2), encoding="utf-8")
    when = measured.get("bandwidth_measured_at", measured["measured_at"])
    level = measured.get("cache_bytes")
    method = measured.get("bandwidth_method", "a sum")

    return Hardware(
        id=THIS_MACHINE, name=f"This machine: {_cpu_model()} ({platform.machine()})", kind="cpu",
        memory_bytes=int(psutil.virtual_memory().total), bandwidth_bytes_per_s=measured["bandwidth_bytes_per_s"],
        bf16_flops=measured["bf16_flops"], usd_per_hour=0.0, watts=None,
        sources={"bandwidth_bytes_per_s": f"measured {when}: {method}, over a 512 MiB tensor",
                 "bf16_flops": f"measured {measured['measured_at']}: 1024² bf16 matmul, best of 5",
                 "cache_bandwidth_bytes_per_s": (f"measured {when}: {method}, 16 times over a quarter of the "
                                                 f"{level / 2**20:,.0f} MiB L3, best of 20" if level else ""),
                 "memory_bytes": "psutil: total RAM", "usd_per_hour": "your own machine: set a price to compare"},
        cache_bytes=level, cache_bandwidth_bytes_per_s=measured.get("cache_bandwidth_bytes_per_s"),
    )


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache (Linux: sysfs; elsewhere ``None``)."""
    largest = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
        value = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size) if size.isdigit() else None
        if value and (largest is None or value > largest):
            largest = value
    return largest


def _read_bandwidth(data, rounds: int, passes: int = 1, read=None) -> float:
    """Bytes a second reading ``data`` ``passes`` times in a row (``read``, else a sum), the best
    of ``rounds`` (several passes a round: over a tensor the cache holds, one pass is short enough
    for a call's own cost to count)."""
    read = read or (lambda tensor: tensor.sum())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(passes):
            read(data)
        best = min(best, time.perf_counter() - start)
    return passes * data.numel() * data.element_size() / best


def _streaming_read():
    """The fast path's kernels' ``read_bytes`` (every thread reads its own share as one to several
    runs side by side, as a matrix product reads its weights) where they are built on this machine
    already (loading them is a moment; building them a minute, not done here), else ``None``."""
    from engine.models import kernels  # lazy: kernels imports torch's extension tools

    if kernels.load_if_built() is None:
        return None
    import torch

    return torch.ops.workbench.read_bytes


def _memory_read(data) -> tuple[float, object, str]:
    """How :func:`measure_bandwidth` reads ``data`` (a tensor far bigger than the caches): the
    kernels' read at the best count of runs side by side (1-8; one a thread reads well below what
    two do) where they are built, else a sum. (bytes a second, the read, what it is)."""
    kernel = _streaming_read()
    if kernel is None:
        return _read_bandwidth(data, 5), None, "a sum"
    rates = {count: _read_bandwidth(data, 3, read=lambda t, c=count: kernel(t, c)) for count in (1, 2, 4, 8)}
    streams = max(rates, key=rates.get)

    def read(tensor):
        return kernel(tensor, streams)
    return rates[streams], read, f"the kernels' read ({streams} runs a thread, the best of 1-8)"


def measure_bandwidth() -> dict:
    """Read bandwidth from memory (a read over a tensor far bigger than the caches) and, where
    the last-level cache's size is known, from that cache (over a quarter of it, read again and
    again), with the threads torch uses. A few seconds. The read is the kernels' where they are
    built, the best of 1-8 runs read side by side by each thread (a PyTorch sum, one run a thread,
    reads well below what the memory gives a matrix product: a decode step came out at more than
    100% of its figure), else a sum; ``bandwidth_method`` says which."""
    heavy_imports()
    import torch

    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MiB
    rate, read, method = _memory_read(data)
    result = {"bandwidth_bytes_per_s": rate, "bandwidth_method": method}
    del data
    cache = last_level_cache_bytes()
    if cache:
        data = torch.ones(cache // 16, dtype=torch.float32)  # a quarter of it
        data.sum()  # in the cache now
        cached = _read_bandwidth(data, 20, passes=16, read=read)
        if cached > result["bandwidth_bytes_per_s"]:  # else the cache's figure says nothing the memory's doesn't
            result.update(cache_bytes=cache, cache_bandwidth_bytes_per_s=cached)
    result["bandwidth_measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def bandwidth_probe():
    """A function that measures the memory's read bandwidth again, as :func:`measure_bandwidth`
    reads it, in a fraction of a second (the best of three reads of 512 MiB, held while the
    function lives): for a figure taken right before and after another measurement, on a machine
    whose bandwidth drifts."""
    heavy_imports()
    import torch

    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    _, read, _ = _memory_read(data)
    return lambda: _read_bandwidth(data, 3, read=read)


def measure_cpu() -> dict:
    """Read bandwidth (:func:`measure_bandwidth`) and bf16 matmul FLOP/s with the threads torch
    uses. A few seconds."""
    heavy_imports()
    import torch

    measured = measure_bandwidth()
    n = 1024
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return {**measured, "bf16_flops": 2 * n ** 3 / best}
