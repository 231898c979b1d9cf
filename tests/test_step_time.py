"""The step-time model: hand-computed seconds for a tiny shape, and the measured 16 x 8 step it must reproduce."""

import pytest
from transformers import Qwen3Config

from longqa.distributed.planner import GIB, ModelSizes, plan_memory
from longqa.distributed.step_time import (DECODE_FRACTION_OF_FLOOR, GPU_ADAM_S_PER_PARAM, HOST_ADAM_CORE_S_PER_PARAM,
                                          HOST_CORES_PER_GPU, NVLINK_BYTES_PER_S, PCIE_BYTES_PER_S, PREFILL_MFU,
                                          UPDATE_MFU, plan_step_time)
from longqa.model.shapes import SHAPES

PEAK = 989e12
HBM = 4.3e12
# qwen3-tiny by hand: per layer q 64x64, k and v 32x64, o 64x64, MLP 3 x 64x128; two layers; head 512 x 64
LINEAR = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
HEAD = 512 * 64
ATTENTION = 16 * 4 * 2  # head_dim x heads x layers
KV_TOKEN = 2 * 2 * 2 * 16  # keys and values x layers x KV heads x head_dim


def tiny():
    return ModelSizes.from_config(Qwen3Config(**SHAPES["qwen3-tiny"]))


def step(sizes, world=1, cpu_offload=False, batch=2, mini=2, n=2, prompt=100, response=10, budget=1000, **extra):
    plan = plan_memory(sizes, world_size=world, gpu_bytes=141 * GIB, micro_batch_tokens=budget, prompt_length=prompt,
                       response_length=response, n=n, cpu_offload=cpu_offload, param_bytes=2,
                       sharded=world > 1 or cpu_offload, groups_per_rank=batch // world)
    return plan_step_time(sizes, plan, gpus_per_node=8, prompt_length=prompt, response_length=response, n=n,
                          batch_size=batch, mini_batch_size=mini, epochs=1, micro_batch_tokens=budget,
                          recomputed=0.0, cpu_offload=cpu_offload, **extra)


def test_one_gpu_phases_against_hand_counts():
    sizes = tiny()
    t = step(sizes)
    prefill = 2 * LINEAR * 100 + 4 * ATTENTION * 100 * 101 // 2  # one prompt's forward
    assert t.prefill == pytest.approx(2 * prefill / (PEAK * PREFILL_MFU))
    # two groups in flight for 10 steps: the weights each step, each group's prompt KV each step, each sample's own
    floor = 2 * (10 * (LINEAR + HEAD) + KV_TOKEN * (100 * 2 * 10 + 2 * 2 * sum(range(10)))) / HBM
    assert t.decode == pytest.approx(floor / DECODE_FRACTION_OF_FLOOR)
    # both groups fit one micro-batch: 120 tokens each, the head on 20, pairs: the prompt's and each response's
    pairs = 100 * 101 // 2 + 2 * (10 * 100 + 10 * 11 // 2)
    group = 6 * LINEAR * 120 + 6 * HEAD * 20 + 12 * ATTENTION * pairs
    assert t.micro_batches == 1 and t.old_logprobs == 0  # one mini-batch, one epoch: on-policy
    assert t.update == pytest.approx(2 * group / (PEAK * UPDATE_MFU))
    assert t.optimizer == pytest.approx(GPU_ADAM_S_PER_PARAM * sizes.params) and t.optimizer_steps == 1
    assert t.refresh == 0  # one process: the engine shares the model's weights
    assert t.total == pytest.approx(t.prefill + t.decode + t.update + t.optimizer)


def test_sharded_and_offloaded_micro_batches_wait_for_their_copies():
    sizes = tiny()
    t = step(sizes, world=2, cpu_offload=True, batch=4, mini=1, budget=120)  # 2 groups a rank, one a micro-batch
    shard = 2 * sizes.params / 2
    assert t.micro_batches == 2 and t.optimizer_steps == 2
    # compute is negligible at this size: each micro-batch takes its copies over PCIe (the shards in twice, the
    # gradients out: the way in is the longer)
    assert 2 * shard / PCIE_BYTES_PER_S > 8 * sizes.params / NVLINK_BYTES_PER_S
    assert t.update == pytest.approx(2 * 2 * shard / PCIE_BYTES_PER_S)
    assert t.old_logprobs == pytest.approx(2 * shard / PCIE_BYTES_PER_S)  # two mini-batches: a forward first
    per_param = HOST_ADAM_CORE_S_PER_PARAM[2] / HOST_CORES_PER_GPU
    assert t.optimizer == pytest.approx(2 * per_param * sizes.params / 2)
    assert t.refresh == pytest.approx(2 * sizes.params / NVLINK_BYTES_PER_S + shard / PCIE_BYTES_PER_S)


def test_a_group_over_the_budget_is_cut_into_packs_that_each_carry_the_prompt():
    sizes = tiny()
    whole, cut = step(sizes, batch=1, mini=1, budget=120), step(sizes, batch=1, mini=1, budget=110)
    assert (whole.micro_batches, cut.micro_batches) == (1, 2)
    one_response = 6 * LINEAR * 110 + 6 * HEAD * 10 + 12 * ATTENTION * (100 * 101 // 2 + 10 * 100 + 10 * 11 // 2)
    assert cut.update == pytest.approx(2 * one_response / (PEAK * UPDATE_MFU))


def test_the_measured_16_x_8_step_is_reproduced():
    """Qwen3-1.7B, 16 prompts of 8,192 tokens x 8 responses of 1,024, one H200, bf16, nothing recomputed: rollout
    8.81 s and update 8.46 s (benchmarks/RESULTS.md, whole GRPO step, 8cd9084)."""
    sizes = ModelSizes.from_config(Qwen3Config(**SHAPES["qwen3-1.7b"]))
    t = step(sizes, batch=16, mini=16, n=8, prompt=8192, response=1024, budget=16384)
    assert t.prefill + t.decode == pytest.approx(8.81, rel=0.1)
    assert t.update + t.optimizer + t.refresh == pytest.approx(8.46, rel=0.15)


def test_offloaded_activations_go_out_and_come_back_over_pcie():
    sizes = tiny()
    t = step(sizes, batch=1, mini=1, budget=120, activation_offload=1.0)
    # both layers' activations of a 120-token micro-batch: 6 x 64 + 3 x 128 bf16 values a token, each way
    assert t.update == pytest.approx(2 * 120 * 2 * (6 * 64 + 3 * 128) / PCIE_BYTES_PER_S)
