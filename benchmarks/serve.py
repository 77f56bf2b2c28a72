"""The server measured side by side in one run, on the default model.

1. The same requests one after another (concurrency 1) through HTTP (``inference-workbench serve``
   in a subprocess, read with the load generator) and in-process (``LoadedModel.generate`` in this
   process, the server idle meanwhile), interleaved over rounds: output tok/s, HTTP / in-process.
2. Aggregate output tok/s at concurrency 16 against concurrency 1, with TPOT p50/p99.
3. A Poisson rate sweep (burstiness 1) until the server can't keep up: throughput stops
   following the arrivals and TTFT grows (the queue builds).
4. With ``llama-server`` on PATH: the same concurrency-16 load against it (``-np 16``, the default
   model's own GGUF file), our aggregate tok/s as a ratio of its.

Every request is the shipped prompt set's short prompts (decode dominates, as in the essay's chat
answers) with exactly ``--tokens`` tokens (``ignore_eos``), greedy.

    python benchmarks/serve.py [--precision bf16] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from engine.generation.generate import generate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}) before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {timeout:.0f} s")


def start_server(port: int, precision: str, threads: int = 0, extra: tuple[str, ...] = (),
                 cpus: list[int] | None = None) -> subprocess.Popen:
    """``inference-workbench serve`` on the default model in a subprocess (batch 16, no history);
    ``threads``: its matmul threads fixed (0: it adapts); ``extra``: more of its options; ``cpus``:
    the CPUs it may run on (``None``: this process's)."""
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--precision",
                             precision, "--max-batch", "16", "--no-history", *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
                            env={**os.environ, **({"INFERENCE_WORKBENCH_THREADS": str(threads)} if threads else {})})


def stop(process: subprocess.Popen) -> None:
    import signal

    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def run_load(url: str, prompts, tokens: int, requests: int, concurrency=(), rates=(), model=None):
    from engine.load.generator import LoadPlan, LoadRunner

    plan = LoadPlan(url=url, model=model, concurrency=tuple(concurrency), rates=tuple(rates), requests=requests,
                    max_tokens=tokens, ignore_eos=True, max_duration_s=600).validated()
    return LoadRunner(plan, prompts).run()


def in_process(loaded, prompts, tokens: int, requests: int) -> tuple[float, int]:
    """Output tok/s of the same requests, one after another, in this process."""
    from engine.base.events import Finished
    from engine.base.request import GenerationRequest

    from engine.base.sampling import SamplingParams

    made = 0
    start = time.perf_counter()
    for i in range(requests):
        request = GenerationRequest(prompts[i % len(prompts)].text, max_new_tokens=tokens, ignore_eos=True,
                                    top_alternatives=0, sampling=SamplingParams(temperature=0.0))
        for event in generate(loaded, request):
            if isinstance(event, Finished):
                made += event.tokens
    return made / (time.perf_counter() - start), made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16",
                        help="bf16 by default: what one serves on a CPU with AMX/AVX-512 BF16 (half fp32's bytes "
                             "a token); fp32 and the -fast precisions work too")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--solo-requests", type=int, default=6, help="requests per concurrency-1 round")
    parser.add_argument("--batch-requests", type=int, default=32, help="requests at concurrency 16")
    parser.add_argument("--rates", default="0.5,1,2,4,8", help="req/s of the Poisson sweep")
    parser.add_argument("--rate-requests", type=int, default=24)
    parser.add_argument("--server-threads", type=int, default=os.cpu_count(),
                        help="the server's matmul threads, fixed (INFERENCE_WORKBENCH_THREADS): the load generator "
                             "shares this machine, and its few %% of a core would otherwise be read as another "
                             "program's load and cost the server a thread; 0 lets it adapt (default: all cores)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from engine.load.prompts import read_prompts
    from engine.load.report import ms
    from engine.models import default_model
    from engine.models.loading import LoadRequest, load_model

    prompts = [p for p in read_prompts() if p.kind == "short"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args.precision, args.server_threads)
    try:
        wait_healthy(url + "/health", server)
        loaded = load_model(LoadRequest("default", args.precision, "cpu"))
        in_process(loaded, prompts, 8, 1)  # warm-up, both sides
        run_load(url + "/v1", prompts, 8, 1, concurrency=(1,))

        print(f"default model, {args.precision}, {args.tokens} tokens per request, short prompts, greedy\n")
        http_rates, local_rates = [], []
        for round_ in range(args.rounds):
            local, _ = in_process(loaded, prompts, args.tokens, args.solo_requests)
            (solo,) = run_load(url + "/v1", prompts, args.tokens, args.solo_requests, concurrency=(1,))
            local_rates.append(local)
            http_rates.append(solo.summary.output_throughput)
            print(f"round {round_ + 1}: in-process {local:6.1f} tok/s · HTTP concurrency 1 "
                  f"{solo.summary.output_throughput:6.1f} tok/s · ratio {solo.summary.output_throughput / local:.3f}")
        http_1, local_1 = statistics.median(http_rates), statistics.median(local_rates)
        print(f"1. HTTP at concurrency 1 / in-process: {http_1:.1f} / {local_1:.1f} tok/s = {http_1 / local_1:.3f} "
              f"(target ≥ 0.9)")
        loaded.close()
        del loaded

        (batch,) = run_load(url + "/v1", prompts, args.tokens, args.batch_requests, concurrency=(16,))
        s = batch.summary
        print(f"2. concurrency 16: {s.output_throughput:.1f} tok/s aggregate = {s.output_throughput / http_1:.2f}× "
              f"concurrency 1 (target ≥ 6); TPOT p50 {ms(s.tpot, 'median')}, p99 {ms(s.tpot, 'p99')}; "
              f"TTFT p50 {ms(s.ttft, 'median')}; {s.completed}/{s.requests} done, tokens from {s.counted_by}")

        print("3. Poisson arrivals (burstiness 1):")
        print(f"   {'rate':>8} {'done':>6} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'max in flight':>13}")
        for rate in [float(r) for r in args.rates.split(",") if r.strip()]:
            (point,) = run_load(url + "/v1", prompts, args.tokens, args.rate_requests, rates=(rate,))
            p = point.summary
            print(f"   {rate:>6g}/s {p.completed:>3}/{p.requests:<2} {p.request_throughput:>6.2f} "
                  f"{p.output_throughput:>9.1f} {ms(p.ttft, 'median'):>9} {ms(p.ttft, 'p99'):>9} "
                  f"{ms(p.tpot, 'median'):>9} {p.max_concurrency:>13}")
            if p.request_throughput < 0.7 * rate:
                print("   (saturated: requests arrive faster than they finish)")
                break
    finally:
        stop(server)

    llama = shutil.which("llama-server")
    if llama is None:
        print("4. llama-server not on PATH: no peer comparison")
        return
    port = free_port()
    peer = subprocess.Popen([llama, "-m", str(default_model.gguf_path()), "--port", str(port), "-np", "16",
                             "-c", str(16 * 1024), "-t", str(os.cpu_count())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", peer)
        run_load(f"http://127.0.0.1:{port}/v1", prompts, 8, 1, concurrency=(1,))
        (theirs,) = run_load(f"http://127.0.0.1:{port}/v1", prompts, args.tokens, args.batch_requests,
                             concurrency=(16,))
        t = theirs.summary
        print(f"4. llama-server -np 16 (its GGUF, {default_model.gguf_path().name}): {t.output_throughput:.1f} tok/s "
              f"aggregate, TPOT p50 {ms(t.tpot, 'median')}; ours / theirs = "
              f"{s.output_throughput / t.output_throughput:.2f}")
    finally:
        stop(peer)


if __name__ == "__main__":
    main()
