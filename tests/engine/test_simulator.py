"""The serving simulator against schedules worked out by hand, and against the engine core itself:
the same requests, the same limits, the same steps."""

import pytest

from engine.base.errors import InvalidRequestError
from engine.base.events import STEP_PARTS
from engine.estimates.predict_load import served_speed
from engine.estimates.simulator import (EngineLimits, ServingSimulator, SimRequest, Workload, closed_loop, open_loop,
                                        simulate)
from engine.estimates.step_cost import FEATURES, StepCost, StepSample, fit

SECOND_A_STEP = StepCost(1.0, 0.0, 0.1, 0.0, 0.0, 0.01, 0.0)
"""1 s a step, 0.1 s a decode row, 0.01 s a prompt token: times that add up by hand."""


def _times(result) -> list[float]:
    return [round(t, 6) for t in result.chunk_times_s]


def test_one_request_reads_its_prompt_in_chunks_then_decodes_a_token_a_step():
    workload = Workload((SimRequest(prompt_tokens=40, output_tokens=5),))
    limits = EngineLimits(max_batch=4, token_budget=32, prefill_chunk=32)
    run = simulate(workload, limits, SECOND_A_STEP, trace=True)
    # 32 prompt tokens (1.32 s), the other 8 and the first token (1.08 s), then 1.1 s a token
    assert run.shapes == [(0, 32, 0, 32 * 16.5, 0, 1), (0, 8, 0, 8 * (32 + 4.5), 0, 1),
                          (1, 0, 41, 0, 0, 0), (1, 0, 42, 0, 0, 0), (1, 0, 43, 0, 0, 0), (1, 0, 44, 0, 0, 0)]
    [result] = run.results
    assert _times(result) == [2.4, 3.5, 4.6, 5.7, 6.8]
    assert result.ttft_s == pytest.approx(2.4) and result.e2e_s == pytest.approx(6.8)
    assert result.tpot_s == pytest.approx(1.1) and run.steps == 6 and run.preemptions == 0
    assert run.summary.output_throughput == pytest.approx(5 / 6.8)
    assert run.prompt_steps == [2]


def test_two_requests_share_their_steps():
    workload = Workload((SimRequest(8, 3), SimRequest(8, 2)))
    run = simulate(workload, EngineLimits(max_batch=4, token_budget=32, prefill_chunk=32), SECOND_A_STEP)
    first, second = run.results
    # both prompts in one step (1 + 0.16 s), then both decode (1 + 0.2 s), then the first alone (1.1 s)
    assert _times(first) == [1.16, 2.36, 3.46] and _times(second) == [1.16, 2.36]
    assert run.prompt_steps == [1, 1]
    assert run.steps == 3 and run.summary.ttft["median"] == pytest.approx(1.16)
    assert [(m.running, m.waiting) for m in run.timeline] == [(2, 0), (1, 0), (0, 0)]


def test_a_full_batch_makes_the_next_request_wait():
    workload = Workload((SimRequest(8, 2), SimRequest(8, 2), SimRequest(8, 2)))
    run = simulate(workload, EngineLimits(max_batch=2, token_budget=32, prefill_chunk=32), SECOND_A_STEP)
    third = run.results[2]
    # admitted once the first two end (t = 2.36), then its prompt (1.08 s) and one decode step (1.1 s)
    assert _times(third) == [3.44, 4.54] and third.ttft_s == pytest.approx(3.44)


def test_a_request_preempted_when_blocks_run_out_is_computed_again_later():
    """Three blocks of 16 tokens for two requests of 8 + 20 tokens: at their 17th cache token the
    older takes the last block and the newer is preempted; it comes back when the older ends,
    reads its prompt and 9 tokens again in one chunk, and goes on."""
    workload = Workload((SimRequest(8, 20), SimRequest(8, 20)))
    limits = EngineLimits(max_batch=2, token_budget=64, prefill_chunk=64, kv_blocks=3, prefix_caching=False)
    one_second = StepCost(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    run = simulate(workload, limits, one_second, trace=True)
    older, newer = run.results
    assert _times(older) == [float(t) for t in range(1, 21)]
    assert _times(newer) == [*map(float, range(1, 10)), *map(float, range(21, 32))]
    assert run.preemptions == 1 and [shape[4] for shape in run.shapes].index(1) == 9  # the 10th step
    assert run.shapes[20][:2] == (0, 17)  # its feed again: the prompt and the 9 tokens it had
    after = run.timeline[9]  # the older holds two blocks, the newer waits
    assert (after.running, after.waiting, after.kv_blocks, after.preemptions) == (1, 1, 2, 1)


def test_a_shared_prefix_is_read_once():
    """Two requests behind the same 64-token system prompt, the second sent after the first
    ended: it finds the four blocks in the prefix cache and reads only the rest."""
    workload = closed_loop(1, [80], [4], requests=2)
    shared = Workload(tuple(SimRequest(r.prompt_tokens, r.output_tokens, 0.0, 64) for r in workload.requests), 1)
    limits = EngineLimits(max_batch=4, token_budget=128, prefill_chunk=128, kv_blocks=64)
    run = simulate(shared, limits, SECOND_A_STEP, trace=True)
    assert run.cached_tokens == 64
    assert [shape[1] for shape in run.shapes if shape[1]] == [80, 16]
    assert run.results[1].start_s == pytest.approx(run.results[0].e2e_s)  # sent when the first ended


def test_an_open_loop_arrives_at_its_rate():
    workload = open_loop(4.0, [10, 20, 30], [5], requests=2000, seed=3)
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert arrivals[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # a mean gap of 1 / rate
    assert sorted({r.prompt_tokens for r in workload.requests}) == [10, 20, 30]


def test_a_deadline_cuts_what_is_in_flight_and_leaves_the_rest_unsent():
    """As the load generator ends a setting: what was sent and not finished by the deadline is
    cut (a request waiting for the full batch too), what was due after it is not sent, and a
    step that ends past the deadline gives nothing."""
    workload = Workload(tuple(SimRequest(8, 50, arrival_s=float(i)) for i in range(10)))
    run = simulate(workload, EngineLimits(max_batch=4), StepCost(0.1, 0, 0, 0, 0, 0, 0), max_duration_s=4.5)
    outcomes = [r.outcome for r in run.results]
    assert outcomes[:5] == ["cut"] * 5 and outcomes[5:] == ["not sent"] * 5  # 50 tokens take 5 s
    quick = Workload((SimRequest(8, 45, 0.0), SimRequest(8, 46, 0.0)))
    cut = simulate(quick, EngineLimits(max_batch=4), StepCost(0.1, 0, 0, 0, 0, 0, 0), max_duration_s=4.5)
    assert [r.outcome for r in cut.results] == ["completed", "cut"]  # its last token's step ends at 4.6 s
    assert cut.results[0].e2e_s == pytest.approx(4.5)


def test_a_request_too_long_for_the_kv_budget_is_refused():
    with pytest.raises(InvalidRequestError, match="doesn't fit"):
        simulate(Workload((SimRequest(100, 10),)), EngineLimits(kv_blocks=4), SECOND_A_STEP)


def test_ten_thousand_requests_are_simulated():
    """Big workloads finish (their speed is benchmarks/simulator.py's); every request completes."""
    workload = open_loop(20.0, [50, 200, 600], [32, 128], requests=10_000, seed=1)
    run = simulate(workload, EngineLimits(max_batch=16, token_budget=256, prefill_chunk=256, kv_blocks=2048),
                   StepCost(0.001, 0.02, 0.002, 1e-7, 0.001, 0.0002, 0.0))
    assert run.summary.completed == 10_000 and run.summary.output_throughput > 0


def test_the_step_cost_fit_finds_the_figures_it_was_made_from():
    truth = StepCost(0.0005, 0.004, 0.0006, 2e-7, 0.002, 0.00015, 1e-9, 0.006)
    shapes = [(1, 0, 0, 100, 0), (2, 0, 0, 300, 0), (4, 0, 0, 2000, 0), (8, 0, 0, 9000, 0), (16, 0, 0, 20000, 0),
              (0, 1, 128, 0, 8256), (1, 1, 64, 50, 4000), (4, 2, 100, 400, 30000), (0, 1, 512, 0, 131328),
              (16, 1, 112, 30000, 9000), (0, 3, 48, 0, 400), (3, 2, 20, 90, 210)]
    samples = [StepSample(*shape, truth.seconds(*shape)) for shape in shapes]
    got = fit(samples)
    for name in FEATURES:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert got.error == pytest.approx(0.0, abs=1e-9) and got.samples == len(shapes)
    # a server sums its steps' parts: the formula gives their seconds from the sums alone
    sums = [sum(column) for column in zip(*(sample.features() for sample in samples))]
    assert truth.total(sums) == pytest.approx(sum(sample.seconds for sample in samples), rel=1e-12)


def test_the_servers_own_steps_are_checked_against_the_timed_figures():
    """A server whose steps ran 1.25 times as long as the timed figures say: the factor found
    again from what its /metrics summed over them; none where the server doesn't count them."""
    timed = StepCost(0.0005, 0.004, 0.0006, 2e-7, 0.002, 0.00015, 1e-9, 0.006)
    one_user = [(1, 0, 0, 40 + i, 0) for i in range(30)] + [(0, 1, 40, 0, 820), (1, 1, 12, 70, 80)]
    samples = [StepSample(*shape, 1.25 * timed.seconds(*shape)) for shape in one_user]
    counted = (sum(s.seconds for s in samples), tuple(map(sum, zip(*(s.features() for s in samples)))))
    assert len(counted[1]) == len(STEP_PARTS) and served_speed(timed, counted) == pytest.approx(1.25)
    assert served_speed(timed, None) is None and served_speed(timed, (0.0, counted[1])) is None


def test_the_simulator_steps_as_the_engine_core_does(loaded_llama):
    """The same requests through the engine core (a tiny model) and the simulator, under a
    server's limits with a small KV budget: step for step the same decode rows, prompt tokens,
    cache tokens read, prompt pairs, preemptions and prompt chunks."""
    from engine.base.events import StepCompleted
    from engine.base.request import GenerationRequest
    from engine.generation.core import CoreSettings, EngineCore

    per_token = loaded_llama.info.kv_bytes_per_token
    settings = CoreSettings(token_budget=24, max_batch=3, prefill_chunk=16, kv_budget_bytes=7 * 16 * per_token,
                            prefix_caching=True)
    lengths = [(40, 12), (25, 30), (23, 20), (5, 8)]
    core = EngineCore(loaded_llama, settings)
    shared = list(range(5, 21))  # the first block shared by the first two prompts
    prompts = [shared + [100 + i] * (n - 16) if i < 2 else [200 + 7 * i + j for j in range(n)]
               for i, (n, _) in enumerate(lengths)]
    for ids, (_, out) in zip(prompts, lengths):
        request = GenerationRequest("(token ids)", mode="raw", max_new_tokens=out, ignore_eos=True, top_alternatives=0)
        core.submit(request, prompt_ids=ids)
    steps = []
    while not core.idle:
        steps += [e for e in core.step() if isinstance(e, StepCompleted)]
    engine = [(s.decode_tokens, s.prefill_tokens, s.kv_tokens_read, s.prompt_pairs, s.preempted, s.prompt_chunks)
              for s in steps]
    workload = Workload(tuple(SimRequest(n, out, 0.0, 16 if i < 2 else 0) for i, (n, out) in enumerate(lengths)))
    run = simulate(workload, EngineLimits.of(settings, per_token), SECOND_A_STEP, trace=True)
    assert run.shapes == engine
    assert sum(shape[4] for shape in engine) > 0  # the budget made it preempt: that path was compared too


def test_a_prompt_sent_again_is_found_in_the_cache_the_server_kept():
    """One simulator for two settings, as one server for two: the second finds the first's prompt
    in the prefix cache (its full blocks, leaving the last token to compute), and answers it as
    a greedy server does, the same way: its answer's blocks are cached already, not cached anew."""
    from engine.estimates.simulator import ServingSimulator

    ids = list(range(100, 140))  # 40 tokens: two full blocks and 8
    simulator = ServingSimulator(EngineLimits(max_batch=4, token_budget=64, prefill_chunk=64, kv_blocks=32),
                                 SECOND_A_STEP)
    first = simulator.run(closed_loop(1, [ids], [30], requests=1), trace=True)
    kept = simulator.kv.kept_blocks
    again = simulator.run(closed_loop(1, [ids], [30], requests=1), trace=True)
    assert first.cached_tokens == 0 and again.cached_tokens == 32
    assert first.shapes[0][1] == 40 and again.shapes[0][1] == 8
    assert again.results[0].ttft_s < first.results[0].ttft_s
    assert kept == 4 and simulator.kv.kept_blocks == 4  # 70 tokens: four full blocks, the same ones
    other = simulator.run(closed_loop(1, [list(range(200, 240))], [30], requests=1))
    assert other.cached_tokens == 0 and simulator.kv.kept_blocks == 8  # another prompt: another answer


def test_a_servers_front_end_adds_its_share_to_each_step():
    """A step's front-end share (its own, each token streamed in it) on the engine's clock, and
    each request's latency outside it, spent before the engine sees the request."""
    from dataclasses import replace

    from engine.estimates.step_cost import FrontEnd

    served = replace(SECOND_A_STEP, front=FrontEnd(step_s=0.5, token_s=0.1, request_s=1.0))
    run = simulate(Workload((SimRequest(8, 2),)), EngineLimits(token_budget=32, prefill_chunk=32), served)
    # seen by the engine 1 s after it was sent; its prompt: 1.08 s and the front end's 0.5 + 0.1 (its
    # first token); then 1.1 + 0.5 + 0.1
    assert _times(run.results[0]) == [2.68, 4.38]
    assert run.steps == 2 and run.timeline[-1].t == pytest.approx(4.38)
    kept = StepCost.from_dict(served.to_dict())
    assert kept == served


def test_each_request_draws_its_latency_outside_the_engine_from_the_measured_ones():
    """With the latencies measured one a request, each simulated request takes one of them, each
    as often as the others: the spread a client saw is kept (the same for the same workload), and
    a closed loop's user sends its next request once its answer has arrived."""
    from dataclasses import replace

    from engine.estimates.step_cost import FrontEnd

    served = replace(SECOND_A_STEP, front=FrontEnd(0.0, 0.0, 0.5, request_spread_s=(0.0, 0.0, 3.0)))
    workload = closed_loop(1, [8], [2], requests=30, seed=0)
    run = simulate(workload, EngineLimits(token_budget=32, prefill_chunk=32), served)
    extra = [round(r.ttft_s - 1.08, 6) for r in run.results]  # the prompt's step alone takes 1.08 s
    assert set(extra) == {0.0, 3.0} and extra.count(3.0) == 10
    assert len({i % 3 for i, x in enumerate(extra) if x == 3.0}) > 1  # shuffled, not the measured order over again
    assert all(round(r.e2e_s - r.ttft_s, 6) == 1.1 for r in run.results)  # the decode step, as without it
    waits = [b.start_s - (a.start_s + a.e2e_s) for a, b in zip(run.results, run.results[1:])]
    assert all(abs(w) < 1e-9 for w in waits)  # the next one leaves as the last one's answer arrives
    assert _times(simulate(workload, EngineLimits(token_budget=32, prefill_chunk=32), served).results[5]) == \
        _times(run.results[5])
    kept = StepCost.from_dict(served.to_dict())
    assert kept == served and "p90 3000.0 ms" in served.front.describe()


def test_a_request_arriving_with_others_in_flight_waits_longer_outside_the_server():
    """The client's part of a TTFT, measured at loads with different counts in flight, is drawn
    between them: a request sent while another runs reaches the engine what the line gives for
    one in flight over what it gives for none later (its HTTP side waits for a core), so that
    wait overlaps the step under way, and it takes the latency measured at one user on top."""
    from dataclasses import replace

    from engine.estimates.step_cost import FrontEnd

    front = FrontEnd(0.0, 0.0, 0.25, client_s=((0.0, 0.5), (2.0, 1.5), (6.0, 3.5)))
    assert [front.client_at(x) for x in (-1, 0, 1, 2, 4, 6, 9)] == [0.5, 0.5, 1.0, 1.5, 2.5, 3.5, 3.5]
    served = replace(SECOND_A_STEP, front=front)
    limits = EngineLimits(token_budget=32, prefill_chunk=32)
    # the first: its prompt's step ends at 1.08 s, its second token's at 2.18 s
    early = simulate(Workload((SimRequest(8, 2, arrival_s=0.0), SimRequest(8, 2, arrival_s=0.5))), limits, served)
    assert early.in_flight == [0, 1] and early.client_s == [0.5, 1.0]
    assert _times(early.results[0])[0] == pytest.approx(1.08 + 0.25)
    # the second reaches the engine at 1.0 s, within the first's prompt step: read beside its decode
    # row in the next step (1 + 0.1 + 0.08 s), at 2.26 s, 1.76 s after it was sent: its wait outside hid
    assert _times(early.results[1])[0] == pytest.approx(1.76 + 0.25)
    # the server's own TTFT, from arrival, is the client's less its part
    assert early.results[1].ttft_s - early.client_s[1] == pytest.approx(1.76 + 0.25 - 1.0)
    # sent at 0.9 s it reaches the engine at 1.4 s, after the next step began (the first's decode
    # row alone, to 2.18 s): its prompt is read after it, alone (1.08 s), 2.36 s after it was sent
    late = simulate(Workload((SimRequest(8, 2, arrival_s=0.0), SimRequest(8, 2, arrival_s=0.9))), limits, served)
    assert _times(late.results[1])[0] == pytest.approx(2.36 + 0.25)
    assert late.results[1].start_s == 0.9  # timed from when it was sent
    kept = StepCost.from_dict(served.to_dict())
    assert kept == served
    assert "the client's part 500.0 ms at 0.0 in flight, 1500.0 ms at 2.0" in served.front.describe()


def test_a_prompt_the_server_refuses_ends_at_once_and_its_user_sends_the_next():
    workload = closed_loop(1, [None, 20], [4], requests=4, seed=0)
    run = simulate(workload, EngineLimits(token_budget=64, prefill_chunk=64), SECOND_A_STEP)
    refused = [r for r, request in zip(run.results, workload.requests) if request.refused]
    assert len(refused) == 2 and all(r.outcome == "errored" for r in refused)
    assert run.summary.completed == 2 and run.summary.errored == 2


def test_a_cancelled_simulation_ends_at_its_next_step():
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 3
    run = simulate(Workload((SimRequest(8, 50),)), EngineLimits(), SECOND_A_STEP).steps
    stopped = ServingSimulator(EngineLimits(), SECOND_A_STEP).run(Workload((SimRequest(8, 50),)), cancelled=cancelled)
    assert run == 50 and stopped.steps == 3 and stopped.results[0].outcome == "cut"


def test_a_recorded_setting_is_replayed_as_it_was_sent():
    """A load generator's report: an open loop's requests at their send times, a closed loop's as
    many users; each prompt and answer as long as they were, an answer cut short as long as asked,
    a refused request refused, one never counted left out."""
    from engine.estimates.simulator import recorded

    requests = [{"start_s": 0.5, "prompt_tokens": 12, "output_tokens": 4, "outcome": "completed"},
                {"start_s": 0.1, "prompt_tokens": 30, "output_tokens": 2, "outcome": "cut"},
                {"start_s": 0.7, "prompt_tokens": None, "output_tokens": 0, "outcome": "errored", "status": 400},
                {"start_s": 0.9, "prompt_tokens": None, "output_tokens": 0, "outcome": "errored", "status": 503},
                {"start_s": 0.0, "prompt_tokens": None, "output_tokens": 0, "outcome": "not sent", "sent": False}]
    open_ = recorded({"mode": "rate", "value": 2.0, "requests": requests}, max_tokens=8)
    assert open_.users is None
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.refused) for r in open_.requests] == [
        (0.1, 30, 8, False), (0.5, 12, 4, False), (0.7, 1, 8, True)]
    closed = recorded({"mode": "concurrency", "value": 4, "requests": requests}, max_tokens=8)
    assert closed.users == 4 and [r.arrival_s for r in closed.requests] == [0.0] * 3
    with pytest.raises(InvalidRequestError, match="Not a setting"):
        recorded({"mode": "rate", "requests": [{"start_s": "soon"}]}, 8)
    with pytest.raises(InvalidRequestError, match="no request"):
        recorded({"mode": "rate", "value": 1.0, "requests": requests[3:]}, 8)
