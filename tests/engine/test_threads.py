"""The thread count follows the cores other programs leave free."""

import os
import subprocess
import sys
import time

import pytest
import torch

from engine.generation import threads
from engine.generation.threads import adapt, choose


def test_choose_gives_up_only_cores_others_really_use():
    assert choose(0.0, cores=2, most=2) == 2
    assert choose(0.2, cores=2, most=2) == 2  # background noise keeps both
    assert choose(0.6, cores=2, most=2) == 1
    assert choose(1.0, cores=2, most=2) == 1
    assert choose(5.0, cores=2, most=2) == 1  # never below one
    assert choose(0.0, cores=16, most=8) == 8  # never above PyTorch's own start count
    assert choose(9.5, cores=16, most=8) == 6


def test_a_fixed_count_wins(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("INFERENCE_WORKBENCH_THREADS", "1")
    try:
        assert adapt(force=True) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_time_the_hypervisor_took_is_no_other_process(monkeypatch):
    """Steal time (a shared host running something else on our virtual CPUs) counts as neither
    ours nor another process's: a quiet machine on a busy host keeps its threads."""
    import psutil
    from collections import namedtuple

    times = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")
    sample = [times(10.0, 0, 1.0, 50.0, 0.5, 0, 0, 2.0, 0.3, 0), times(20.0, 0, 2.0, 40.0, 0, 0, 0, 3.0, 0, 0)]
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu: sample)
    # busy: user + system (+ nice, irq, softirq) per CPU; idle, iowait, steal and guest time are not
    assert threads._busy_seconds([0, 1]) == pytest.approx(11.0 + 22.0)
    assert threads._busy_seconds([0, 2]) is None  # a CPU the kernel didn't report: no figure


def _measured(deadline_s: float, until) -> "threads.ThreadChoice | None":
    """Choices made by :func:`adapt` over real time until ``until(choice)`` holds (a load measured
    over time: polled, bounded); the last choice made."""
    choice = None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        choice = adapt() or choice
        if choice is not None and choice.others_cores is not None and until(choice):
            break
    return choice


@pytest.mark.alone
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2,
                    reason="needs two CPUs and two PyTorch threads")
def test_a_busy_core_elsewhere_takes_a_thread_away_and_gives_it_back(monkeypatch):
    """Measured against what else runs: on a machine that is already busy (another process on a
    core), the thread comes back to what that load leaves, not to every core."""
    from engine.generation import threads
    from engine.generation.threads import choose

    monkeypatch.delenv("INFERENCE_WORKBENCH_THREADS", raising=False)
    adapt(force=True)
    start = threads._start_threads  # PyTorch's own count: an earlier test's busy moment may have left fewer
    torch.set_num_threads(start)
    cores = len(os.sched_getaffinity(0))
    adapt(force=True)
    before = _measured(5, lambda c: True)
    if before.others_cores > cores - 0.75:
        pytest.skip(f"other processes keep {before.others_cores:.1f} of {cores} cores busy: one more can't be seen")
    import psutil

    use = psutil.cpu_percent(interval=0.5, percpu=True)  # the busy loop goes where others leave room
    cpu = min(sorted(os.sched_getaffinity(0)), key=lambda c: use[c] if c < len(use) else 100.0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        adapt(force=True)
        loaded = _measured(20, lambda c: c.others_cores >= before.others_cores + 0.5)
        assert loaded.others_cores >= before.others_cores + 0.5  # the busy loop is seen
        assert torch.get_num_threads() == loaded.threads == choose(loaded.others_cores, cores, start)
        if before.threads == start:  # a quiet machine: the busy core's thread is given up
            assert loaded.threads == start - 1
    finally:
        busy.kill()
        busy.wait()
    adapt(force=True)
    quiet = before.threads == start
    after = _measured(20, lambda c: c.others_cores <= loaded.others_cores - 0.5 and (c.threads == start or not quiet))
    assert after.others_cores <= loaded.others_cores - 0.5  # the loop's core is free again …
    assert torch.get_num_threads() == after.threads == choose(after.others_cores, cores, start)
    if quiet:
        assert after.threads == start  # … and on a quiet machine its thread is back
