"""The fast path's weights on huge pages against ordinary pages, side by side.

    python benchmarks/huge_pages.py [--precision int8-fast] [--model default] [--rounds 8] [--start 40]

Loads the model twice in one process, once with its weights (and the compiled steps' packed
copies of them) moved onto huge pages (engine/models/huge_pages.py, what a load does on Linux)
and once with ``INFERENCE_WORKBENCH_NO_HUGE_PAGES`` set, readies both compiled steps, then times 64-token
decodes of 1 and of 16 sequences from position ``--start``, alternating between the two models
round by round. Prints each median step, the ratio of the medians of the per-round ratios, the
16-row step's gain over one row for each, how much of each model's weights the kernel backs
with huge pages (smaps' AnonHugePages), and the CPU's flags. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.generation.compiled_step import compile_decoder  # noqa: E402
from engine.generation.paged_cache import PagedCache  # noqa: E402
from engine.models import huge_pages  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402


def anon_huge_kib() -> int:
    """The process's anonymous memory backed by huge pages, in KiB."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    return int(text.split("AnonHugePages:")[1].split()[0])


def ready(request: LoadRequest):
    """The model loaded and its compiled steps ready (built or loaded now, under the environment
    of this moment), or the reason they aren't, and an exit."""
    loaded = load_model(request)
    report = compile_decoder(loaded.fast)
    if report.error or report.rows_error:
        sys.exit(f"the compiled steps aren't ready: {report.error or report.rows_error}")
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8-fast", choices=("fp32-fast", "bf16-fast", "int8-fast", "int4-fast"))
    parser.add_argument("--model", default="default", help="any model the app loads")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--start", type=int, default=40, help="the position every sequence decodes from")
    args = parser.parse_args()
    if not huge_pages.available():
        sys.exit("huge pages can't be advised here (Linux only, and INFERENCE_WORKBENCH_NO_HUGE_PAGES unset)")
    os.environ[huge_pages.DISABLE_ENV] = "1"
    plain = ready(LoadRequest(args.model, args.precision, "cpu"))  # its packed copies in ordinary pages too
    del os.environ[huge_pages.DISABLE_ENV]
    before = anon_huge_kib()
    moved = ready(LoadRequest(args.model, args.precision, "cpu"))
    backed = anon_huge_kib() - before
    ids = torch.randint(100, 40000, (1, args.start), generator=torch.Generator().manual_seed(0))
    names = {"ordinary pages": plain, "huge pages": moved}
    caches, times = {}, {}
    with torch.inference_mode():
        for name, loaded in names.items():
            for rows in (1, 16):
                cache = caches[name, rows] = PagedCache(loaded.fast)
                for seq in range(rows):
                    cache.add(seq, args.start + 65)
                    cache.prefill(seq, ids)
                times[name, rows] = []
        for r in range(args.rounds):
            for name in (names if r % 2 else reversed(list(names))):
                for rows in (1, 16):
                    cache, seqs = caches[name, rows], list(range(rows))
                    for seq in seqs:
                        cache.crop(seq, args.start)
                    start = time.perf_counter()
                    for _ in range(64):
                        cache.decode(seqs, [1] * rows)
                    times[name, rows].append((time.perf_counter() - start) / 64)
    print(f"{args.model}, {args.precision}, 64-token decodes from position {args.start}, {args.rounds} rounds "
          f"alternating, {torch.get_num_threads()} threads; CPU flags: {cpu_flags()}")
    print(f"huge pages backing the moved model and its steps' packed copies: {backed / 1024:.1f} MiB (its weights "
          f"{moved.fast.huge_page_bytes / 2**20:.1f} MiB)")
    for name in names:
        one, sixteen = (statistics.median(times[name, rows]) for rows in (1, 16))
        print(f"{name:>15}: 1 row {one * 1e3:.3f} ms, 16 rows {sixteen * 1e3:.3f} ms a step; 16 rows ÷ 1: "
              f"{16 * one / sixteen:.2f}× the tokens a second")
    for rows in (1, 16):
        ratio = statistics.median(a / b for a, b in zip(times["ordinary pages", rows], times["huge pages", rows]))
        print(f"huge pages, {rows:>2} row{'s' if rows > 1 else ''}: {ratio:.3f}× as fast (median of per-round ratios)")


if __name__ == "__main__":
    main()
