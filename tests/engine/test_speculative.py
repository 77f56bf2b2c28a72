import json

import pytest

from engine.base.cancel import CancelToken
from engine.base.errors import InvalidRequestError
from engine.base.events import DraftVerified, Finished, StepCompleted, TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.generation.speculative import DraftSpec, early_exit_model, load_draft, parse_draft, stream_speculative
from engine.generation.generate import generate
from tests.tiny import kv_held_ok

PROMPT = "The quick brown fox 😀 jumps"


def plain(loaded, request):
    return next(e for e in generate(loaded, request) if isinstance(e, Finished))


def check_counts(events):
    """The counts the stream reports agree with the tokens it emitted."""
    verified = [e for e in events if isinstance(e, DraftVerified)]
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    final = events[-1]
    assert isinstance(final, Finished)
    assert final.drafted_tokens == sum(len(v.drafted_ids) for v in verified)
    assert final.accepted_tokens == sum(v.accepted for v in verified)
    assert sum(t.drafted is True for t in tokens) == final.accepted_tokens
    assert [t.index for t in tokens] == list(range(final.tokens))
    assert tokens[0].drafted is False  # the first token comes from the target's prefill
    # after each verification: its accepted tokens, then one of the target's own
    position = 1
    stream = iter(events)
    for event in stream:
        if isinstance(event, DraftVerified):
            following = []
            for e in stream:
                following.append(e)
                if len(following) == event.accepted + 1 or isinstance(e, Finished):
                    break
            step_tokens = [e for e in following if isinstance(e, TokenGenerated)]
            assert [t.token_id for t in step_tokens[:event.accepted]] == list(event.drafted_ids[:event.accepted])
            assert all(t.drafted for t in step_tokens[:event.accepted])
            if len(step_tokens) == event.accepted + 1:
                assert step_tokens[-1].drafted is False
                if event.accepted < len(event.drafted_ids):  # a correction differs from the rejected guess
                    assert step_tokens[-1].token_id != event.drafted_ids[event.accepted]
            position += len(step_tokens)
    return final


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma2"])
@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_early_exit_speculation_equals_plain_greedy(tiny_models, arch, draft_tokens):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=24, ignore_eos=True)
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    events = list(stream_speculative(loaded, draft, request, draft_tokens))
    final = check_counts(events)
    assert final.token_ids == plain(loaded, request).token_ids
    assert final.drafted_tokens > 0
    # the view shares the target's weights and leaves the target whole
    assert draft.weights_bytes == 0
    assert plain(loaded, request).token_ids == final.token_ids


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_lower_precision_draft_of_the_same_model(tiny_models, arch):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=20, ignore_eos=True)
    draft = load_draft(parse_draft(f"{tiny_models[arch]}:bf16", "fp32"), loaded)
    final = check_counts(list(stream_speculative(loaded, draft, request, 3)))
    assert final.token_ids == plain(loaded, request).token_ids
    assert final.accepted_tokens / final.drafted_tokens > 0.5  # bf16 mostly agrees with fp32
    # the same weights as their own draft agree with themselves always
    same = load_draft(parse_draft(str(tiny_models[arch]), "fp32"), loaded)
    final = check_counts(list(stream_speculative(loaded, same, request, 3)))
    assert final.accepted_tokens == final.drafted_tokens > 0
    assert final.token_ids == plain(loaded, request).token_ids


def test_the_default_model_speculates_on_itself(default_fp32):
    request = GenerationRequest("Explain microservices in simple terms.", max_new_tokens=32)
    draft = load_draft(parse_draft("early-exit:20", "fp32"), default_fp32)
    final = check_counts(list(stream_speculative(default_fp32, draft, request, 3)))
    reference = plain(default_fp32, request)
    assert final.token_ids == reference.token_ids and final.text == reference.text
    assert final.kv_cache_bytes == final.kv_cache_bytes_predicted


def test_sampled_speculation_is_seeded_and_counts_add_up(loaded_llama):
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=30, ignore_eos=True,
                                sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    first = check_counts(list(stream_speculative(loaded_llama, draft, request, 3)))
    again = check_counts(list(stream_speculative(loaded_llama, draft, request, 3)))
    assert first.token_ids == again.token_ids and first.tokens == 30
    assert 0 <= first.accepted_tokens <= first.drafted_tokens


def test_limits_and_stops_are_exact(loaded_llama):
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    for limit in (1, 2, 5, 7):
        request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=limit, ignore_eos=True)
        final = check_counts(list(stream_speculative(loaded_llama, draft, request, 4)))
        assert final.tokens == limit and final.reason == "length"
        assert final.kv_cache_bytes == final.kv_cache_bytes_predicted


def test_cancel_stops_between_tokens(loaded_llama):
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    cancel = CancelToken()
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=200, ignore_eos=True)
    events = []
    for event in stream_speculative(loaded_llama, draft, request, 4, cancel):
        events.append(event)
        if isinstance(event, TokenGenerated) and event.index == 5:
            cancel.cancel()
    assert events[-1].reason == "cancelled" and events[-1].tokens == 6


def test_bad_drafts_are_refused(tiny_models, loaded_llama, sp_tokenizer, tmp_path):
    from tests.tiny import build_model_folder

    with pytest.raises(InvalidRequestError, match="between 1 and 1"):
        early_exit_model(loaded_llama.model, 2)
    with pytest.raises(InvalidRequestError):
        parse_draft("early-exit:many", "fp32")
    other = build_model_folder(tmp_path / "other", "llama", sp_tokenizer)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        load_draft(parse_draft(str(other), "fp32"), loaded_llama)
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    with pytest.raises(InvalidRequestError):
        stream_speculative(loaded_llama, draft, GenerationRequest(PROMPT, mode="raw"), 0)


def test_parse_draft():
    assert parse_draft("ngram", "bf16") == DraftSpec("ngram", layers=3)
    assert parse_draft("ngram:5", "bf16").label == "ngram:5"
    for bad in ("ngram:0", "ngram:x", "ngram:9"):
        with pytest.raises(InvalidRequestError, match="ngram needs a size"):
            parse_draft(bad, "fp32")
    assert parse_draft("early-exit:8", "bf16") == DraftSpec("early-exit", layers=8)
    assert parse_draft("default:nf4", "bf16") == DraftSpec("model", model="default", precision="nf4")
    assert parse_draft("/models/small", "bf16") == DraftSpec("model", model="/models/small", precision="bf16")
    assert parse_draft("C:/x/small.gguf:int8", "fp32").model == "C:/x/small.gguf"


def test_bench_cli_reports_the_draft(tmp_path, tiny_llama):
    from engine.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "--model", str(tiny_llama), "--prompt", "fox", "--raw", "--max-new-tokens", "12",
                 "--ignore-eos", "--draft", "early-exit:1", "--draft-tokens", "3", "--compare-plain", "--quiet",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["draft"] == "early-exit:1" and data["draft_tokens_per_step"] == 3
    assert 0 <= data["accepted_tokens"] <= data["drafted_tokens"]
    assert data["acceptance_rate"] == pytest.approx(data["accepted_tokens"] / data["drafted_tokens"])
    assert data["speedup_vs_plain"] > 0 and data["same_tokens_as_plain"] is True
    assert len(data["token_ids"]) == 12
    # the speed-up predicted from what the steps cost, beside the measured one
    assert 0 <= data["alpha"] <= 1 and 0 < data["guesses_per_step"] <= 3  # fewer where the limit is near
    assert data["draft_cost"] > 0 and data["verify_cost"] > 0 and data["predicted_speedup"] > 0
    assert main(["bench", "--model", str(tiny_llama), "--prompt", "fox", "--compare-plain"]) == 1


def test_ttft_excludes_the_consumer_and_an_early_stop_keeps_the_step_time(loaded_llama):
    import time

    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=9, ignore_eos=True)
    events = []
    for event in stream_speculative(loaded_llama, draft, request, 4):
        events.append(event)
        if not isinstance(event, TokenGenerated):
            time.sleep(0.05)  # a slow consumer of Prefilled and DraftVerified
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    final = events[-1]
    prefilled = events[0]
    # wall time with the consumer's sleeps in it; the token latencies leave them out
    assert tokens[0].elapsed_s >= 0.05
    assert tokens[0].latency_s <= tokens[0].elapsed_s - 0.05
    assert tokens[0].latency_s >= prefilled.prefill_s
    # decode_s is every step's whole time, even when the limit cuts a step short
    assert final.decode_s == pytest.approx(sum(t.latency_s for t in tokens[1:]))
    assert final.tokens == 9


def test_a_draft_with_a_wider_output_layer(tiny_models, loaded_llama, byte_tokenizer, tmp_path):
    """Same tokenizer, output padded wider (as Qwen2.5 7B is against 0.5B): draft scores are cut
    to the target's vocabulary, greedy and sampled."""
    from tests.tiny import build_model_folder

    config = loaded_llama.model.config
    wide = build_model_folder(tmp_path / "wide", "llama", byte_tokenizer, vocab_size=config.vocab_size + 16)
    draft = load_draft(parse_draft(str(wide), "fp32"), loaded_llama)
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=12, ignore_eos=True)
    final = check_counts(list(stream_speculative(loaded_llama, draft, request, 3)))
    assert final.token_ids == plain(loaded_llama, request).token_ids
    sampled = GenerationRequest(PROMPT, mode="raw", max_new_tokens=12, ignore_eos=True,
                                sampling=SamplingParams(temperature=1.0, seed=1))
    final = check_counts(list(stream_speculative(loaded_llama, draft, sampled, 3)))
    assert all(t < config.vocab_size for t in final.token_ids)


@pytest.mark.parametrize("precision", ["fp32-fast", "int8-fast", "int4-fast"])
def test_speculation_runs_on_the_fast_runner(tiny_models, precision):
    """On a fast precision both the target's verify pass and an early-exit draft run on the fast
    path's paged caches (not transformers' forward), and greedy output is the fast path's own."""
    from engine.generation.paged_cache import PagedCache
    from engine.generation.speculative import Speculation

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), precision, "cpu"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    assert isinstance(Speculation(loaded, draft, 3).runner, PagedCache)
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=20, ignore_eos=True, top_alternatives=2)
    alone = [e for e in generate(loaded, request) if isinstance(e, TokenGenerated)]

    def same_as_alone(final):
        """fp32 and int8 (a kernel that treats each row alike): token for token. int4's kernel
        computes several rows (the verify pass) a little differently from one (a plain step),
        so the answers agree up to a token where plain decoding had a near-tie."""
        got = list(final.token_ids)
        if precision != "int4-fast":
            return got == [e.token_id for e in alone]
        for event, token in zip(alone, got):
            if event.token_id != token:
                first, second = event.top_alternatives
                return second.logprob > first.logprob - 0.1
        return True

    final = check_counts(list(stream_speculative(loaded, draft, request, 3)))
    assert same_as_alone(final) and final.drafted_tokens > 0
    assert kv_held_ok(loaded, final.kv_cache_bytes, final.kv_cache_bytes_predicted)
    # a draft loaded at a fast precision of its own runs on its own paged cache
    own = load_draft(parse_draft(f"{tiny_models['llama']}:int8-fast", precision), loaded)
    assert isinstance(own.runner(), PagedCache)
    assert same_as_alone(check_counts(list(stream_speculative(loaded, own, request, 4))))


@pytest.mark.parametrize("precision", ["fp32", "fp32-fast"])
def test_requests_speculating_together_in_one_core_get_their_solo_answers(tiny_models, precision):
    from engine.generation.core import CoreSettings, EngineCore
    from engine.generation.speculative import Speculation

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), precision, "cpu"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    requests = [GenerationRequest(p, mode="raw", max_new_tokens=n, ignore_eos=True)
                for p, n in ((PROMPT, 9), ("fox " * 20, 14), ("A", 5))]
    core = EngineCore(loaded, CoreSettings(token_budget=16, prefill_chunk=8), proposer=Speculation(loaded, draft, 3))
    ids = [core.submit(r) for r in requests]
    tokens = {rid: [] for rid in ids}
    finals = {}
    for event in core.run():
        if isinstance(event, TokenGenerated):
            tokens[event.request_id].append(event.token_id)
            assert kv_held_ok(loaded, event.kv_cache_bytes, event.kv_cache_bytes_predicted)
        elif isinstance(event, Finished):
            finals[event.request_id] = event
        elif isinstance(event, StepCompleted):  # the caches hold what was kept (rolled back), every step
            assert kv_held_ok(loaded, event.kv_cache_bytes, event.kv_cache_bytes_predicted,
                              max(1, event.running))
    for rid, request in zip(ids, requests):
        assert tokens[rid] == list(plain(loaded, request).token_ids)
        assert finals[rid].drafted_tokens > 0
        assert kv_held_ok(loaded, finals[rid].kv_cache_bytes, finals[rid].kv_cache_bytes_predicted)
    assert core.kv_bytes() == 0 and len(core.runner) == 0 and len(core.proposer.runner) == 0


def test_non_finite_scores_stop_a_speculative_run_with_its_tokens(tiny_llama, tmp_path):
    from engine.base.errors import NonFiniteError
    from tests.engine.test_honesty import _nan_after

    folder, request, before = _nan_after(tiny_llama, tmp_path, steps=3)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    with pytest.raises(NonFiniteError, match="NaN") as caught:
        list(stream_speculative(loaded, draft, request, 4))
    partial = caught.value.finished
    assert partial.reason == "error" and list(partial.token_ids) == before


@pytest.mark.parametrize("precision", ["fp32-fast", "fp32"])
def test_a_drafts_cache_is_within_the_kv_budget(tiny_models, precision):
    """The draft's own cache holds the same tokens as the target's: the core's budget covers
    both (the target's blocks fewer by the draft's share). On the fast path the draft's pool never
    grows past its share, read from both pools' storages; on the reference runner the draft's
    caches (transformers', measured from their tensors) hold no more than the target's tokens, so
    the two together stay within the budget."""
    from engine.generation.core import CoreSettings, EngineCore
    from engine.generation.speculative import Speculation

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), precision, "cpu"))
    draft = load_draft(DraftSpec("early-exit", layers=1), loaded)
    speculation = Speculation(loaded, draft, 3)
    budget = 40 * 16 * loaded.info.kv_bytes_per_token
    core = EngineCore(loaded, CoreSettings(token_budget=32, kv_budget_bytes=budget), proposer=speculation)
    draft_runner = speculation.runner
    per_block = 16 * (loaded.info.kv_bytes_per_token + speculation.kv_bytes_per_token)
    assert speculation.kv_bytes_per_token > 0
    assert core.kv.total_blocks == budget // per_block < 40
    if core.paged:
        assert draft_runner.kv.total_blocks == core.kv.total_blocks
    requests = [GenerationRequest(p, mode="raw", max_new_tokens=40, ignore_eos=True) for p in (PROMPT, "fox " * 30)]
    ids = [core.submit(request) for request in requests]
    tokens = {rid: [] for rid in ids}
    drafted = 0
    while not core.idle:
        for event in core.step():
            if isinstance(event, TokenGenerated):
                tokens[event.request_id].append(event.token_id)
        if core.paged:
            held = core.runner.storage_nbytes() + draft_runner.storage_nbytes()
            assert draft_runner.kv.pool.allocated <= draft_runner.kv.total_blocks
        else:
            drafts = sum(draft_runner.kv_bytes(seq) for seq in speculation.sequences)
            drafted = max(drafted, drafts)
            held = core.kv.block_bytes(core.kv.total_blocks) + drafts
        assert held <= budget
    assert core.paged or drafted > 0  # the reference draft's caches were measured while they held tokens
    assert [tokens[rid] for rid in ids] == [list(plain(loaded, r).token_ids) for r in requests]


REPEATING = "one two three four five one two three four five one two three"
"""A raw prompt whose continuation has occurred before: prompt lookup finds its n-grams."""


@pytest.mark.parametrize("arch,precision", [("llama", "fp32"), ("qwen2", "fp32"), ("gpt2", "fp32"),
                                            ("gemma2", "fp32"), ("mistral", "fp32"), ("llama", "int8-fast"),
                                            ("gemma3", "fp32-fast")])
def test_prompt_lookup_equals_plain_greedy(tiny_models, arch, precision):
    """Prompt lookup's guesses are checked by the target like any draft's: greedy output is plain
    decoding's token for token, on the reference runner and the fast path's (sliding windows too),
    while guesses are made and some are kept."""
    loaded = load_model(LoadRequest(str(tiny_models[arch]), precision, "cpu"))
    request = GenerationRequest(REPEATING, mode="raw", max_new_tokens=24, ignore_eos=True)
    draft = load_draft(parse_draft("ngram:1", precision), loaded)
    assert draft.model is None and draft.weights_bytes == 0
    final = check_counts(list(stream_speculative(loaded, draft, request, 4)))
    assert final.token_ids == plain(loaded, request).token_ids
    assert final.drafted_tokens > 0
    if loaded.fast is not None and not loaded.fast.windowed:  # (window caches keep a rollback's margin)
        assert kv_held_ok(loaded, final.kv_cache_bytes, final.kv_cache_bytes_predicted)


def test_prompt_lookup_guesses_what_followed_the_latest_occurrence(loaded_llama):
    """The guesses are the tokens after the last n-gram's latest earlier occurrence, at most as
    many as asked for and as there is room for; nothing where the n-gram never occurred."""
    import torch

    from engine.generation.sampling import make_sampler
    from engine.generation.speculative import PromptLookup

    lookup = PromptLookup(loaded_llama, 2, 4)
    greedy = make_sampler(SamplingParams())
    lookup.add(0, None, 64)
    ids = [1, 2, 9, 1, 2, 7, 8, 3, 1, 2]
    assert lookup.propose(0, greedy, torch.tensor(ids), room=8).tokens == (7, 8, 3, 1)
    assert lookup.propose(0, greedy, torch.tensor(ids), room=3).tokens == (7, 8)
    assert lookup.propose(0, greedy, torch.tensor(ids + [5]), room=8).tokens == ()  # (2, 5) never occurred
    lookup.add(1, None, 64)
    assert lookup.propose(1, greedy, torch.tensor([4, 4]), room=8).tokens == ()
    assert lookup.propose(1, greedy, torch.tensor([4, 4, 4]), room=8).tokens == (4,)
    # a sampled request's guess is a certainty for the acceptance rule
    sampled = make_sampler(SamplingParams(temperature=1.0, seed=3))
    lookup.add(2, None, 64)
    proposal = lookup.propose(2, sampled, torch.tensor(ids), room=8)
    assert [int(q.argmax()) for q in proposal.probs] == list(proposal.tokens)
    assert all(float(q.sum()) == 1.0 and int((q > 0).sum()) == 1 for q in proposal.probs)
    lookup.remove(0)
    assert 0 not in lookup.ids and 0 not in lookup.sequences


def test_sampled_prompt_lookup_is_seeded_and_counts_add_up(loaded_llama):
    draft = load_draft(parse_draft("ngram:1", "fp32"), loaded_llama)
    request = GenerationRequest(REPEATING, mode="raw", max_new_tokens=30, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.7, seed=5))
    first = check_counts(list(stream_speculative(loaded_llama, draft, request, 4)))
    again = check_counts(list(stream_speculative(loaded_llama, draft, request, 4)))
    assert first.token_ids == again.token_ids and first.tokens == 30 and first.drafted_tokens > 0


def test_the_predicted_speedup_is_the_formula_of_what_was_measured():
    """(1 − α^(k+1)) / ((1 − α)(k·c + v)); α from the steps as the share of looked-at guesses kept;
    the break-even α is where the formula gives 1."""
    from engine.measure.speculative_run import (break_even, break_even_alpha, expected_speedup, expected_tokens,
                                                plain_steps_of)

    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(0.8, 4, 0.1, 1.2) == pytest.approx((1 - 0.8 ** 5) / (0.2 * (0.4 + 1.2)))
    alpha = break_even_alpha(4, 0.1, 1.2)
    assert expected_speedup(alpha, 4, 0.1, 1.2) == pytest.approx(1.0)
    assert 0 < break_even_alpha(4, 0.5, 1.5) < 1  # 5 tokens for 3.5 steps at best
    assert break_even_alpha(4, 1.0, 1.5) is None  # 5 tokens for 5.5 steps at best: never pays

    def step(drafted, accepted, draft_s, step_s):
        return DraftVerified(0, tuple(range(drafted)), ("",) * drafted, accepted, draft_s, step_s / 2, 0.0,
                             step_s=step_s)

    steps = [step(4, 4, 0.004, 0.016), step(4, 1, 0.004, 0.016), step(2, 0, 0.002, 0.014)]
    # 5 + 2 + 1 tokens in those steps, 2 more from plain steps; a plain step takes 10 ms
    def token(index, drafted):
        from engine.base.memory import MemorySample

        return TokenGenerated(index=index, token_id=index, text="", logprob=0.0, top_alternatives=(), latency_s=0.0,
                              elapsed_s=0.0, kv_cache_bytes=0, kv_cache_bytes_predicted=0,
                              memory=MemorySample(None, "cpu"), drafted=drafted)
    events = [token(0, False), token(1, False), steps[0], *[token(i, True) for i in (2, 3, 4, 5)], token(6, False),
              token(7, False), steps[1], token(8, True), token(9, False)]
    assert plain_steps_of(events) == 2
    predicted = break_even(steps, 2, 0.010)
    assert predicted.alpha == pytest.approx(5 / (5 + 2))  # the 5 kept of the 7 looked at
    assert predicted.draft_cost == pytest.approx(0.010 / 10 / 0.010)
    assert predicted.verify_cost == pytest.approx((0.012 + 0.012 + 0.012) / 3 / 0.010)
    assert predicted.plain_steps == 2 and predicted.guesses == pytest.approx(10 / 3)
    tokens = 2 * expected_tokens(predicted.alpha, 4) + expected_tokens(predicted.alpha, 2) + 2
    cost = 2 * (4 * 0.1 + 1.2) + (2 * 0.1 + 1.2) + 2
    assert predicted.predicted == pytest.approx(tokens / cost)
    assert break_even([], 2, 0.01) is None and break_even(steps, 2, 0.0) is None
    # each token's events after its scores (1 ms each here) are part of its step's cost
    timed = break_even(steps, 2, 0.010, emit_s=0.001)
    assert timed.verify_cost == pytest.approx((0.012 + 0.005 + 0.012 + 0.002 + 0.012 + 0.001) / 3 / 0.010)
