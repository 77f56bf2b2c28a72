import re
import threading

import pytest
import torch

from engine.base.cancel import CancelToken
from engine.base.errors import InvalidRequestError, PromptTooLongError
from engine.base.events import Finished, Prefilled, TokenGenerated
from engine.models.loading import LoadRequest, load_model
from engine.base.request import ChatMessage, GenerationRequest, encode_prompt
from engine.base.sampling import SamplingParams
from engine.generation.generate import generate as engine_generate

PROMPT = "The quick brown fox 😀 jumps"


def tokens_of(events):
    return [e for e in events if isinstance(e, TokenGenerated)]


def hf_greedy(loaded, request, max_new_tokens):
    ids = torch.tensor([loaded.encode(request)])
    out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "nf4"])
def test_greedy_equals_transformers_generate(tiny_models, arch, precision):
    loaded = load_model(LoadRequest(str(tiny_models[arch]), precision, "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=24)
    ours = [e.token_id for e in tokens_of(engine_generate(loaded, request))]
    assert ours == hf_greedy(loaded, request, 24)
    assert len(ours) >= 3


def test_event_stream_shape_and_invariants(loaded_llama):
    events = list(engine_generate(loaded_llama, GenerationRequest(PROMPT, mode="raw", max_new_tokens=12,
                                                          ignore_eos=True)))
    assert isinstance(events[0], Prefilled)
    assert isinstance(events[-1], Finished)
    tokens = tokens_of(events)
    finished = events[-1]
    assert [t.index for t in tokens] == list(range(12))
    assert finished.reason == "length" and finished.tokens == 12
    assert finished.token_ids == tuple(t.token_id for t in tokens)
    assert "".join(t.text for t in tokens) == loaded_llama.tokenizer.decode(list(finished.token_ids))
    assert finished.text == "".join(t.text for t in tokens)
    assert tokens[0].latency_s == pytest.approx(finished.ttft_s)
    assert finished.decode_s == pytest.approx(sum(t.latency_s for t in tokens[1:]), rel=1e-6)
    assert finished.decode_tokens_per_s == pytest.approx(11 / finished.decode_s)
    assert all(b.elapsed_s > a.elapsed_s for a, b in zip(tokens, tokens[1:]))
    for t in tokens:
        assert t.logprob <= 0
        assert len(t.top_alternatives) == 5
        best = t.top_alternatives[0]
        assert best.logprob >= t.logprob - 1e-6
        assert [a.logprob for a in t.top_alternatives] == sorted((a.logprob for a in t.top_alternatives), reverse=True)
        # greedy: the chosen token is the most likely one
        assert best.token_id == t.token_id
        assert t.memory.rss_bytes > 0 and t.memory.device == "cpu"
        assert t.memory.device_allocated_bytes is None  # no GPU here: absent, not zero
    assert finished.peak_rss_bytes >= max(t.memory.rss_bytes for t in tokens)


def test_logprobs_are_the_models_log_softmax(loaded_llama):
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=1)
    token = tokens_of(engine_generate(loaded_llama, request))[0]
    ids = torch.tensor([loaded_llama.encode(request)])
    with torch.inference_mode():
        logits = loaded_llama.model(input_ids=ids).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)[token.token_id]
    assert token.logprob == pytest.approx(float(expected), abs=1e-4)


def test_same_seed_same_sampled_tokens(loaded_llama):
    def run(seed):
        request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=20, ignore_eos=True,
                                    sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        return [t.token_id for t in tokens_of(engine_generate(loaded_llama, request))]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_cancel_finishes_within_one_token(loaded_llama):
    cancel = CancelToken()
    events = []
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=200, ignore_eos=True)
    for event in engine_generate(loaded_llama, request, cancel):
        events.append(event)
        if isinstance(event, TokenGenerated) and event.index == 4:
            cancel.cancel()
    finished = events[-1]
    assert finished.reason == "cancelled"
    assert finished.tokens in (5, 6)
    assert "".join(t.text for t in tokens_of(events)) == loaded_llama.tokenizer.decode(list(finished.token_ids))


def test_cancel_from_another_thread(loaded_llama):
    cancel = CancelToken()
    seen = threading.Event()
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=10_000, ignore_eos=True)
    result = {}

    def consume():
        count = 0
        for event in engine_generate(loaded_llama, request, cancel):
            if isinstance(event, TokenGenerated):
                count += 1
                seen.set()
            result["last"] = event
        result["count"] = count

    worker = threading.Thread(target=consume)
    worker.start()
    assert seen.wait(30)
    cancel.cancel()
    worker.join(30)
    assert not worker.is_alive()
    assert result["last"].reason == "cancelled"
    assert result["count"] < 200


def test_cancel_before_start_generates_nothing(loaded_llama):
    cancel = CancelToken()
    cancel.cancel()
    events = list(engine_generate(loaded_llama, GenerationRequest(PROMPT, mode="raw"), cancel))
    assert len(events) == 1 and events[0].reason == "cancelled" and events[0].tokens == 0
    assert events[0].ttft_s is None


def test_stop_string_ends_generation(loaded_llama):
    base = GenerationRequest(PROMPT, mode="raw", max_new_tokens=30, ignore_eos=True)
    full = list(engine_generate(loaded_llama, base))[-1]
    words = re.findall(r"[A-Za-z]{2,}", full.text)
    assert words, full.text
    stop = words[len(words) // 2]
    stopped = list(engine_generate(loaded_llama, GenerationRequest(PROMPT, mode="raw", max_new_tokens=30,
                                                           ignore_eos=True, stop=(stop,))))[-1]
    assert stopped.reason == "stop_string" and stopped.stop_string == stop
    assert stop in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.tokens < full.tokens
    # it stopped at the first token that completed the stop string
    assert stop not in loaded_llama.tokenizer.decode(list(stopped.token_ids[:-1]))


def test_eos_ends_generation_like_generate(tmp_path, tiny_llama):
    """Make the 4th greedy token an end-of-sequence token via generation_config.json."""
    import json
    import shutil

    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=20, ignore_eos=True)
    plain = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    free_run = [t.token_id for t in tokens_of(engine_generate(plain, request))]
    eos = free_run[3]
    folder = shutil.copytree(tiny_llama, tmp_path / "eos")
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos]
    (folder / "generation_config.json").write_text(json.dumps(config))
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    stopping = GenerationRequest(PROMPT, mode="raw", max_new_tokens=20)
    finished = list(engine_generate(loaded, stopping))[-1]
    assert finished.reason == "eos"
    assert list(finished.token_ids) == free_run[:free_run.index(eos) + 1]
    assert list(finished.token_ids) == hf_greedy(loaded, stopping, 20)


def test_context_window_ends_generation(tmp_path, byte_tokenizer):
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "short", "llama", byte_tokenizer, max_position_embeddings=24)
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=100, ignore_eos=True)
    n_prompt = len(loaded.encode(request))
    finished = list(engine_generate(loaded, request))[-1]
    assert finished.reason == "context"
    assert n_prompt + finished.tokens == 24
    with pytest.raises(PromptTooLongError, match="24"):
        engine_generate(loaded, GenerationRequest("fox " * 40, mode="raw"))


def test_chat_template_with_system_prompt_and_history(loaded_llama):
    request = GenerationRequest(
        "And now?", system_prompt="Be brief.",
        history=(ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!")),
    )
    text = loaded_llama.tokenizer.decode(encode_prompt(loaded_llama.tokenizer, request))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    raw = GenerationRequest("And now?", mode="raw")
    assert loaded_llama.tokenizer.decode(encode_prompt(loaded_llama.tokenizer, raw)) == "And now?"


def test_chat_mode_without_template_is_refused(tmp_path, sp_tokenizer):
    from tests.tiny import build_model_folder

    loaded = load_model(LoadRequest(str(build_model_folder(tmp_path / "m", "llama", sp_tokenizer)), "fp32", "cpu"))
    with pytest.raises(InvalidRequestError, match="raw mode"):
        engine_generate(loaded, GenerationRequest("hello"))
    assert tokens_of(engine_generate(loaded, GenerationRequest("hello", mode="raw", max_new_tokens=3)))


@pytest.mark.parametrize("request_kwargs,match", [
    ({"prompt": ""}, "empty"),
    ({"prompt": "   \n"}, "empty"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": -5}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": "many"}, "max_new_tokens"),
    ({"prompt": "hi", "sampling": SamplingParams(top_p="x")}, "top_p"),
])
def test_bad_requests_raise_before_any_event(loaded_llama, request_kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine_generate(loaded_llama, GenerationRequest(**request_kwargs))


def test_long_prompt_prefills_in_chunks_and_matches_one_pass(loaded_llama, monkeypatch):
    import engine.generation.generate as gen

    request = GenerationRequest("fox jumps over " * 20, mode="raw", max_new_tokens=8, ignore_eos=True)
    whole = [t.token_id for t in tokens_of(engine_generate(loaded_llama, request))]
    monkeypatch.setattr(gen, "PREFILL_CHUNK", 7)
    chunked = [t.token_id for t in tokens_of(engine_generate(loaded_llama, request))]
    assert chunked == whole


def test_a_plain_string_stop_is_one_stop_string():
    assert GenerationRequest("hi", stop="END").validated().stop == ("END",)
    with pytest.raises(InvalidRequestError, match="stop"):
        GenerationRequest("hi", stop=(1, 2)).validated()


def test_huge_max_new_tokens(loaded_llama):
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine_generate(loaded_llama, GenerationRequest("hi", mode="raw", max_new_tokens=10**12))
    cancel = CancelToken()
    events = []
    for event in engine_generate(loaded_llama, GenerationRequest("hi", mode="raw", max_new_tokens=5_000_000,
                                                         ignore_eos=True), cancel):
        events.append(event)
        if isinstance(event, TokenGenerated) and event.index == 2:
            cancel.cancel()
    assert events[-1].reason == "cancelled"


def test_ties_break_to_the_first_index_like_generate(tmp_path, tiny_llama):
    """Duplicate the unembedding row of the greedy token into a lower id: every step where it
    wins is an exact tie, and argmax (like generate) must pick the lower id."""
    import shutil

    from safetensors.torch import load_file, save_file

    plain = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=8)
    first = tokens_of(engine_generate(plain, request))[0].token_id
    lower = next(i for i in range(first) if i not in plain.eos_ids)
    folder = shutil.copytree(tiny_llama, tmp_path / "tied")
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][lower] = weights["lm_head.weight"][first]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(LoadRequest(str(folder), "fp32", "cpu"))
    expected = hf_greedy(loaded, request, 8)
    assert expected[0] == lower
    for k in (0, 1, 2, 5):
        ours = [t.token_id for t in tokens_of(engine_generate(loaded, GenerationRequest(
            PROMPT, mode="raw", max_new_tokens=8, top_alternatives=k)))]
        assert ours == expected, k


def test_streams_can_interleave_on_one_thread_and_leave_no_inference_mode(loaded_llama):
    a = engine_generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True))
    b = engine_generate(loaded_llama, GenerationRequest("dog", mode="raw", max_new_tokens=6, ignore_eos=True))
    done = {"a": [], "b": []}
    for _ in range(8):
        for name, gen in (("a", a), ("b", b)):
            event = next(gen, None)
            assert not torch.is_inference_mode_enabled()
            if event is not None:
                done[name].append(event)
    assert done["a"][-1].reason == done["b"][-1].reason == "length"
    alone = list(engine_generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)))
    assert done["a"][-1].token_ids == alone[-1].token_ids


def test_a_slow_consumer_does_not_slow_the_measured_tokens(loaded_llama):
    import time

    events = []
    for event in engine_generate(loaded_llama, GenerationRequest("fox", mode="raw", max_new_tokens=6, ignore_eos=True)):
        events.append(event)
        time.sleep(0.05)
    tokens = tokens_of(events)
    wall = tokens[-1].elapsed_s - tokens[0].elapsed_s
    assert wall >= 5 * 0.05  # wall clock does include the consumer's time
    # the tokens' own latencies exclude it: wall time = consumer time + engine time, whatever the load
    assert sum(t.latency_s for t in tokens[1:]) <= wall - 5 * 0.05
    assert events[-1].decode_s == pytest.approx(sum(t.latency_s for t in tokens[1:]))


def test_a_decode_steps_activations_are_read_once_per_model_outside_the_answer(tiny_models, monkeypatch):
    """A single answer carries its model's decode-step activations, read from the allocator by a
    throwaway sequence through the idle core before the answer's clock starts: once per loaded model
    (a second answer reuses it), the answer's tokens the same as without it."""
    from engine.base import memory
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(str(tiny_models["llama"]), "fp32", "cpu"))
    watched = []
    real = memory.StepAllocations.__enter__
    monkeypatch.setattr(memory.StepAllocations, "__enter__", lambda self: watched.append(1) or real(self))
    request = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=8, ignore_eos=True)
    first = [e for e in engine_generate(loaded, request) if isinstance(e, Finished)][0]
    second = [e for e in engine_generate(loaded, request) if isinstance(e, Finished)][0]
    assert first.activation_bytes and first.activation_bytes > 0 and watched == [1]
    assert second.activation_bytes == first.activation_bytes and second.token_ids == first.token_ids
    assert first.tokens == 8 and first.prompt_tokens == len(loaded.encode(request))
