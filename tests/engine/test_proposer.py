"""The engine core's proposer and batch sampler, and the core lent to its model's other clients.

Any proposer's guesses are verified by the target, so the answer is the target's own whatever
is guessed; the sampler takes a step's whole batch (greedy and seeded requests together); a
batch sweep or a speculative run borrows the model's core and gives it back as it was, its
prefix cache untouched."""

import pytest

from engine.base.cancel import CancelToken
from engine.base.events import BatchFinished, DraftVerified, Finished, TokenGenerated
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.generation.core import CoreSettings, EngineCore
from engine.generation.generate import generate, kept_service
from engine.generation.proposer import NOTHING, Proposal, Proposer
from engine.models.loading import LoadRequest, load_model
from tests.tiny import CORPUS


class Scripted(Proposer):
    """Guesses from a script: each request's expected answer (its solo answer), with every
    ``wrong``-th guess made wrong on purpose, or nothing but token 0 when no script is given."""

    lookahead = 3

    def __init__(self, scripts: dict[int, list[int]] | None = None, wrong: int = 3) -> None:
        self.scripts = scripts or {}
        self.wrong = wrong
        self.prompts: dict[int, int] = {}
        self.totals: dict[int, list[int]] = {}
        self.made = 0
        self.held: set[int] = set()

    def add(self, seq, request, tokens):
        self.held.add(seq)
        self.totals.setdefault(seq, [0, 0])

    def remove(self, seq):
        self.held.discard(seq)

    def propose(self, seq, sampler, committed, room):
        n = min(self.lookahead, room - 1)
        if n <= 0:
            return NOTHING
        script = self.scripts.get(seq)
        if script is None:
            return Proposal((0,) * n)
        start = len(committed) - self.prompts[seq]
        guesses = []
        for token in script[start:start + n]:
            self.made += 1
            guesses.append((token + 1) % 256 if self.made % self.wrong == 0 else token)
        return Proposal(tuple(guesses)) if guesses else NOTHING

    def settle(self, seq, proposal, accepted, committed, verify_s):
        self.totals[seq][0] += len(proposal.tokens)
        self.totals[seq][1] += accepted
        return None

    def counts(self, seq):
        drafted, accepted = self.totals.pop(seq, (0, 0))
        return {"drafted_tokens": drafted, "accepted_tokens": accepted}


def answers(core, requests):
    """Submit ``requests`` together and run ``core`` dry: each one's tokens and Finished."""
    rids = [core.submit(r) for r in requests]
    tokens = {rid: [] for rid in rids}
    finals = {}
    for event in core.run():
        if isinstance(event, TokenGenerated):
            tokens[event.request_id].append(event.token_id)
        elif isinstance(event, Finished):
            finals[event.request_id] = event
    return [tokens[rid] for rid in rids], [finals[rid] for rid in rids]


def solo(loaded, request):
    return [e.token_id for e in generate(loaded, request) if isinstance(e, TokenGenerated)]


def greedy(text, n=24):
    return GenerationRequest(text, mode="raw", max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("precision", ["fp32", "fp32-fast"])
def test_any_proposers_guesses_leave_the_targets_own_answer(tiny_llama, precision):
    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    requests = [greedy(text) for text in CORPUS[:3]]
    expected = [solo(loaded, r) for r in requests]

    scripted = Scripted()
    core = EngineCore(loaded, CoreSettings(token_budget=64), proposer=scripted)
    for rid, (request, answer) in enumerate(zip(requests, expected), start=1):
        scripted.scripts[rid] = answer
        scripted.prompts[rid] = len(loaded.encode(request))
    tokens, finals = answers(core, requests)
    assert tokens == expected
    # right guesses are kept, every wrong one is rejected, so some but not all are accepted
    assert all(0 < f.accepted_tokens < f.drafted_tokens for f in finals)
    assert sum(f.drafted_tokens for f in finals) == scripted.made
    assert not scripted.held and len(core.runner) == 0

    wrong = Scripted()  # token 0 every time: (almost) nothing accepted, the same answers
    tokens, finals = answers(EngineCore(loaded, CoreSettings(token_budget=64), proposer=wrong), requests)
    assert tokens == expected
    assert all(0 < f.drafted_tokens and f.accepted_tokens < f.drafted_tokens for f in finals)


def test_the_batch_sampler_gives_each_request_its_solo_tokens(loaded_llama):
    """Greedy, greedy with a penalty and seeded sampling in one batch: each as alone."""
    requests = [
        greedy(CORPUS[0]),
        GenerationRequest(CORPUS[1], mode="raw", max_new_tokens=24, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3)),
        GenerationRequest(CORPUS[2], mode="raw", max_new_tokens=24, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.9, top_k=20, seed=7)),
        GenerationRequest(CORPUS[3], mode="raw", max_new_tokens=24, ignore_eos=True,
                          sampling=SamplingParams(temperature=1.2, top_p=0.9, seed=8)),
    ]
    expected = [solo(loaded_llama, r) for r in requests]
    tokens, _ = answers(EngineCore(loaded_llama, CoreSettings(token_budget=64)), requests)
    assert tokens == expected


def test_a_proposer_that_fails_ends_its_request_alone(loaded_llama):
    class Failing(Scripted):
        def propose(self, seq, sampler, committed, room):
            if seq == 2 and len(committed) > self.prompts[seq] + 3:
                raise RuntimeError("the draft failed")
            return super().propose(seq, sampler, committed, room)

    requests = [greedy(text) for text in CORPUS[:3]]
    expected = [solo(loaded_llama, r) for r in requests]
    proposer = Failing()
    proposer.prompts = {rid: len(loaded_llama.encode(r)) for rid, r in enumerate(requests, start=1)}
    tokens, finals = answers(EngineCore(loaded_llama, CoreSettings(token_budget=64), proposer=proposer), requests)
    assert finals[1].reason == "error" and "the draft failed" in finals[1].error
    assert tokens[1] == expected[1][:len(tokens[1])]
    assert [tokens[0], tokens[2]] == [expected[0], expected[2]]
    assert not proposer.held


# -- the model's core lent to its other clients ------------------------------------------------
def chat_turn(text):
    return GenerationRequest("You are a terse assistant. Answer in one line. " + text, mode="raw",
                             max_new_tokens=8, ignore_eos=True)


def test_a_batch_sweep_borrows_the_models_core_and_gives_it_back(loaded_llama):
    from engine.measure.sweep import run_sweep

    service = kept_service(loaded_llama)
    core = service.core
    before = core.settings
    list(generate(loaded_llama, chat_turn("What is a token?"), service=service))
    kept, kept_bytes = core.kv.kept_blocks, core.kept_bytes()
    assert kept > 0

    points, skipped = run_sweep(loaded_llama, greedy(CORPUS[0], 8), [1, 3], service=service, with_ceiling=False,
                                available=lambda: None)
    assert [p.batch for p in points] == [1, 3] and not skipped
    assert all(p.generated_tokens == 8 * p.batch for p in points)
    assert core.idle and core.settings == before and type(core.proposer) is Proposer
    assert (core.kv.kept_blocks, core.kept_bytes()) == (kept, kept_bytes)  # the sweep's prompts kept nothing
    assert len(core.runner) == 0
    again = [e for e in generate(loaded_llama, chat_turn("What is a KV cache?"), service=service)
             if isinstance(e, Finished)][0]
    assert again.cached_tokens > 0  # the window's chat still finds its prefix


def test_a_speculative_run_borrows_the_models_core_and_gives_it_back(loaded_llama):
    from engine.generation.speculative import DraftSpec, load_draft, stream_speculative
    from engine.measure.speculative_run import speculative_report

    draft = load_draft(DraftSpec("early-exit", layers=1), loaded_llama)
    service = kept_service(loaded_llama)
    core = service.core
    before = core.settings
    list(generate(loaded_llama, chat_turn("What is a token?"), service=service))
    kept = core.kv.kept_blocks

    request = greedy(CORPUS[1])
    report = speculative_report(loaded_llama, draft, request, 3, compare_plain=True, service=service)
    assert report.same_tokens_as_plain and report.drafted_tokens > 0
    assert report.finished.cached_tokens == 0 and report.plain.finished.cached_tokens == 0  # both computed cold
    assert list(report.finished.token_ids) == solo(loaded_llama, request)
    assert core.idle and core.settings == before and type(core.proposer) is Proposer
    assert core.kv.kept_blocks >= kept and len(core.runner) == 0

    # a run abandoned half-way (the consumer stops reading) leaves the core idle and plain
    stream = stream_speculative(loaded_llama, draft, greedy(CORPUS[2], 40), 3, CancelToken(), service=service)
    seen = 0
    for event in stream:
        seen += isinstance(event, DraftVerified)
        if seen == 2:
            break
    stream.close()
    assert seen == 2 and core.idle and type(core.proposer) is Proposer and len(core.runner) == 0
    after = [e for e in generate(loaded_llama, greedy(CORPUS[2]), service=service) if isinstance(e, TokenGenerated)]
    assert [e.token_id for e in after] == solo(loaded_llama, greedy(CORPUS[2]))
    assert all(e.drafted is None for e in after)  # plain decoding again


def test_a_busy_core_is_not_lent(loaded_llama):
    from engine.base.errors import EngineError

    service = kept_service(loaded_llama)
    events = service.answer(greedy(CORPUS[0]))  # taken into the core now
    with pytest.raises(EngineError, match="busy"):
        with service.borrowed(CoreSettings(max_batch=4)):
            pass
    assert [e for e in events if isinstance(e, Finished)][0].reason == "length"


def test_a_batch_through_the_core_equals_the_batch_on_its_own(loaded_llama):
    from engine.measure.batch import stream_batch

    prompts = [loaded_llama.encode(greedy(text)) for text in CORPUS[:3]]
    own = [e for e in stream_batch(loaded_llama, greedy(CORPUS[0], 10), prompts) if isinstance(e, BatchFinished)][0]
    service = kept_service(loaded_llama)
    core = service.core
    lent = [e for e in stream_batch(loaded_llama, greedy(CORPUS[0], 10), prompts, service=service)
            if isinstance(e, BatchFinished)][0]
    assert [s.token_ids for s in lent.sequences] == [s.token_ids for s in own.sequences]
    assert lent.kv_cache_bytes == own.kv_cache_bytes and lent.generated_tokens == 30
    assert core.idle and len(core.runner) == 0
