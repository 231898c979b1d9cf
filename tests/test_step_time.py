"""The step-time model: hand-computed seconds for a tiny shape, and the measured 16 x 8 step it must reproduce."""

import pytest
from transformers import Qwen3Config

from longqa.model.shapes import SHAPES
from longqa.planning.flops import decode_floor_s
from longqa.planning.planner import GIB, ModelSizes, plan_memory
from longqa.planning.step_time import (
    DECODE_FRACTION_OF_FLOOR,
    GPU_ADAM_S_PER_PARAM,
    HOST_ADAM_S_PER_PARAM,
    NVLINK_BYTES_PER_S,
    OFFLOAD_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    PREFILL_MFU,
    UPDATE_MFU,
    attention_mfu,
    plan_step_time,
)

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
    plan = plan_memory(
        sizes,
        world_size=world,
        gpu_bytes=141 * GIB,
        micro_batch_tokens=budget,
        prompt_length=prompt,
        response_length=response,
        n=n,
        cpu_offload=cpu_offload,
        param_bytes=2,
        sharded=world > 1 or cpu_offload,
        groups_per_rank=batch // world,
    )
    return plan_step_time(
        sizes,
        plan,
        gpus_per_node=8,
        prompt_length=prompt,
        response_length=response,
        n=n,
        batch_size=batch,
        mini_batch_size=mini,
        epochs=1,
        micro_batch_tokens=budget,
        recomputed=0.0,
        cpu_offload=cpu_offload,
        **extra,
    )


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
    products, attention = 6 * LINEAR * 120 + 6 * HEAD * 20, 12 * ATTENTION * pairs
    assert t.micro_batches == 1 and t.old_logprobs == 0  # one mini-batch, one epoch: on-policy
    assert t.update == pytest.approx(2 * (products / (PEAK * UPDATE_MFU) + attention / (PEAK * attention_mfu(16))))
    assert t.optimizer == pytest.approx(GPU_ADAM_S_PER_PARAM * sizes.params) and t.optimizer_steps == 1
    assert t.refresh == 0  # one process: the engine shares the model's weights
    assert t.total == pytest.approx(t.prefill + t.decode + t.update + t.optimizer)


def test_sharded_and_offloaded_micro_batches_wait_for_their_copies():
    sizes = tiny()
    t = step(sizes, world=2, cpu_offload=True, batch=4, mini=1, budget=120)  # 2 groups a rank, one a micro-batch
    shard = 2 * sizes.params / 2
    assert t.micro_batches == 2 and t.optimizer_steps == 2
    # compute is negligible at this size: each micro-batch waits for FSDP2's offload (the bf16 shards in twice, the
    # gradients out), longer than for its collectives
    offload = 3 * shard / OFFLOAD_BYTES_PER_S["fsdp2"]
    assert offload > 8 * sizes.params / NVLINK_BYTES_PER_S
    assert t.update == pytest.approx(2 * offload)
    assert t.old_logprobs == pytest.approx(2 * shard / OFFLOAD_BYTES_PER_S["fsdp2"])  # two mini-batches: a forward
    assert t.optimizer == pytest.approx(2 * HOST_ADAM_S_PER_PARAM["fsdp2"] / 2 * sizes.params / 2)  # bf16: half
    assert t.refresh == pytest.approx(2 * sizes.params / NVLINK_BYTES_PER_S + shard / PCIE_BYTES_PER_S)
    # ZeRO-3's partitions stay on the GPU: only the float32 gradients go out, and the forward brings nothing in
    t = step(sizes, world=2, cpu_offload=True, batch=4, mini=1, budget=120, strategy="deepspeed", state_bytes=4)
    offload = 4 * sizes.params / 2 / OFFLOAD_BYTES_PER_S["deepspeed"]
    assert t.update == pytest.approx(2 * max(offload, 8 * sizes.params / NVLINK_BYTES_PER_S))
    assert t.old_logprobs == pytest.approx(2 * 2 * sizes.params / NVLINK_BYTES_PER_S)  # the gathers alone
    assert t.optimizer == pytest.approx(2 * HOST_ADAM_S_PER_PARAM["deepspeed"] * sizes.params / 2)
    assert t.refresh == pytest.approx(2 * sizes.params / NVLINK_BYTES_PER_S)


@pytest.mark.parametrize("strategy,measured", [("fsdp2", 39.63), ("deepspeed", 4.69)])
def test_the_measured_offloaded_updates_are_reproduced(strategy, measured):
    """Qwen3-1.7B offloaded on one H200, float32 masters, 8 prompts of 512 tokens x 8 responses of drawn lengths up
    to 64 (a mean of about 26), one group a micro-batch: updates of 39.63 s under FSDP2 and 4.69 s under ZeRO-3
    (benchmarks/RESULTS.md, offloaded optimizer, e4fccee)."""
    sizes = ModelSizes.from_config(Qwen3Config(**SHAPES["qwen3-1.7b"]))
    t = step(
        sizes,
        cpu_offload=True,
        batch=8,
        mini=8,
        n=8,
        prompt=512,
        response=26,
        budget=1024,
        strategy=strategy,
        state_bytes=4,
    )
    assert t.micro_batches == 8
    assert t.update + t.optimizer == pytest.approx(measured, rel=0.1)


def test_a_group_over_the_budget_is_cut_into_packs_that_each_carry_the_prompt():
    sizes = tiny()
    whole, cut = step(sizes, batch=1, mini=1, budget=120), step(sizes, batch=1, mini=1, budget=110)
    assert (whole.micro_batches, cut.micro_batches) == (1, 2)
    products, attention = 6 * LINEAR * 110 + 6 * HEAD * 10, 12 * ATTENTION * (100 * 101 // 2 + 10 * 100 + 10 * 11 // 2)
    assert cut.update == pytest.approx(2 * (products / (PEAK * UPDATE_MFU) + attention / (PEAK * attention_mfu(16))))


def test_the_attention_rate_follows_the_head_dimension_between_the_measured_ones():
    assert attention_mfu(64) == 0.191 and attention_mfu(128) == 0.303
    assert attention_mfu(96) == pytest.approx((0.191 + 0.303) / 2)
    assert attention_mfu(16) == 0.191 and attention_mfu(256) == 0.303  # held outside them


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
    # both layers' activations of a 120-token micro-batch: 8 x 64 + 3 x 128 + 3 x 32 bf16 values a token (hidden and
    # queries, the MLP's, keys and values), each way
    assert t.update == pytest.approx(2 * 120 * 2 * (8 * 64 + 3 * 128 + 3 * 32) / PCIE_BYTES_PER_S)


def test_a_small_model_s_update_at_long_prompts_is_counted_with_its_slower_attention():
    """SmolLM2-135M's shape (head dim 64), 64 prompts of 8,192 tokens x 8 responses (drawn lengths, a mean of 157),
    one H200, bf16, compiled flex: updates of 4.55-4.60 s (benchmarks/RESULTS.md, a small model at long prompts,
    3026ca7), three quarters of it attention. One rate for all FLOPs put it at 2.0 s."""
    sizes = ModelSizes.from_config(Qwen3Config(**SHAPES["smollm2-135m"]))
    t = step(sizes, batch=64, mini=64, n=8, prompt=8192, response=157, budget=45056)
    assert t.update + t.optimizer == pytest.approx(4.57, rel=0.2)


def test_drawn_lengths_hold_each_group_until_its_longest_sample():
    """rollout.response_lengths=lognormal: the plan decodes the drawn lengths, each group for as many steps as its
    longest sample, which takes longer than every sample at their mean length."""
    from longqa.config import load_config
    from longqa.planning.step_time import planned_lengths
    from longqa.rollout.lengths import draw_response_lengths

    sizes = tiny()
    cfg = load_config(
        None,
        [
            "rollout.response_lengths=lognormal",
            "rollout.n=8",
            "data.train_batch_size=6",
            "data.max_response_length=64",
            "trainer.seed=3",
        ],
    )
    lengths = planned_lengths(cfg, world_size=2)
    assert lengths == [draw_response_lengths("lognormal", 8, 64, (3, 0, g, 0)) for g in range(3)]
    assert planned_lengths(cfg, world_size=2, response_length=40) == 40
    assert planned_lengths(load_config(None, ["data.max_response_length=64"]), world_size=2) == 64
    flat = [length for group in lengths for length in group]
    mean = round(sum(flat) / len(flat))
    plan = plan_memory(
        sizes,
        world_size=1,
        gpu_bytes=141 * GIB,
        micro_batch_tokens=1000,
        prompt_length=100,
        response_length=64,
        n=8,
        param_bytes=2,
        sharded=False,
        groups_per_rank=3,
    )
    drawn, averaged = (
        plan_step_time(
            sizes,
            plan,
            gpus_per_node=8,
            prompt_length=100,
            response_length=r,
            n=8,
            batch_size=3,
            mini_batch_size=3,
            epochs=1,
            micro_batch_tokens=1000,
            recomputed=0.0,
            cpu_offload=False,
        )
        for r in (lengths, mean)
    )
    floor = decode_floor_s(sizes.config, 100, lengths, in_flight=plan.kv_groups)
    assert drawn.decode == pytest.approx(floor / DECODE_FRACTION_OF_FLOOR)
    assert drawn.decode > averaged.decode and max(flat) > mean
