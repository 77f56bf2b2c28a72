"""KV blocks taken on demand, preemption when they run out, and the prefix cache: the KV cache
manager's counts, and greedy answers equal to each request's solo answer through all of it."""

import pytest

from engine.generation.core import CoreSettings, EngineCore
from engine.generation.kv_manager import KVCacheManager, block_keys
from engine.base.events import Finished, Preempted, Prefilled, StepCompleted, TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from tests.conftest import ARCHITECTURES
from tests.tiny import CORPUS
from engine.generation.generate import generate

SYSTEM = "You are a terse assistant. Answer in one line, plainly. "  # 3+ blocks of 16 byte tokens
QUESTIONS = ["Why is the sky blue?", "What is a KV cache?", "Name a fox.", "2+2?"]


def copy(start, end):
    return ("block", start, end)


# -- the manager alone -------------------------------------------------------------------
def test_blocks_are_taken_as_a_request_grows_and_freed_when_it_ends():
    kv = KVCacheManager(bytes_per_token=10, total_blocks=4, block_tokens=4)
    assert kv.hold(1, 5) and kv.held[1] == 2 and kv.free_blocks == 2
    assert kv.hold(1, 8) and kv.held[1] == 2  # still two blocks
    assert kv.hold(1, 9) and kv.held[1] == 3
    assert not kv.can_hold(2, 8) and not kv.hold(2, 8) and 2 not in kv.held  # nothing changed
    assert kv.hold(2, 4) and kv.free_blocks == 0
    assert kv.release(1) == 3 and kv.free_blocks == 3 and kv.used_blocks == 1
    assert kv.block_bytes(3) == 120 and kv.fits_alone(16) and not kv.fits_alone(17)


def test_the_prefix_cache_finds_whole_block_chains_and_evicts_least_recently_used():
    kv = KVCacheManager(bytes_per_token=1, total_blocks=4, prefix_caching=True, block_tokens=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    assert kv.keep(a, 7, copy) == 3 and kv.kept_blocks == 3  # the half block [7] is not kept
    assert kv.keep(a, 7, copy) == 0  # already kept
    assert [b.data for b in kv.lookup([1, 2, 3, 4, 9])] == [("block", 0, 2), ("block", 2, 4)]
    assert (kv.queries, kv.hits) == (5, 4)
    assert [b.data for b in kv.lookup([1, 2, 3, 4])] == [("block", 0, 2)]  # one token always left to compute
    assert kv.lookup([9, 2, 3, 4, 5]) == []  # same tokens after a different start: another chain
    assert kv.lookup([2, 1, 3, 4]) == []
    # blocks [1,2] and [3,4] were just used; [5,6] is the least recent and goes first
    assert kv.hold(7, 4) and kv.kept_blocks == 2 and kv.evicted == 1
    assert len(kv.lookup(a)) == 2
    assert kv.hold(8, 2) and kv.kept_blocks == 1  # no free block: a kept one made room
    assert kv.keep([7, 7, 8, 8, 9], 5, copy) == 0 and kv.free_blocks == 0  # keeping never evicts
    assert kv.hold(8, 4) and kv.kept_blocks == 0  # a request's blocks come before kept ones
    assert not kv.hold(8, 6) and kv.held[8] == 2


def test_the_keys_chain_every_block_before():
    one = block_keys([1, 2, 3, 4], 2, 2)
    assert one[0] == block_keys([1, 2, 9, 9], 1, 2)[0]
    assert one[1] != block_keys([0, 0, 3, 4], 2, 2)[1]


def test_no_budget_keeps_nothing():
    kv = KVCacheManager(bytes_per_token=1, total_blocks=None, prefix_caching=True, block_tokens=2)
    assert not kv.prefix_caching and kv.keep([1, 2, 3], 3, copy) == 0 and kv.hold(1, 10 ** 6)


# -- through the core -----------------------------------------------------------------------
def run(core, requests, gap=None):
    """Submit ``requests`` (all at once, or one each ``gap`` steps) and run the core dry; per
    request its tokens, Prefilled and Finished, and the Preempted events."""
    rids, tokens, prefilled, finals, preempted = [], {}, {}, {}, []
    queue = list(requests)
    step = 0
    while queue or not core.idle:
        if queue and (gap is None or step % gap == 0):
            for request in queue if gap is None else queue[:1]:
                rid = core.submit(request)
                rids.append(rid)
                tokens[rid] = []
            queue = [] if gap is None else queue[1:]
        for event in core.step():
            if isinstance(event, TokenGenerated):
                tokens[event.request_id].append(event.token_id)
            elif isinstance(event, Prefilled):
                prefilled[event.request_id] = event
            elif isinstance(event, Finished):
                finals[event.request_id] = event
            elif isinstance(event, Preempted):
                preempted.append(event)
            elif isinstance(event, StepCompleted) and event.kv_blocks_total is not None:
                assert event.kv_blocks_used + event.kv_blocks_kept <= event.kv_blocks_total
        step += 1
        assert step < 2000
    assert core.kv.used_blocks == 0 and len(core.runner) == 0
    return ([tokens[r] for r in rids], [prefilled[r] for r in rids], [finals[r] for r in rids], preempted)


def solo(loaded, request):
    return [e.token_id for e in generate(loaded, request) if isinstance(e, TokenGenerated)]


def chat(question, n=12):
    return GenerationRequest(SYSTEM + question, mode="raw", max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_caching_gives_every_architecture_its_uncached_greedy_answers(tiny_models, arch):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32", "cpu"))
    requests = [chat(q) for q in QUESTIONS]
    expected = [solo(loaded, r) for r in requests]
    settings = CoreSettings(token_budget=40, prefill_chunk=16, kv_budget_bytes=1 << 24, prefix_caching=True)
    core = EngineCore(loaded, settings)
    tokens, prefilled, finals, _ = run(core, requests, gap=3)  # each arrives once the one before has read some
    assert tokens == expected
    if arch in ("mistral", "gemma2"):  # sliding-window layers: excluded, and said why
        assert "sliding-window" in core.prefix_caching_off and core.kv.kept_blocks == 0
        assert all(p.cached_tokens == 0 for p in prefilled)
        return
    assert core.prefix_caching_off is None
    shared = len(loaded.encode(chat(""))) // 16 * 16
    assert core.kept_bytes() == core.kv.kept_blocks * 16 * loaded.info.kv_bytes_per_token > 0  # measured = predicted
    assert prefilled[0].cached_tokens == 0
    assert [p.cached_tokens for p in prefilled[1:]] == [shared] * 3
    assert [f.cached_tokens for f in finals] == [p.cached_tokens for p in prefilled]
    assert core.kv.hits == 3 * shared and core.kv.queries == sum(p.prompt_tokens for p in prefilled)
    # the answers' blocks were kept too: asking again with the whole first exchange as the prompt
    history = loaded.encode(requests[0]) + tokens[0]
    again = GenerationRequest("(given as ids)", mode="raw", max_new_tokens=6, ignore_eos=True)
    rid = core.submit(again, prompt_ids=history + [32])
    follow = [e for e in core.run() if getattr(e, "request_id", None) == rid]
    assert next(e for e in follow if isinstance(e, Prefilled)).cached_tokens == len(history) // 16 * 16
    cold = EngineCore(loaded, CoreSettings())
    cold.submit(again, prompt_ids=history + [32])
    assert [e.token_id for e in follow if isinstance(e, TokenGenerated)] == \
        [e.token_id for e in cold.run() if isinstance(e, TokenGenerated)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fast_runner_copies_cached_blocks_and_answers_as_without(tiny_models, arch):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32-fast", "cpu"))
    requests = [chat(q) for q in QUESTIONS]
    expected = [solo(loaded, r) for r in requests]
    core = EngineCore(loaded, CoreSettings(token_budget=40, prefill_chunk=16, kv_budget_bytes=1 << 24,
                                           prefix_caching=True))
    tokens, prefilled, _, _ = run(core, requests, gap=3)
    assert tokens == expected
    assert all(p.cached_tokens > 0 for p in prefilled[1:])


def test_requests_arriving_together_share_what_the_first_has_computed(tiny_llama):
    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    requests = [chat(q) for q in QUESTIONS]
    expected = [solo(loaded, r) for r in requests]
    core = EngineCore(loaded, CoreSettings(token_budget=17, prefill_chunk=16, max_batch=8, kv_budget_bytes=1 << 24,
                                           prefix_caching=True))
    tokens, prefilled, _, _ = run(core, requests)
    assert tokens == expected
    # the later three wait for the blocks the first is computing rather than compute them too
    shared = len(loaded.encode(chat(""))) // 16 * 16
    assert [p.cached_tokens for p in prefilled] == [0] + [shared] * 3


@pytest.mark.parametrize("precision", ["fp32", "fp32-fast"])
def test_preempted_requests_recompute_and_get_their_solo_answers(tiny_llama, precision):
    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    requests = [GenerationRequest(text, mode="raw", max_new_tokens=48, ignore_eos=True) for text in CORPUS[:5]]
    expected = [solo(loaded, r) for r in requests]
    worst = max(len(loaded.encode(r)) for r in requests) + 49
    settings = CoreSettings(token_budget=64, block_tokens=8, prefix_caching=True,
                            kv_budget_bytes=2 * worst * loaded.info.kv_bytes_per_token)
    core = EngineCore(loaded, settings)
    tokens, _, finals, preempted = run(core, requests)
    assert tokens == expected
    assert preempted and sum(f.preemptions for f in finals) == len(preempted)
    assert all(f.reason == "length" for f in finals)


def test_preemption_under_speculation_keeps_the_solo_answers_and_the_draft_counts(tiny_llama):
    from engine.generation.speculative import DraftSpec, Speculation, load_draft

    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    requests = [GenerationRequest(text, mode="raw", max_new_tokens=40, ignore_eos=True) for text in CORPUS[:4]]
    expected = [solo(loaded, r) for r in requests]
    worst = max(len(loaded.encode(r)) for r in requests) + 45
    settings = CoreSettings(token_budget=32, block_tokens=4, kv_budget_bytes=2 * worst * loaded.info.kv_bytes_per_token)
    core = EngineCore(loaded, settings, proposer=Speculation(loaded, draft, 3))
    tokens, _, finals, preempted = run(core, requests)
    assert tokens == expected and preempted
    assert all(f.drafted_tokens > 0 and f.accepted_tokens <= f.drafted_tokens for f in finals)
    assert len(core.proposer.runner) == 0


def test_new_limits_keep_the_prefix_cache_and_a_server_serves_through_the_windows_core(loaded_llama):
    import httpx

    from engine.generation.generate import kept_core
    from tests.serving import serve

    core = kept_core(loaded_llama)
    alone = core.settings
    first = [e for e in generate(loaded_llama, chat("What is a token?"), core=core) if isinstance(e, Finished)][0]
    kept = core.kv.kept_blocks
    assert kept > 0 and first.cached_tokens == 0
    server = serve(loaded_llama, core=core)  # reconfigured to the server's limits, the same core
    try:
        assert server.service.core is core and core.settings.max_batch == 8 and core.kv.kept_blocks == kept
        answer = httpx.post(f"{server.url}/completions", timeout=60, json={
            "model": server.model_name, "prompt": SYSTEM + "What is a KV cache?", "max_tokens": 4,
            "temperature": 0}).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.stop(drain=False, timeout=30)
    core.reconfigure(alone)
    assert core.settings == alone and core.kv.kept_blocks >= kept
    again = [e for e in generate(loaded_llama, chat("What is a token?"), core=core) if isinstance(e, Finished)][0]
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    smaller = CoreSettings(max_batch=1, kv_budget_bytes=2 * 16 * loaded_llama.info.kv_bytes_per_token,
                           prefix_caching=True)
    core.reconfigure(smaller)  # fewer blocks: the most recently used stay
    assert core.kv.kept_blocks == 2


def test_the_windows_core_takes_a_request_as_long_as_the_context(loaded_llama):
    from engine.generation.generate import kept_core

    core = kept_core(loaded_llama)
    context = loaded_llama.info.context_length
    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=10 * context, ignore_eos=True)
    final = [e for e in generate(loaded_llama, request, core=core) if isinstance(e, Finished)][0]
    assert final.reason == "context" and final.prompt_tokens + final.tokens == context
