"""The KV cache's precision (``--kv-dtype``): an int8 cache of llama.cpp's q8_0 blocks in the
block pool, written and read by the kernels, its bytes measured from the pool's tensors."""

import pytest
import torch

from engine.base.errors import UnsupportedPrecisionError
from engine.base.events import TokenGenerated
from engine.base.request import GenerationRequest
from engine.generation.generate import generate
from engine.models.loading import LoadRequest, load_model
from tests.engine.test_fast import PROMPT, core_answers


@pytest.fixture(scope="module")
def kernels_loaded():
    from engine.models import kernels

    if not kernels.kernels():
        pytest.skip(f"the kernels aren't available here: {kernels.unavailable()}")


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory, byte_tokenizer):
    """A tiny Llama and a tiny Gemma 3 (sliding-window layers) with heads of 32 values: one q8_0
    block a head."""
    from tests.tiny import build_model_folder

    root = tmp_path_factory.mktemp("q8")
    return {arch: build_model_folder(root / arch, arch, byte_tokenizer, max_position_embeddings=2048, head_dim=32)
            for arch in ("llama", "gemma3")}


def stored_values(pool: torch.Tensor, block: int, slot: int, dim: int) -> torch.Tensor:
    """A slot's keys (or values) of every KV head read back from an int8 pool's bytes: each block's
    fp16 scale times its 32 codes."""
    raw = pool[block, :, slot].view(pool.shape[1], dim // 32, 34)
    scales = raw[..., :2].contiguous().view(torch.float16).float()
    return (raw[..., 2:].float() * scales).reshape(pool.shape[1], dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_pool_holds_q8_0_blocks_and_attention_reads_them(kernels_loaded, dtype):
    """write_q8 keeps each 32 values as an fp16 scale (the largest magnitude / 127) and 32 codes,
    what q8_round_trip gives; attention over the pool, one row or a prompt chunk, through a block
    table or a window, equals attention over those values."""
    from engine.models.fast import q8_round_trip

    torch.manual_seed(0)
    kv_heads, dim, tokens, n = 2, 64, 16, 70
    keys = torch.zeros(8, kv_heads, tokens, dim // 32 * 34, dtype=torch.int8)
    values = torch.zeros_like(keys)
    table = torch.tensor([[5, 2, 7, 0, 3]])
    k, v = torch.randn(n, kv_heads, dim) * 3, torch.randn(n, kv_heads, dim)
    k[4, 0, :32] = 0  # a block of zeros: scale 0, codes 0
    positions = torch.arange(n)
    blocks, slots = table[0][positions // tokens], positions % tokens
    torch.ops.workbench.write_q8(keys, blocks, slots, k)
    torch.ops.workbench.write_q8(values, blocks, slots, v)
    kept_k, kept_v = q8_round_trip(k), q8_round_trip(v)
    for i in range(n):
        assert torch.equal(stored_values(keys, blocks[i], slots[i], dim), kept_k[i])
    assert kept_k[4, 0, :32].abs().sum() == 0
    assert (kept_k - k).abs().max() <= k.abs().max() / 127  # half a step of the largest block's scale, and fp16's
    scale = dim ** -0.5
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2

    def exact(q, first, last):
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), kept_k[first:last + 1].transpose(0, 1)[None], kept_v[first:last + 1].transpose(0, 1)[None],
            scale=scale, enable_gqa=True)

    q = torch.randn(1, 6, 1, dim).to(dtype)
    one = torch.ops.workbench.attend_paged(q, keys, values, table, torch.tensor([n - 1]), scale, 0, 0.0)
    assert one.dtype == dtype and torch.allclose(one.float(), exact(q, 0, n - 1), atol=tolerance)
    window = torch.ops.workbench.attend_paged(q, keys, values, table, torch.tensor([n - 1]), scale, 20, 0.0)
    assert torch.allclose(window.float(), exact(q, n - 20, n - 1), atol=tolerance)
    chunk_q = torch.randn(n, 6, 1, dim).to(dtype)
    chunk = torch.ops.workbench.attend_chunk(chunk_q, keys, values, table[0], 0, scale, 0, 0.0)
    rows = torch.ops.workbench.attend_paged(chunk_q, keys, values, table.expand(n, -1).contiguous(), positions,
                                            scale, 0, 0.0)
    assert torch.equal(chunk, rows)  # a token's attention the same in a chunk as alone


def test_an_int8_cache_holds_its_predicted_bytes_and_answers_alike_alone_or_together(kernels_loaded, q8_models):
    """Gemma 3 (a window) with an int8 cache: the bytes read from the pool's tensors stay within
    whole blocks of the prediction from the config at 34 bytes per 32 values (window included), a
    token's bytes are at most 0.55× a bf16 cache's, and three greedy answers decoded together
    equal each alone."""
    model = str(q8_models["gemma3"])
    loaded = load_model(LoadRequest(model, "fp32-fast", "cpu", kv_dtype="int8"))
    bf16 = load_model(LoadRequest(model, "bf16-fast", "cpu"))
    assert loaded.info.kv_dtype == "int8" and bf16.info.kv_dtype == "bfloat16"
    assert loaded.info.kv_bytes_per_token <= 0.55 * bf16.info.kv_bytes_per_token
    requests = [GenerationRequest(PROMPT * k, mode="raw", max_new_tokens=20, ignore_eos=True) for k in (1, 3, 6)]
    alone = []
    for request in requests:
        events = list(generate(loaded, request))
        tokens = [e for e in events if isinstance(e, TokenGenerated)]
        block = 16 * loaded.info.kv_bytes_per_token
        for event in tokens:
            assert event.kv_cache_bytes_predicted <= event.kv_cache_bytes < event.kv_cache_bytes_predicted + 2 * block
        alone.append(events[-1].token_ids)
    assert core_answers(loaded, requests) == alone


def test_a_perplexity_chunk_reads_what_the_cache_would_have_kept(kernels_loaded, q8_models):
    """chunk_logits (perplexity, read without a cache) rounds keys and values as an int8 cache
    keeps them: its logits equal a prompt's through the pool, and differ from a full-precision
    cache's."""
    from engine.generation.paged_cache import PagedCache
    from engine.models.fast import chunk_logits

    model = str(q8_models["llama"])
    int8 = load_model(LoadRequest(model, "fp32-fast", "cpu", kv_dtype="int8"))
    full = load_model(LoadRequest(model, "fp32-fast", "cpu"))
    ids = int8.encode(GenerationRequest(PROMPT * 4, mode="raw"))
    with torch.inference_mode():
        cache = PagedCache(int8.fast)
        cache.add(0, len(ids))
        through_pool = cache.prefill(0, torch.tensor([ids]))
        chunk = chunk_logits(int8.fast, torch.tensor([ids]), 1)[0, -1]
        unrounded = chunk_logits(full.fast, torch.tensor([ids]), 1)[0, -1]
    assert torch.allclose(through_pool, chunk, atol=1e-4)
    assert not torch.allclose(chunk, unrounded, atol=1e-4)


def test_kv_dtypes_no_path_runs_are_refused_clearly(q8_models, tiny_llama):
    """The reference runner keeps transformers' cache; fp8 needs a GPU's arithmetic; an fp32 cache
    under bf16 activations keeps nothing more; int8 needs heads of whole 32-value blocks. Each
    refusal names why, before any weight is read where the header says it."""
    model = str(q8_models["llama"])
    with pytest.raises(UnsupportedPrecisionError, match="fast precision"):
        load_model(LoadRequest(model, "fp32", "cpu", kv_dtype="int8"))
    with pytest.raises(UnsupportedPrecisionError, match="fp8"):
        load_model(LoadRequest(model, "bf16-fast", "cpu", kv_dtype="fp8_e4m3"))
    with pytest.raises(UnsupportedPrecisionError, match="bfloat16"):
        load_model(LoadRequest(model, "bf16-fast", "cpu", kv_dtype="fp32"))
    with pytest.raises(UnsupportedPrecisionError, match="Unknown KV-cache dtype"):
        load_model(LoadRequest(model, "bf16-fast", "cpu", kv_dtype="q4"))
    with pytest.raises(UnsupportedPrecisionError, match="multiple of 32"):  # its heads are 16 values
        load_model(LoadRequest(str(tiny_llama), "fp32-fast", "cpu", kv_dtype="int8"))
    # the same dtype as the precision's own is no change
    loaded = load_model(LoadRequest(model, "bf16-fast", "cpu", kv_dtype="bf16"))
    assert loaded.info.kv_dtype == "bfloat16"


def test_the_compiled_steps_write_and_read_an_int8_cache(kernels_loaded, q8_models, isolated_cache):
    """The compiled one-sequence and batched steps of Gemma 3 with an int8 cache (the kernels'
    write_q8 in the exported graph) give the eager steps' tokens; their package is not the one a
    full-precision cache's decoder loads."""
    from engine.generation.compiled_step import compile_decoder, package_path

    model = str(q8_models["gemma3"])
    loaded = load_model(LoadRequest(model, "fp32-fast", "cpu", kv_dtype="int8"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=24, ignore_eos=True)
    batch = [GenerationRequest(PROMPT * k, mode="raw", max_new_tokens=16, ignore_eos=True) for k in (1, 2, 4)]
    eager = list(generate(loaded, request))[-1].token_ids
    eager_batch = core_answers(loaded, batch)
    report = compile_decoder(loaded.fast, rows=True)
    assert report.error is None and report.built and loaded.fast.compiled_rows is not None
    assert list(generate(loaded, request))[-1].token_ids == eager
    assert core_answers(loaded, batch) == eager_batch
    full = load_model(LoadRequest(model, "fp32-fast", "cpu"))
    assert package_path(full.fast, report.threads) != package_path(loaded.fast, report.threads)


def test_a_server_with_an_int8_cache_says_what_its_budget_holds_and_answers_as_alone(kernels_loaded, q8_models):
    """``serve --kv-dtype int8``: the service's KV line names the dtype and the tokens its budget
    holds against a 16-bit cache's; three requests at once get each greedy answer the model gives
    alone."""
    import asyncio

    import httpx

    from tests.serving import serve

    loaded = load_model(LoadRequest(str(q8_models["llama"]), "fp32-fast", "cpu", kv_dtype="int8"))
    prompts = [PROMPT * k for k in (1, 2, 3)]
    alone = [list(generate(loaded, GenerationRequest(p, mode="raw", max_new_tokens=12, ignore_eos=True)))[-1].text
             for p in prompts]
    server = serve(loaded, kv_budget_bytes=1 << 20)
    try:
        line = server.service.describe_kv()
        tokens = (1 << 20) // (16 * loaded.info.kv_bytes_per_token) * 16
        sixteen = (1 << 20) // (16 * loaded.info.kv_bytes_per_token) * 16 * loaded.info.kv_bytes_per_token // (
            loaded.info.kv_bytes_per_token * 64 // 34)
        assert "in int8 (q8_0 blocks" in line and f"{tokens:,} tokens" in line and f"{sixteen:,} a 16-bit" in line

        async def together():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                answers = await asyncio.gather(*(http.post("/completions", json={
                    "model": server.model_name, "prompt": p, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}) for p in prompts))
            return [a.json()["choices"][0]["text"] for a in answers]

        assert asyncio.run(together()) == alone
    finally:
        server.stop(drain=False, timeout=30)


def test_speculation_over_an_int8_cache_gives_the_plain_greedy_answer(kernels_loaded, q8_models):
    """An early-exit draft's guesses verified over the int8 pool (a prompt chunk's attention, then
    the cache rolled back past the rejected ones) give the tokens plain decoding gives."""
    from engine.generation.speculative import DraftSpec, load_draft, stream_speculative

    loaded = load_model(LoadRequest(str(q8_models["llama"]), "fp32-fast", "cpu", kv_dtype="int8"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    request = GenerationRequest(PROMPT * 3, mode="raw", max_new_tokens=24, ignore_eos=True)
    plain = list(generate(loaded, request))[-1]
    final = list(stream_speculative(loaded, draft, request, 3))[-1]
    assert final.token_ids == plain.token_ids and final.drafted_tokens > 0
