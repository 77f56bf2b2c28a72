"""What sharing prefix blocks in place would cost the CPU decode step, side by side in one run.

The prefix cache copies a hit's blocks into the request's own contiguous slot (engine/generation/
kv_manager.py): it saves the prompt's compute, not its memory. Sharing them instead (vLLM's paged
KV: one copy of a block, a block table per request) needs an attention that reads blocks where
they lie. vLLM's GPU kernels do; on the CPU our decode step hands PyTorch's attention one
contiguous [batch, KV heads, tokens, dim] view per layer, so a paged layout would first gather
every request's blocks into one, at every step. This measures both on the default model: the
batched decode step of 16 requests behind a shared 600-token system prompt, and the gather of
their keys and values from a block pool that a paged layout would add to it, and prints the
gather's share of the step and the memory the sharing would save.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/paged_gather.py [--precision bf16-fast] [--requests 16] [--prefix 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.preemption import cpu_flags  # noqa: E402
from engine.generation.kv_manager import BLOCK_TOKENS  # noqa: E402
from engine.generation.runners import batch_runner_for  # noqa: E402
from engine.models.loading import LoadRequest, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-fast")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=600, help="tokens of the shared system prompt")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    loaded = load_model(LoadRequest("default", args.precision, "cpu"))
    if loaded.fast is None:
        raise SystemExit(f"{args.precision} has no fast path here: pick a *-fast precision.")
    runner = batch_runner_for(loaded)
    vocab = loaded.tokenizer.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, vocab - 100, (1, args.prefix), generator=generator)
    seqs = list(range(args.requests))
    with torch.inference_mode():
        for seq in seqs:  # the shared prompt and a 40-token question each
            runner.add(seq, args.prefix + 40 + args.steps + 2)
            question = torch.randint(100, vocab - 100, (1, 40), generator=generator)
            runner.prefill(seq, torch.cat([prefix, question], dim=1))
        tokens = [1] * len(seqs)
        runner.decode(seqs, tokens)  # warm

        step_s, gather_s = [], []
        layers = len(runner.keys)
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.decode(seqs, tokens)
            step_s.append(time.perf_counter() - start)

            # the paged layout: every layer's KV in a pool of blocks, [KV heads, blocks, 16, dim], the
            # prefix's blocks once, each request's table pointing at them and at its own; the least
            # gather that gives the attention a [requests, KV heads, tokens, dim] view is one
            # index_select per layer and K/V into a preallocated buffer (a transposed view of it)
            length = runner.length(seqs[0])
            blocks = -(-length // BLOCK_TOKENS)
            shared = args.prefix // BLOCK_TOKENS
            own = blocks - shared
            table = torch.tensor([b for i in range(len(seqs))
                                  for b in [*range(shared), *(shared + i * own + j for j in range(own))]])
            heads, dim = runner.keys[0].shape[1], runner.keys[0].shape[3]
            pools = [torch.zeros((heads, shared + own * len(seqs), BLOCK_TOKENS, dim), dtype=runner.keys[0].dtype)
                     for _ in range(2)]
            out = torch.empty((heads, len(table), BLOCK_TOKENS, dim), dtype=pools[0].dtype)
            start = time.perf_counter()
            for _ in range(layers):
                for pool in pools:
                    torch.index_select(pool, 1, table, out=out)
                    out.view(heads, len(seqs), -1, dim).transpose(0, 1)[:, :, :length]
            gather_s.append(time.perf_counter() - start)

    step, gather = statistics.median(step_s), statistics.median(gather_s)
    per_token = loaded.info.kv_bytes_per_token
    saved = (len(seqs) - 1) * (args.prefix // BLOCK_TOKENS) * BLOCK_TOKENS * per_token
    whole = len(seqs) * (args.prefix + 40) * per_token
    print(f"CPU flags: {cpu_flags()}; threads: {torch.get_num_threads()}; model: {loaded.info.name} {args.precision}")
    print(f"{len(seqs)} requests, {args.prefix}-token shared prefix, context {runner.length(seqs[0])} tokens")
    print(f"decode step (slot cache, contiguous): {step * 1e3:.2f} ms (median of {args.steps})")
    print(f"gathering every layer's K and V from a paged pool: {gather * 1e3:.2f} ms per step")
    print(f"ratio gather/step: {gather / step:.2f}  (a paged layout on this attention: step × {1 + gather / step:.2f})")
    print(f"memory sharing would save: {saved / 2**20:.1f} MiB of {whole / 2**20:.1f} MiB of KV "
          f"({saved / whole:.0%})")


if __name__ == "__main__":
    main()
