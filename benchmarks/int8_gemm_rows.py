"""Why 16 requests at once are not 8× one on int8-fast (CPU): the weight matrix products at 16
rows against 1 row, for the kernels PyTorch offers here, on the default model's shapes.

    python benchmarks/int8_gemm_rows.py [--threads 2]

Prints µs per product at 1 and 16 rows and the ratio of each to int8-fast's 1-row product
(what a batched step must stay near for the throughput target): the weight-only int8 kernel
int8-fast uses, bf16 dense, W8A8 with ``torch._int_mm``, and oneDNN's prepacked W8A8 GEMM with
a per-row activation scale folded outside it (so each row's result doesn't depend on the others).
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(3072, 576), (576, 1536), (960, 576), (4096, 576)]  # gate+up, down, q+k+v, a head block


def _time(fn, repeats: int = 40) -> float:
    fn(), fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'shape':>11} {'rows':>4} {'int8pack':>9} {'bf16':>7} {'_int_mm':>8} {'onednn':>7}   (µs; ×: vs int8pack at 1 row)")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        scale = weight.abs().amax(1) / 127
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        zero = torch.zeros(n, dtype=torch.int64)
        dense, q_t = weight.bfloat16(), q.t().contiguous()
        base = None
        for rows in (1, 16):
            x = torch.randn(rows, k)
            xb = x.bfloat16()

            def int_mm():
                s = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
                xq = torch.round(x / s).to(torch.int8)
                padded = torch.cat([xq, xq.new_zeros(17 - rows, k)]) if rows < 17 else xq  # needs > 16 rows
                return torch._int_mm(padded, q_t)[:rows].float() * s * scale

            def onednn():
                s = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
                xq = (torch.round(x / s) + 128).to(torch.uint8)
                return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale, zero, None, 1.0, 0,
                                                          torch.float32, "none", [], "") * s

            times = [_time(lambda: torch._weight_int8pack_mm(xb, q, scale.bfloat16())),
                     _time(lambda: torch.nn.functional.linear(xb, dense)), _time(int_mm), _time(onednn)]
            base = base or times[0]
            cells = " ".join(f"{t:5.0f}/{t / base:3.1f}×" for t in times)
            print(f"{n:>5}×{k:<5} {rows:>4} {cells}")


if __name__ == "__main__":
    main()
