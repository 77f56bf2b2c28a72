"""Planning past one GPU: Llama-3.1-70B at 32k context on H100-80GB, checked against figures
computed by hand from its config (hidden 8192, 80 layers, 64 heads, 8 KV heads of 128,
intermediate 28672, vocabulary 128256, untied head)."""

from __future__ import annotations

import pytest

from engine.base.errors import InvalidRequestError
from engine.estimates import hardware
from engine.estimates.estimate import config_for
from engine.estimates.parallel import plan_tensor_parallel

# parameters: 2 × 128256 × 8192 (embeddings, head) + 80 × (2 × 8192² + 2 × 8192 × 1024 + 3 × 8192 × 28672
# + 2 × 8192) + 8192 = 70,553,706,496
WEIGHTS = 2 * 70_553_706_496  # bf16
READ = WEIGHTS - 2 * 128256 * 8192 + 2 * 8192  # a token reads one row of the untied input table: 139,006,083,072
KV = 2 * 80 * 8 * 128 * 2 * 32768  # K and V, 80 layers, 8 heads of 128, bf16, 32k tokens: 10 GiB
DECODE_ACTIVATION = (4 * 8192 + 2 * 28672) * 2 + 4 * 128256 + 4 * 64 * 32768
PREFILL_ACTIVATION = 8192 * (4 * 8192 + 2 * 28672) * 2
RUNTIME = 2 * 2**30
USABLE = int(0.9 * 80 * 2**30)


@pytest.fixture(scope="module")
def plan():
    config = config_for("meta-llama/Llama-3.1-70B")
    return plan_tensor_parallel(config, hardware.get("h100-sxm"), "bf16", "bf16", 32768, 1,
                                model="meta-llama/Llama-3.1-70B")


def test_per_gpu_memory_by_hand(plan):
    by_size = {o.gpus: o for o in plan.options}
    assert list(by_size) == [1, 2, 4, 8]
    for n, option in by_size.items():
        assert option.weights_per_gpu_bytes == -(-WEIGHTS // n)
        assert option.kv_per_gpu_bytes == KV // n  # 8 KV heads: split up to 8 ways
        assert option.activation_per_gpu_bytes == -(-(DECODE_ACTIVATION + PREFILL_ACTIVATION) // n)
        assert option.total_per_gpu_bytes == (-(-WEIGHTS // n) + KV // n
                                              + -(-(DECODE_ACTIVATION + PREFILL_ACTIVATION) // n) + RUNTIME)
        assert option.usable_per_gpu_bytes == USABLE
    assert by_size[4].total_per_gpu_bytes == 40_480_060_672
    assert by_size[2].total_per_gpu_bytes == 78_812_637_696 > USABLE  # two GPUs: 73.4 GiB of 72 allowed


def test_the_gpu_count_and_the_commands(plan):
    assert plan.chosen.gpus == 4
    assert plan.vllm_command == ("vllm serve meta-llama/Llama-3.1-70B --tensor-parallel-size 4 --max-model-len 32768 "
                                 "--gpu-memory-utilization 0.90 --max-num-seqs 1 --dtype bfloat16")
    assert plan.sglang_command.startswith("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-70B "
                                          "--tp 4 --context-length 32768 --mem-fraction-static 0.90")


def test_interconnect_and_ceiling_by_hand(plan):
    four = plan.chosen
    # a ring all-reduce of the bf16 hidden state, twice a layer: 2 × (4-1)/4 × 8192 × 2 bytes × 2 × 80
    assert four.allreduce_bytes_per_token == 3_932_160
    link = 450e9  # NVLink, one direction
    assert four.interconnect_time_s == pytest.approx(3_932_160 / link + 160 * 5e-6)
    memory = (-(-READ // 4) + KV // 4) / 3.35e12
    assert four.memory_time_s == pytest.approx(memory)
    assert four.bound == "memory"
    assert four.decode_tokens_per_s_ceiling == pytest.approx(1 / (memory + four.interconnect_time_s))
    assert plan.usd_per_million_tokens == pytest.approx(4 * 2.99 / (four.decode_tokens_per_s_ceiling * 3600) * 1e6)


def test_more_gpus_than_kv_heads_copy_the_heads():
    config = config_for("meta-llama/Llama-3.1-70B")
    plan = plan_tensor_parallel(config, hardware.get("l4"), "bf16", "bf16", 8192, 4, largest=32)
    by_size = {o.gpus: o for o in plan.options}
    assert by_size[16].kv_per_gpu_bytes == by_size[8].kv_per_gpu_bytes  # a GPU holds one KV head either way
    assert plan.chosen.gpus == 8 and "--tensor-parallel-size 8" in plan.vllm_command


def test_a_cpu_profile_is_refused_and_nothing_fits_is_said(capsys):
    from engine.cli import main

    config = config_for("meta-llama/Llama-3.1-70B")
    with pytest.raises(InvalidRequestError, match="GPU"):
        plan_tensor_parallel(config, hardware.get("ddr5-desktop"))
    assert plan_tensor_parallel(config, hardware.get("rtx-3060"), context=131072, largest=8).chosen is None
    assert main(["estimate", "--model", "meta-llama/Llama-3.1-70B", "--hardware", "h100-sxm", "--context", "32768",
                 "--gpus"]) == 0
    out = capsys.readouterr().out
    assert "→ 4 GPUs" in out and "vllm serve meta-llama/Llama-3.1-70B --tensor-parallel-size 4" in out


def test_a_quantized_plan_keeps_every_flag_before_its_note():
    from engine.estimates.parallel import sglang_command, vllm_command

    command = vllm_command("M", 4, 8192, 2, "int4", "fp8", 0.9)
    flags, _, note = command.partition("  # ")
    assert "--quantization awq" in flags and "--kv-cache-dtype fp8" in flags  # not lost after a shell comment
    assert note == "a checkpoint quantized to int4"
    assert sglang_command("M", 4, 8192, 2, "fp8", "fp8", 0.9).endswith("--quantization fp8 --kv-cache-dtype fp8_e5m2")


def test_a_load_point_is_a_share_of_the_ceiling_of_its_gpu_count():
    from engine.estimates.parallel import ceiling_for

    config = config_for("meta-llama/Llama-3.1-70B")
    h100 = hardware.get("h100-sxm")
    # 16 requests of 2,048 tokens on 4 GPUs: the weights read/4 (16 rows of the input table) + 16 × KV(2048)/4
    # read once a step, and 16 × the link time
    kv = 2 * 80 * 8 * 128 * 2 * 2048
    memory = (-(-(READ + 15 * 2 * 8192) // 4) + 16 * kv // 4) / 3.35e12
    link = 16 * 3_932_160 / 450e9 + 160 * 5e-6
    compute = 16 * plan_tensor_parallel(config, h100, "bf16", "bf16", 2048, 16).options[0].compute_time_s / 4
    assert ceiling_for(config, h100, "bf16", "bf16", 2048, 16, gpus=4) == pytest.approx(
        16 / (max(memory, compute) + link), rel=1e-3)
    one = ceiling_for(config, h100, "bf16", "bf16", 2048, 16, gpus=1)
    assert one < ceiling_for(config, h100, "bf16", "bf16", 2048, 16, gpus=4)  # one GPU reads every weight itself
    with pytest.raises(InvalidRequestError, match="evenly"):
        ceiling_for(config, h100, "bf16", "bf16", 2048, 16, gpus=3)
