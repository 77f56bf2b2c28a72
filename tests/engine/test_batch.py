import json

import pytest

from engine.measure.batch import stream_batch
from engine.base.cancel import CancelToken
from engine.base.errors import InvalidRequestError
from engine.base.events import BatchFinished, BatchStep, Finished
from engine.models.loading import LoadRequest, load_model
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.measure.sweep import SweepPoint, record_points, run_sweep
from engine.generation.generate import generate

PROMPTS = ("The quick brown fox", "Hi", "A longer prompt, so the others need left padding 😀", "abc abc abc")


def alone(loaded, request):
    return next(e for e in generate(loaded, request) if isinstance(e, Finished)).token_ids


def batched(loaded, requests, base=None, cancel=None):
    events = list(stream_batch(loaded, base or requests[0], [loaded.encode(r) for r in requests], cancel))
    return events, events[-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma2"])
def test_batched_greedy_equals_each_prompt_alone(tiny_models, arch):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32", "cpu"))
    # 20 tokens carry the mistral (window 12) and gemma2 (window 10) caches past their sliding windows
    requests = [GenerationRequest(p, mode="raw", max_new_tokens=20, ignore_eos=True) for p in PROMPTS]
    events, final = batched(loaded, requests)
    assert isinstance(final, BatchFinished) and final.batch == len(PROMPTS)
    for request, sequence in zip(requests, final.sequences):
        assert sequence.token_ids == alone(loaded, request)
        assert sequence.reason == "length" and sequence.tokens == 20
    steps = [e for e in events if isinstance(e, BatchStep)]
    assert len(steps) == 20
    # every sequence's text is its pieces joined
    for i, sequence in enumerate(final.sequences):
        assert "".join(step.texts[i] for step in steps) == sequence.text
    # measured KV equals the prediction at every step; the fullest step holds each prompt and 18
    # answer tokens (in the last one all end, and their caches are freed at once)
    assert all(step.kv_cache_bytes == step.kv_cache_bytes_predicted for step in steps)
    assert final.kv_cache_bytes == steps[-2].kv_cache_bytes == sum(
        loaded.predicted_kv_bytes(len(loaded.encode(r)) + 18) for r in requests)
    assert steps[-1].kv_cache_bytes == 0


def test_each_sequence_stops_on_its_own(default_fp32):
    """The default model ends "Hi" after a few tokens; the others go on to their limit."""
    requests = [GenerationRequest("Hi", max_new_tokens=40),
                GenerationRequest("Write a long story about a lighthouse keeper.", max_new_tokens=40)]
    events, final = batched(default_fp32, requests)
    short, long = final.sequences
    assert short.reason == "eos" and short.tokens < 40
    assert long.reason == "length" and long.tokens == 40
    assert short.token_ids == alone(default_fp32, requests[0])
    assert long.token_ids == alone(default_fp32, requests[1])
    steps = [e for e in events if isinstance(e, BatchStep)]
    assert [s.active for s in steps] == [2] * short.tokens + [1] * (40 - short.tokens)
    assert all(s.token_ids[0] is None for s in steps[short.tokens:])
    assert final.generated_tokens == short.tokens + long.tokens
    assert final.aggregate_tokens_per_s > 0 and final.mean_ttft_s > 0


def test_sampled_batch_is_each_sequence_sampled_alone(loaded_llama):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=7)
    requests = [GenerationRequest(p, mode="raw", max_new_tokens=10, sampling=sampling, ignore_eos=True)
                for p in PROMPTS[:3]]
    _, final = batched(loaded_llama, requests)
    assert [s.token_ids for s in final.sequences] == [alone(loaded_llama, r) for r in requests]


def test_a_batch_works_out_no_alternatives_it_never_shows(loaded_llama, monkeypatch):
    """A batch's steps carry tokens and texts, not each token's top alternatives: asked for
    them (the request's default), the batch still never computes them, and its tokens are the
    same as alone."""
    from engine.generation import step_output

    def no(*args, **kwargs):
        raise AssertionError("a batch computed top alternatives")

    requests = [GenerationRequest(p, mode="raw", max_new_tokens=6, ignore_eos=True) for p in PROMPTS[:2]]
    assert requests[0].top_alternatives > 0
    expected = [alone(loaded_llama, r) for r in requests]
    monkeypatch.setattr(step_output, "top_scores", no)
    _, final = batched(loaded_llama, requests)
    assert [s.token_ids for s in final.sequences] == expected and all(s.reason == "length" for s in final.sequences)


def test_stop_strings_apply_per_sequence(default_fp32):
    base = GenerationRequest("x", max_new_tokens=30, stop=("microservices",))
    requests = [GenerationRequest("Explain microservices in simple terms."), GenerationRequest("Count to five.")]
    events = list(stream_batch(default_fp32, base, [default_fp32.encode(r) for r in requests]))
    first, second = events[-1].sequences
    assert first.reason == "stop_string" and "microservices" in first.text
    assert second.reason != "stop_string"


def test_cancel_mid_batch_ends_every_sequence(loaded_llama):
    cancel = CancelToken()
    request = GenerationRequest("fox", mode="raw", max_new_tokens=50, ignore_eos=True)
    events = []
    for event in stream_batch(loaded_llama, request, [loaded_llama.encode(request)] * 3, cancel):
        events.append(event)
        if isinstance(event, BatchStep) and event.step == 4:
            cancel.cancel()
    final = events[-1]
    assert final.cancelled and all(s.reason == "cancelled" and s.tokens == 5 for s in final.sequences)


def test_each_sequence_leaves_out_its_own_time_in_the_watched_step(loaded_llama, monkeypatch):
    """The first decode step is watched (its activations read from the allocator) and left out
    of the decode figures. Each sequence leaves out its own token's time in that step, not the
    step's: on a busy machine the step can end well after its tokens were timed, and a tiny
    model's other steps together take less than that."""
    import time

    from engine.generation.core import EngineCore

    completed = EngineCore._step_completed

    def late(self, work, began, queried, watch):
        if watch is not None:
            time.sleep(0.5)  # the machine busy elsewhere: far longer than the batch's decode steps
        return completed(self, work, began, queried, watch)
    monkeypatch.setattr(EngineCore, "_step_completed", late)
    request = GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)
    events = list(stream_batch(loaded_llama, request, [loaded_llama.encode(request)] * 2))
    done = events[-1]
    assert isinstance(done, BatchFinished) and done.activation_bytes is not None  # the step was watched
    assert all(0 < s.mean_token_latency_s < 0.5 for s in done.sequences)
    assert 0 < done.mean_per_token_latency_s < 0.5


def test_bad_batches_are_refused(loaded_llama):
    request = GenerationRequest("fox", mode="raw")
    with pytest.raises(InvalidRequestError):
        list(stream_batch(loaded_llama, request, []))
    with pytest.raises(InvalidRequestError):
        list(stream_batch(loaded_llama, request, [[1, 2], []]))
    context = loaded_llama.info.context_length  # a prompt with no room left to answer in
    with pytest.raises(InvalidRequestError, match="context window"):
        list(stream_batch(loaded_llama, request, [[5] * context, [5, 6]]))
    with pytest.raises(InvalidRequestError):
        run_sweep(loaded_llama, request, [0, 2])


def test_sweep_measures_each_batch_size(loaded_llama, tmp_path, monkeypatch):
    import torch

    request = GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)
    seen = []
    # one thread throughout: a kernel's scratch per thread, which moves with the threads the core
    # takes on a busy machine, can weigh as much as this tiny model's rows (batch 1 read 1,600 B
    # against batch 4's 1,040 B where the count changed between them)
    threads = torch.get_num_threads()
    monkeypatch.setenv("INFERENCE_WORKBENCH_THREADS", "1")
    try:
        points, skipped = run_sweep(loaded_llama, request, [4, 1, 2], on_point=seen.append, with_ceiling=False)
    finally:
        monkeypatch.delenv("INFERENCE_WORKBENCH_THREADS")
        torch.set_num_threads(threads)
    assert [p.batch for p in points] == [1, 2, 4] and seen == points and not skipped
    for point in points:
        assert point.generated_tokens == 6 * point.batch
        # the fullest step: every sequence's prompt and 4 answer tokens (all end in the next, freed)
        assert point.kv_cache_bytes == point.kv_cache_bytes_predicted == loaded_llama.predicted_kv_bytes(
            len(loaded_llama.encode(request)) + 4, point.batch)
        assert point.aggregate_tokens_per_s > 0 and point.mean_per_token_latency_s > 0
    assert points[2].predicted_extra_bytes > points[0].predicted_extra_bytes
    # a decode step's activations, read from the allocator, grow with the rows in the step
    assert all(p.activation_bytes > 0 for p in points)
    assert points[0].activation_bytes < points[2].activation_bytes
    # the points land in the run history, where the cost explorer reads them
    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path))
    record_points(loaded_llama, points, len(loaded_llama.encode(request)))
    from engine.storage.history import load_all

    records = load_all()
    assert sorted(r.batch for r in records) == [1, 2, 4] and {r.kind for r in records} == {"sweep"}
    four = next(r for r in records if r.batch == 4)
    assert four.decode_tokens_per_s == pytest.approx(points[2].aggregate_tokens_per_s / 4)


def test_sweep_stops_before_a_batch_that_would_not_fit(loaded_llama):
    request = GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)
    from engine.measure.sweep import predicted_extra_bytes

    prompt = len(loaded_llama.encode(request))
    room = int(predicted_extra_bytes(loaded_llama, 2, prompt, 6) / 0.8) + 1  # batch 2 fits, 4 does not
    points, skipped = run_sweep(loaded_llama, request, [1, 2, 4, 8], available=lambda: room, with_ceiling=False)
    assert [p.batch for p in points] == [1, 2]
    assert [s.batch for s in skipped] == [4, 8]
    assert "free" in skipped[0].reason and skipped[0].predicted_extra_bytes > 0.8 * room


def test_sweep_cli_writes_the_documented_json(tmp_path, tiny_llama, monkeypatch):
    from engine.cli import main

    monkeypatch.setenv("INFERENCE_WORKBENCH_DATA", str(tmp_path / "data"))
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--model", str(tiny_llama), "--batch", "1,2", "--prompt", "fox", "--raw",
                 "--max-new-tokens", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [p["batch"] for p in data["points"]] == [1, 2]
    for point in data["points"]:
        for key in ("batch", "aggregate_tokens_per_s", "mean_ttft_s", "mean_per_token_latency_s",
                    "peak_memory_bytes", "kv_cache_bytes"):
            assert point[key] is not None, key
        assert point["kv_cache_bytes"] == point["kv_cache_bytes_predicted"]
    assert set(data["points"][0]) == set(SweepPoint.__dataclass_fields__)
    assert main(["sweep", "--model", str(tiny_llama), "--batch", "one", "--prompt", "fox"]) == 1


@pytest.mark.parametrize("precision", ["fp32-fast", "int8-fast"])
def test_a_fast_path_batch_runs_on_the_engine_core(tiny_models, precision):
    """The sweep's batches on a fast precision decode through the core's paged cache, all rows in
    one step: fp32-fast equals each prompt alone; int8-fast equals each prompt alone through the
    same batched runner."""
    loaded = load_model(LoadRequest(str(tiny_models["llama"]), precision, "cpu"))
    requests = [GenerationRequest(p, mode="raw", max_new_tokens=12, ignore_eos=True) for p in PROMPTS]
    events, final = batched(loaded, requests)
    steps = [e for e in events if isinstance(e, BatchStep)]
    assert len(steps) == 12 and steps[0].active == len(PROMPTS)
    block = 16 * loaded.info.kv_bytes_per_token  # the pool's blocks: whole ones, a partly filled last
    assert all(s.kv_cache_bytes % block == 0 for s in steps)
    assert all(s.kv_cache_bytes_predicted <= s.kv_cache_bytes < s.kv_cache_bytes_predicted + 2 * block * len(PROMPTS)
               for s in steps)
    for request, sequence in zip(requests, final.sequences):
        single = batched(loaded, [request])[1].sequences[0].token_ids
        assert sequence.token_ids == single and sequence.tokens == 12
        if precision == "fp32-fast":
            assert sequence.token_ids == alone(loaded, request)
    assert final.aggregate_tokens_per_s > 0 and final.kv_cache_bytes == max(s.kv_cache_bytes for s in steps)
    for i, sequence in enumerate(final.sequences):
        assert "".join(step.texts[i] for step in steps) == sequence.text


def test_a_rate_above_its_ceiling_measures_the_bandwidth_again_and_says_why_if_it_still_is(monkeypatch):
    """A sweep point faster than its ceiling: the bandwidth is measured again and the new ceiling
    stands; where even that is beaten, the point says so (a note), never a share over 100%."""
    from types import SimpleNamespace

    from engine.estimates import hardware
    from engine.measure import sweep

    measured = []
    ceilings = iter([10.0, 20.0, 10.0, 12.0, 10.0])
    monkeypatch.setattr(sweep, "profile_for", lambda loaded: SimpleNamespace(id=hardware.THIS_MACHINE))
    monkeypatch.setattr(hardware, "this_machine", lambda bandwidth=False: measured.append(bandwidth) or "again")
    monkeypatch.setattr(sweep, "estimate_for", lambda *a: SimpleNamespace(
        decode_tokens_per_s_ceiling=next(ceilings), bandwidth_level="memory", bandwidth_bytes_per_s=2e10))
    assert sweep.above_ceiling(None, 15.0, 1, 64) == (20.0, None)  # measured again: 20 holds
    ceiling, note = sweep.above_ceiling(None, 15.0, 1, 64)  # measured again: 12, still beaten
    assert ceiling == 12.0 and note.startswith("above the ceiling: 15.0 tok/s against 12.0") and "20.0 GB/s" in note
    assert sweep.above_ceiling(None, 9.0, 1, 64) == (10.0, None)  # below: nothing measured again
    assert measured == [True, True]


def test_the_watched_step_is_left_out_of_the_batch_timing(loaded_llama, monkeypatch):
    """Reading the activations slows their step on the CPU: the batch's decode figures come from the
    other steps (a watch made to take half a second would otherwise sink the rate)."""
    import time

    from engine.base import memory

    real_exit = memory.StepAllocations.__exit__

    def slow_exit(self, *exc):
        time.sleep(0.5)  # the watch's own cost, exaggerated
        return real_exit(self, *exc)

    monkeypatch.setattr(memory.StepAllocations, "__exit__", slow_exit)
    request = GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)
    events, final = batched(loaded_llama, [request] * 3)
    steps = [e for e in events if isinstance(e, BatchStep)]
    assert steps[1].latency_s >= 0.5 and max(s.latency_s for s in steps[2:]) < 0.5
    decode_s = sum(s.latency_s for s in steps[2:])
    assert final.aggregate_tokens_per_s == pytest.approx(3 * 4 / decode_s, rel=1e-6)
    assert all(r.mean_token_latency_s < 0.5 for r in final.sequences)
    assert final.activation_bytes > 0


def test_a_steps_allocations_are_read_from_the_allocator():
    import torch

    from engine.base.memory import StepAllocations

    with StepAllocations(torch.device("cpu")) as watch:
        a = torch.ones(1 << 20, dtype=torch.uint8)  # 1 MiB
        b = torch.ones(1 << 19, dtype=torch.uint8)  # and 0.5 MiB while it lives
        del a, b
        c = torch.ones(1 << 18, dtype=torch.uint8)
    assert (1 << 20) + (1 << 19) <= watch.peak_bytes < (1 << 20) + (1 << 19) + (1 << 16)
    # what the step keeps (its KV cache's growth) is not an activation
    assert (1 << 18) <= watch.kept_bytes < (1 << 18) + (1 << 16)
    assert watch.activation_bytes == watch.peak_bytes - watch.kept_bytes
    kept = c
    with StepAllocations(torch.device("cpu")) as nothing:
        kept.add_(1)  # in place: no new tensor
    assert nothing.peak_bytes < 1024  # a scalar wrapped as a tensor, no more


def test_two_watches_at_once_read_one_figure_and_never_crash():
    """The CPU's allocation records come from the process's one profiler: two watches at once (two
    of Compare's concurrent lanes reading their models' activations) crashed the process. The
    second finds the first running and reads nothing; the first reads its figure."""
    import threading

    import torch

    from engine.base.memory import StepAllocations

    inside, release = threading.Event(), threading.Event()
    first = StepAllocations(torch.device("cpu"))

    def watch_first():
        with first:
            torch.ones(1 << 20, dtype=torch.uint8)
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=watch_first)
    thread.start()
    assert inside.wait(30)
    with StepAllocations(torch.device("cpu")) as second:
        torch.ones(1 << 20, dtype=torch.uint8)
    release.set()
    thread.join(30)
    assert second.peak_bytes is None and first.peak_bytes >= 1 << 20
