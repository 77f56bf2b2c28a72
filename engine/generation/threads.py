"""How many threads the matrix work uses, chosen while generating from how busy the machine is.

PyTorch's CPU kernels split each matmul across its OpenMP threads (one per core by default),
and every split ends at a barrier where all threads wait for the slowest. When another
program keeps one of those cores busy, the thread that shares it gets a fraction of the core
and every barrier waits for it: on two cores, with one busy loop beside it, decoding falls
to well under half its speed, while one thread, alone on the free core, keeps most of it
(benchmarks/contention.py).

So between tokens (at most every :data:`INTERVAL_S`), :func:`adapt` measures how many cores
*other* processes used since the last look (the busy time of the CPUs this process may run
on, less this process's own CPU time) and sets the thread count to the cores left over, never
below one nor above the count PyTorch started with. A quiet machine keeps every thread.

The OpenMP wait policy stays active (threads spin briefly at a barrier before sleeping): it
can only be set before PyTorch starts, and passive waiting costs quiet decoding a third of its
speed to save what the thread count already saves (benchmarks/contention.py).

``INFERENCE_WORKBENCH_THREADS=N`` fixes the count instead (benchmarks that compare thread
counts, or a user who knows better).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

INTERVAL_S = 0.25
"""Shortest span the others' load is averaged over (shorter spans are mostly noise)."""
SPARE = 0.25
"""Others' use of a core below this is background noise, not a reason to give the core up."""

_local = threading.local()
_start_threads: int | None = None


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    """Threads the matrix work uses from now on."""
    others_cores: float | None
    """Cores other processes kept busy over the last span (the fast path's build process among
    them); ``None`` before a first span."""
    cores: int
    """CPUs this process may run on."""


def _fixed() -> int | None:
    value = os.environ.get("INFERENCE_WORKBENCH_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: every CPU
        return list(range(os.cpu_count() or 1))


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent not idle on ``cpus``, since boot, less the time the hypervisor ran
    something else on them (steal): that is no process this one can leave a core to, and it
    comes in bursts on either CPU. Counted, a shared host's steal read as a quarter to half a
    core busy elsewhere on a quiet machine, and the engine
    gave up a thread (and its compiled step, built for two) for the next span."""
    import psutil

    try:
        per_cpu = psutil.cpu_times(percpu=True)
    except (OSError, RuntimeError):
        return None
    total = 0.0
    for index in cpus:
        if index >= len(per_cpu):
            return None
        times = per_cpu[index]
        idle = times.idle + getattr(times, "iowait", 0.0)
        total += (sum(times) - idle - getattr(times, "steal", 0.0)
                  - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0))
    return total


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def choose(others_cores: float, cores: int, most: int) -> int:
    """Threads for the cores that others leave free (at least one, at most ``most``)."""
    taken = max(0, math.ceil(others_cores - SPARE))
    return max(1, min(most, cores - taken))


def adapt(force: bool = False) -> ThreadChoice | None:
    """Look at the machine (at most every :data:`INTERVAL_S` unless ``force``) and set this
    thread's PyTorch thread count to fit; returns the choice when it looked, else ``None``.

    Per thread: OpenMP keeps the count per calling thread, so each engine thread (the
    window's, each compare lane's) adapts its own."""
    import torch

    global _start_threads
    if _start_threads is None:
        _start_threads = torch.get_num_threads()
    fixed = _fixed()
    if fixed is not None:
        if torch.get_num_threads() != fixed:
            torch.set_num_threads(fixed)
        return None
    now = time.monotonic()
    last = getattr(_local, "last", None)
    if last is not None and not force and now - last[0] < INTERVAL_S:
        return None
    cpus = _cpus()
    busy, own = _busy_seconds(cpus), _own_seconds()
    if busy is None:
        return None
    _local.last = (now, busy, own)
    if last is None or now - last[0] < 0.05:
        return ThreadChoice(torch.get_num_threads(), None, len(cpus))
    span = now - last[0]
    # this process's own time counts on every CPU it ran on, including any outside ``cpus``
    # (never, with affinity): the difference is the others' share of our CPUs
    others = max(0.0, ((busy - last[1]) - (own - last[2])) / span)
    threads = choose(others, len(cpus), _start_threads)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return ThreadChoice(threads, others, len(cpus))
