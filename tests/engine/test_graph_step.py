"""The captured decode step of a lone request on CUDA (engine/generation/runners.py, GraphStep):
its static cache, the copies in and out of the request's own cache, and its fallback. A CPU has
no CUDA graphs, so these run the same static step eager (``capture`` off); the graph itself was
measured on a GPU (README, benchmarks/cuda_check.py)."""

import pytest
import torch

from engine.base.events import Finished, TokenGenerated
from engine.base.request import GenerationRequest
from engine.generation import runners
from engine.generation.core import EngineCore
from engine.generation.generate import alone
from engine.generation.runners import ReferenceBatchRunner
from engine.models.loading import LoadRequest, load_model


@pytest.fixture(scope="module")
def llama(tiny_llama):
    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    yield loaded
    loaded.close()


def _runner(loaded, graphs: bool) -> ReferenceBatchRunner:
    runner = ReferenceBatchRunner(loaded.model, loaded.supports_logits_to_keep)
    runner.graphs = graphs
    return runner


def _answer(loaded, runner, prompt: str, tokens: int = 20, **settings):
    core = EngineCore(loaded, alone(**settings), runner=runner)
    core.submit(GenerationRequest(prompt, mode="raw", max_new_tokens=tokens, ignore_eos=True))
    events = [e for e in core.run() if isinstance(e, (TokenGenerated, Finished))]
    made = [e for e in events if isinstance(e, TokenGenerated)]
    return [e.token_id for e in made], [e.logprob for e in made], [e.kv_cache_bytes for e in made], core


def test_the_static_step_gives_the_eager_steps_tokens_logprobs_and_kv_bytes(llama):
    ids, logprobs, kv, _ = _answer(llama, _runner(llama, False), "the quick brown fox")
    runner = _runner(llama, True)
    graph_ids, graph_logprobs, graph_kv, _ = _answer(llama, runner, "the quick brown fox")
    assert runner.graph is not None and runner.graph_error is None  # it ran (eager here), no fallback
    assert graph_ids == ids and graph_kv == kv
    assert graph_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_the_static_cache_grows_and_the_request_moves_out_and_back(llama, monkeypatch):
    monkeypatch.setattr(runners, "GRAPH_MIN_CAPACITY", 8)
    prompt = torch.tensor([[5, 6, 7]])
    tokens = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    outs = {}
    for graphs in (False, True):
        runner = _runner(llama, graphs)
        runner.add(1, tokens=4)  # wanted 4: the first static cache holds 8, the request outgrows it
        with torch.inference_mode():
            runner.prefill(1, prompt)
            rows = [runner.decode([1], [t]) for t in tokens[:7]]
            if graphs:
                assert runner.graph.capacity == 16 and runner.graph.seq == 1
                held = runner.kv_bytes(1)
            keys, values = map(torch.stack, runner.block_kv(1, 0, 10))  # out of the static cache: its own again
            if graphs:
                assert runner.graph.seq is None and runner.kv_bytes(1) == held
            rows += [runner.decode([1], [t]) for t in tokens[7:]]
        outs[graphs] = (torch.cat(rows), keys, values, runner.length(1))
    assert outs[True][3] == outs[False][3] == 13
    for mine, theirs in zip(outs[True][:3], outs[False][:3]):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_a_step_that_cannot_be_captured_runs_eager_and_says_why(llama, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    ids, _, _, _ = _answer(llama, _runner(llama, False), "a lighthouse")
    runner = _runner(llama, True)
    monkeypatch.setattr(runners, "GraphStep", refuse)
    failed_ids, _, _, _ = _answer(llama, runner, "a lighthouse")
    assert failed_ids == ids
    assert not runner.graphs and runner.graph is None and "not permitted" in runner.graph_error


def test_graphs_apply_only_on_cuda(llama):
    assert not runners.graphs_apply(llama.model)  # a CPU model: the eager step
