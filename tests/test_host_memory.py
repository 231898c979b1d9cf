"""The host-memory plan: hand-computed bytes for made-up and tiny shapes, the node's peak, refusals with advice."""

import pytest
from transformers import Qwen3Config

from longqa.model.shapes import SHAPES
from longqa.planning.host_memory import (
    HOST_MARGIN_BYTES,
    check_host_plan,
    fsdp2_offloaded_state,
    offloaded_activations,
    pinned_bytes,
    plan_host_memory,
)
from longqa.planning.planner import GIB, ModelSizes, PlanError


def sizes(shape):
    return ModelSizes.from_config(Qwen3Config(**SHAPES[shape]))


def test_pinned_memory_is_rounded_up_to_a_power_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 600, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]


def test_fsdp2_pins_each_padded_shard_and_its_gradient_and_not_the_moments():
    made_up = ModelSizes(
        params=507,
        layer_params=0,
        embedding_params=0,
        hidden=0,
        intermediate=0,
        layers=0,
        kv_heads=0,
        head_dim=0,
        vocab=0,
        shapes=((5, 100), (7,)),
    )
    # (5, 100) over 2 ranks: 3 rows of 100 in bf16, 600 bytes, pinned as 1,024 twice, plus 2 x 600 of moments;
    # (7,): 4 elements, 8 bytes, pinned as 8 twice, plus 2 x 8
    assert fsdp2_offloaded_state(made_up, world_size=2, param_bytes=2) == 2 * 1024 + 2 * 600 + 2 * 8 + 2 * 8
    assert fsdp2_offloaded_state(made_up, world_size=1, param_bytes=4) == 2 * 2048 + 2 * 2000 + 2 * 32 + 2 * 28


def test_the_offloaded_state_of_a_real_shape_lies_between_its_bytes_and_twice_its_pinned_half():
    qwen3_8b = sizes("qwen3-8b")
    exact = 8 * qwen3_8b.params / 2  # four bf16 tensors a parameter, over 2 ranks
    state = fsdp2_offloaded_state(qwen3_8b, world_size=2, param_bytes=2)
    assert exact < state < 1.5 * exact


def test_offloaded_activations_are_the_offloaded_layers_tensors_each_rounded():
    tiny = sizes("qwen3-tiny")  # hidden 64, MLP 128, 4 query heads and 2 key/value heads of 16, 2 layers
    # one layer of two, in bf16: eight tensors of 1,000 tokens x 64 (hidden and queries; 128,000 bytes ->
    # 131,072), three of 1,000 x 128 (the MLP's; 256,000 -> 262,144), three of 1,000 x 32 (keys and values;
    # 64,000 -> 65,536)
    one_layer = 8 * 131072 + 3 * 262144 + 3 * 65536
    assert offloaded_activations(tiny, 1000, 0.5) == one_layer
    assert offloaded_activations(tiny, 1000, 1.0) == 2 * one_layer
    assert offloaded_activations(tiny, 1000, 0.0) == 0


def test_the_node_peak_is_its_ranks_times_the_larger_phase_plus_margins_and_the_prompt_cache():
    tiny = sizes("qwen3-tiny")
    plan = plan_host_memory(
        tiny,
        world_size=8,
        ranks_per_node=4,
        host_bytes=64 * GIB,
        param_bytes=4,
        micro_batch_tokens=1000,
        cpu_offload=True,
        activation_offload=0.5,
        prompt_tokens=1000,
    )
    assert plan.loading == 4 * tiny.params
    assert plan.offloaded_state == fsdp2_offloaded_state(tiny, 8, 4)
    assert plan.offloaded_activations == 8 * 131072 + 3 * 262144 + 3 * 65536  # one layer's, as above
    assert plan.peak == 4 * (max(plan.loading, plan.training) + HOST_MARGIN_BYTES) + 4 * 1000
    zero3 = plan_host_memory(
        tiny,
        world_size=8,
        ranks_per_node=4,
        host_bytes=64 * GIB,
        param_bytes=2,
        micro_batch_tokens=1000,
        cpu_offload=True,
        strategy="deepspeed",
        prompt_tokens=0,
    )
    assert zero3.offloaded_state == 16 * tiny.params // 8
    assert (
        plan_host_memory(
            tiny, world_size=8, ranks_per_node=4, host_bytes=64 * GIB, param_bytes=2, micro_batch_tokens=1000
        ).training
        == 0
    )  # nothing offloaded: nothing on the host


def test_refusals_name_what_to_change():
    qwen3_32b = sizes("qwen3-32b")
    common = dict(micro_batch_tokens=20480, param_bytes=2)
    # two ranks holding the offloaded state of Qwen3-32B: more than 256 GiB with the pinned rounding
    plan = plan_host_memory(qwen3_32b, world_size=2, ranks_per_node=2, host_bytes=256 * GIB, cpu_offload=True, **common)
    assert plan.offloaded_state > plan.loading
    with pytest.raises(
        PlanError,
        match=r"GiB of host memory per node but a node has 256.0 GiB.*use more GPUs "
        r"\(the offloaded state, .* GiB per rank, is divided by their number, now 2\)",
    ):
        check_host_plan(plan, 2, 2)
    # eight ranks each reading the whole model in fp32: the load is the peak
    plan = plan_host_memory(
        qwen3_32b,
        world_size=8,
        ranks_per_node=8,
        host_bytes=512 * GIB,
        cpu_offload=False,
        micro_batch_tokens=20480,
        param_bytes=4,
    )
    with pytest.raises(
        PlanError,
        match=r"fewer ranks per node \(--gpus-per-node; each reads the whole model, 122.0 "
        r"GiB.*model.dtype=bfloat16.*--host-memory-gib",
    ):
        check_host_plan(plan, 8, 4)
    plan = plan_host_memory(
        sizes("qwen3-8b"),
        world_size=1,
        ranks_per_node=1,
        host_bytes=128 * GIB,
        micro_batch_tokens=262144,
        param_bytes=2,
        activation_offload=0.5,
    )
    with pytest.raises(PlanError, match="lower model.activation_offload"):
        check_host_plan(plan, 1, 2)
    check_host_plan(
        plan_host_memory(qwen3_32b, world_size=8, ranks_per_node=8, host_bytes=1024 * GIB, cpu_offload=True, **common),
        8,
        2,
    )  # one node of eight: fits


def test_the_ratio_named_for_a_partial_offload_fits_in_whole_sub_groups():
    """ZeRO-3 offloading Qwen3-8B's optimizer on one GPU (9 sub-groups of 10^9 parameters): the named ratio is the
    largest whose sub-groups fit the node; none is named where even the whole optimizer on the GPU would not do."""
    from longqa.planning.host_memory import fitting_offload_ratio

    qwen3_8b = sizes("qwen3-8b")

    def plan(host_gib, fraction=1.0):
        return plan_host_memory(
            qwen3_8b,
            world_size=1,
            ranks_per_node=1,
            host_bytes=host_gib * GIB,
            param_bytes=2,
            micro_batch_tokens=16384,
            cpu_offload=True,
            strategy="deepspeed",
            offload_fraction=fraction,
        )

    assert (plan(96).sub_groups, plan(96).optimizer_bytes) == (9, 16 * qwen3_8b.params)
    for host_gib in (40, 64, 96, 120):
        ratio = fitting_offload_ratio(plan(host_gib))
        on_host = 9 - int((1 - ratio) * 9)
        assert plan(host_gib, on_host / 9).peak <= host_gib * GIB < plan(host_gib, (on_host + 1) / 9).peak
    assert fitting_offload_ratio(plan(19)) is None  # the load alone (15.3 GiB + margin) is over
