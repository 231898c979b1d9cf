"""The memory planner: sizes counted on the meta device, plans that fit, refusals that say what to change."""

import re

import pytest
from transformers import Qwen3Config

from longqa.cli import main
from longqa.model.shapes import SHAPES
from longqa.planning.planner import GIB, ModelSizes, PlanError, check_plan, plan_memory

H200 = 141 * GIB
RECIPE = dict(micro_batch_tokens=16384, prompt_length=16384, response_length=4096, n=8, param_bytes=2)  # bf16


def sizes(shape):
    return ModelSizes.from_config(Qwen3Config(**SHAPES[shape]))


def test_sizes_match_the_released_parameter_counts():
    assert sizes("qwen3-32b").params == pytest.approx(32.8e9, rel=0.01)
    assert sizes("qwen3-8b").params == pytest.approx(8.19e9, rel=0.01)
    tied = sizes("qwen3-1.7b")
    assert tied.params == pytest.approx(1.72e9, rel=0.01)  # tied: the embedding counts once
    assert tied.embedding_params == 151936 * 2048 + 2048  # embedding + final norm


def plan(shape, gpus, offload=False, checkpointing=True, strategy="fsdp2", offload_params=False, **extra):
    options = {**RECIPE, "groups_per_rank": 256 // gpus, **extra}  # the recipe's 256 prompts a step
    p = plan_memory(
        sizes(shape),
        world_size=gpus,
        gpu_bytes=H200,
        gradient_checkpointing=checkpointing,
        cpu_offload=offload,
        strategy=strategy,
        offload_params=offload_params,
        **options,
    )
    check_plan(p, offload, checkpointing, options["micro_batch_tokens"], options.get("kv_cache_bytes"))
    return p


def test_qwen3_32b_on_8_gpus_needs_offload():
    with pytest.raises(PlanError, match=r"offload the training state to the CPU \(actor.cpu_offload=true frees 30.5"):
        plan("qwen3-32b", 8)
    fits = plan("qwen3-32b", 8, offload=True)
    assert fits.training_state == 0 and fits.total < H200
    assert plan("qwen3-32b", 32).total < H200  # the recipe's 4 nodes x 8 shard it enough


def test_small_models_fit_and_the_state_divides_by_the_ranks():
    one, eight = plan("qwen3-1.7b", 1), plan("qwen3-1.7b", 8)
    assert one.training_state == 8 * eight.training_state
    assert one.rollout_weights == eight.rollout_weights  # the engine holds full weights on every rank


def test_activation_settings_are_named_when_they_are_the_problem():
    with pytest.raises(PlanError, match="turn on model.gradient_checkpointing"):
        plan("qwen3-8b", 8, checkpointing=False, micro_batch_tokens=65536)
    with pytest.raises(PlanError, match=r"lower actor.max_tokens_per_micro_batch \(now 262144\)"):
        plan("qwen3-8b", 8, offload=True, micro_batch_tokens=262144)
    with pytest.raises(PlanError, match="lower rollout.kv_cache_bytes"):
        plan("qwen3-8b", 8, offload=True, kv_cache_bytes=120 * GIB)


def test_cli_prints_the_table_and_refuses_with_exit_2(capsys):
    assert (
        main(
            ["plan", "configs/loongrl-qwen3-32b.yaml", "actor.cpu_offload=true", "--gpus", "8", "--shape", "qwen3-32b"]
        )
        == 0
    )
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "configs/loongrl-qwen3-32b.yaml", "--gpus", "8", "--shape", "qwen3-32b"]) == 2
    captured = capsys.readouterr()
    assert "rollout KV cache" in captured.out and "actor.cpu_offload=true" in captured.err
    assert main(["plan"]) == 0  # the embedded default on one GPU


def test_cli_prints_host_memory_and_step_time_beside_the_gpu_table(capsys):
    assert (
        main(
            [
                "plan",
                "configs/loongrl-qwen3-8b.yaml",
                "actor.cpu_offload=true",
                "--gpus",
                "2",
                "--shape",
                "qwen3-8b",
                "--response-length",
                "800",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 2 GPU(s) of 141 GiB, 2 per node with 250 GiB of host memory, FSDP2, CPU offload" in out
    assert "per rank, loading: the whole model             15.3 GiB" in out  # 8.19B parameters in bf16
    assert "rollout engine (weights, KV on the GPU)         0.0 GiB" in out
    # float32 master shards, their gradients and moments: 16 bytes a parameter, half of them on each rank
    assert "per rank, training: offloaded state" in out and "(2 ranks)                           151.1 GiB" in out
    assert "step time per GRPO step (16 prompts x 4, responses of 800 tokens" in out
    for phase in (
        "rollout: prefill",
        "rollout: decode",
        "old log-probs (forward)",
        "update (",
        "optimizer (1 step)",  # the Arctic launcher's one update a step
        "weight refresh (engine's copy)",
        "step  ",
    ):
        assert f"\n  {phase}" in out
    assert main(["plan", "configs/loongrl-qwen3-32b.yaml", "--gpus", "32", "--shape", "qwen3-32b"]) == 0
    assert "32 GPU(s) of 141 GiB, 8 per node with 1000 GiB of host memory" in capsys.readouterr().out


def test_cli_refuses_a_plan_over_the_host_memory(capsys):
    args = ["plan", "configs/loongrl-qwen3-32b.yaml", "actor.cpu_offload=true", "--gpus", "2", "--shape", "qwen3-32b"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "node peak (2 ranks)" in captured.out
    assert "GiB of host memory per node but a node has 250.0 GiB" in captured.err and "use more GPUs" in captured.err
    assert main([*args, "--host-memory-gib", "576"]) == 0


def test_cli_finds_the_largest_shape_two_gpus_can_train(capsys):
    assert main(["plan", "configs/loongrl-qwen3-32b.yaml", "--gpus", "2", "--largest"]) == 0
    lines = capsys.readouterr().out.split("the longest prompt")[0].splitlines()  # (then each shape's longest)
    assert lines[0].startswith("the largest Qwen3 shape on 2 GPU(s) of 141 GiB, 2 per node with 250 GiB")
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "qwen3-32b, actor.cpu_offload=false",
        "qwen3-32b, actor.cpu_offload=true",
        "qwen3-14b, actor.cpu_offload=false",
        "qwen3-14b, actor.cpu_offload=true",
        "qwen3-8b, actor.cpu_offload=false",
    ]
    assert "GiB per GPU but a GPU has 141.0 GiB" in lines[1] and "GiB of host memory per node" in lines[2]
    assert re.search(r"fits \(GPU 1\d\d\.\d GiB, host \d+\.\d GiB per node\)$", lines[5])


def test_one_process_shares_its_weights_and_the_kv_cache_takes_its_share_of_the_free_memory():
    qwen3_8b = sizes("qwen3-8b")
    one = plan_memory(qwen3_8b, world_size=1, gpu_bytes=H200, sharded=False, groups_per_rank=64, **RECIPE)
    assert one.rollout_weights == 0 and one.unsharded_layers == 0 and one.training_state == 8 * qwen3_8b.params
    group = 2 * 2 * 36 * 8 * 128 * (16384 + 8 * 4096)  # keys and values, bf16, layers, KV heads, head_dim, tokens
    free = H200 - 2 * qwen3_8b.params  # before the first update only the bf16 weights are allocated
    assert one.kv_groups == int(0.4 * free) // group and one.rollout_kv == one.kv_groups * group
    capped = plan_memory(
        qwen3_8b,
        world_size=1,
        gpu_bytes=H200,
        sharded=False,
        groups_per_rank=64,
        kv_cache_bytes=3 * group + 1,
        **RECIPE,
    )
    assert capped.kv_groups == 3
    with pytest.raises(PlanError, match="set rollout.kv_cache_bytes"):
        plan("qwen3-8b", 1, checkpointing=0.5, micro_batch_tokens=32768)


def test_loading_the_whole_model_on_each_gpu_is_checked_first():
    """Every rank moves the whole model to its GPU and the engine copies it before the model is sharded."""
    fp32 = plan_memory(
        sizes("qwen3-32b"), world_size=8, gpu_bytes=H200, cpu_offload=True, **{**RECIPE, "param_bytes": 4}
    )
    assert fp32.loading == 2 * 4 * sizes("qwen3-32b").params + 6 * GIB  # the model and the engine's copy, fp32
    with pytest.raises(PlanError, match=r"loading needs about 250.1 GiB per GPU.*model.dtype=bfloat16"):
        check_plan(fp32, True, 1.0, 16384, None)


def test_the_trainer_check_refuses_before_loading(tmp_path):
    from longqa.config import load_config
    from longqa.planning.planner import check_fit, check_run

    cfg = load_config(None, [])  # the embedded default: tiny
    for gpu_bytes in (H200, GIB):
        checked = check_run(cfg, 1, machine=False, gpu_bytes=gpu_bytes)
        if gpu_bytes == H200:
            assert check_fit(checked.config, 1, gpu_bytes, checked.sizes).total < H200
            continue
        with pytest.raises(PlanError, match="GiB per GPU but a GPU has 1.0 GiB"):
            check_fit(checked.config, 1, gpu_bytes, checked.sizes)


def test_recomputing_part_of_the_layers_plans_activations_between_none_and_all():
    activations = [
        plan_memory(
            sizes("qwen3-8b"),
            world_size=1,
            gpu_bytes=H200,
            gradient_checkpointing=fraction,
            cpu_offload=True,
            **{**RECIPE, "micro_batch_tokens": 32768},
        ).activations
        for fraction in (1.0, 0.5, 0.25, 0.0)
    ]
    assert activations == sorted(activations) and len(set(activations)) == 4
    with pytest.raises(PlanError, match="raise model.checkpoint_fraction"):
        plan("qwen3-8b", 1, offload=True, checkpointing=0.25, micro_batch_tokens=65536)


def test_deepspeed_keeps_its_bf16_weight_partition_on_the_gpu_and_steps_the_same_bytes_on_the_host():
    """ZeRO-3 holds 18 bytes a parameter (fp32 weights, gradients and moments, and a bf16 partition), whatever the
    model's dtype; FSDP2 holds four tensors in the model's dtype, 16 bytes in fp32 and 8 in bf16. Offloading the
    optimizer leaves ZeRO-3's bf16 partition on the GPU and puts 16 bytes per parameter on the host, as FSDP2's
    offload of an fp32 model does."""
    params = sizes("qwen3-8b").params
    fsdp, zero3 = plan("qwen3-8b", 8), plan("qwen3-8b", 8, strategy="deepspeed")
    assert (fsdp.training_state, zero3.training_state) == (8 * params // 8, 16 * params // 8 + 2 * params // 8)
    assert plan("qwen3-8b", 8, param_bytes=4).training_state == 16 * params // 8
    assert fsdp.host_state == zero3.host_state == 0
    fsdp = plan("qwen3-8b", 8, offload=True, param_bytes=4)
    zero3 = plan("qwen3-8b", 8, offload=True, strategy="deepspeed")
    assert (fsdp.training_state, zero3.training_state) == (0, 2 * params // 8)
    assert fsdp.host_state == zero3.host_state == 16 * params // 8
    assert plan("qwen3-8b", 8, offload=True).host_state == 8 * params // 8
    both = plan("qwen3-8b", 8, offload=True, strategy="deepspeed", offload_params=True)
    assert (both.training_state, both.host_state) == (0, 18 * params // 8)


def test_a_deepspeed_plan_reads_the_offloads_of_its_config_file(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}')
    base = ["plan", "configs/loongrl-qwen3-32b.yaml", "actor.strategy=deepspeed"]
    assert main([*base, f"actor.deepspeed_config={ds}", "--shape", "qwen3-32b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "optimizer and parameters offloaded (DeepSpeed's CPU Adam steps it on the host)" in out
    assert "training state (weights, grads, AdamW)        0.0 GiB" in out
    # on 1 GPU the bf16 weight partition alone does not fit beside the rest: the advice is to offload it too
    assert main([*base, "actor.cpu_offload=true", "--shape", "qwen3-32b", "--gpus", "1"]) == 2
    assert "offload the parameters too (zero_optimization.offload_param.device: cpu" in capsys.readouterr().err


@pytest.mark.parametrize("gpus,ratio", [(1, 0.5), (1, 0.3), (2, 0.5), (2, 0.0)])
def test_a_partial_offload_keeps_zero3_s_first_sub_groups_on_the_gpu(gpus, ratio):
    """`actor.cpu_offload_ratio`: DeepSpeed cuts a rank's partition into sub-groups of `sub_group_size` (10^9)
    parameters and keeps the first int((1 - ratio) * sub-groups) on the GPU; the plan moves exactly their 16
    bytes a parameter from the host to the GPU, and their AdamW step with them."""
    import math

    from longqa.config import load_config
    from longqa.planning.host_memory import plan_host_config
    from longqa.planning.planner import offload_fraction, plan_config
    from longqa.planning.step_time import step_time_config

    qwen3_8b = sizes("qwen3-8b")
    groups = math.ceil(qwen3_8b.params / gpus / 10**9)
    on_gpu = int((1 - ratio) * groups)

    def config(r):
        return load_config(
            "configs/loongrl-qwen3-8b.yaml",
            ["actor.strategy=deepspeed", "actor.cpu_offload=true", f"actor.cpu_offload_ratio={r}"],
        )

    whole, part = config(1.0), config(ratio)
    assert offload_fraction(whole, gpus, qwen3_8b.params) == 1.0
    assert offload_fraction(part, gpus, qwen3_8b.params) == (groups - on_gpu) / groups
    plans = [plan_config(c, qwen3_8b, gpus, H200) for c in (whole, part)]
    moved = 16 * qwen3_8b.params // gpus - int((groups - on_gpu) / groups * 16 * qwen3_8b.params // gpus)
    assert plans[0].host_state - plans[1].host_state == pytest.approx(moved, abs=1)
    assert plans[1].training_state - plans[0].training_state == pytest.approx(moved, abs=1)
    hosts = [plan_host_config(c, qwen3_8b, gpus, gpus, 128 * GIB * gpus) for c in (whole, part)]
    assert hosts[0].offloaded_state - hosts[1].offloaded_state == pytest.approx(moved, abs=1)
    times = [step_time_config(c, qwen3_8b, p, gpus) for c, p in zip((whole, part), plans)]
    assert times[1].optimizer < times[0].optimizer and times[1].update <= times[0].update


def test_the_plan_names_the_partial_offload_where_host_memory_runs_out(capsys):
    """Qwen3-8B on one H200 of 64 GiB host memory: the offloaded optimizer (122 GiB) cannot be held, and the plan
    names the ratio that fits the host; with it, the plan fits and says what steps where."""
    base = [
        "plan",
        "configs/loongrl-qwen3-8b.yaml",
        "--shape",
        "qwen3-8b",
        "--host-memory-gib",
        "96",
        "actor.strategy=deepspeed",
        "actor.cpu_offload=true",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
    ]
    assert main(base) == 2
    ratio = re.search(r"actor.cpu_offload_ratio=([0-9.]+) or lower", capsys.readouterr().err).group(1)
    assert main([*base, f"actor.cpu_offload_ratio={ratio}"]) == 0
    out = capsys.readouterr().out
    share = (9 - int((1 - float(ratio)) * 9)) / 9  # ZeRO-3 keeps whole sub-groups of 1e9 parameters on the GPU
    assert (
        f"{share:.0%} of the optimizer offloaded (DeepSpeed's CPU Adam steps it on the host, torch's AdamW "
        f"the rest on the GPU)"
        in out
        and out.rstrip().endswith("fits")
    )
    # a ratio that keeps no whole sub-group on the GPU offloads all of it, and the plan says so
    assert main([*base, "actor.cpu_offload_ratio=0.9", "--host-memory-gib", "200"]) == 0
    assert (
        "the whole optimizer offloaded: actor.cpu_offload_ratio=0.9 keeps int(0.1 x 9) = 0 of its 9 sub-groups"
        in capsys.readouterr().out
    )
    assert main([*base, "actor.cpu_offload_ratio=0.05", "--gpu-memory-gib", "96"]) == 2
    assert "offload more of the optimizer (raise actor.cpu_offload_ratio)" in capsys.readouterr().err
    # --largest tries that share where the whole optimizer does not fit the host but the GPU has room
    assert (
        main(
            [
                "plan",
                "configs/loongrl-qwen3-8b.yaml",
                "--largest",
                "--host-memory-gib",
                "96",
                "actor.strategy=deepspeed",
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.split("the longest prompt")[0].splitlines()[-2:]
    assert "qwen3-8b, actor.cpu_offload=true: this plan needs about" in last[0]
    assert last[1].startswith(f"  qwen3-8b, actor.cpu_offload=true actor.cpu_offload_ratio={ratio}: fits")


def test_offloaded_layers_keep_no_activations_on_the_gpu():
    """A layer offloaded holds nothing on the GPU, a recomputed one its input; the rest all of theirs."""

    def activations(checkpointing, offload):
        return plan_memory(
            sizes("qwen3-8b"),
            world_size=1,
            gpu_bytes=H200,
            gradient_checkpointing=checkpointing,
            activation_offload=offload,
            cpu_offload=True,
            **{**RECIPE, "micro_batch_tokens": 32768},
        ).activations

    none, quarter_recomputed, quarter_offloaded = activations(0, 0), activations(0.25, 0), activations(0, 0.25)
    layer = (none - quarter_offloaded) / 9  # 9 of 36 layers
    # recomputed: each keeps its bf16 input; the one being recomputed holds its activations again only after the
    # kept layers (the last ones, whose backward passes come first) have freed theirs, below this peak
    assert quarter_recomputed - quarter_offloaded == 9 * 2 * 4096 * 32768
    assert activations(0.25, 0.25) == quarter_recomputed - 9 * layer
    # with every layer recomputed, the one being recomputed is the peak: all the inputs and one layer's all
    assert activations(1.0, 0) >= 36 * 2 * 4096 * 32768 + layer > activations(0, 1.0)
    with pytest.raises(PlanError, match="model.activation_offload"):
        plan("qwen3-8b", 1, offload=True, checkpointing=0.25, micro_batch_tokens=65536)


def test_a_kl_penalty_s_reference_model_is_counted_on_each_gpu():
    """algo.kl_coef > 0 keeps a frozen copy of the starting weights in model.dtype: whole while the actor is built,
    then sharded like the policy under FSDP2, whole beside a ZeRO-3 engine."""
    from longqa.config import load_config
    from longqa.planning.planner import plan_config

    qwen3_8b = sizes("qwen3-8b")
    base = ["model.dtype=bfloat16", "actor.cpu_offload=true"]
    plans = {
        kl: {
            strategy: plan_config(
                load_config(
                    "configs/loongrl-qwen3-8b.yaml",
                    [*base, f"algo.kl_coef={kl}", f"actor.strategy={strategy}", "rollout.kv_cache_bytes=1000000000"],
                ),
                qwen3_8b,
                8,
                H200,
            )
            for strategy in ("fsdp2", "deepspeed")
        }
        for kl in (0, 0.001)
    }
    for strategy, share in (("fsdp2", 8), ("deepspeed", 1)):
        without, with_kl = plans[0][strategy], plans[0.001][strategy]
        assert with_kl.reference_weights == 2 * qwen3_8b.params // share and without.reference_weights == 0
        assert with_kl.total - without.total == with_kl.reference_weights
        assert with_kl.loading - without.loading == 2 * qwen3_8b.params
    assert "reference model (algo.kl_coef)" in plans[0.001]["fsdp2"].table()


def test_plan_takes_the_gpu_count_a_ray_config_runs_and_refuses_another(capsys):
    """Under trainer.launcher=ray the config says how many GPUs it runs (trainer.ray_workers, a verl line's
    nnodes x n_gpus_per_node): plan sizes that many, and a different --gpus is refused, never planned quietly."""
    line = ["configs/loongrl-qwen3-32b.yaml", "trainer.launcher=ray", "trainer.ray_workers=32", "--shape", "qwen3-32b"]
    assert main(["plan", *line]) == 0
    assert "on 32 GPU(s) of 141 GiB" in capsys.readouterr().out
    assert main(["plan", *line, "--gpus", "32"]) == 0
    capsys.readouterr()
    assert main(["plan", *line, "--gpus", "8"]) == 2
    assert "--gpus 8, but the config runs trainer.ray_workers=32 Ray workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "workers, gpus, use_gpu, expected",
    [
        (None, 8, True, 8),
        (8, 8, True, 8),
        (4, 8, True, 4),
        (32, 8, True, None),
        (None, 0, False, None),
        (2, 0, False, 2),  # CPU workers on a cluster without GPUs
    ],
)
def test_ray_workers_are_never_more_than_the_cluster_s_gpus(workers, gpus, use_gpu, expected):
    from longqa.config import ConfigError, load_config
    from longqa.train.ray_launcher import ray_worker_count

    cfg = load_config(None, [f"trainer.ray_workers={workers}"] if workers else [])
    if expected is None:
        with pytest.raises(ConfigError):
            ray_worker_count(cfg, gpus, use_gpu)
    else:
        assert ray_worker_count(cfg, gpus, use_gpu) == expected


def test_sampling_beside_the_update_counts_the_engine_s_copy_of_the_weights():
    """rollout.overlap=true: one process whose engine would share the model's tensors keeps a copy of them instead
    (the update changes the model's while the engine samples), and the plan counts it."""
    from longqa.config import load_config
    from longqa.planning.planner import plan_config

    smollm2 = sizes("smollm2-135m")
    plans = {
        overlap: plan_config(
            load_config(
                None,
                [
                    "model.dtype=float32",
                    "rollout.mode=one_step_off",
                    f"rollout.overlap={str(overlap).lower()}",
                    "rollout.kv_cache_bytes=1000000000",
                    "actor.max_tokens_per_micro_batch=8192",
                ],
            ),
            smollm2,
            1,
            H200,
        )
        for overlap in (False, True)
    }
    assert plans[False].rollout_weights == 0 and plans[True].rollout_weights == 4 * smollm2.params
    assert plans[True].total - plans[False].total == 4 * smollm2.params


SPLIT_RUN = [
    "--shape",
    "qwen3-1.7b",
    "data.max_prompt_length=8192",
    "data.max_response_length=1024",
    "rollout.n=8",
    "data.train_batch_size=24",
    "actor.ppo_mini_batch_size=24",
    "actor.max_tokens_per_micro_batch=16384",
    "model.dtype=bfloat16",
]


@pytest.mark.parametrize(
    "setting, split_wins", [("rollout.response_lengths=lognormal", False), ("data.max_response_length=4096", True)]
)
def test_each_split_of_the_gpus_takes_the_longer_side_and_the_fastest_that_fits_is_proposed(
    capsys, setting, split_wins
):
    """`longqa plan --split`: on 6 GPUs, every number of sampler ranks from 1 to 5; a split whose training ranks do
    not divide the batch is marked with the trainer's own refusal; each step is the longer of the samplers' rollout
    and the training ranks' work plus the weights' broadcast; more samplers sample faster, more training ranks train
    faster; the proposal is the fastest split that fits, unless every GPU sampling then training is faster still
    (at drawn lengths of mean about 400 tokens; not with every response at 4,096, where the rollout weighs more)."""
    from longqa.config import load_config
    from longqa.planning.fit import Machine, shape_sizes
    from longqa.planning.split_plan import best_split, plan_splits

    run = [*SPLIT_RUN, setting]
    cfg = load_config(None, run[2:])
    colocated, splits = plan_splits(cfg, shape_sizes("qwen3-1.7b"), Machine(6, 141 * GIB, 8, 750 * GIB))
    assert [(s.samplers, s.trainers) for s in splits] == [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1)]
    assert [s.error is None for s in splits] == [False, True, True, True, True]
    assert "data.train_batch_size=24 must be a multiple of the 5 ranks" in splits[0].error
    rollouts, trainings = [s.rollout_s for s in splits], [s.training_s for s in splits]
    assert rollouts == sorted(rollouts, reverse=True) and trainings == sorted(trainings)
    for s in splits:
        assert s.step_s == pytest.approx(max(s.rollout_s, s.training_s) + s.weights_s)
    best = best_split(splits)
    assert best.step_s == min(s.step_s for s in splits[1:])
    assert main(["plan", "--gpus", "6", "--split", *run]) == 0
    out = capsys.readouterr().out
    assert colocated.error is None and (best.step_s < colocated.step.total) == split_wins
    assert f"synchronous, every GPU sampling then training: {colocated.step.total:.1f} s a step; fits: yes" in out
    if split_wins:
        assert f"proposed: rollout.sampler_ranks={best.samplers} rollout.mode=one_step_off, {best.trainers} " in out
    else:  # no split beats every GPU sampling then training: that is the proposal
        assert (
            f"proposed: every GPU samples and trains (rollout.sampler_ranks=0): the fastest split, "
            f"rollout.sampler_ranks={best.samplers}, would take {best.step_s:.1f} s" in out
        )


def test_a_split_plan_proposes_only_a_layout_that_plan_accepts(capsys):
    """On 3 GPUs a batch of 16 cannot be shared out: `longqa plan --gpus 3` refuses it, so `plan --split` marks
    every GPU sampling then training as not fitting, with the same words, and proposes a split that `plan` then
    accepts; a small model's times are shown in milliseconds, not as 0.0."""
    assert main(["plan", "--gpus", "3"]) == 2
    refusal = capsys.readouterr().err.strip().removeprefix("longqa: error: ")
    assert refusal == "data.train_batch_size=16 must be a multiple of the 3 ranks: each rank owns whole groups"
    assert main(["plan", "--split", "--gpus", "3"]) == 0
    out = capsys.readouterr().out
    synchronous = re.search(r"every GPU sampling then training: (\S+) s a step; fits: (.*)", out)
    assert float(synchronous.group(1)) > 0 and synchronous.group(2) == f"no: {refusal}"
    proposed = re.search(
        r"proposed: (rollout.sampler_ranks=\d+) (rollout.mode=one_step_off), .*: (\S+) s a step, "
        r"every GPU sampling then training does not fit",
        out,
    )
    assert proposed and float(proposed.group(3)) > 0
    assert main(["plan", "--gpus", "3", proposed.group(1), proposed.group(2)]) == 0
    assert capsys.readouterr().out.endswith("fits\n")


def test_a_mini_batch_that_does_not_divide_the_batch_is_refused_on_one_rank_as_on_several(capsys):
    """Mini-batches of 3 groups out of 4 would make a last mini-batch of 1 on one rank, as they give a rank of
    two no whole share: one rule refuses it in `plan` for any number of GPUs, in `config show` and in `train`."""
    message = (
        "actor.ppo_mini_batch_size=3 must divide data.train_batch_size=4{}: each optimizer step takes a "
        "mini-batch of that many groups, and every mini-batch must be alike; use {} (or another such size)"
    )
    for gpus, ranks, use in (
        (1, "", 2),
        (2, " and be a multiple of the 2 ranks", 2),
        (4, " and be a multiple of the 4 ranks", 4),
    ):
        assert (
            main(
                [
                    "plan",
                    "--gpus",
                    str(gpus),
                    "--shape",
                    "qwen3-tiny",
                    "data.train_batch_size=4",
                    "actor.ppo_mini_batch_size=3",
                ]
            )
            == 2
        )
        assert capsys.readouterr().err == f"longqa: error: {message.format(ranks, use)}\n"
    assert main(["config", "show", "data.train_batch_size=4", "actor.ppo_mini_batch_size=3"]) == 2
    assert capsys.readouterr().err == f"longqa: error: {message.format('', 2)}\n"


def test_a_training_rank_beside_sampler_ranks_plans_no_engine():
    """With rollout.sampler_ranks the plan (the trainer's memory check, and `longqa plan`) is a training rank's: the
    engine's copy of the weights and its KV cache are on the sampler ranks."""
    from longqa.config import load_config
    from longqa.planning.fit import shape_sizes
    from longqa.planning.planner import plan_config

    sizes = shape_sizes("qwen3-1.7b")
    colocated = plan_config(load_config(None, SPLIT_RUN[2:]), sizes, 2, 141 * GIB)
    apart = plan_config(load_config(None, [*SPLIT_RUN[2:], "rollout.sampler_ranks=2"]), sizes, 2, 141 * GIB)
    assert colocated.rollout_weights > 0 and colocated.rollout_kv > 0
    assert apart.rollout_weights == apart.rollout_kv == 0
    assert apart.total == colocated.total - colocated.rollout_weights - colocated.rollout_kv


def test_plan_with_sampler_ranks_is_a_training_rank_s_over_the_other_gpus(capsys):
    """`longqa plan --gpus 3 rollout.sampler_ranks=1` plans what the trainer checks: 2 training ranks, no engine on
    them; a job with no training rank left is refused as the trainer refuses it."""
    assert (
        main(
            [
                "plan",
                "--gpus",
                "3",
                *SPLIT_RUN,
                "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=4",
                "rollout.sampler_ranks=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 2 GPU(s) of 141 GiB" in out and "1 more GPU(s) only sample, rollout.sampler_ranks=1" in out
    assert re.search(r"rollout weights \(engine's copy\) +0\.0 GiB", out)
    assert re.search(r"rollout KV cache \(none here\) +0\.0 GiB", out)
    assert (
        main(
            [
                "plan",
                "--gpus",
                "2",
                *SPLIT_RUN,
                "data.train_batch_size=3",
                "actor.ppo_mini_batch_size=3",
                "rollout.sampler_ranks=1",
            ]
        )
        == 0
    )  # one training rank: any batch
    assert main(["plan", "--gpus", "1", *SPLIT_RUN, "rollout.sampler_ranks=1"]) == 2
    assert "rollout.sampler_ranks=1 sets that many ranks apart to sample, but the job has 1" in capsys.readouterr().err


def test_a_split_needs_two_gpus(capsys):
    assert main(["plan", "--split", *SPLIT_RUN]) == 2
    assert "sampler ranks of their own need at least 2 GPUs" in capsys.readouterr().err
