"""Does the server's ``/metrics`` say what its clients measure? Side by side in one run.

The server (``inference-workbench serve``, the default model) runs in a subprocess; the load
generator (engine/load, another process) sends streamed chat requests at concurrency 1, 4 and 16.
Around each setting ``/metrics`` is read, and the histograms' ``_sum``/``_count`` deltas give the
server's mean TTFT, TPOT and end-to-end time, its counters the tokens it read and wrote. Beside
them: the same means as the clients measured them (TTFT to the first content chunk, TPOT =
(E2E − TTFT)/(n − 1), vLLM's definitions) and the tokens the clients were told (usage).

Target: TTFT within 5% or 10 ms of the clients', token counts exact. The server times
a request from its arrival at the HTTP front end, so its TTFT lacks only the network on both sides
and the SSE framing; TPOT and E2E are printed for the record.

    python benchmarks/serve_agreement.py [--precision bf16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve import free_port, run_load, start_server, stop, wait_healthy  # noqa: E402

HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
              "e2e": "vllm:e2e_request_latency_seconds", "itl": "vllm:inter_token_latency_seconds"}
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "generated": "vllm:generation_tokens_total"}


def scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, name in HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
        out[key] = total / count if count else None
        out[f"{key}_count"] = count
    for key, name in COUNTERS.items():
        out[key] = after.get(name, 0) - before.get(name, 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-user", type=int, default=2, help="requests per setting: this × concurrency "
                        "(at least 8)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from engine.load.prompts import read_prompts

    prompts = [p for p in read_prompts() if p.kind == "short"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args.precision, os.cpu_count())
    rows = []
    try:
        wait_healthy(f"{url}/health", server)
        run_load(f"{url}/v1", prompts, 8, 2, concurrency=(1,))  # warm-up, left out
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            before = scrape(url)
            (setting,) = run_load(f"{url}/v1", prompts, args.tokens, max(8, args.requests_per_user * concurrency),
                                  concurrency=(concurrency,))
            after = scrape(url)
            done = [r for r in setting.results if r.ok]
            client = {"ttft": statistics.fmean(r.ttft_s for r in done),
                      "tpot": statistics.fmean(r.tpot_s for r in done if r.tpot_s is not None),
                      "e2e": statistics.fmean(r.e2e_s for r in done),
                      "prompt": sum(r.prompt_tokens or 0 for r in done),
                      "generated": sum(r.output_tokens for r in done),
                      "counted_by": {r.counted_by for r in done}, "failed": len(setting.results) - len(done)}
            rows.append((concurrency, len(done), client, server_means(before, after)))
    finally:
        stop(server)

    print(f"\nserve_agreement: default model, {args.precision}, {args.tokens} tokens a request, streamed chat "
          f"(client: the load generator in another process; server: /metrics deltas)")
    print(f"{'conc':>4} {'req':>4} | {'TTFT client':>11} {'server':>9} {'diff':>15} {'ok':>3} | "
          f"{'TPOT client':>11} {'server':>9} | {'E2E client':>10} {'server':>9} | tokens in (client/server) "
          f"· out (client/server)")
    all_ok = True
    for concurrency, n, client, server_side in rows:
        diff = server_side["ttft"] - client["ttft"]
        share = diff / client["ttft"]
        ttft_ok = abs(share) <= 0.05 or abs(diff) <= 0.010
        counts_ok = (client["prompt"] == server_side["prompt"] and client["generated"] == server_side["generated"]
                     and server_side["ttft_count"] == n and not client["failed"])
        all_ok &= ttft_ok and counts_ok
        print(f"{concurrency:>4} {n:>4} | {client['ttft'] * 1e3:>9.1f}ms {server_side['ttft'] * 1e3:>7.1f}ms "
              f"{diff * 1e3:>+7.1f}ms {share:>+6.1%} {'yes' if ttft_ok else 'NO':>3} | "
              f"{client['tpot'] * 1e3:>9.2f}ms {server_side['tpot'] * 1e3:>7.2f}ms | "
              f"{client['e2e'] * 1e3:>8.0f}ms {server_side['e2e'] * 1e3:>7.0f}ms | "
              f"{client['prompt']:.0f}/{server_side['prompt']:.0f} · {client['generated']:.0f}/"
              f"{server_side['generated']:.0f} ({'exact' if counts_ok else 'DIFFER'}; clients counted by "
              f"{', '.join(sorted(client['counted_by']))})")
    print("within target (TTFT ±5% or ±10 ms, counts exact):", "yes" if all_ok else "NO")
    try:
        flags = [f for f in open("/proc/cpuinfo").read().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
                 if f.startswith(("avx512", "amx"))]
        print("CPU flags:", " ".join(flags))
    except (OSError, IndexError):
        pass


if __name__ == "__main__":
    main()
