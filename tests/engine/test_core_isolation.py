"""Whatever goes wrong with one request in the engine core ends that request alone: the others
in the batch get exactly their solo answers, and the core takes new requests afterwards."""

from __future__ import annotations

import pytest
import torch

from engine.base.events import Finished, TokenGenerated
from engine.generation import core as core_module
from engine.generation import output as output_module
from engine.generation.core import CoreSettings, EngineCore
from engine.generation.detokenize import IncrementalDetokenizer
from engine.base.sampling import SamplingParams
from engine.base.request import GenerationRequest
from tests.tiny import CORPUS
from engine.generation.generate import generate

GREEDY = SamplingParams(temperature=0.0)
VICTIM_SEED = 4242


def request(prompt: str, seed: int | None = None, stop: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(prompt, mode="raw", sampling=SamplingParams(temperature=0.0, seed=seed),
                             max_new_tokens=10, ignore_eos=True, stop=stop, top_alternatives=0)


def solo(loaded, req: GenerationRequest) -> list[int]:
    return [e.token_id for e in generate(loaded, req) if isinstance(e, TokenGenerated)]


class Boom(RuntimeError):
    pass


def _inject_sampler(monkeypatch, core, victim):
    real = core_module.make_sampler

    def make_sampler(params, device):
        sampler = real(params, device)
        if params.seed != VICTIM_SEED:
            return sampler

        class Failing(type(sampler)):
            def __call__(self, scores, seen):
                if len(seen) > len(victim.prompt) + 2:  # fails at its fourth token, mid-answer
                    raise Boom("sampling failed")
                return super().__call__(scores, seen)
        sampler.__class__ = Failing
        sampler.plain_greedy = False  # picked by calling it, not from the batch's argmax
        return sampler
    monkeypatch.setattr(core_module, "make_sampler", make_sampler)


def _inject_detokenizer(monkeypatch, core, victim):
    made = []

    class Detokenizer(IncrementalDetokenizer):
        def __init__(self, tokenizer):
            super().__init__(tokenizer)
            made.append(self)
            self.victim = len(made) == victim.order + 1  # admitted in submission order

        def add(self, token):
            if self.victim and len(self.text) > 3:
                raise Boom("detokenizing failed")
            return super().add(token)
    monkeypatch.setattr(output_module, "IncrementalDetokenizer", Detokenizer)


def _inject_stop(monkeypatch, core, victim):
    real = output_module.stop_reason

    def stop_reason(token, piece, text, request, *rest):
        if "VICTIM" in request.stop and len(text) > 2:
            raise Boom("stop handling failed")
        return real(token, piece, text, request, *rest)
    monkeypatch.setattr(output_module, "stop_reason", stop_reason)


def _inject_nan(monkeypatch, core, victim):
    real = core.runner.decode

    def decode(seqs, tokens):
        out = real(seqs, tokens).clone()
        if victim.rid in seqs:
            out[seqs.index(victim.rid)] = float("nan")
        return out
    monkeypatch.setattr(core.runner, "decode", decode)


def _inject_prefill(monkeypatch, core, victim):
    real = core.runner.prefill

    def prefill(seq, ids, *rest):
        if seq == victim.rid and ids.shape[1] and ids[0, 0] >= 0:
            raise Boom("prefill failed")
        return real(seq, ids, *rest)
    monkeypatch.setattr(core.runner, "prefill", prefill)


def _inject_admission(monkeypatch, core, victim):
    real = core.runner.add

    def add(seq, tokens=0, **hopes):
        if seq == victim.rid:
            raise Boom("admission failed")
        return real(seq, tokens, **hopes)
    monkeypatch.setattr(core.runner, "add", add)


INJECTIONS = {"sampling": _inject_sampler, "detokenizing": _inject_detokenizer, "stop handling": _inject_stop,
              "NaN scores": _inject_nan, "prompt chunk": _inject_prefill, "admission": _inject_admission}


class _Victim:
    rid: int = -1
    order: int = 0
    prompt: list[int] = []


@pytest.mark.parametrize("where", list(INJECTIONS))
def test_a_failure_in_one_request_ends_it_alone(loaded_llama, monkeypatch, where):
    others = [request(p) for p in CORPUS[:3]]
    expected = [solo(loaded_llama, r) for r in others]
    core = EngineCore(loaded_llama, CoreSettings(token_budget=32, prefill_chunk=8, max_batch=8))
    victim = _Victim()
    victim.order = 1
    bad = request(CORPUS[4], seed=VICTIM_SEED, stop=("VICTIM",))
    rids = [core.submit(others[0])]
    victim.rid = core.submit(bad)
    victim.prompt = core.waiting[-1].prompt
    rids += [core.submit(r) for r in others[1:]]
    INJECTIONS[where](monkeypatch, core, victim)

    tokens: dict[int, list[int]] = {rid: [] for rid in [*rids, victim.rid]}
    finals: dict[int, Finished] = {}
    for _ in range(200):
        if core.idle:
            break
        for event in core.step():
            if isinstance(event, TokenGenerated):
                tokens[event.request_id].append(event.token_id)
            elif isinstance(event, Finished):
                finals[event.request_id] = event
    assert core.idle, "the core did not finish"

    assert finals[victim.rid].reason == "error"
    if where == "NaN scores":
        assert "NaN" in finals[victim.rid].error
    else:
        assert "Boom" in finals[victim.rid].error
    assert [tokens[rid] for rid in rids] == expected
    assert [finals[rid].reason for rid in rids] == ["length"] * 3
    assert core.kv.used_blocks == 0 and len(core.runner) == 0 and core.kv_bytes() == 0

    monkeypatch.undo()  # the same core takes the next request and answers it as alone
    again = request(CORPUS[5])
    rid = core.submit(again)
    after = [e.token_id for e in core.run() if isinstance(e, TokenGenerated) and e.request_id == rid]
    assert after == solo(loaded_llama, again)


def test_an_out_of_memory_error_is_everyones(loaded_llama, monkeypatch):
    """Running out of memory is not one request's fault: the step raises, for the service to end
    every request (engine/generation/service.py)."""
    core = EngineCore(loaded_llama, CoreSettings(token_budget=32, max_batch=8))
    core.submit(request(CORPUS[0]))

    def prefill(seq, ids, *rest):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(core.runner, "prefill", prefill)
    with pytest.raises(torch.OutOfMemoryError):
        core.step()


def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(loaded_llama):
    from engine.base.errors import InvalidRequestError

    core = EngineCore(loaded_llama)
    vocab = loaded_llama.vocab_size
    for ids in ([vocab], [-5, 3], [3, vocab + 10]):
        with pytest.raises(InvalidRequestError, match="not a token of"):
            core.submit(request("ids"), prompt_ids=ids)
    assert core.idle
    core.submit(request("ids"), prompt_ids=[vocab - 1, 0])  # the vocabulary's last id is one
    assert len(core.waiting) == 1
