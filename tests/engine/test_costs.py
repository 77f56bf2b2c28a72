import json
import subprocess
import sys

import pytest

from engine.estimates import costs
from engine.estimates import hardware
from engine.estimates.estimate import config_for, count_parameters
from engine.estimates.hardware import Hardware
from engine.generation.generate import generate

FLAT = Hardware(id="flat", name="test", kind="gpu", memory_bytes=80 * 2 ** 30, bandwidth_bytes_per_s=1e12,
                bf16_flops=1e15, usd_per_hour=3.6, watts=500)


@pytest.fixture(scope="module")
def llama8b():
    return config_for("meta-llama/Llama-3.1-8B")


def test_llama_3_1_8b_sanity_values(llama8b):
    e = costs.estimate(llama8b, FLAT, "bf16", "bf16", context=1000, batch=1)
    assert e.parameters == 8_030_261_248
    assert e.weights_bytes == 16_060_522_496  # 16.06 GB
    assert e.kv_bytes_per_token == 131_072  # 2 × 32 layers × 8 KV heads × 128 × 2 bytes
    assert e.kv_bytes_total == 1000 * 131_072


@pytest.mark.parametrize("hub_id,billions", [
    ("Qwen/Qwen2.5-0.5B", 0.494), ("Qwen/Qwen2.5-7B", 7.616), ("meta-llama/Llama-3.1-70B", 70.554),
    ("mistralai/Mistral-7B-v0.3", 7.248), ("google/gemma-2-9b", 9.242), ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.135),
    ("Qwen/Qwen3-0.6B", 0.596), ("google/gemma-3-1b-it", 1.000),
])
def test_shipped_configs_match_the_model_cards(hub_id, billions):
    assert count_parameters(config_for(hub_id)).total / 1e9 == pytest.approx(billions, abs=0.001)


def test_memory_bound_ceiling_and_money(llama8b):
    e = costs.estimate(llama8b, FLAT, "bf16", "bf16", context=1000, batch=2)
    # a step reads every weight but the untied input table (128256 × 4096 in bf16), of which each
    # of the 2 sequences looks up one row: 16,060,522,496 − 1,050,673,152 + 2 × 8,192
    assert e.weights_read_bytes == 15_009_865_728
    step_bytes = e.weights_read_bytes + 2 * 1000 * 131_072
    assert e.memory_bound_tokens_per_s == pytest.approx(2 / (step_bytes / 1e12))
    assert e.bound == "memory" and e.decode_tokens_per_s_ceiling == e.memory_bound_tokens_per_s
    assert e.per_request_tokens_per_s == pytest.approx(e.decode_tokens_per_s_ceiling / 2)
    # $ per 1M = $/h ÷ (tok/s × 3600) × 1e6 ; Wh per 1M = W × 1e6 ÷ tok/s ÷ 3600
    assert e.usd_per_million_tokens == pytest.approx(3.6 / (e.decode_tokens_per_s_ceiling * 3600) * 1e6)
    assert e.wh_per_million_tokens == pytest.approx(500 * 1e6 / e.decode_tokens_per_s_ceiling / 3600)


def test_a_tied_table_is_read_by_its_head():
    """SmolLM2's head is its input table: a step reads it whole, except under int8-fast and
    int4-fast, whose head is a quantized copy beside the bf16 table (what fast_path.py measures)."""
    config = config_for("HuggingFaceTB/SmolLM2-135M-Instruct")
    cpu = Hardware(id="cpu", name="test", kind="cpu", memory_bytes=2 ** 34, bandwidth_bytes_per_s=2e10, bf16_flops=1e12,
                   usd_per_hour=None, watts=None)
    bf16 = costs.estimate(config, cpu, "bf16", "bf16", context=64)
    assert bf16.weights_read_bytes == bf16.weights_bytes
    assert bf16.flops_per_token == 2.0 * bf16.parameters + 4 * 30 * 9 * 64 * 64  # the head's product counts once
    int8 = costs.estimate(config, cpu, "int8-fast", "bf16", context=64)
    assert int8.weights_bytes - int8.weights_read_bytes == 2 * 49152 * 576 - 2 * 576
    assert int8.memory_bound_tokens_per_s == pytest.approx(2e10 / (int8.weights_read_bytes + 64 * 30 * 2 * 3 * 64 * 2))


def test_compute_bound_beyond_the_ridge(llama8b):
    short = costs.estimate(llama8b, FLAT, "bf16", "bf16", context=16, batch=1)
    assert short.ridge_batch is not None and short.ridge_batch > 1
    # an untied table is looked up, not multiplied: 2 FLOPs per other weight, plus the attention
    assert short.flops_per_token == 2.0 * (short.parameters - 128256 * 4096) + 4 * 32 * 32 * 128 * 16
    before = costs.estimate(llama8b, FLAT, "bf16", "bf16", context=16, batch=int(short.ridge_batch * 0.8))
    after = costs.estimate(llama8b, FLAT, "bf16", "bf16", context=16, batch=int(short.ridge_batch * 1.25) + 1)
    assert (before.bound, after.bound) == ("memory", "compute")
    assert after.decode_tokens_per_s_ceiling == pytest.approx(FLAT.bf16_flops / after.flops_per_token)
    # at long contexts every sequence's KV reads grow as fast as its compute: never compute-bound
    assert costs.estimate(llama8b, FLAT, "bf16", "bf16", context=8192, batch=1).ridge_batch is None


def test_training_breakeven_is_three_times_the_training_tokens(llama8b):
    e = costs.estimate(llama8b, FLAT, "bf16", context=1, batch=1, training_tokens=15e12)
    assert e.training_flops == pytest.approx(6 * e.parameters * 15e12)
    assert e.training_breakeven_tokens == pytest.approx(45e12)


def test_precisions_and_formats_shrink_the_weights(llama8b):
    sizes = {p: costs.estimate(llama8b, FLAT, p, context=1).weights_bytes for p in ("fp32", "bf16", "int8", "nf4", "q8_0", "q4_k")}
    assert sizes["fp32"] == 2 * sizes["bf16"]
    assert sizes["bf16"] > sizes["int8"] > sizes["q8_0"] > sizes["q4_k"]
    # bitsandbytes leaves the embeddings and output head in 16 bits; GGUF quantizes every matrix
    assert sizes["nf4"] > sizes["q4_k"]
    assert sizes["q4_k"] == int(8_030_261_248 * 4.5 / 8)


def test_fits_against_device_memory(llama8b):
    small = Hardware(**{**FLAT.to_dict(), "memory_bytes": 8 * 2 ** 30})
    assert not costs.estimate(llama8b, small, "bf16", context=1).fits
    assert costs.estimate(llama8b, small, "nf4", context=1).fits


def test_kv_dtypes_and_sliding_windows():
    gemma = config_for("google/gemma-2-9b")
    long = costs.estimate(gemma, FLAT, "bf16", "bf16", context=32768)
    short = costs.estimate(gemma, FLAT, "bf16", "fp8", context=32768)
    assert short.kv_bytes_total * 2 == long.kv_bytes_total
    # half the layers slide over 4096 tokens: far less than 32768 × all layers
    assert long.kv_bytes_total < 32768 * long.kv_bytes_per_token * 0.6


def test_predicted_kv_matches_a_measured_run(loaded_llama):
    from engine.base.request import GenerationRequest

    finished = list(generate(loaded_llama, GenerationRequest("fox jumps", mode="raw", max_new_tokens=9,
                                                            ignore_eos=True)))[-1]
    in_cache = finished.prompt_tokens + finished.tokens - 1
    e = costs.estimate(loaded_llama.model.config, FLAT, "fp32", "fp32", context=in_cache)
    assert e.kv_bytes_total == finished.kv_cache_bytes
    assert e.weights_bytes + 64 == loaded_llama.info.weights_bytes  # + the rotary buffer


def test_this_machine_is_measured_once_and_cached(isolated_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "measure_cpu", lambda: calls.append(1) or {"bandwidth_bytes_per_s": 2e10,
                                                                              "bf16_flops": 3e11})
    first = hardware.this_machine()
    second = hardware.this_machine()
    assert calls == [1] and first.bandwidth_bytes_per_s == second.bandwidth_bytes_per_s == 2e10
    hardware.this_machine(measure=True)
    assert calls == [1, 1]


def test_measure_cpu_gives_plausible_numbers():
    result = hardware.measure_cpu()
    assert 1e9 < result["bandwidth_bytes_per_s"] < 2e12
    assert 1e8 < result["bf16_flops"] < 1e16  # a CPU without bf16 instructions (AVX2 only) reads ~1e9
    if hardware.last_level_cache_bytes():  # read from its cache too, and faster than from memory
        assert result["cache_bytes"] == hardware.last_level_cache_bytes()
        assert result["cache_bandwidth_bytes_per_s"] > result["bandwidth_bytes_per_s"]


def test_a_step_whose_bytes_fit_in_the_l3_is_bound_by_the_l3_not_the_memory():
    """On a CPU whose last-level cache holds a step's bytes, the memory-bound line (and so the
    ceiling) uses that cache's bandwidth, and the estimate says which; a step past three quarters
    of it reads from memory, and a profile without the cache's figures uses the memory's."""
    cpu = Hardware(id="cpu", name="test", kind="cpu", memory_bytes=2 ** 34, bandwidth_bytes_per_s=2e10,
                   bf16_flops=1e14, usd_per_hour=None, watts=None, cache_bytes=480 * 2 ** 20,
                   cache_bandwidth_bytes_per_s=2e11)
    assert cpu.bandwidth_for(100 * 2 ** 20) == (2e11, "L3") and cpu.bandwidth_for(400 * 2 ** 20) == (2e10, "memory")
    small = costs.estimate(config_for("default"), cpu, "int8", "bf16", 256, 1)
    assert small.bandwidth_level == "L3" and small.bandwidth_bytes_per_s == 2e11
    assert small.memory_bound_tokens_per_s == pytest.approx(2e11 / (small.weights_read_bytes + small.kv_bytes_total))
    big = costs.estimate(config_for("meta-llama/Llama-3.1-8B"), cpu, "bf16", "bf16", 256, 1)
    assert big.bandwidth_level == "memory" and big.bandwidth_bytes_per_s == 2e10
    plain = Hardware(**{**cpu.to_dict(), "cache_bytes": None, "cache_bandwidth_bytes_per_s": None})
    assert costs.estimate(config_for("default"), plain, "int8", "bf16", 256, 1).bandwidth_level == "memory"


def test_the_ceiling_takes_the_bandwidth_when_it_is_drawn(isolated_cache, monkeypatch):
    """Asked for a ceiling, this machine's bandwidth is measured again (the rest of its profile
    kept): a figure measured on a busier hour no longer caps a quicker one."""
    monkeypatch.setattr(hardware, "measure_cpu", lambda: {"bandwidth_bytes_per_s": 1e10, "bf16_flops": 3e11})
    monkeypatch.setattr(hardware, "measure_bandwidth", lambda: {"bandwidth_bytes_per_s": 3e10,
                                                               "bandwidth_measured_at": "now"})
    assert hardware.this_machine().bandwidth_bytes_per_s == 1e10
    again = hardware.this_machine(bandwidth=True)
    assert again.bandwidth_bytes_per_s == 3e10 and again.bf16_flops == 3e11
    assert hardware.this_machine().bandwidth_bytes_per_s == 3e10  # kept for the next reader


def test_edits_are_kept_and_sources_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_WORKBENCH_CONFIG", str(tmp_path))
    assert all(p.sources.get("bandwidth_bytes_per_s") for p in hardware.shipped_profiles())
    hardware.save_edit("l4", usd_per_hour=0.5)
    assert [p for p in hardware.profiles() if p.id == "l4"][0].usd_per_hour == 0.5


def test_estimate_cli(tmp_path):
    out = tmp_path / "e.json"
    result = subprocess.run([sys.executable, "-m", "engine.cli", "estimate", "--model", "meta-llama/Llama-3.1-8B",
                             "--precision", "bf16", "--kv-dtype", "bf16", "--context", "8192", "--batch", "4",
                             "--hardware", "h100-sxm", "--training-tokens", "15e12", "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    for key in ("parameters", "weights_bytes", "weights_read_bytes", "kv_bytes_per_token", "kv_bytes_total",
                "activation_bytes", "total_bytes",
                "fits", "decode_tokens_per_s_ceiling", "bound", "usd_per_million_tokens", "wh_per_million_tokens",
                "training_breakeven_tokens"):
        assert key in data
    assert data["kv_bytes_total"] == 4 * 8192 * 131_072 and data["bound"] == "memory" and data["fits"] is True
    assert "fits" in result.stdout


def test_hardware_cli_lists_this_machine():
    result = subprocess.run([sys.executable, "-m", "engine.cli", "hardware", "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    ids = [p["id"] for p in json.loads(result.stdout)]
    assert "h100-sxm" in ids and ids[-1] == "this-machine"
