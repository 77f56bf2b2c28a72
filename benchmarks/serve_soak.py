"""Soak the server: does its memory stop growing once it has seen its busiest moment?

``inference-workbench serve`` on the default model in a subprocess, prefix caching on, its default
KV budget; a closed loop of ``--concurrency`` clients sends distinct prompts (each a shipped prompt
with a number of its own, so the prefix cache churns) for ``--seconds``. The server's RSS (psutil)
and its KV pool (``/metrics``: the pool's storage bytes, the budget, kept and held blocks) are read
every few seconds. Targets: RSS at the end within 5% of RSS after ``--warmup`` seconds, and the
pool never past its budget.

    python benchmarks/serve_soak.py [--precision bf16] [--seconds 300] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve import free_port, start_server, stop, wait_healthy  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    """The server's KV gauges from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=5).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:kv_cache")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--warmup", type=float, default=120)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import psutil

    from engine.load.generator import LoadPlan, LoadRunner
    from engine.load.prompts import Prompt, read_prompts
    from engine.models.kernels import cpu_flags

    print(f"CPU: {platform.processor() or platform.machine()}; flags: "
          + " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))))
    shipped = read_prompts()
    prompts = [Prompt(f"({i}) {shipped[i % len(shipped)].text}") for i in range(20000)]
    port = free_port()
    server = start_server(port, args.precision)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/health", server)
        process = psutil.Process(server.pid)
        plan = LoadPlan(url=f"{base}/v1", concurrency=(args.concurrency,), requests=100000, max_tokens=args.tokens,
                        ignore_eos=True, max_duration_s=args.seconds, scrape=False).validated()
        result = {}
        loader = threading.Thread(target=lambda: result.setdefault("report", LoadRunner(plan, prompts).run()))
        start = time.monotonic()
        loader.start()
        samples = []
        while loader.is_alive():
            time.sleep(5)
            figures = scrape(f"{base}/metrics")
            samples.append((time.monotonic() - start, process.memory_info().rss, figures))
            at, rss, f = samples[-1]
            print(f"{at:6.0f} s  RSS {rss / 2**20:8.1f} MiB  pool {f.get('vllm:kv_cache_pool_bytes', 0) / 2**20:7.1f}"
                  f" MiB of {f.get('vllm:kv_cache_budget_bytes', 0) / 2**20:.0f}  held "
                  f"{f.get('vllm:kv_cache_usage_perc', 0):.1%}  kept blocks {f.get('vllm:kv_cache_kept_blocks', 0):.0f}",
                  flush=True)
        loader.join()
    finally:
        stop(server)
    end = samples[-1][1]
    past = max(f.get("vllm:kv_cache_pool_bytes", 0) - f.get("vllm:kv_cache_budget_bytes", 0) for _, _, f in samples)
    pool = [f.get("vllm:kv_cache_pool_bytes", 0) for _, _, f in samples]
    points = ", ".join(f"{next(rss for at, rss, _ in samples if at >= t) / 2**20:.0f} MiB at {t:.0f} s"
                       for t in (30, 60, args.warmup) if t < samples[-1][0])
    after = next(rss for at, rss, _ in samples if at >= args.warmup)
    print(f"{args.precision}, concurrency {args.concurrency}, {args.seconds:.0f} s: RSS {points}, "
          f"{end / 2**20:.0f} MiB at the end: {end / after - 1:+.1%} after the {args.warmup:.0f} s warm-up (target "
          f"< 5%); the pool's bytes at most {max(pool) / 2**20:.1f} MiB, past its budget by "
          f"{max(0, past) / 2**20:.1f} MiB (target 0)")


if __name__ == "__main__":
    main()
