"""One model's job queue: jobs submitted together run one at a time, in order, each ending once
with its events complete; a waiting job can be cancelled; the session says what runs and waits."""

from engine.base.events import BatchStep, Finished, Prefilled, TokenGenerated
from engine.jobs import ScoreJob, Scored, SweepJob, SweepResult, Tagged, TokenizeJob, Tokenized
from engine.models.loading import LoadRequest
from engine.base.request import GenerationRequest
from engine.measure.sweep import SweepPoint


def _session(qtbot, tiny_llama):
    from app.worker import ModelSession

    session = ModelSession("test")
    with qtbot.waitSignal(session.loaded, timeout=60_000):
        session.load(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    return session


def _record(session):
    log = []
    session.job_started.connect(lambda job: log.append(("started", job)))
    session.job_events.connect(lambda job, events: log.append(("events", job, events)))
    session.job_finished.connect(lambda job, result: log.append(("finished", job, result)))
    session.job_failed.connect(lambda job, exc: log.append(("failed", job, exc)))
    return log


def test_a_generation_a_comparison_and_a_sweep_queued_on_one_model(qtbot, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path))
    session = _session(qtbot, tiny_llama)
    log = _record(session)
    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=12, ignore_eos=True)
    sweep = SweepJob(GenerationRequest("fox", mode="raw", max_new_tokens=3, ignore_eos=True), (1, 2))
    # the window's prompt, a comparison lane's (its answer, then scoring), a sweep
    ids = [session.ask(request), session.ask(request), session.submit(ScoreJob(request, (5, 6, 7))),
           session.submit(sweep)]
    assert session.busy and session.waiting()[-3:] == ids[1:]
    with qtbot.waitSignal(session.job_finished, timeout=120_000, check_params_cb=lambda job, _: job == ids[-1]):
        pass
    assert not session.busy and session.running is None
    # started, then its events, then ended: each job once, one after another, in the order submitted
    order = [(entry[0], entry[1]) for entry in log if entry[0] != "events"]
    assert order == [(kind, job) for job in ids for kind in ("started", "finished")]
    for job_id in ids[:2]:  # a generation's events: the prompt read, then every token in order
        events = [e for entry in log if entry[0] == "events" and entry[1] == job_id for e in entry[2]]
        final = next(entry[2] for entry in log if entry[0] == "finished" and entry[1] == job_id)
        assert isinstance(events[0], Prefilled) and isinstance(final, Finished)
        tokens = [e for e in events[1:] if isinstance(e, TokenGenerated)]
        assert [t.index for t in tokens] == list(range(12)) and len(events) == 13
        assert tuple(t.token_id for t in tokens) == final.token_ids
    scored = next(entry[2] for entry in log if entry[0] == "finished" and entry[1] == ids[2])
    assert isinstance(scored, Scored) and len(scored.logprobs) == 3
    result = next(entry[2] for entry in log if entry[0] == "finished" and entry[1] == ids[3])
    assert isinstance(result, SweepResult) and [p.batch for p in result.points] == [1, 2]
    sweep_events = [e for entry in log if entry[0] == "events" and entry[1] == ids[3] for e in entry[2]]
    assert [e for e in sweep_events if isinstance(e, SweepPoint)] == list(result.points)
    steps = [e for e in sweep_events if isinstance(e, Tagged)]
    assert all(isinstance(e.event, BatchStep) for e in steps) and {e.tag for e in steps} == {1, 2}
    assert session.shutdown()


def test_a_new_kind_of_job_runs_through_the_same_queue(qtbot, tiny_llama):
    session = _session(qtbot, tiny_llama)
    request = GenerationRequest("The quick brown fox", mode="raw")
    job = session.submit(TokenizeJob(request))
    assert session.describe(job) == "tokenizing"
    with qtbot.waitSignal(session.job_finished, timeout=30_000) as blocker:
        pass
    job_id, result = blocker.args
    assert job_id == job and isinstance(result, Tokenized)
    assert "".join(result.pieces) == "The quick brown fox" and len(result.token_ids) == len(result.pieces) > 1
    assert session.shutdown()


def test_a_cancelled_waiting_job_ends_without_running_and_the_next_one_runs(qtbot, tiny_llama):
    session = _session(qtbot, tiny_llama)
    log = _record(session)
    long = GenerationRequest("fox", mode="raw", max_new_tokens=100_000, ignore_eos=True)
    short = GenerationRequest("fox", mode="raw", max_new_tokens=3, ignore_eos=True)
    first, second, third = (session.ask(r) for r in (long, short, short))
    qtbot.waitUntil(lambda: session.running == first, timeout=30_000)
    assert session.describe(first) == "generation" and session.waiting() == [second, third]
    session.cancel(second)
    session.cancel(first)
    with qtbot.waitSignal(session.job_finished, timeout=60_000, check_params_cb=lambda job, _: job == third):
        pass
    results = {entry[1]: entry[2] for entry in log if entry[0] == "finished"}
    assert results[first].reason == "cancelled"
    assert results[second].reason == "cancelled" and results[second].tokens == 0
    assert results[third].reason == "length" and results[third].tokens == 3
    assert session.shutdown()


def test_a_job_without_a_model_fails_with_a_message(qtbot):
    from app.worker import ModelSession

    session = ModelSession("empty")
    with qtbot.waitSignal(session.job_failed, timeout=10_000) as blocker:
        job = session.submit(TokenizeJob(GenerationRequest("fox", mode="raw")))
    assert blocker.args[0] == job and "No model is loaded" in str(blocker.args[1])
    assert not session.busy
    assert session.shutdown()


def test_background_work_is_handed_back_on_the_gui_thread_below_its_priority(qtbot):
    import os
    import sys
    import threading

    from app.background import Background

    background = Background()
    seen = []

    def work():
        tid = threading.get_native_id()
        return tid, os.getpriority(os.PRIO_PROCESS, tid) if sys.platform.startswith("linux") else None

    with qtbot.waitSignal(background._delivered, timeout=10_000):
        background.submit(work, lambda result: seen.append((threading.get_native_id(), result)))
    qtbot.waitUntil(lambda: bool(seen))
    [(delivered_on, (worked_on, nice))] = seen
    assert delivered_on == threading.get_native_id() != worked_on  # worked off the GUI thread, delivered on it
    if sys.platform.startswith("linux"):
        gui = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert nice > gui  # scheduled below the GUI thread
    failures = []
    with qtbot.waitSignal(background._delivered, timeout=10_000):
        background.submit(lambda: 1 / 0, seen.append, failures.append)
    qtbot.waitUntil(lambda: bool(failures))
    assert isinstance(failures[0], ZeroDivisionError)
    background.close()


def test_the_engine_thread_is_scheduled_below_the_gui_thread(qtbot, tiny_llama):
    import os
    import sys
    import threading

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")
    session = _session(qtbot, tiny_llama)
    worker = session.worker.niced_thread
    assert worker != threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, worker) > os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert session.shutdown()


def test_the_session_keeps_its_queue_in_the_gui_thread(qtbot, tiny_llama, monkeypatch):
    """A job's end is booked (queue, running job, re-emitted signals) in the GUI thread, not in the
    worker's (PySide runs a lambda connected across threads in the emitting thread)."""
    import threading

    session = _session(qtbot, tiny_llama)
    booked = []
    ended = session._on_ended
    monkeypatch.setattr(session, "_on_ended", lambda *args: (booked.append(threading.current_thread()),
                                                              ended(*args)))
    with qtbot.waitSignal(session.job_finished, timeout=60_000):
        session.submit(TokenizeJob(GenerationRequest("fox", mode="raw")))
    assert booked == [threading.main_thread()] and not session.busy
    session.shutdown()


def test_an_asked_prompt_waits_behind_a_sweep_and_is_never_taken_into_its_batch(qtbot, tiny_llama, tmp_path,
                                                                                monkeypatch):
    """A prompt asked while a sweep holds the model's engine service on loan waits at the door, is
    seen waiting as its job, and is answered alone once the sweep ends: the sweep's batches hold
    its own requests only."""
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path))
    session = _session(qtbot, tiny_llama)
    log = _record(session)
    sweep = session.submit(SweepJob(GenerationRequest("fox", mode="raw", max_new_tokens=3, ignore_eos=True), (1, 2)))
    asked = session.ask(GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=5, ignore_eos=True))
    assert session.waiting()[-1] == asked and session.describe(asked) == "generation"
    with qtbot.waitSignal(session.job_finished, timeout=120_000, check_params_cb=lambda job, _: job == asked):
        pass
    order = [(entry[0], entry[1]) for entry in log if entry[0] != "events"]
    assert order == [("started", sweep), ("finished", sweep), ("started", asked), ("finished", asked)]
    steps = [e for entry in log if entry[0] == "events" and entry[1] == sweep for e in entry[2]
             if isinstance(e, Tagged) and isinstance(e.event, BatchStep)]
    assert {e.tag for e in steps} == {1, 2} and all(len(e.event.token_ids) == e.tag for e in steps)
    final = next(entry[2] for entry in log if entry[0] == "finished" and entry[1] == asked)
    events = [e for entry in log if entry[0] == "events" and entry[1] == asked for e in entry[2]]
    assert isinstance(final, Finished) and final.reason == "length" and final.tokens == 5
    assert isinstance(events[0], Prefilled) and [e.index for e in events[1:]] == list(range(5))
    assert final.activation_bytes is not None and final.activation_bytes > 0  # read from the allocator
    assert not session.busy and not session.door.waiting()
    assert session.shutdown()


def test_an_asked_prompt_whose_job_breaks_fails_with_why_and_the_next_is_answered(qtbot, tiny_llama, monkeypatch):
    from engine.generation.service import EngineService

    session = _session(qtbot, tiny_llama)
    turn = EngineService.turn
    monkeypatch.setattr(EngineService, "turn", lambda self, watch=False: 1 / 0)
    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=4, ignore_eos=True)
    with qtbot.waitSignal(session.job_failed, timeout=60_000) as blocker:
        asked = session.ask(request)
    assert blocker.args[0] == asked and "ZeroDivisionError" in str(blocker.args[1])
    qtbot.waitUntil(lambda: not session.busy, timeout=10_000)
    monkeypatch.setattr(EngineService, "turn", turn)
    with qtbot.waitSignal(session.job_finished, timeout=60_000) as blocker:
        again = session.ask(request)
    assert blocker.args[0] == again and blocker.args[1].tokens == 4  # a fresh service took it
    assert session.shutdown()


def test_a_prompt_asked_without_a_model_fails_with_a_message_and_is_not_kept(qtbot):
    from app.worker import ModelSession

    session = ModelSession("empty")
    with qtbot.waitSignal(session.job_failed, timeout=10_000) as blocker:
        asked = session.ask(GenerationRequest("fox", mode="raw"))
    assert blocker.args[0] == asked and "No model is loaded" in str(blocker.args[1])
    qtbot.waitUntil(lambda: not session.busy, timeout=10_000)
    assert not session.door.waiting() and not session._asked  # nothing left to be answered by a later job
    assert session.shutdown()
