"""The compiled steps' fp32 and bf16 products: the kernels' ``dense_linear`` against Inductor's.

    python benchmarks/dense_products.py --random-config google/gemma-3-1b-it --precision fp32-fast --rows 1,4,16,64

For each row count, the step that runs it (the one-sequence step for 1, the batched step for
more) is compiled twice in this process, once with the products as Inductor makes them (on the
weights it packs) and once through ``dense_linear`` (engine/models/kernels/dense.h), into a
temporary folder; then the two packages' steps are called alternately, ``--rounds`` rounds of 12
steps each at position ``--position`` of every row's own blocks. Prints each median step time and
the ratio (Inductor's time ÷ ``dense_linear``'s: above 1, ``dense_linear`` is the faster), with
the CPU's flags. What the app builds follows it: engine/generation/compiled_step.py. Run it on a
quiet machine; a build takes a minute or two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.generation import compiled_step  # noqa: E402
from engine.models import fast, kernels  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-fast", choices=("fp32-fast", "bf16-fast"))
    parser.add_argument("--model", default="default", help="any model the app loads")
    parser.add_argument("--random-config", metavar="HUB_ID", help="random weights in a shipped config, as fast_path.py")
    parser.add_argument("--rows", default="1,16", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--position", type=int, default=64)
    args = parser.parse_args()
    if not (kernels.kernels() and fast.dense_op()):
        sys.exit("the kernels' dense_linear isn't available here (an AVX-512 build of the kernels is needed)")
    if args.random_config:
        from fast_path import random_model

        args.model = random_model(args.random_config)
    threads = torch.get_num_threads()
    loaded = load_model(LoadRequest(args.model, args.precision, "cpu"))
    d = loaded.fast
    d.step_attention = True  # as the build process sets it where the kernels load
    weights = compiled_step.fingerprint(d)
    counts = [int(n) for n in args.rows.split(",")]
    print(f"{args.model}, {args.precision}, {threads} threads; CPU flags: {cpu_flags()}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for rows in counts:
            kind = compiled_step.STEP if rows == 1 else compiled_step.ROWS
            steps = {}
            for dense in (False, True):
                path = Path(folder) / f"{kind}-{int(dense)}.pt2"
                if not path.exists():
                    d.dense = dense
                    what = "one-sequence" if kind == compiled_step.STEP else "batched"
                    print(f"compiling the {what} step {'with' if dense else 'without'} dense_linear …", flush=True)
                    compiled_step.build_package(d, path, threads, weights, kind)
                steps[dense] = compiled_step.load_package(d, path, weights)
            d.dense = fast.dense_op()
            times = time_steps(d, steps, rows, args.position, args.rounds)
            theirs, ours = (statistics.median(times[dense]) for dense in (False, True))
            ratios = [a / b for a, b in zip(times[False], times[True])]
            print(f"{rows:>3} row{'s' if rows > 1 else ' '}: Inductor {theirs * 1e3:7.1f} ms, dense_linear "
                  f"{ours * 1e3:7.1f} ms a step; Inductor ÷ dense_linear {min(ratios):.2f}-{max(ratios):.2f} "
                  f"(median {statistics.median(ratios):.2f})", flush=True)
            del steps
    return 0


def time_steps(d, steps: dict, rows: int, position: int, rounds: int) -> dict[bool, list[float]]:
    """Each round's median step time for each package, the packages alternating."""
    width = position // compiled_step.BLOCK_TOKENS + 1
    halves = 2 if d.windowed else 1
    keys, values = compiled_step._example_pool(d, blocks=2 * rows * width + 8)
    cos, sin = fast._rotary_tables(d, max(512, position + 1))
    ids = torch.randint(0, 1000, (rows, 1), generator=torch.Generator().manual_seed(0))
    positions = torch.full((rows,), position, dtype=torch.long)
    table = torch.arange(rows * width, dtype=torch.long).view(rows, width).repeat(1, halves)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        for round_ in range(rounds):
            for dense in ((False, True) if round_ % 2 else (True, False)):
                taken = []
                for _ in range(12):
                    start = time.perf_counter()
                    steps[dense](d, keys, values, cos, sin, ids, positions, table)
                    taken.append(time.perf_counter() - start)
                times[dense].append(statistics.median(taken[2:]))
    return times


if __name__ == "__main__":
    raise SystemExit(main())
