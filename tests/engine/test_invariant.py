"""Batch-invariant arithmetic: in bf16 a request's greedy answer is the one it gets alone,
whatever runs beside it, however its prompt is cut into chunks, with the prefix cache too."""

import pytest
import torch

from engine.base.events import TokenGenerated
from engine.base.request import GenerationRequest
from engine.generation.core import CoreSettings, EngineCore
from engine.generation.generate import generate
from engine.generation.invariant import answers_note, fixed_row_products
from engine.models.loading import LoadRequest, load_model
from tests.tiny import CORPUS, build_model_folder

SYSTEM = "You are a terse assistant. Answer in one line. "


def test_products_under_fixed_rows_are_each_rows_own():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80).bfloat16()
    x = torch.randn(21, 96).bfloat16()
    with fixed_row_products():
        together = layer(x)
        apart = torch.cat([layer(x[i:i + 1]) for i in range(21)])
        threes = torch.cat([layer(x[i:i + 3]) for i in range(0, 21, 3)])
        batched = layer(x.view(3, 7, 96)).view(21, 80)  # leading dimensions are rows too
    assert torch.equal(together, apart) and torch.equal(together, threes) and torch.equal(together, batched)
    assert torch.allclose(together.float(), layer(x).float(), atol=5e-2)  # the same product, rounded alike


@pytest.mark.parametrize("precision", ["bf16", "bf16-fast"])
def test_bf16_answers_are_the_same_alone_and_in_any_batch(byte_tokenizer, tmp_path, precision):
    folder = build_model_folder(tmp_path / "llama", "llama", byte_tokenizer, max_position_embeddings=512)
    loaded = load_model(LoadRequest(str(folder), precision, "cpu"))
    loaded.batch_invariant = True
    assert "each the same alone and in any batch" in answers_note(loaded)
    requests = [GenerationRequest(SYSTEM + text * 2, mode="raw", max_new_tokens=32, ignore_eos=True)
                for text in CORPUS[:9]]
    alone = [[e.token_id for e in generate(loaded, r) if isinstance(e, TokenGenerated)] for r in requests]
    # all at once, the prompts cut by a small token budget, the system prompt's blocks from the cache
    core = EngineCore(loaded, CoreSettings(token_budget=40, prefill_chunk=24, max_batch=16, kv_budget_bytes=1 << 24,
                                           prefix_caching=True))
    ids = [core.submit(r) for r in requests]
    got = {rid: [] for rid in ids}
    cached = 0
    for event in core.run():
        if isinstance(event, TokenGenerated):
            got[event.request_id].append(event.token_id)
        cached += getattr(event, "cached_tokens", 0) or 0
    assert [got[rid] for rid in ids] == alone
    assert cached > 0  # some prompts began from the cache
    loaded.batch_invariant = False
    assert "can differ alone and in a batch" in answers_note(loaded)


def test_a_batch_invariant_server_says_so_and_gives_the_model_back_as_it_was(tiny_models):
    from tests.serving import serve

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), "bf16", "cpu"))
    assert "can differ alone and in a batch" in answers_note(loaded)
    server = serve(loaded, batch_invariant=True)
    try:
        assert loaded.batch_invariant and "each the same alone and in any batch" in server.service.describe_kv()
    finally:
        server.stop(drain=False, timeout=30)
    assert not loaded.batch_invariant  # the window's own prompts run as they did before
