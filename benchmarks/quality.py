"""Every precision's price in quality on the default model, in one table: perplexity over the shipped
text (llama.cpp's method, ctx 512), KL divergence from fp32 (mean, 99th percentile), the share of
tokens whose top choice stays fp32's, weights bytes, decode tok/s, and how long each took.

fp32 runs first and is kept as the reference (top 512 log-probabilities per token and the rest's
mass); one precision or more (``--exact``, int8-fast by default) is also measured against fp32 loaded
beside it with every probability, to say how much keeping the top 512 changes the figure, and
served (``--served``, int8-fast by default) by this workbench's server on a loopback port and
scored from the prompt log-probabilities it returns (its top 20), as a served model is measured:
the same perplexity, and how low the served KL's lower bound reads against the figure here.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/quality.py [--precisions fp32,bf16,...] [--chunks N] [--exact int8-fast,...] [--served int8-fast]

A precision may name a KV-cache dtype after an ``@`` (``int8-fast@int8``: int8-fast's weights, an
int8 KV cache): what the cache's bits cost, measured the same way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.base.request import GenerationRequest  # noqa: E402
from engine.generation.generate import generate  # noqa: E402
from engine.measure import quality  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402
from engine.base.units import format_bytes  # noqa: E402

PRECISIONS = "fp32,bf16,int8,nf4,fp32-fast,bf16-fast,int8-fast,int4-fast"


def decode_speed(loaded, tokens: int = 64) -> float | None:
    request = GenerationRequest("Write a short story about a lighthouse keeper.", max_new_tokens=tokens,
                                ignore_eos=True)
    finished = list(generate(loaded, request))[-1]
    return finished.decode_tokens_per_s


def measure_served_copy(loaded, tokens, args, reference):
    """``loaded`` served on a free loopback port, scored from its prompt log-probabilities."""
    from engine.endpoint import connect, parse_endpoint
    from engine.measure.served_quality import measure_served
    from engine.serve.server import Server, ServeSettings

    server = Server(loaded, ServeSettings(port=0, history=False, token_budget=512)).start()
    endpoint = connect(parse_endpoint(server.url))
    try:
        return measure_served(endpoint, tokens, loaded.token_text, quality.adds_bos(loaded.tokenizer),
                              "quality-text.txt", args.ctx, args.chunks, reference)
    finally:
        endpoint.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default=PRECISIONS)
    parser.add_argument("--chunks", type=int, help="score the first N chunks only (default: the whole text)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--exact", default="int8-fast", help="also measured against fp32 with every probability "
                                                             "(comma-separated precisions; '' to skip)")
    parser.add_argument("--served", default="int8-fast", help="also served and scored through the API ('' to skip)")
    args = parser.parse_args()
    _, text = quality.read_text(None)
    rows = []
    served = []
    reference = None
    reference_model = None
    for precision in ["fp32"] + [p for p in args.precisions.split(",") if p and p != "fp32"]:
        weights, _, kv = precision.partition("@")
        loaded = load_model(LoadRequest("default", weights, "cpu", kv_dtype=kv or "auto"))
        tokens = quality.text_tokens(loaded, text)
        report, kept = quality.measure(loaded, tokens, "quality-text.txt", args.ctx, args.chunks, reference)
        exact = None
        if precision in args.exact.split(",") and reference_model is not None:
            exact, _ = quality.measure(loaded, tokens, "quality-text.txt", args.ctx, args.chunks, reference_model)
        speed = decode_speed(loaded)
        rows.append((precision, report, speed, exact))
        if precision == args.served and reference is not None:
            served.append((precision, report, measure_served_copy(loaded, tokens, args, reference)))
        d = report.divergence
        print(f"  {precision}: PPL {report.perplexity:.4f} in {report.seconds:.1f} s"
              + ("" if d is None else f", KLD {d.kld_mean:.5f}"), file=sys.stderr, flush=True)
        if reference is None:
            reference = kept
            reference_model = loaded  # kept loaded for --exact
        else:
            loaded.close()
    print(f"\ndefault model (SmolLM2-135M-Instruct), quality-text.txt, ctx {args.ctx}, "
          f"{rows[0][1].chunks} chunks ({rows[0][1].tokens_scored:,} tokens scored); CPU flags: {cpu_flags()}")
    print(f"{'precision':<15} {'KV cache':<9} {'weights':>10} {'PPL':>16} {'PPL ratio':>9} {'mean KLD':>10} "
          f"{'KLD p99':>9} {'same top':>9} {'decode':>11} {'time':>8}")
    for precision, report, speed, _ in rows:
        d = report.divergence
        print(f"{precision.partition('@')[0]:<15} {report.kv_dtype:<9} {format_bytes(report.weights_bytes):>10} "
              f"{report.perplexity:>8.3f} ± {report.perplexity_err:<5.3f} "
              f"{'—' if d is None else f'{d.ppl_ratio:.4f}':>9} {'—' if d is None else f'{d.kld_mean:.5f}':>10} "
              f"{'—' if d is None else f'{d.kld_p99:.4f}':>9} {'—' if d is None else f'{100 * d.same_top:.2f}%':>9} "
              f"{speed or 0:>6.1f} tok/s {report.seconds:>7.1f}s")
    for precision, report, _, exact in rows:
        if exact is not None:
            top, full = report.divergence.kld_mean, exact.divergence.kld_mean
            print(f"\n{precision}: mean KLD with fp32's top {report.divergence.top_k} and the rest as one bucket "
                  f"{top:.6f}, with every probability {full:.6f}: the kept reference reads "
                  f"{100 * (top - full) / full:+.2f}% (p99 {report.divergence.kld_p99:.5f} vs "
                  f"{exact.divergence.kld_p99:.5f})")
    for precision, here, there in served:
        d, e = here.divergence, there.divergence
        print(f"\n{precision} served (this workbench's server, its top {e.served_top_k} per token): PPL "
              f"{there.perplexity:.4f} (here {here.perplexity:.4f}), same top {100 * e.same_top:.2f}% (here "
              f"{100 * d.same_top:.2f}%), mean KLD ≥ {e.kld_mean:.6f} (here {d.kld_mean:.6f}: the lower bound reads "
              f"{100 * (e.kld_mean - d.kld_mean) / d.kld_mean:+.1f}%), p99 ≥ {e.kld_p99:.5f} (here {d.kld_p99:.5f}); "
              f"{there.seconds:.1f} s through the API")
    if reference_model is not None:
        reference_model.close()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
