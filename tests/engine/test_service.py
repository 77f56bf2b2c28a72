"""The engine service: every client's one way into a loaded model's core, stepped by a server's
thread or by the client itself as it reads its events."""

from __future__ import annotations

import pytest

from engine.base.errors import InvalidRequestError, NonFiniteError, RequestFailedError, request_failed
from engine.base.events import Finished, TokenGenerated
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.generation.core import CoreSettings
from engine.generation.service import EngineService
from tests.tiny import CORPUS


def greedy(prompt: str, tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(prompt, mode="raw", max_new_tokens=tokens, ignore_eos=True,
                             sampling=SamplingParams(temperature=0.0))


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenGenerated)]


def alone(loaded, request, steps: list | None = None) -> list[int]:
    """``request``'s tokens in a service of its own (``steps``: gets the steps it took)."""
    service = EngineService(loaded, CoreSettings(max_batch=1))
    tokens = tokens_of(service.answer(request))
    if steps is not None:
        steps.append(service.core.steps)
    return tokens


def test_clients_on_one_thread_share_the_steps_and_each_gets_its_own_answer(loaded_llama):
    requests = [greedy(text) for text in CORPUS[:3]]
    service = EngineService(loaded_llama, CoreSettings(max_batch=4))
    answers = [service.answer(r) for r in requests]  # taken into the core now, none stepped yet
    read = [list(a) for a in answers]  # the first reader steps for all three
    solo_steps: list[int] = []
    assert [tokens_of(a) for a in read] == [alone(loaded_llama, r, solo_steps) for r in requests]
    assert max(solo_steps) <= service.core.steps < sum(solo_steps)  # the steps were shared
    assert all(isinstance(a[-1], Finished) for a in read) and service.core.idle


def test_a_reader_that_leaves_mid_answer_ends_its_request_and_loses_no_one_elses(loaded_llama):
    service = EngineService(loaded_llama, CoreSettings(max_batch=4))
    left, stays = service.answer(greedy(CORPUS[0], 12)), service.answer(greedy(CORPUS[1]))
    for event in left:
        if isinstance(event, TokenGenerated):
            break  # mid-step: the step is finished for the other request
    left.close()
    assert tokens_of(stays) == alone(loaded_llama, greedy(CORPUS[1]))
    assert service.core.idle and service.in_flight == 0


def test_a_bad_request_is_refused_at_once_and_a_failed_one_raises_with_its_run(loaded_llama, monkeypatch):
    service = EngineService(loaded_llama, CoreSettings(max_batch=2))
    with pytest.raises(InvalidRequestError):
        service.answer(greedy("fox " * 4 * loaded_llama.info.context_length))
    runner = service.core.runner
    decode = runner.decode

    def broken(*args):
        if service.core.steps >= 3:
            raise RuntimeError("a broken step")
        return decode(*args)

    monkeypatch.setattr(runner, "decode", broken)
    with pytest.raises(RequestFailedError, match="a broken step") as caught:
        list(service.answer(greedy(CORPUS[0], 12)))
    assert caught.value.finished.reason == "error" and not isinstance(caught.value, NonFiniteError)
    monkeypatch.undo()
    assert tokens_of(service.answer(greedy(CORPUS[0]))) == alone(loaded_llama, greedy(CORPUS[0]))  # a fresh core


def test_one_error_shape_names_scores_that_stopped_being_finite():
    from engine.base.errors import non_finite_message

    from engine.generation.decoding import failed_event

    nan = failed_event(1, non_finite_message("fp16", "m", 2), tokens=2)
    other = failed_event(2, "The engine failed: boom")
    assert isinstance(request_failed(nan), NonFiniteError) and request_failed(nan).finished is nan
    assert type(request_failed(other)) is RequestFailedError and str(request_failed(other)) == other.error


def test_answers_read_in_turn_one_event_each_stay_right(loaded_llama):
    """Two readers on one thread taking turns, an event each: a step one of them paused runs to its
    end before the other steps, so neither answer loses or repeats a token."""
    requests = [greedy(CORPUS[0], 10), greedy(CORPUS[1], 7)]
    service = EngineService(loaded_llama, CoreSettings(max_batch=4))
    readers = [service.answer(r) for r in requests]
    read: list[list] = [[], []]
    while readers[0] is not None or readers[1] is not None:
        for i, reader in enumerate(readers):
            if reader is not None:
                event = next(reader, None)
                if event is None:
                    readers[i] = None
                else:
                    read[i].append(event)
    assert [tokens_of(r) for r in read] == [alone(loaded_llama, r) for r in requests]
    assert service.core.idle and service.ready
