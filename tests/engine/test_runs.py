import math

import numpy as np
import pytest

from engine.base.events import Finished, MemorySample, Prefilled, TokenGenerated
from engine.runs import Run


def token(i, latency, rss=1000, device=None, text="x", special=False):
    memory = MemorySample(rss_bytes=rss, device="cpu", device_allocated_bytes=device)
    return TokenGenerated(index=i, token_id=i, text=text, logprob=-1.0, top_alternatives=(), latency_s=latency,
                          elapsed_s=0.1 * (i + 1), kv_cache_bytes=100 * (i + 1), kv_cache_bytes_predicted=None,
                          memory=memory, special=special)


def finished(tokens, reason="length"):
    return Finished(reason=reason, tokens=tokens, prompt_tokens=3, ttft_s=0.5, decode_s=0.2, decode_tokens_per_s=7.0,
                    total_s=0.7, peak_memory_bytes=5000, peak_rss_bytes=5000, kv_cache_bytes=100 * tokens,
                    kv_cache_bytes_predicted=None, token_ids=tuple(range(tokens)))


def test_columns_grow_past_capacity_and_absent_values_are_nan():
    buffer = Run(capacity=2)
    buffer.extend([token(0, 0.5), token(1, 0.1)])
    buffer.extend([token(2, 0.2)])
    assert buffer.count == 3
    assert buffer.column("kv_bytes").tolist() == [100, 200, 300]
    assert np.isnan(buffer.column("kv_predicted")).all()
    assert not buffer.has("device_allocated") and buffer.has("rss")


def test_speeds():
    buffer = Run()
    buffer.extend([token(0, 0.5)] + [token(i, 0.1 if i % 2 else 0.3) for i in range(1, 9)])
    assert buffer.tokens_per_s()[0] == pytest.approx(2.0)  # 1 / TTFT
    rolling = buffer.rolling_tokens_per_s(window=2)
    assert math.isnan(rolling[0])
    assert rolling[1] == pytest.approx(10.0)  # one step of 0.1 s
    assert rolling[2] == pytest.approx(2 / 0.4)  # 0.1 + 0.3
    # the live decode speed is computed the way the engine computes it at the end
    assert buffer.decode_tokens_per_s() == pytest.approx(8 / (4 * 0.1 + 4 * 0.3))


def test_events_are_kept_once_in_order_with_the_text_and_the_ends():
    run = Run(weights_bytes=42)
    prefilled = Prefilled(prompt_tokens=3, prefill_s=0.4, prefill_tokens_per_s=7.5, kv_cache_bytes=300,
                          kv_cache_bytes_predicted=None, memory=MemorySample(rss_bytes=1000, device="cpu"))
    run.extend([prefilled, token(0, 0.5, text="Hel")])
    assert run.text == "Hel"
    run.extend([token(1, 0.1, text="lo"), token(2, 0.1, text="<eot>", special=True)])
    assert run.text == "Hello"  # special tokens are not part of the answer
    version = run.version
    run.finish(finished(3, "eos"))
    assert run.version > version and run.finished.reason == "eos"
    assert [type(e).__name__ for e in run.events] == ["Prefilled", "TokenGenerated", "TokenGenerated",
                                                       "TokenGenerated", "Finished"]
    assert run.prefilled is prefilled and run.token_ids == [0, 1, 2] and run.count == 3
    assert run.ttft_s() == 0.5 and run.kv_bytes() == 300 and run.peak_memory_bytes() == 5000
    assert run.decode_tokens_per_s() == 7.0  # the engine's figure once it finished
    assert run.latency_stats()["latency_p50_s"] == pytest.approx(0.1)


def test_a_failed_run_keeps_its_partial_answer():
    run = Run()
    run.extend([token(0, 0.5), token(1, 0.1)])
    run.fail("scores were NaN", finished(2, "error"))
    assert run.error == "scores were NaN" and run.finished.reason == "error" and run.count == 2
    empty = Run()
    empty.fail("out of memory")
    assert empty.finished is None and empty.error == "out of memory" and empty.decode_tokens_per_s() is None


def test_a_saved_series_reads_like_a_live_run():
    saved = Run.from_series({"latency_s": [0.5, 0.1, None], "kv_bytes": [1, 2, 3], "unknown": [9]}, weights_bytes=7)
    assert saved.count == 3 and saved.weights_bytes == 7
    assert saved.column("kv_bytes").tolist() == [1, 2, 3] and np.isnan(saved.column("latency_s")[2])
