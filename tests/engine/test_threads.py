"""The thread count follows the cores other programs leave free."""

import os
import subprocess
import sys
import time

import pytest
import torch

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2,
                    reason="needs two CPUs and two PyTorch threads")
def test_a_busy_core_elsewhere_takes_a_thread_away_and_gives_it_back(monkeypatch):
    from engine.generation import threads

    monkeypatch.delenv("INFERENCE_WORKBENCH_THREADS", raising=False)
    adapt(force=True)
    start = threads._start_threads  # PyTorch's own count: an earlier test's busy moment may have left fewer
    torch.set_num_threads(start)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        adapt(force=True)
        deadline = time.monotonic() + 20
        choice = None
        while time.monotonic() < deadline:  # a measurement over real time: poll it, bounded
            choice = adapt() or choice
            if choice is not None and choice.others_cores is not None and choice.threads < start:
                break
        assert choice.others_cores >= 0.5 and torch.get_num_threads() == start - 1
    finally:
        busy.kill()
        busy.wait()
    adapt(force=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and torch.get_num_threads() < start:
        adapt()
    assert torch.get_num_threads() == start
