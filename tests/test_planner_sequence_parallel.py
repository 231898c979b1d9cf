"""The planner under Ulysses sequence parallelism (``actor.sequence_parallel_size``): a rank's share of a row counted
against a hand computation, the all-to-alls' time, the degree a refused plan names, the longest prompt each shape
trains, and where one group's KV no longer fits the fast engine's GPU."""

import pytest
from transformers import Qwen3Config

from longqa.cli import main
from longqa.config import load_config
from longqa.model.shapes import SHAPES
from longqa.planning.activations import Compute, activation_bytes, all_to_all_bytes, layer_bytes
from longqa.planning.fit import Machine, longest_prompt, shape_sizes, trains_prompt
from longqa.planning.planner import (
    GIB,
    ModelSizes,
    PlanError,
    check_plan,
    fitting_sequence_parallel,
    longest_kv_prompt,
    plan_memory,
    sequence_parallel_degrees,
    with_sequence_parallel,
)
from longqa.planning.step_time import ALL_TO_ALL_BYTES_PER_S, all_to_all_s

H200 = 141 * GIB
COMPILED = Compute(compiled=True)


def tiny():  # hidden 64, MLP 128, 2 layers, 4 query heads and 2 key/value heads of 16, vocabulary 512
    return ModelSizes.from_config(Qwen3Config(**SHAPES["qwen3-tiny"]))


def test_a_rank_keeps_its_share_of_the_row_and_attention_over_the_whole_row_for_its_heads():
    """qwen3-tiny by hand, a 1,024-token row over 4 ranks. A compiled layer saves per token 16-bit widths 3 x 128
    (MLP), 4 x 64 (hidden), 3 x 64 (queries), 3 x 32 (keys), 1 x 64, and float32 4 x (2 x 4 + 2 + 2): 2,032 bytes.
    Of those, attention's kernel keeps queries, keys, values and output (2 x (64 + 64 + 32 + 32)) and a float32
    log-sum-exp per head (4 x 4): 400. Over 4 ranks a rank holds 256 tokens of the other 1,632 and, for all 1,024
    tokens, one query head and one key/value head (two repeated over four ranks): 2 x 16 x 4 + 4 = 132."""
    sizes = tiny()
    assert layer_bytes(sizes, COMPILED, 1024) == 1024 * 2032  # unsplit, as before
    assert layer_bytes(sizes, COMPILED, 1024, sequence_parallel=4) == 256 * 1632 + 1024 * 132
    split = activation_bytes(sizes, COMPILED, 1024, sequence_parallel=4)
    assert split.layers == 2 * (256 * 1632 + 1024 * 132)  # both layers kept
    # the key/value heads repeated: more than a quarter of the unsplit layer, which 2 x 16 x 3 + 4 would have been
    assert split.layers > 2 * 1024 * 2032 / 4
    # a layer's attention backward pass: the gradients of output, queries, keys and values in the kernel's layout
    # (1,024 tokens x 16 x (1 + 1 + 1 + 1)) and their sequence-layout all-to-all buffers (256 x 16 x (4 + 4 + 2 + 2))
    assert all_to_all_bytes(sizes, COMPILED, 1024, 4) == 2 * (1024 * 16 * 4 + 256 * 16 * 12)
    assert all_to_all_bytes(sizes, COMPILED, 1024, 1) == 0
    # per token of the rank's share: the LM head's and the bookkeeping are those of a 256-token row
    alone = activation_bytes(sizes, COMPILED, 256)
    assert (split.head, split.other) == (alone.head, alone.other)


def test_a_plan_over_sequence_parallel_ranks_divides_the_activations_alone():
    sizes = shape_sizes("qwen3-8b")
    common = dict(
        world_size=8,
        gpu_bytes=H200,
        micro_batch_tokens=139264,
        prompt_length=131072,
        response_length=2048,
        n=4,
        param_bytes=2,
        groups_per_rank=2,
    )
    one, two = plan_memory(sizes, **common), plan_memory(sizes, **common, sequence_parallel=2)
    assert (two.training_state, two.rollout_weights, two.rollout_kv) == (
        one.training_state,
        one.rollout_weights,
        one.rollout_kv,
    )
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-3)  # 8 key/value heads: none repeated
    assert one.total > H200 > two.total


def test_the_refusal_names_the_smallest_degree_that_divides_the_gpus_and_the_heads():
    sizes = shape_sizes("qwen3-8b")  # 32 query heads, 8 key/value heads
    assert sequence_parallel_degrees(sizes, 8) == [1, 2, 4, 8]
    assert sequence_parallel_degrees(sizes, 32, gpus_per_node=8) == [1, 2, 4, 8]  # within a node
    assert sequence_parallel_degrees(shape_sizes("smollm2-135m"), 8) == [1]  # 9 heads
    cfg = load_config("configs/loongrl-qwen3-8b.yaml", ["data.max_prompt_length=131072"])
    assert fitting_sequence_parallel(cfg, sizes, 8, H200) == (2, None)
    assert fitting_sequence_parallel(cfg, sizes, 8, 60 * GIB) is None  # no degree fits a 60 GiB GPU
    plan = plan_memory(
        sizes, world_size=8, gpu_bytes=H200, micro_batch_tokens=24576, prompt_length=131072, response_length=2048, n=4
    )
    with pytest.raises(PlanError, match=r"set actor.sequence_parallel_size=2, the smallest sequence-parallel degree"):
        check_plan(plan, False, True, 24576, None, fitting_parallel=(2, None))
    with pytest.raises(
        PlanError, match=r"actor.sequence_parallel_size=4 with actor.max_tokens_per_micro_batch=9000 or"
    ):
        check_plan(plan, False, True, 24576, None, fitting_parallel=(4, 9000))


@pytest.mark.parametrize(
    "config, gpus, shape, prompt, degree",
    [
        ("configs/loongrl-qwen3-8b.yaml", 8, "qwen3-8b", 131072, 2),
        ("configs/loongrl-qwen3-32b.yaml", 32, "qwen3-32b", 65536, 4),
    ],
)
def test_long_prompts_are_refused_naming_the_degree_and_fit_with_it(config, gpus, shape, prompt, degree, capsys):
    """Qwen3-8B at 131,072-token prompts on 8 H200s and Qwen3-32B at 65,536 on 32: refused without sequence
    parallelism, naming the degree, and fitting with it."""
    args = ["plan", config, "--gpus", str(gpus), "--shape", shape, f"data.max_prompt_length={prompt}"]
    assert main(args) == 2
    assert f"set actor.sequence_parallel_size={degree}, the smallest" in capsys.readouterr().err
    assert main([*args, f"actor.sequence_parallel_size={degree}"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("fits") and f"1/{degree} of a row" in out
    assert main([*args, f"actor.sequence_parallel_size={degree // 2}"]) == 2  # (the smallest that fits)


def test_a_degree_past_the_node_or_not_dividing_the_ranks_is_refused(capsys):
    args = ["plan", "configs/loongrl-qwen3-8b.yaml", "--shape", "qwen3-8b", "actor.ppo_mini_batch_size=16"]
    assert main([*args, "--gpus", "16", "--gpus-per-node", "8", "actor.sequence_parallel_size=16"]) == 2
    assert "actor.sequence_parallel_size=16 spans nodes of --gpus-per-node 8" in capsys.readouterr().err
    assert main([*args, "--gpus", "8", "actor.sequence_parallel_size=3"]) == 2
    assert "actor.sequence_parallel_size=3 must divide the 8 training ranks" in capsys.readouterr().err


def test_the_all_to_alls_move_the_rank_s_queries_keys_values_and_output():
    """qwen3-tiny over 4 ranks, a 1,000-token row: each rank's 250 tokens of queries (4 heads), keys and values (2
    heads repeated to 4) and output, 16 wide in bf16, three quarters of it sent, in each of 2 layers."""
    config = Qwen3Config(**SHAPES["qwen3-tiny"])
    sent = 2 * 250 * 16 * (4 + 4 + 4 + 4) * 3 / 4
    assert all_to_all_s(config, 1000, 4) == pytest.approx(2 * sent / ALL_TO_ALL_BYTES_PER_S)
    assert all_to_all_s(config, 1000, 1) == 0


def test_the_update_s_flops_split_over_the_ranks_and_the_all_to_alls_add():
    from test_step_time import step  # (the step-time tests' tiny run)

    sizes = tiny()
    one = step(sizes, world=2, batch=2, mini=2, budget=120)  # a micro-batch a group
    two = step(sizes, world=2, batch=2, mini=2, budget=120, sequence_parallel=2)
    # one data-parallel rank updates both groups, each micro-batch's FLOPs split over 2 ranks: the compute is the
    # same per rank, the all-to-alls come on top (the weights' gathers are the same per micro-batch, and longer)
    assert two.micro_batches == 2 * one.micro_batches
    assert two.update > one.update
    assert (two.prefill, two.decode) == (one.prefill, one.decode)  # the rollout is unchanged


def test_the_longest_prompt_is_the_last_step_that_trains():
    """The bisection against the rule it bisects: the prompt found trains, one step more does not; and sequence
    parallelism trains longer prompts on the same GPUs."""
    cfg = load_config("configs/loongrl-qwen3-8b.yaml", ["actor.cpu_offload=true"])
    sizes, machine = shape_sizes("qwen3-1.7b"), Machine(gpus=2, gpu_bytes=40 * GIB, gpus_per_node=2, host_bytes=10**13)
    plain = longest_prompt(cfg, sizes, machine)
    assert trains_prompt(cfg, sizes, machine, plain) and not trains_prompt(cfg, sizes, machine, plain + 1024)
    split = longest_prompt(with_sequence_parallel(cfg, 2), sizes, machine)
    assert split > 1.4 * plain


def test_the_longest_prompt_one_gpu_s_engine_holds_a_group_of():
    """qwen3-8b: 2 x 2 bytes x 36 layers x 8 KV heads x 128 per token; an H200 less the bf16 weights and the
    margin."""
    sizes = shape_sizes("qwen3-8b")
    per_token = 2 * 2 * 36 * 8 * 128
    room = H200 - 2 * sizes.params - 6 * GIB
    assert longest_kv_prompt(sizes, H200, 2048, 4, 2) == room // per_token - 4 * 2048
    # past it, no layout samples: the refusal says the engine holds a group's KV on one GPU
    plan = plan_memory(
        sizes,
        world_size=8,
        gpu_bytes=H200,
        micro_batch_tokens=8192,
        prompt_length=900_000,
        response_length=2048,
        n=4,
        param_bytes=2,
    )
    with pytest.raises(PlanError, match=r"it has no tensor parallelism for the prompt's KV\), and one group's KV"):
        check_plan(plan, False, True, 8192, None)


@pytest.mark.slow
def test_largest_reports_each_shape_s_longest_prompt(capsys):
    assert main(["plan", "configs/loongrl-qwen3-8b.yaml", "--gpus", "2", "--largest", "--host-memory-gib", "4000"]) == 0
    table = capsys.readouterr().out.split("the longest prompt each shape trains")[1].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:] if line.startswith("  qwen3")}
    assert set(rows) >= {"qwen3-32b", "qwen3-8b", "qwen3-1.7b"}
    shape, offload, plain, split, degree, kv = rows["qwen3-1.7b"]
    assert degree == "2" and int(split.replace(",", "")) > int(plain.replace(",", ""))
