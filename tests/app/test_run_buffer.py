import math

import numpy as np
import pytest

from app.run_buffer import RunBuffer
from engine.events import MemorySample, TokenGenerated


def token(i, latency, rss=1000, device=None):
    memory = MemorySample(rss_bytes=rss, device="cpu", device_allocated_bytes=device)
    return TokenGenerated(index=i, token_id=i, text="x", logprob=-1.0, top_alternatives=(), latency_s=latency,
                          elapsed_s=0.1 * (i + 1), kv_cache_bytes=100 * (i + 1), kv_cache_bytes_predicted=None,
                          memory=memory)


def test_columns_grow_past_capacity_and_absent_values_are_nan():
    buffer = RunBuffer(capacity=2)
    buffer.extend([token(0, 0.5), token(1, 0.1)])
    buffer.extend([token(2, 0.2)])
    assert buffer.count == 3
    assert buffer.column("kv_bytes").tolist() == [100, 200, 300]
    assert np.isnan(buffer.column("kv_predicted")).all()
    assert not buffer.has("device_allocated") and buffer.has("rss")


def test_speeds():
    buffer = RunBuffer()
    buffer.extend([token(0, 0.5)] + [token(i, 0.1 if i % 2 else 0.3) for i in range(1, 9)])
    assert buffer.tokens_per_s()[0] == pytest.approx(2.0)  # 1 / TTFT
    rolling = buffer.rolling_tokens_per_s(window=2)
    assert math.isnan(rolling[0])
    assert rolling[1] == pytest.approx(10.0)  # one step of 0.1 s
    assert rolling[2] == pytest.approx(2 / 0.4)  # 0.1 + 0.3
    # the live decode speed is computed the way the engine computes it at the end
    assert buffer.decode_tokens_per_s() == pytest.approx(8 / (4 * 0.1 + 4 * 0.3))


def test_reset_starts_a_new_run():
    buffer = RunBuffer()
    buffer.extend([token(0, 0.5), token(1, 0.1)])
    version = buffer.version
    buffer.reset(weights_bytes=42)
    assert buffer.count == 0 and buffer.weights_bytes == 42 and buffer.version > version
    assert buffer.decode_tokens_per_s() is None
