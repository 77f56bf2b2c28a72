import json
import subprocess
import sys
import threading

import pytest

from engine.measure.compare import LaneSpec, agreement, parse_lane, report, run_comparison, teacher_forced_logprobs
from engine.base.errors import InvalidRequestError
from engine.base.events import Loaded, TokenGenerated
from engine.base.request import GenerationRequest
from engine.storage.serialize import event_from_dict, event_to_dict
from engine.generation.generate import generate

REQUEST = GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=12, ignore_eos=True)


def test_agreement():
    assert agreement([1, 2, 3], [1, 2, 3]) == (1.0, None)
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (0.75, 1)
    assert agreement([1, 2], [1, 2, 3, 4]) == (0.5, 2)
    assert agreement([], []) == (1.0, None)


def test_parse_lane():
    assert parse_lane("default:nf4") == LaneSpec("default", "nf4")
    assert parse_lane("/models/x:bf16:cpu") == LaneSpec("/models/x", "bf16", "cpu")
    assert parse_lane("C:/models/x:fp32") == LaneSpec("C:/models/x", "fp32")
    lane = parse_lane("default:int8-fast@int8:cpu")  # a KV-cache dtype after the precision
    assert lane == LaneSpec("default", "int8-fast", "cpu", kv_dtype="int8")
    assert lane.label == "default · int8-fast · int8 KV · cpu"
    with pytest.raises(InvalidRequestError):
        parse_lane("default")
    with pytest.raises(InvalidRequestError, match="MODEL:PRECISION\\[@KV\\]"):
        parse_lane("default:int8-fast@q2")


def test_teacher_forcing_scores_what_generation_chose(loaded_llama):
    events = list(generate(loaded_llama, REQUEST))
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    scores = teacher_forced_logprobs(loaded_llama, loaded_llama.encode(REQUEST), [t.token_id for t in tokens])
    assert scores == pytest.approx([t.logprob for t in tokens], abs=1e-4)


@pytest.mark.parametrize("schedule", ["fair", "concurrent"])
def test_identical_lanes_agree_completely(tiny_llama, schedule):
    threads_before = set(threading.enumerate())
    specs = [LaneSpec(str(tiny_llama), "fp32", "cpu")] * 3
    seen = []
    runs = run_comparison(specs, REQUEST, schedule, on_event=lambda index, event: seen.append(index))
    # Concurrent lanes leave no thread behind. Threads from earlier tests may end meanwhile, so compare
    # the threads alive now with those alive before rather than counting them.
    assert set(threading.enumerate()) <= threads_before
    assert set(seen) == {0, 1, 2}
    result = report(runs, REQUEST, schedule)
    assert result["schedule"] == schedule and len(result["lanes"]) == 3
    for lane in result["lanes"]:
        assert lane["token_agreement"] == 1.0
        assert lane["first_divergence"] is None
        assert lane["mean_abs_logprob_delta"] == 0.0
        assert lane["token_ids"] == result["lanes"][0]["token_ids"]


def test_other_precisions_diverge_measurably(tiny_llama):
    runs = run_comparison([LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(tiny_llama), "nf4", "cpu")], REQUEST)
    rows = report(runs, REQUEST, "fair")["summary"]
    assert rows[1]["mean_abs_logprob_delta"] > 0
    assert rows[0]["weights_bytes"] > rows[1]["weights_bytes"]
    for key in ("load_s", "ttft_s", "decode_tokens_per_s", "latency_p50_s", "latency_p95_s", "tokens", "kv_cache_bytes"):
        assert rows[1][key] is not None
    # each lane's own memory: its weights and its KV, beside the one process's peak they share
    for row in rows:
        assert row["model_memory_bytes"] == row["weights_bytes"] + row["kv_cache_bytes"]
    assert rows[0]["model_memory_bytes"] > rows[1]["model_memory_bytes"]


def test_lanes_with_other_tokenizers_get_no_token_metrics(tiny_llama, tmp_path, sp_tokenizer):
    from tests.tiny import build_model_folder

    other = build_model_folder(tmp_path / "sp", "llama", sp_tokenizer)
    runs = run_comparison([LaneSpec(str(tiny_llama), "fp32", "cpu"), LaneSpec(str(other), "fp32", "cpu")], REQUEST)
    row = report(runs, REQUEST, "fair")["summary"][1]
    assert row["token_agreement"] is None and row["mean_abs_logprob_delta"] is None
    assert row["tokens"] == 12


def test_events_round_trip_through_json(loaded_llama):
    events = [loaded_llama.info] + list(generate(loaded_llama, REQUEST))
    again = [event_from_dict(json.loads(json.dumps(event_to_dict(e)))) for e in events]
    assert again == events
    assert isinstance(again[0], Loaded)


def test_compare_cli(tmp_path, tiny_llama):
    out, csv_path = tmp_path / "cmp.json", tmp_path / "cmp.csv"
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "compare", "--lane", f"{tiny_llama}:fp32:cpu", "--lane",
         f"{tiny_llama}:bf16:cpu", "--raw", "--prompt", "The quick brown fox", "--max-new-tokens", "8",
         "--ignore-eos", "--quiet", "--json", str(out), "--csv", str(csv_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [lane["precision"] for lane in data["lanes"]] == ["fp32", "bf16"]
    for lane in data["lanes"]:
        assert {"token_agreement", "first_divergence", "mean_abs_logprob_delta", "ttft_s",
                "decode_tokens_per_s", "kv_cache_bytes", "token_ids"} <= lane.keys()
    assert data["lanes"][0]["token_agreement"] == 1.0
    assert csv_path.read_text().splitlines()[0].startswith("lane,label,load_s")
    assert "agree" in result.stdout and "|Δlogp|" in result.stdout


@pytest.mark.default_model
def test_two_precisions_of_the_default_model(default_model_folder):
    request = GenerationRequest("What is the capital of France?", max_new_tokens=16)
    runs = run_comparison([LaneSpec("default", "fp32", "cpu"), LaneSpec("default", "bf16", "cpu")], request)
    rows = report(runs, request, "fair")["summary"]
    assert "Paris" in runs[1].finished.text
    assert 0 < rows[1]["mean_abs_logprob_delta"] < 0.5  # bf16 bends the model a little, not a lot
    assert rows[1]["weights_bytes"] == pytest.approx(rows[0]["weights_bytes"] / 2, rel=1e-3)
