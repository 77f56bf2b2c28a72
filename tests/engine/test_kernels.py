"""The int8-activation kernels (engine/models/kernels: the build this CPU takes, AMX, AVX-512
VNNI or AVX2) against the same arithmetic in plain PyTorch: Q8_0 and Q4_1 weights times activations
quantized per block of 32, every row on its own (a batched row equals the row alone, bit for
bit), whatever the thread count; the batched decode step's attention against softmax in float64;
and, where the CPU runs more than one build, the others too."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from engine.models import kernels
from engine.models.quantize import (BLOCK, Int4BlockLinear, Int8BlockLinear, fuse_rows, has_int8_activations,
                                    int8_activations_reference, pack_q4, pack_q8, q4_blocks, q8_blocks)



@pytest.fixture(autouse=True, scope="module")
def _built():
    """The kernels, compiled when the first of these tests runs (not while collecting: a run that
    selects none of them, such as the README's pass of the ``alone`` tests, doesn't compile them)."""
    if not kernels.kernels():
        pytest.skip(f"int8 kernels: {kernels.unavailable()}")

SHAPES = [(13, 96, 40), (1, 576, 200), (21, 576, 64), (8, 1536, 48), (5, 64, 200), (16, 1536, 48), (37, 96, 40),
          (3, 576, 200), (6, 96, 40)]
"""(rows, inputs, outputs): whole row tiles of 4 and what is left over (one tile of the last 5
rows where a single row would be left, or of the 2 or 3 left), whole and part column tiles;
outputs padded to 16. With AMX, 16 rows and more run on its tiles:
whole tiles of 16 rows and fewer left over, an even and an odd number of blocks (and each row
still equals the row alone, which the VNNI tiles compute)."""


def by_hand_q8(x, codes, scales):
    xq, xs = int8_activations_reference(x)
    rows, cols = x.shape
    n = codes.shape[0]
    dots = (xq.double().reshape(rows, 1, cols // BLOCK, BLOCK)
            * codes.double().reshape(1, n, cols // BLOCK, BLOCK)).sum(-1)  # [M, N, blocks]
    return (dots * xs.double()[:, None, :] * scales.double()[None]).sum(-1)


def by_hand_q4(x, codes, d, m):
    xq, xs = int8_activations_reference(x)
    rows, cols = x.shape
    n = codes.shape[0]
    codes = codes.double()
    dots = (xq.double().reshape(rows, 1, cols // BLOCK, BLOCK) * codes.reshape(1, n, cols // BLOCK, BLOCK)).sum(-1)
    sums = xq.double().reshape(rows, cols // BLOCK, BLOCK).sum(-1) * xs.double()  # [M, blocks]
    return (dots * xs.double()[:, None, :] * d.double()[None] + m.double()[None] * sums[:, None, :]).sum(-1)


@pytest.mark.parametrize("rows,cols,outs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_is_the_block_arithmetic_and_each_row_its_own(rows, cols, outs, dtype):
    generator = torch.Generator().manual_seed(rows * cols + outs)
    weight = torch.randn(outs, cols, generator=generator)
    x = (torch.randn(rows, cols, generator=generator) * 3).to(dtype)
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, no division by it
    codes, scales = q8_blocks(weight)
    packed = pack_q8(codes, scales)
    y = torch.ops.workbench.q8_linear(x, *packed)[:, :outs]
    assert y.dtype == dtype and y.shape == (rows, outs)
    expected = by_hand_q8(x, codes, scales)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max())
    alone = torch.cat([torch.ops.workbench.q8_linear(x[i:i + 1].contiguous(), *packed)[:, :outs] for i in range(rows)])
    assert torch.equal(y, alone)
    # and the weights' own error is Q8_0's: small against the float product
    exact = x.double() @ weight.double().T
    assert (y.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("rows,cols,outs", SHAPES)
def test_q4_is_the_block_arithmetic_and_each_row_its_own(rows, cols, outs):
    generator = torch.Generator().manual_seed(7 + rows)
    weight = torch.randn(outs, cols, generator=generator)
    x = torch.randn(rows, cols, generator=generator)
    codes, d, m = q4_blocks(weight)
    packed = pack_q4(codes, d, m)
    y = torch.ops.workbench.q4_linear(x, *packed)[:, :outs]
    expected = by_hand_q4(x, codes, d, m)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    alone = torch.cat([torch.ops.workbench.q4_linear(x[i:i + 1].contiguous(), *packed)[:, :outs] for i in range(rows)])
    assert torch.equal(y, alone)
    exact = x.double() @ weight.double().T
    assert (y.double() - exact).norm() / exact.norm() < 0.15  # 4 bits: Q4_1's error


@pytest.mark.parametrize("rows", [1, 3, 16, 21])
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_block_arithmetic_of_a_row_with_nan_or_inf_is_not_finite_and_its_own(rows, kind, bad):
    """A NaN or an infinity among a row's activations makes every output of that row non-finite
    (the engine's check of the scores then ends that request with an error), wherever it lies in
    its block of 32, and leaves the other rows as they were. (Quantizing had dropped a NaN: its
    block's largest magnitude skipped it, and the row's outputs came out finite.)"""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 576, generator=generator)
    packed = pack_q8(*q8_blocks(weight)) if kind == "q8" else pack_q4(*q4_blocks(weight))
    product = getattr(torch.ops.workbench, f"{kind}_linear")
    x = torch.randn(rows, 576, generator=generator)
    clean = product(x, *packed)
    for at in (0, 5, 17, 31, 575):  # first and second half of a block, first and last block
        spoiled = x.clone()
        spoiled[rows // 2, at] = bad
        y = product(spoiled, *packed)
        assert not torch.isfinite(y[rows // 2]).any(), at
        others = [r for r in range(rows) if r != rows // 2]
        assert torch.equal(y[others], clean[others])


def test_the_thread_count_changes_nothing():
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(300, 576, generator=generator), torch.randn(17, 576, generator=generator)
    packed = pack_q8(*q8_blocks(weight))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.workbench.q8_linear(x, *packed)
        torch.set_num_threads(2)
        two = torch.ops.workbench.q8_linear(x, *packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_the_products_run_on_more_than_one_thread(kind):
    """Built without OpenMP, ATen's parallel_for runs everything on the calling thread: count the
    CPU time each of this process's threads spends on a run of products."""
    psutil = pytest.importorskip("psutil")
    generator = torch.Generator().manual_seed(5)
    weight, x = torch.randn(4096, 576, generator=generator), torch.randn(64, 576, generator=generator)
    op, packed = ((torch.ops.workbench.q8_linear, pack_q8(*q8_blocks(weight))) if kind == "q8" else
                  (torch.ops.workbench.q4_linear, pack_q4(*q4_blocks(weight))))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        op(x, *packed)
        before = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
        spent = 0.0
        while spent < 1.0:  # CPU seconds over all threads, counted in 10 ms ticks
            for _ in range(20):
                op(x, *packed)
            spent = sum(t.user_time + t.system_time - before.get(t.id, 0.0) for t in psutil.Process().threads())
        after = {t.id: t.user_time + t.system_time - before.get(t.id, 0.0) for t in psutil.Process().threads()}
    finally:
        torch.set_num_threads(threads)
    working = sorted(after.values(), reverse=True)
    assert working[1] > 0.2 * working[0], working[:4]


@pytest.mark.parametrize("kind", [Int8BlockLinear, Int4BlockLinear])
def test_layers_fuse_into_one_call_and_keep_their_own(kind):
    generator = torch.Generator().manual_seed(5)
    parts = []
    for rows in (576, 192, 192):
        linear = torch.nn.Linear(576, rows, bias=rows == 192)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(rows, 576, generator=generator) * 0.05)
        parts.append(kind(linear))
    x = torch.randn(3, 576, generator=generator).to(torch.bfloat16)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_rows(parts)
    assert isinstance(fused, kind)
    assert torch.equal(fused(x), separate)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)  # the parts, now views, still work
    name = "weight" if kind is Int8BlockLinear else "packed"
    assert getattr(parts[1], name).untyped_storage().data_ptr() == getattr(fused, name).untyped_storage().data_ptr()


@pytest.mark.parametrize("precision", ["int8-fast", "int4-fast"])
def test_a_batched_answer_through_the_core_is_the_request_alone(tiny_llama, precision):
    """Each row's activations are quantized on their own: four requests decoded together (and
    read in the same steps) give each one's solo tokens, logprobs and alternatives."""
    from engine.base.events import TokenGenerated
    from engine.base.request import GenerationRequest
    from engine.base.sampling import SamplingParams
    from engine.generation.core import CoreSettings, EngineCore
    from engine.models.loading import LoadRequest, load_model
    from tests.tiny import CORPUS

    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    assert has_int8_activations(loaded.model)

    def answers(core, requests):
        rids = [core.submit(r) for r in requests]
        tokens = {rid: [] for rid in rids}
        for event in core.run():
            if isinstance(event, TokenGenerated):  # its logprob and alternatives too: the sampler's pass is per row
                tokens[event.request_id].append((event.token_id, event.logprob, event.top_alternatives))
        return [tokens[rid] for rid in rids]

    requests = [GenerationRequest(text, mode="raw", sampling=SamplingParams(temperature=0.0), max_new_tokens=12,
                                  ignore_eos=True) for text in CORPUS[:4]]
    together = answers(EngineCore(loaded, CoreSettings(max_batch=8)), requests)
    alone = [answers(EngineCore(loaded, CoreSettings(max_batch=1)), [r])[0] for r in requests]
    assert all(len(t) == 12 for t in together)
    assert [[token for token, _, _ in t] for t in together] == [[token for token, _, _ in a] for a in alone]
    # the batched step's scores are the solo step's to float rounding (its norms and attention run
    # as other kernels): the same logprobs to 1e-5, the same alternatives in the same order
    for t, a in zip(together, alone):
        for (_, logprob, others), (_, solo_logprob, solo_others) in zip(t, a):
            assert logprob == pytest.approx(solo_logprob, abs=1e-5)
            assert [o.token_id for o in others] == [o.token_id for o in solo_others]


@pytest.mark.parametrize("precision", ["int8-fast", "int4-fast"])
def test_the_quantized_precisions_keep_keys_and_values_in_fp16(tiny_llama, precision):
    """As llama.cpp's F16 cache: the load says so (compute in fp32, the cache in fp16, 2 bytes a
    value in the prediction), the cache holds fp16, and every token's KV figure is what it holds."""
    from engine.base.events import TokenGenerated
    from engine.base.request import GenerationRequest
    from engine.generation.generate import generate
    from engine.generation.paged_cache import PagedCache
    from engine.models.loading import LoadRequest, load_model
    from tests.tiny import kv_held_ok

    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    info = loaded.info
    assert (info.compute_dtype, info.kv_dtype) == ("float32", "float16")
    assert info.kv_bytes_per_token == 2 * info.num_layers * info.num_kv_heads * info.head_dim * 2
    cache = PagedCache(loaded.fast)
    assert {k.dtype for k in cache.keys + cache.values} == {torch.float16}
    assert cache.block_nbytes() == 16 * info.kv_bytes_per_token  # read from the fp16 tensors
    request = GenerationRequest("one two three", mode="raw", max_new_tokens=6, ignore_eos=True)
    tokens = [e for e in generate(loaded, request) if isinstance(e, TokenGenerated)]
    assert len(tokens) == 6 and tokens[-1].kv_cache_bytes > 0
    assert all(kv_held_ok(loaded, t.kv_cache_bytes, t.kv_cache_bytes_predicted) for t in tokens)


def test_row_totals_are_each_rows_logsumexp_and_largest_few_alone_or_in_a_batch(monkeypatch):
    """The sampler's pass over a step's scores (kernels/scores.h): each row's log Σ exp, argmax
    and k largest (best first, the lower id first among equals, as decoding.top_scores), the same
    bits for a row alone, in a batch and at any thread count; NaN or +inf makes a row's total
    non-finite and leaves the other rows alone (−inf is a token that can't come)."""
    import math

    from engine.generation.decoding import top_scores
    from engine.generation.sampling import row_totals

    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(5, 10007, generator=generator) * 10  # two whole chunks of 4,096 and a part one
    scores[1, 17] = scores[1, 9000] = scores[1, 9001] = 80.0  # ties across chunks: the lower ids first
    scores[2] -= 1e4  # far from zero: each chunk's largest is taken out before exponentiating
    scores[3, 10006] = 90.0  # the largest in the part chunk's last lane
    picked, totals, largest = row_totals(scores, top=20)
    assert picked == torch.argmax(scores, dim=-1).tolist() and picked[1] == 17 and picked[3] == 10006
    assert totals == pytest.approx(torch.logsumexp(scores.double(), dim=-1).tolist(), rel=1e-6)
    for i in range(5):
        assert largest[i] == top_scores(scores[i], 20)  # ids and scores, exactly
    assert largest[1][0][:3] == [17, 9000, 9001]
    alone = [row_totals(scores[i:i + 1].clone(), top=20) for i in range(5)]
    assert [a[1][0] for a in alone] == totals and [a[2][0] for a in alone] == largest  # bit for bit
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert row_totals(scores, top=20) == (picked, totals, largest)
    finally:
        torch.set_num_threads(threads)
    assert row_totals(scores, top=3)[2] == [(ids[:3], values[:3]) for ids, values in largest]
    assert row_totals(scores)[2] is None  # no alternatives asked for: none handed on
    for bad in (float("nan"), float("inf")):
        broken = scores.clone()
        broken[4, 5000] = bad
        _, broken_totals, _ = row_totals(broken, top=5)
        assert broken_totals[:4] == totals[:4] and not math.isfinite(broken_totals[4])
    ruled_out = scores.clone()
    ruled_out[4, 5000] = float("-inf")  # a token that can't come: nothing wrong with the row
    assert row_totals(ruled_out)[1][4] == pytest.approx(torch.logsumexp(ruled_out[4].double(), -1).item(), rel=1e-6)
    assert not math.isfinite(row_totals(torch.full((1, 8), float("-inf")))[1][0])  # no token can come
    assert row_totals(torch.tensor([[2.0, 3.0, 3.0, 1.0]]), top=4)[2] == [([1, 2, 0, 3], [3.0, 3.0, 2.0, 1.0])]
    monkeypatch.setattr(kernels, "loaded", lambda: None)  # without them: the same numbers, searched for elsewhere
    assert row_totals(scores, top=20)[:2] == (picked, pytest.approx(totals, rel=1e-6))


ATTENTION_SHAPES = [(16, 9, 3, 128, 64), (1, 9, 3, 64, 64), (5, 8, 8, 300, 32), (3, 4, 1, 64, 128), (2, 2, 2, 1, 16),
                    (2, 7, 1, 70, 32), (2, 6, 1, 40, 32), (3, 4, 2, 50, 24)]
"""(rows, query heads, KV heads, cache slots, head size): the default model's GQA at 16 rows and
at one (its query heads split between the threads), plain multi-head attention, one KV head for
four queries, a one-slot cache, seven and six queries per KV head (the vector loops' blocks of 4
and 3, 4 and 2 heads; 1 in plain multi-head), and a head size that isn't a multiple of 16 (the
plain loops). Positions fall anywhere in the cache, so the scores' last 16 slots are mostly a
partial group."""


@pytest.mark.parametrize("rows,heads,kv_heads,capacity,dim", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.float32, torch.float16)])
def test_attention_is_each_rows_softmax_over_its_own_cache(rows, heads, kv_heads, capacity, dim, dtype, cache):
    """The batched step's attention: each row over its slots up to its own position (what lies
    beyond is never read: NaN there changes nothing), the query heads of a KV head sharing it,
    and a row's result bit for bit the same alone as in the batch; over a cache of the queries'
    type, or fp16 under fp32 queries (the quantized precisions' cache), computed in fp32."""
    from engine.models.fast import _attend_one

    generator = torch.Generator().manual_seed(rows * capacity + dim)
    q = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
    keys = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(cache)
    values = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(cache)
    positions = torch.randint(0, capacity, (rows,), generator=generator)
    positions[0] = capacity - 1
    positions[-1] = 0 if rows > 1 else positions[-1]
    mask = (torch.arange(capacity) <= positions.view(rows, 1)).view(rows, 1, 1, capacity)
    expected = _attend_one(q.double(), keys.double(), values.double(), mask, dim ** -0.5)
    for row, at in enumerate(positions.tolist()):
        keys[row, :, at + 1:] = float("nan")
        values[row, :, at + 1:] = float("nan")
    out = torch.ops.workbench.attend_rows(q, keys, values, positions, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.double(), expected, rtol=tolerance, atol=tolerance)
    alone = [torch.ops.workbench.attend_rows(q[r:r + 1], keys[r:r + 1], values[r:r + 1], positions[r:r + 1],
                                             dim ** -0.5) for r in range(rows)]
    assert torch.equal(torch.cat(alone), out)
    # as a step passes them: the queries a slice of the rotated queries and keys, rows apart
    rotated = torch.cat([q, torch.full((rows, kv_heads, 1, dim), float("nan"), dtype=dtype)], dim=1)
    sliced = rotated[:, :heads]
    assert rows == 1 or not sliced.is_contiguous()
    assert torch.equal(torch.ops.workbench.attend_rows(sliced, keys, values, positions, dim ** -0.5), out)


CHUNK_SHAPES = [(9, 3, 64, 0, 40), (9, 3, 64, 37, 21), (8, 8, 32, 16, 5), (4, 1, 128, 100, 1), (7, 1, 32, 3, 18),
                (4, 2, 24, 10, 9)]
"""(query heads, KV heads, head size, cached tokens, new tokens): the default model's GQA from the
start and after a cached prefix (a tile of 16 rows and a partial one), plain multi-head attention
in 5 rows (speculation's verify pass), one row (an eager decode step), seven queries per KV head
over two tiles, and a head size the vector loops don't take."""


@pytest.mark.parametrize("heads,kv_heads,dim,start,count", CHUNK_SHAPES)
@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.float32, torch.float16)])
def test_a_chunk_attends_through_its_block_table_each_token_as_alone(heads, kv_heads, dim, start, count, dtype, cache):
    """The paged forms read a sequence's blocks where they lie in the pool, in any order: a decode
    step's rows (``attend_paged``) give what ``attend_rows`` gives over a contiguous copy, and a
    prompt chunk's new tokens (``attend_chunk``, in tiles of rows) each give, bit for bit, what a
    row of its own gives up to its position; what lies past the chunk's last token is never read."""
    from engine.models.fast import _attend_one, gather_blocks

    generator = torch.Generator().manual_seed(start * 7 + count + dim)
    end, tokens = start + count, 16
    width = -(-end // tokens)
    pool_keys = torch.randn(width + 5, kv_heads, tokens, dim, generator=generator).to(cache)
    pool_values = torch.randn(width + 5, kv_heads, tokens, dim, generator=generator).to(cache)
    table = torch.randperm(width + 5, generator=generator)[:width]  # the sequence's blocks, anywhere
    last = int(table[(end - 1) // tokens])
    pool_keys[last, :, (end - 1) % tokens + 1:] = float("nan")  # slots past the chunk: never read
    pool_values[last, :, (end - 1) % tokens + 1:] = float("nan")
    q = torch.randn(count, heads, 1, dim, generator=generator).to(dtype)
    positions = torch.arange(start, end)
    rows_table = table.view(1, -1).expand(count, -1).contiguous()
    paged = torch.ops.workbench.attend_paged(q, pool_keys, pool_values, rows_table, positions, dim ** -0.5)
    copied = torch.ops.workbench.attend_rows(q, gather_blocks(pool_keys, rows_table), gather_blocks(pool_values, rows_table),
                                             positions, dim ** -0.5)
    assert torch.equal(paged, copied)
    chunk = torch.ops.workbench.attend_chunk(q, pool_keys, pool_values, table, start, dim ** -0.5)
    assert chunk.dtype == dtype and chunk.shape == q.shape
    alone = [torch.ops.workbench.attend_paged(q[i:i + 1], pool_keys, pool_values, table.view(1, -1),
                                              positions[i:i + 1], dim ** -0.5) for i in range(count)]
    assert torch.equal(chunk, torch.cat(alone))
    keys, values = gather_blocks(pool_keys, table.view(1, -1))[0], gather_blocks(pool_values, table.view(1, -1))[0]
    mask = (torch.arange(keys.shape[1]) <= positions.view(count, 1)).view(count, 1, 1, -1)
    expected = _attend_one(q.double(), keys.double().expand(count, -1, -1, -1).nan_to_num(),
                           values.double().expand(count, -1, -1, -1).nan_to_num(), mask, dim ** -0.5)
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(chunk.double(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(RuntimeError, match="past its block table"):
        torch.ops.workbench.attend_chunk(q, pool_keys, pool_values, table[:-1], start + tokens, dim ** -0.5)


@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.float32, torch.float16)])
@pytest.mark.parametrize("cap", [0.0, 0.5])
def test_a_sliding_window_reads_only_its_last_slots_and_their_blocks(dim, dtype, cache, cap):
    """With a window W, a row at position p attends to slots p - W + 1 … p only: the same as the
    whole row's attention with the earlier slots masked out, and the blocks wholly before them are
    never read (given back, their table entries may name anything). With a soft cap (Gemma 2's),
    each score is cap · tanh(score / cap) before the softmax (a small cap here, so it bites)."""
    from engine.models.fast import _attend_one, gather_blocks

    generator = torch.Generator().manual_seed(dim)
    tokens, window, start, count = 16, 21, 40, 9
    end = start + count
    width = -(-end // tokens)
    pool_keys = torch.randn(width + 3, 2, tokens, dim, generator=generator).to(cache)
    pool_values = torch.randn(width + 3, 2, tokens, dim, generator=generator).to(cache)
    order = torch.randperm(width + 3, generator=generator)
    table, spare = order[:width], int(order[width])  # the sequence's blocks, and one it doesn't hold
    keys, values = gather_blocks(pool_keys, table.view(1, -1))[0], gather_blocks(pool_values, table.view(1, -1))[0]
    q = torch.randn(count, 6, 1, dim, generator=generator).to(dtype)
    positions = torch.arange(start, end)
    at = positions.view(count, 1)
    slots = torch.arange(keys.shape[1])
    mask = ((slots <= at) & (slots > at - window)).view(count, 1, 1, -1)
    expected = _attend_one(q.double(), keys.double().expand(count, -1, -1, -1),
                           values.double().expand(count, -1, -1, -1), mask, dim ** -0.5, cap)
    uncapped = _attend_one(q.double(), keys.double().expand(count, -1, -1, -1),
                           values.double().expand(count, -1, -1, -1), mask, dim ** -0.5)
    assert not cap or not torch.allclose(expected, uncapped, atol=1e-2)
    given_back = table.clone()
    given_back[0] = spare  # block 0 holds slots 0-15, before every row's window (first slot 20)
    pool_keys[spare] = float("nan")
    pool_values[spare] = float("nan")
    rows = given_back.view(1, -1).expand(count, -1).contiguous()
    paged = torch.ops.workbench.attend_paged(q, pool_keys, pool_values, rows, positions, dim ** -0.5, window, cap)
    chunk = torch.ops.workbench.attend_chunk(q, pool_keys, pool_values, given_back, start, dim ** -0.5, window, cap)
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(paged.double(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(chunk, paged)
    whole = torch.ops.workbench.attend_paged(q, pool_keys, pool_values, rows, positions, dim ** -0.5)
    assert whole.isnan().all()  # without the window the given-back block is read


@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.float32, torch.float16)])
def test_attention_softmax_over_a_nan_is_nan_for_that_row_alone(dtype, cache):
    """A NaN in a key a row reads makes that row's result NaN for the query heads sharing the key
    (the vector softmax had clamped the NaN score to e^-87: a weight of ~0, a finite answer), and
    leaves the other rows, and the row's other KV heads, as they were."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(5, 8, 1, 64, generator=generator).to(dtype)
    keys = torch.randn(5, 2, 40, 64, generator=generator).to(cache)
    values = torch.randn(5, 2, 40, 64, generator=generator).to(cache)
    positions = torch.tensor([39, 20, 30, 5, 17])
    clean = torch.ops.workbench.attend_rows(q, keys, values, positions, 0.125)
    keys[2, 1, 12, 7] = float("nan")
    out = torch.ops.workbench.attend_rows(q, keys, values, positions, 0.125)
    assert torch.isnan(out[2, 4:]).all()  # KV head 1's query heads
    assert torch.equal(out[2, :4], clean[2, :4]) and torch.equal(out[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])


def test_attention_refuses_what_it_cannot_read():
    q, cache = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(RuntimeError, match="a position outside the cache"):
        torch.ops.workbench.attend_rows(q, cache, cache, torch.tensor([3, 8]), 0.25)
    with pytest.raises(RuntimeError, match="positions, int64"):
        torch.ops.workbench.attend_rows(q, cache, cache, torch.tensor([3]), 0.25)
    with pytest.raises(RuntimeError, match="heads must match"):
        torch.ops.workbench.attend_rows(torch.randn(2, 3, 1, 16), cache, cache, torch.tensor([3, 4]), 0.25)
    with pytest.raises(RuntimeError, match="q float32 or bfloat16, keys and values of one type"):  # fp32 under bf16
        torch.ops.workbench.attend_rows(q.bfloat16(), cache, cache, torch.tensor([3, 4]), 0.25)
    with pytest.raises(RuntimeError, match="keys and values of one type"):
        torch.ops.workbench.attend_rows(q, cache.half(), cache.bfloat16(), torch.tensor([3, 4]), 0.25)
    codes = torch.zeros(2, 2, 8, 17, dtype=torch.int8)  # an int8 cache's rows: 34 bytes a 32 values
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.workbench.attend_rows(q, codes, codes, torch.tensor([3, 4]), 0.25)
    with pytest.raises(RuntimeError, match="head size"):  # 64 values a head are 68 bytes a row, not 34
        wide = torch.zeros(2, 2, 8, 34, dtype=torch.int8)
        torch.ops.workbench.attend_rows(torch.randn(2, 4, 1, 64), wide, wide, torch.tensor([3, 4]), 0.25)
    with pytest.raises(RuntimeError, match="D a multiple of 32"):
        torch.ops.workbench.write_q8(codes, torch.tensor([0]), torch.tensor([0]), torch.randn(1, 2, 16))
    with pytest.raises(RuntimeError, match="a slot outside the pool"):
        torch.ops.workbench.write_q8(torch.zeros(2, 2, 8, 34, dtype=torch.int8), torch.tensor([2]),
                                     torch.tensor([0]), torch.randn(1, 2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inputs, outputs", [(1, 1152, 45), (1, 100, 8), (2, 31, 21), (3, 576, 67), (5, 576, 67),
                                                    (16, 96, 40), (9, 64, 24)])
def test_dense_products_are_the_product_and_each_row_its_own(rows, inputs, outputs, dtype):
    """``dense_linear`` (a decode step's fp32/bf16 products): the float64 product within the
    dtype's rounding, for any row count, inputs not a multiple of the vector (masked tails) and
    outputs not a multiple of the row tile; a batched row equals the row alone, bit for bit.
    (The AVX2 build's is PyTorch's product, which the fast path doesn't call.)"""
    if kernels.loaded().name == "avx2":
        pytest.skip("the AVX2 build has no products of its own")
    generator = torch.Generator().manual_seed(rows * 1000 + inputs)
    w = torch.randn(outputs, inputs, generator=generator).to(dtype)
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    got = torch.ops.workbench.dense_linear(x, w)
    assert got.dtype == dtype and got.shape == (rows, outputs)
    exact = x.double() @ w.double().T
    worst = float((got.double() - exact).abs().max() / exact.abs().max())
    assert worst < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(torch.cat([torch.ops.workbench.dense_linear(x[i:i + 1], w) for i in range(rows)]), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.workbench.dense_linear(x, w), got)
    finally:
        torch.set_num_threads(threads)


def greedy_through_cache(loaded, groups, steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of the first four texts of the tests' corpus through a paged cache of the
    loaded model's fast decoder, each group of them (their indices) read and then decoded ``steps``
    tokens together in a cache of its own; returns every prompt's tokens and the decode steps'
    scores (fp32, their rows one after another)."""
    from engine.base.request import GenerationRequest
    from engine.generation.paged_cache import PagedCache
    from tests.tiny import CORPUS

    d = loaded.fast
    prompts = [torch.tensor([loaded.encode(GenerationRequest(text, mode="raw"))]) for text in CORPUS[:4]]
    tokens, scores = [[] for _ in prompts], []
    with torch.inference_mode():
        for together in groups:
            cache = PagedCache(d)
            for seq in together:
                cache.add(seq, prompts[seq].shape[1] + steps + 4)
                tokens[seq].append(int(cache.prefill(seq, prompts[seq]).argmax()))
            for _ in range(steps):
                logits = cache.decode(together, [tokens[seq][-1] for seq in together])
                scores.append(logits.float())
                for seq, row in zip(together, logits):
                    tokens[seq].append(int(row.argmax()))
    return tokens, torch.cat(scores)


@pytest.mark.parametrize("precision", ["fp32-fast", "bf16-fast"])
def test_the_decode_steps_dense_products_give_pytorchs_tokens(tiny_llama, precision):
    """fp32-fast and bf16-fast decode with the kernels' ``dense_linear`` (one sequence and four
    together) and with PyTorch's products: the same greedy tokens, scores within rounding."""
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    assert loaded.fast.dense == (kernels.loaded().name != "avx2")
    if not loaded.fast.dense:
        pytest.skip("the AVX2 build has no products of its own")
    runs = {}
    for dense in (True, False):
        loaded.fast.dense = dense
        runs[dense] = greedy_through_cache(loaded, ([0], [1, 2, 3]), 10)
    assert runs[True][0] == runs[False][0]
    tolerance = 1e-3 if precision == "fp32-fast" else 5e-2
    assert torch.allclose(runs[True][1], runs[False][1], atol=tolerance * float(runs[False][1].abs().max()))


@pytest.mark.parametrize("precision", ["fp32-fast", "int8-fast"])
def test_the_batched_step_with_the_kernels_attention_is_the_one_without(tiny_llama, precision):
    """The engine core's eager batched step with the kernels' attention (each row up to its own
    position) and without it (rows grouped by length, masked matrix products): the same tokens,
    scores within rounding."""
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    assert loaded.fast.rows_attention  # the kernels are loaded in this process
    runs = {}
    for attention in (True, False):
        loaded.fast.rows_attention = attention
        runs[attention] = greedy_through_cache(loaded, ([0, 1, 2, 3],), 12)
    assert runs[True][0] == runs[False][0]
    assert torch.allclose(runs[True][1], runs[False][1], atol=1e-3 * float(runs[False][1].abs().max()))


def test_every_build_this_cpu_runs_does_the_same_arithmetic():
    """The tests above run the build this CPU takes; on a CPU that runs another (an AVX-512
    machine runs the AVX2 one), the arithmetic tests run again in a process that loads that one."""
    others = [choice for choice in kernels.ISAS if choice != kernels.loaded()
              and all(flag in kernels.cpu_flags() for flag in choice.flags)]
    if not others:
        pytest.skip(f"this CPU runs one build only ({kernels.loaded().name})")
    runs = [arithmetic_tests_with(choice) for choice in others]  # at once: each compiles on one core
    for run in runs:
        try:
            out, _ = run.communicate(timeout=900)
        finally:
            run.kill()
        assert run.returncode == 0, out[-3000:]
        assert " passed" in out and "skipped" not in out


def arithmetic_tests_with(choice: kernels.Isa) -> subprocess.Popen:
    """This module's arithmetic tests in a pytest of their own that loads ``choice``'s build,
    compiled into that run's own cache (not the folder of builds this process announces to its
    children, which is this test run's cache: writing there fails that run's check that the
    tests leave the user's cache alone)."""
    env = {name: value for name, value in os.environ.items() if name != kernels.DIR_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "block_arithmetic or softmax_over or row_totals"],
        env={**env, kernels.ISA_ENV: choice.name}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_loaded_build_is_the_one_chosen():
    assert kernels.loaded() == kernels.isa()
    assert kernels.build_dir().name.startswith(kernels.loaded().name)
    if os.environ.get(kernels.ISA_ENV):
        assert kernels.loaded().name == os.environ[kernels.ISA_ENV]


@pytest.mark.parametrize("streams", [1, 2, 3, 8])
def test_the_bandwidth_read_reads_every_line_whatever_the_runs(streams):
    """``read_bytes`` (the memory's read bandwidth, engine/estimates/hardware.py) touches every
    64-byte line once however its share is cut into runs: a bit set in any one line, the runs'
    leftovers included, shows in what it returns, and nothing else does."""
    lines = 1000 + 7  # not a multiple of the runs
    for line in (0, 499, lines - 1):
        data = torch.zeros(lines * 64, dtype=torch.uint8)
        data[line * 64 + 3] = 4
        assert int(torch.ops.workbench.read_bytes(data, streams)) == 4 << 24
    assert int(torch.ops.workbench.read_bytes(torch.zeros(lines * 64, dtype=torch.uint8), streams)) == 0


def test_the_bandwidth_probe_reads_as_the_measurement_does(monkeypatch):
    """``bandwidth_probe`` (a benchmark's figure taken right around each of its rounds) picks its
    count of runs as ``measure_bandwidth`` does, then reads with that one count every time, and
    gives a finite rate."""
    from engine.estimates import hardware

    counts = []
    read = torch.ops.workbench.read_bytes
    monkeypatch.setattr(hardware, "_streaming_read", lambda: lambda data, runs: counts.append(runs) or read(data, runs))
    probe = hardware.bandwidth_probe()
    assert sorted(set(counts)) == [1, 2, 4, 8]
    counts.clear()
    rate = probe()
    assert math.isfinite(rate) and rate > 0
    assert len(counts) == 3 and len(set(counts)) == 1 and counts[0] in (1, 2, 4, 8)
