"""The window's prompts: asked at the model's door, answered by a job of their own through the
model's engine service, or straight into a running server's batch."""

import time

from engine.base.cancel import CancelToken
from engine.base.events import Finished, Prefilled, TokenGenerated
from engine.base.request import GenerationRequest
from engine.generation.generate import generate
from engine.generation.service import Accepted, EngineService
from engine.jobs import JobContext, Tagged
from engine.prompts import Failed, PromptDoor, PromptJob


def _request(tokens: int = 5) -> GenerationRequest:
    return GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=tokens, ignore_eos=True)


def test_a_closed_door_keeps_a_prompt_for_its_job_which_answers_it_as_generate_does(loaded_llama):
    door = PromptDoor()
    prompt, waits = door.ask(_request(), CancelToken())
    assert waits and door.waiting() == {prompt.tag}
    alone = list(generate(loaded_llama, _request()))[-1]  # meanwhile another job: not the prompt's time
    emitted = []
    ctx = JobContext(loaded_llama, CancelToken(), emitted.append, {}, door)
    started = time.perf_counter()
    assert PromptJob(prompt).run(ctx) is True
    assert not door.waiting() and PromptJob(prompt).run(ctx) is False  # taken once
    assert all(isinstance(e, Tagged) and e.tag == prompt.tag for e in emitted)
    events = [e.event for e in emitted if not isinstance(e.event, Accepted)]
    finished = events[-1]
    assert isinstance(events[0], Prefilled) and isinstance(finished, Finished) and finished.reason == "length"
    assert [e.index for e in events if isinstance(e, TokenGenerated)] == list(range(5))
    assert finished.total_s <= time.perf_counter() - started  # its clock started when the job took it
    assert finished.token_ids == alone.token_ids
    assert finished.activation_bytes == loaded_llama.decode_activations  # a decode step's, as generate() says
    assert ctx.keep["service"].ready  # the model's service, kept for the next prompt


def test_a_dropped_prompt_is_not_answered(loaded_llama):
    door = PromptDoor()
    prompt, _ = door.ask(_request(), CancelToken())
    door.drop(prompt.tag)
    emitted = []
    assert PromptJob(prompt).run(JobContext(loaded_llama, CancelToken(), emitted.append, {}, door)) is False
    assert emitted == []


def test_an_open_door_sends_a_prompt_into_the_servers_service_and_a_stopping_one_keeps_it(loaded_llama):
    door = PromptDoor()
    service = EngineService(loaded_llama)
    emitted = []
    door.open(service, emitted.append)
    prompt, waits = door.ask(_request(3), CancelToken())
    assert not waits and service.in_flight == 1 and not door.waiting()
    while service.in_flight:
        service.turn()
    assert isinstance(emitted[-1], Tagged) and emitted[-1].tag == prompt.tag
    assert isinstance(emitted[-1].event, Finished) and emitted[-1].event.tokens == 3
    service.stop()  # the server stops taking requests: a prompt asked now waits for its own job
    later, waits = door.ask(_request(3), CancelToken())
    assert waits and door.waiting() == {later.tag}
    door.close()
    assert not door.is_open


def test_a_prompt_whose_job_breaks_hears_why(loaded_llama, monkeypatch):
    door = PromptDoor()
    prompt, _ = door.ask(_request(), CancelToken())
    monkeypatch.setattr(EngineService, "turn", lambda self, watch=False: 1 / 0)
    emitted = []
    ctx = JobContext(loaded_llama, CancelToken(), emitted.append, {}, door)
    try:
        PromptJob(prompt).run(ctx)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the job's failure was swallowed")
    failed = emitted[-1].event
    assert isinstance(failed, Failed) and "ZeroDivisionError" in str(failed.error)
    assert "service" not in ctx.keep  # a service left mid-request is not kept for the next prompt
