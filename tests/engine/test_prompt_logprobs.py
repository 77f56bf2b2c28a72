"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): the core scores every prompt token
while it reads the prompt, in chunks, beside other requests; the server returns them in vLLM's
shape. They are what a served model's perplexity is measured from (engine/measure/served_quality.py)."""

import json

import httpx
import pytest
import torch

from engine.base.events import Finished, Prefilled, PromptScored, TokenGenerated
from engine.base.request import GenerationRequest
from engine.base.sampling import SamplingParams
from engine.generation.core import CoreSettings, EngineCore
from engine.models.loading import LoadRequest, load_model
from tests.serving import serve
from tests.tiny import CORPUS

GREEDY = SamplingParams(temperature=0.0)


def full_scores(loaded, ids: list[int]) -> torch.Tensor:
    """log-softmax of the scores at every position, from one forward pass over ``ids``."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def run(core, submissions):
    """Submit (request, ids) pairs together, run the core dry: each one's events in order."""
    rids = [core.submit(request, prompt_ids=ids) for request, ids in submissions]
    events = {rid: [] for rid in rids}
    for event in core.run():
        if getattr(event, "request_id", None) in events:
            events[event.request_id].append(event)
    return [events[rid] for rid in rids]


@pytest.mark.parametrize("precision", ["fp32", "fp32-fast"])
def test_the_core_scores_every_prompt_token_across_chunks_beside_another_request(tiny_llama, precision):
    loaded = load_model(LoadRequest(str(tiny_llama), precision, "cpu"))
    reference = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    prompt = loaded.tokenizer(" ".join(CORPUS[:4]), add_special_tokens=False)["input_ids"][:37]
    other = loaded.tokenizer(" ".join(CORPUS[4:6]), add_special_tokens=False)["input_ids"][:20]
    # a budget of 8 tokens a step: the prompt is read in chunks of at most 8, between the other's decode steps
    core = EngineCore(loaded, CoreSettings(token_budget=8, prefill_chunk=8, max_batch=4))
    scored_request = GenerationRequest("x", mode="raw", sampling=GREEDY, max_new_tokens=3, prompt_logprobs=4)
    plain = GenerationRequest("x", mode="raw", sampling=GREEDY, max_new_tokens=6)
    events, other_events = run(core, [(scored_request, prompt), (plain, other)])
    kinds = [type(e) for e in events]
    assert kinds.index(PromptScored) < kinds.index(Prefilled) < kinds.index(TokenGenerated)
    assert kinds.count(PromptScored) == 1
    scores = next(e for e in events if isinstance(e, PromptScored)).scores
    assert [s.token_id for s in scores] == prompt[1:]
    expected = full_scores(reference, prompt)
    tolerance = 1e-4
    for position, score in enumerate(scores):
        row = expected[position]
        assert score.logprob == pytest.approx(float(row[prompt[position + 1]]), abs=tolerance)
        value = row[prompt[position + 1]]
        assert int((row > value + tolerance).sum()) + 1 <= score.rank <= int((row > value - tolerance).sum()) + 1
        assert len(score.top_alternatives) == 4
        assert [a.logprob for a in score.top_alternatives] == pytest.approx(row.topk(4).values.tolist(), abs=tolerance)
        assert score.top_alternatives[0].text == loaded.token_text(score.top_alternatives[0].token_id)
    # the other request's answer is its answer alone
    alone = run(EngineCore(loaded, CoreSettings(max_batch=1)), [(plain, other)])[0]
    assert [e.token_id for e in other_events if isinstance(e, TokenGenerated)] == \
        [e.token_id for e in alone if isinstance(e, TokenGenerated)]
    assert not any(isinstance(e, PromptScored) for e in other_events)


def test_a_scored_prompt_is_computed_whole_even_where_the_prefix_cache_holds_it(loaded_llama):
    prompt = loaded_llama.tokenizer(" ".join(CORPUS[:8]), add_special_tokens=False)["input_ids"][:48]
    core = EngineCore(loaded_llama, CoreSettings(prefix_caching=True, kv_budget_bytes=1 << 26, block_tokens=16))
    warm = GenerationRequest("x", mode="raw", sampling=GREEDY, max_new_tokens=2)
    assert next(e for e in run(core, [(warm, prompt)])[0] if isinstance(e, Prefilled)).cached_tokens == 0
    again = run(core, [(warm, prompt)])[0]
    assert next(e for e in again if isinstance(e, Prefilled)).cached_tokens >= 32  # the cache does hold it
    scored = run(core, [(GenerationRequest("x", mode="raw", sampling=GREEDY, max_new_tokens=2, prompt_logprobs=0),
                         prompt)])[0]
    assert next(e for e in scored if isinstance(e, Prefilled)).cached_tokens == 0
    scores = next(e for e in scored if isinstance(e, PromptScored)).scores
    expected = full_scores(loaded_llama, prompt)
    assert [s.logprob for s in scores] == pytest.approx(
        [float(expected[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], abs=1e-4)
    assert all(s.top_alternatives == () for s in scores)
    assert isinstance(scored[-1], Finished) and scored[-1].reason == "length"


def test_a_bad_prompt_logprobs_is_refused():
    from engine.base.errors import InvalidRequestError

    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            GenerationRequest("x", prompt_logprobs=bad).validated()


@pytest.fixture(scope="module")
def server(loaded_llama):
    running = serve(loaded_llama)
    yield running
    running.stop()


def test_the_server_returns_prompt_logprobs_in_vllms_shape(server, loaded_llama):
    prompt = loaded_llama.tokenizer(" ".join(CORPUS[1:3]), add_special_tokens=False)["input_ids"][:24]
    expected = full_scores(loaded_llama, prompt)
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        whole = client.post("/completions", json=body)
        assert whole.status_code == 200, whole.text
        entries = whole.json()["choices"][0]["prompt_logprobs"]
        streamed = client.post("/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        chat = client.post("/chat/completions", json={"model": server.model_name, "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "hello"}],
                                                      "prompt_logprobs": 1})
        too_many = client.post("/completions", json={**body, "prompt_logprobs": 21})
        as_ids = client.post("/completions", json={**body, "return_tokens_as_token_ids": True})
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        token = prompt[position + 1]
        row = expected[position]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == loaded_llama.token_text(token)
        best = sorted(((v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] <= 3))
        assert [rank for rank, _, _ in best][:3] == [1, 2, 3]
        assert [lp for _, _, lp in best][:3] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert len(entry) in (3, 4)  # the prompt's token beside the top 3, unless it is one of them
    assert chunks[0]["choices"][0]["prompt_logprobs"] == entries
    assert "prompt_logprobs" not in chunks[1]["choices"][0]
    assert chat.status_code == 200 and len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    assert too_many.status_code == 400 and "prompt_logprobs" in too_many.json()["error"]["message"]
    named = as_ids.json()["choices"][0]["prompt_logprobs"][1]
    assert named[str(prompt[1])]["decoded_token"] == f"token_id:{prompt[1]}"
