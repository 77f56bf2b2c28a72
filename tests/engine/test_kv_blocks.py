"""KV blocks taken on demand, preemption when they run out, and the prefix cache: the KV cache
manager's counts, and greedy answers equal to each request's solo answer through all of it."""

import pytest

from engine.generation.core import CoreSettings, EngineCore
from engine.generation.kv_manager import KVCacheManager, block_keys
from engine.base.events import Finished, Preempted, Prefilled, StepCompleted, TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from tests.conftest import ARCHITECTURES
from tests.tiny import CHAT_TEMPLATE, CORPUS
from dataclasses import replace
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
    assert kv.hold(1, 7) and len(kv.tables[1]) == 4
    first = list(kv.tables[1])
    assert kv.keep(1, a, 7, copy) == 3  # the half block [7] is not cached
    assert kv.keep(1, a, 7, copy) == 0  # already cached
    assert kv.copy_of(first[1]) == ("block", 2, 4)  # a copying runner's copy, taken once
    assert kv.release(1) == 4 and (kv.kept_blocks, kv.free_blocks, kv.used_blocks) == (3, 1, 0)
    assert kv.lookup(2, [1, 2, 3, 4, 9]) == first[:2] == kv.tables[2]  # the very blocks, taken back
    assert (kv.queries, kv.hits) == (5, 4) and (kv.used_blocks, kv.kept_blocks) == (2, 1)
    assert kv.lookup(3, [1, 2, 3, 4]) == first[:1]  # one token always left to compute
    assert kv.shared_blocks == 1 and kv.used_blocks == 2  # [1, 2]: held by two, once
    assert kv.lookup(4, [9, 2, 3, 4, 5]) == []  # same tokens after a different start: another chain
    assert kv.lookup(5, [2, 1, 3, 4]) == []
    kv.release(3), kv.release(2)
    # blocks [1,2] and [3,4] were just used; [5,6] is the least recent and goes first
    assert kv.hold(7, 4) and kv.kept_blocks == 2 and kv.evicted == 1
    assert len(kv.lookup(8, a)) == 2 and kv.release(8) == 2
    assert kv.hold(9, 4) and kv.kept_blocks == 0  # a request's blocks come before cached ones
    assert not kv.hold(9, 6) and kv.held[9] == 2
    kv.pool.check()


def test_a_write_into_a_shared_block_copies_it_first():
    class Storage:
        copied = []

        def resize(self, blocks, block_tokens):
            pass

        def copy_block(self, source, target):
            self.copied.append((source, target))

        def block_nbytes(self):
            return 8

        def storage_nbytes(self):
            return 8 * kv.pool.allocated

        def held_nbytes(self):
            return 8 * kv.pool.held

        def kept_nbytes(self):
            return 8 * kv.pool.cached_free

        def forget_block(self, block):
            pass

    kv = KVCacheManager(bytes_per_token=1, total_blocks=8, prefix_caching=True, block_tokens=2, storage=Storage())
    tokens = [1, 2, 3, 4, 5]
    assert kv.hold(1, 5) and kv.keep(1, tokens, 4) == 2
    assert kv.lookup(2, tokens) == kv.tables[1][:2] and kv.hold(2, 5)
    shared = kv.tables[1][1]
    assert kv.crop(2, 3) == [(shared, kv.tables[2][1])] == Storage.copied  # its own copy to write into
    assert kv.tables[2][1] != shared and kv.pool.refs[shared] == 1 and kv.shared_blocks == 1
    assert kv.crop(1, 3) == [] and kv.pool.key_of[shared] is None  # its only holder: forgotten by the cache
    assert kv.keep(1, [1, 2, 3, 9], 4) == 1  # and cached again once it holds its new tokens
    assert kv.table_bytes(1) == 3 * 8 and kv.pool_bytes()["storage"] == kv.pool.allocated * 8
    kv.pool.check()


def test_the_pool_keeps_every_block_in_one_state_through_random_use():
    import random

    rng = random.Random(3)
    kv = KVCacheManager(bytes_per_token=1, total_blocks=24, prefix_caching=True, block_tokens=2)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9], [7, 7, 1, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    running: dict[int, list[int]] = {}
    for rid in range(300):
        if running and (rng.random() < 0.4 or len(running) > 5):
            gone = rng.choice(list(running))
            kv.keep(gone, running.pop(gone), len(kv.tables.get(gone, ())) * 2)
            kv.release(gone)
        tokens = list(rng.choice(prompts)) + [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
        if kv.can_hold(rid, len(tokens) + 1):
            kv.lookup(rid, tokens)
            assert kv.hold(rid, len(tokens) + 1)
            kv.keep(rid, tokens, len(tokens))
            running[rid] = tokens
        kv.pool.check()
        assert kv.used_blocks + kv.kept_blocks + kv.free_blocks == 24
    assert kv.hits > 0 and kv.shared_blocks >= 0


def test_the_cache_grows_the_pool_only_as_far_as_the_running_requests_do():
    """Distinct prompts one after another: the pool grows with the blocks held at once, the cache
    takes as many again, and after that the least recently used cached blocks make room: memory
    that stops growing (a server soak), while the latest prompts are still found."""
    kv = KVCacheManager(bytes_per_token=1, total_blocks=1000, prefix_caching=True, block_tokens=2)
    kv.pool.chunk = 1
    for i in range(50):
        tokens = [i, i + 100, i, 7, 7, 7, 7, 7, 1]  # 5 blocks, 4 of them full
        found = kv.lookup(i, tokens)
        assert found == []
        assert kv.hold(i, len(tokens)) and kv.keep(i, tokens, len(tokens)) == 4
        kv.release(i)
        kv.pool.check()
    assert kv.pool.allocated <= 2 * 5 and kv.evicted > 0
    again = [49, 149, 49, 7, 7, 7, 7, 7, 1]
    assert len(kv.lookup(99, again)) == 4  # the last prompt is still cached


def test_the_keys_chain_every_block_before():
    one = block_keys([1, 2, 3, 4], 2, 2)
    assert one[0] == block_keys([1, 2, 9, 9], 1, 2)[0]
    assert one[1] != block_keys([0, 0, 3, 4], 2, 2)[1]
    assert block_keys([1, 2, 3, 4], 2, 2, one[0], 1) == one[1:]  # the chain continued from a parent


def test_no_budget_keeps_nothing():
    kv = KVCacheManager(bytes_per_token=1, total_blocks=None, prefix_caching=True, block_tokens=2)
    assert not kv.prefix_caching and kv.hold(1, 10 ** 4) and kv.keep(1, [1, 2, 3], 3, copy) == 0


# -- through the core -----------------------------------------------------------------------
def run(core, requests, gap=None, on_step=None):
    """Submit ``requests`` (all at once, or one each ``gap`` steps) and run the core dry; per
    request its tokens, Prefilled and Finished, and the Preempted events. ``on_step``: called
    with each StepCompleted."""
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
            elif isinstance(event, StepCompleted):
                if event.kv_blocks_total is not None:
                    assert event.kv_blocks_used + event.kv_blocks_kept <= event.kv_blocks_total
                if on_step is not None:
                    on_step(event)
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
    if arch in ("mistral", "gemma2", "gemma3"):  # windows of 10-12 tokens hold no whole 16-token block,
        # so no hit can end after one (test_sliding_window_models_cache_prefixes_too: larger windows)
        assert core.prefix_caching_off is None and all(p.cached_tokens == 0 for p in prefilled)
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


def pool_accounts(core):
    """A step's KV figures against the pool itself: every request's blocks, the cached and the
    empty ones add up to the storage's bytes, read from its tensors' storages."""
    runner, kv = core.runner, core.kv
    storage = sum(t.untyped_storage().nbytes() for t in runner.keys + runner.values)
    block = kv.block_bytes(1)
    held = set().union(*map(set, kv.tables.values())) if kv.tables else set()
    assert len(held) == kv.used_blocks and core.kv_bytes() == len(held) * block
    assert (len(held) + kv.kept_blocks + len(kv.pool.empty)) * block == storage
    assert kv.total_blocks is None or storage <= kv.total_blocks * block  # never past the budget
    kv.pool.check()
    return storage


@pytest.mark.parametrize("arch,precision", [("gemma2", "fp32"), ("mistral", "fp32"), ("gemma3", "fp32-fast"),
                                            ("mistral", "fp32-fast")])
def test_sliding_window_models_cache_prefixes_too(byte_tokenizer, tmp_path, arch, precision):
    """A sliding-window layer keeps only its window's last tokens, so a block copied once it has
    left the window lacks that layer's part (the reference runner's copies), or its part went back
    before it was cached (the fast path's window pool; a cached block keeps its part otherwise); a
    hit needs it only for its last window of tokens (vLLM's hybrid allocator). Answers with the
    prefix cache, concurrent and alone, equal the answers without it, and the fast path's pools
    add up to their tensors' bytes."""
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / arch, arch, byte_tokenizer, sliding_window=40, max_position_embeddings=512)
    loaded = load_model(LoadRequest(str(folder), precision, "cpu"))
    requests = [chat(q, n=30) for q in QUESTIONS]
    expected = [solo(loaded, r) for r in requests]

    def check(step):
        if core.paged:
            pool = core.kv.pool_bytes()
            assert step.kv_cache_bytes == pool["used"] == core.runner.held_nbytes()
            assert pool["used"] + pool["cached"] + pool["free"] == pool["storage"] == \
                sum(t.untyped_storage().nbytes() for t in core.runner.keys + core.runner.values)
            assert pool["free"] >= 0 and step.kv_kept_bytes == pool["cached"]
            runner = core.runner  # each block's window part its own, none also free, read as counted
            parts = list(runner.window_of.values())
            assert len(set(parts)) == len(parts) and not set(parts) & set(runner.window_free)
            counted = {}
            for seq, (start, blocks) in runner.reading.items():
                assert blocks == runner.kv.tables[seq][start:start + len(blocks)]  # (blocks held ahead: next step)
                for block in blocks:
                    counted[block] = counted.get(block, 0) + 1
            assert {b: n for b, n in runner.readers.items() if n} == counted

    for gap in (None, 40):  # together, then one after another
        core = EngineCore(loaded, CoreSettings(token_budget=40, prefill_chunk=16, kv_budget_bytes=1 << 24,
                                               prefix_caching=True))
        tokens, prefilled, _, _ = run(core, requests, gap=gap, on_step=check)
        assert tokens == expected
        assert core.prefix_caching_off is None and all(p.cached_tokens > 0 for p in prefilled[1:])
        if not core.paged:
            assert core.kv.windowless  # blocks whose window part had gone were kept for the full layers
    # a prompt whose whole window lies in blocks that lack it finds a shorter prefix, not a wrong one
    history = loaded.encode(requests[0]) + tokens[0]
    again = GenerationRequest("(given as ids)", mode="raw", max_new_tokens=6, ignore_eos=True)
    rid = core.submit(again, prompt_ids=history + [32])
    follow = [e for e in core.run() if getattr(e, "request_id", None) == rid]
    cold = EngineCore(loaded, CoreSettings())
    cold.submit(again, prompt_ids=history + [32])
    assert [e.token_id for e in follow if isinstance(e, TokenGenerated)] == \
        [e.token_id for e in cold.run() if isinstance(e, TokenGenerated)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fast_runner_shares_cached_blocks_in_place_and_answers_as_without(tiny_models, arch):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32-fast", "cpu"))
    requests = [chat(q, n=24) for q in QUESTIONS]
    expected = [solo(loaded, r) for r in requests]
    budget = 48 * 16 * loaded.info.kv_bytes_per_token
    core = EngineCore(loaded, CoreSettings(token_budget=40, prefill_chunk=16, kv_budget_bytes=budget,
                                           prefix_caching=True))
    seen = {"shared": 0}

    def check(step):
        assert step.kv_pool_bytes == pool_accounts(core)
        seen["shared"] = max(seen["shared"], step.kv_blocks_shared)

    tokens, prefilled, _, _ = run(core, requests, gap=3, on_step=check)
    assert tokens == expected
    system_blocks = len(loaded.encode(chat(""))) // 16
    assert all(p.cached_tokens == system_blocks * 16 for p in prefilled[1:])
    assert seen["shared"] >= system_blocks  # the system prompt's blocks, held once by the requests running


def test_sixteen_requests_behind_one_prompt_hold_its_blocks_once(tiny_llama):
    loaded = load_model(LoadRequest(str(tiny_llama), "fp32-fast", "cpu"))
    system = SYSTEM * 3  # 171 byte tokens: 10 full blocks
    requests = [GenerationRequest(system + f"Question {i}?", mode="raw", max_new_tokens=8, ignore_eos=True)
                for i in range(16)]
    prefix_blocks = len(loaded.encode(GenerationRequest(system, mode="raw"))) // 16
    core = EngineCore(loaded, CoreSettings(token_budget=64, max_batch=16, kv_budget_bytes=1 << 24,
                                           prefix_caching=True))
    most = {"used": 0, "running": 0}

    def check(step):
        pool_accounts(core)
        if step.running > most["running"]:
            most.update(running=step.running, used=step.kv_blocks_used)

    tokens, _, _, _ = run(core, requests, on_step=check)
    assert tokens == [solo(loaded, r) for r in requests]
    assert most["running"] == 16
    # the prefix once, each request its own last blocks: far below 16 copies of the prefix
    assert most["used"] <= prefix_blocks + 16 * 3 < 16 * prefix_blocks


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

    from engine.generation.generate import kept_service
    from tests.serving import serve

    service = kept_service(loaded_llama)
    core = service.core
    alone = core.settings
    first = [e for e in generate(loaded_llama, chat("What is a token?"), service=service) if isinstance(e, Finished)][0]
    kept = core.kv.kept_blocks
    assert kept > 0 and first.cached_tokens == 0
    server = serve(loaded_llama, service=service)  # reconfigured to the server's limits, the same core
    try:
        assert server.service is service and service.core is core and core.settings.max_batch == 8
        assert core.kv.kept_blocks == kept
        answer = httpx.post(f"{server.url}/completions", timeout=60, json={
            "model": server.model_name, "prompt": SYSTEM + "What is a KV cache?", "max_tokens": 4,
            "temperature": 0}).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.stop(drain=False, timeout=30)
    service.reconfigure(alone)
    service.reopen()
    assert core.settings == alone and core.kv.kept_blocks >= kept
    again = [e for e in generate(loaded_llama, chat("What is a token?"), service=service) if isinstance(e, Finished)][0]
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    smaller = CoreSettings(max_batch=1, kv_budget_bytes=2 * 16 * loaded_llama.info.kv_bytes_per_token,
                           prefix_caching=True)
    core.reconfigure(smaller)  # fewer blocks: the most recently used stay
    assert core.kv.kept_blocks == 2


def test_the_windows_core_takes_a_request_as_long_as_the_context(loaded_llama):
    from engine.generation.generate import kept_service

    service = kept_service(loaded_llama)
    context = loaded_llama.info.context_length
    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=10 * context, ignore_eos=True)
    final = [e for e in generate(loaded_llama, request, service=service) if isinstance(e, Finished)][0]
    assert final.reason == "context" and final.prompt_tokens + final.tokens == context


@pytest.mark.parametrize("precision", ["fp32", "fp32-fast"])
def test_a_chats_next_turn_continues_from_its_tokens_and_reads_only_what_is_new(byte_tokenizer, tmp_path, precision):
    """Each turn's prompt is the last prompt's ids, the answer's ids as generated and the
    template's tokens for the new turn: the prefix cache then holds every earlier token, so a
    turn computes only the last answer's final token and its own (the history's text tokenized
    again can split otherwise, and the cache finds nothing past the first difference)."""
    from engine.base.request import ChatMessage
    from engine.generation.generate import kept_service

    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "long", "llama", byte_tokenizer, max_position_embeddings=1024)
    loaded = load_model(LoadRequest(str(folder), precision, "cpu"))
    service = kept_service(loaded)
    history, continues, differs = (), None, 0
    for turn in range(4):
        request = GenerationRequest(f"Turn {turn}: a KV cache?\n\nPlainly.", history=history,
                                    max_new_tokens=17 + turn, ignore_eos=True, continues=continues)
        final = [e for e in generate(loaded, request, service=service) if isinstance(e, Finished)][0]
        if continues is not None:
            earlier = continues[0] + continues[1]
            assert final.continued and final.prompt_ids[:len(earlier)] == earlier
            assert final.cached_tokens == (len(earlier) - 1) // 16 * 16  # all but the answer's last token
            differs += loaded.encode(replace(request, continues=None)) != list(final.prompt_ids)
        history += (ChatMessage("user", request.prompt), ChatMessage("assistant", final.text))
        continues = (final.prompt_ids, final.token_ids)
    assert differs  # the history's text, tokenized again, is not what the model read and wrote
    # a template that renders a past answer otherwise once a turn follows: the text is read again, and said
    loaded.tokenizer.chat_template = CHAT_TEMPLATE_MARKING_PAST
    try:
        request = GenerationRequest("And now?", history=history, max_new_tokens=4, continues=continues)
        final = [e for e in generate(loaded, request, service=service) if isinstance(e, Finished)][0]
        assert final.continued is False and final.tokens > 0 and final.prompt_ids == tuple(loaded.encode(
            replace(request, continues=None)))
    finally:
        loaded.tokenizer.chat_template = CHAT_TEMPLATE


CHAT_TEMPLATE_MARKING_PAST = CHAT_TEMPLATE.replace(
    "{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}(past) {% endif %}{{ m['content'] }}")
