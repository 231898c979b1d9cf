"""verl launch lines on longqa's command line: translated where longqa has the setting, refused in one error."""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from tiny_models import save_tiny_qwen3

from longqa.cli import main
from longqa.config import ConfigError, all_keys, load_config, to_yaml
from longqa.config.verl_keys import (
    FIXED,
    GROUPS,
    NOTED,
    RENAMED,
    VERL_DEFAULTS,
    is_verl_line,
    verl_key_table,
    verl_notes,
)
from longqa.train.resume import REFUSED_ON_RESUME

# The reference recipe's verl launch (Qwen3-32B on LoongRL, 4 nodes of 8 GPUs), values filled in: the keys
# longqa has ...
RECIPE_TAKEN = [
    "algorithm.adv_estimator=grpo",
    "algorithm.norm_adv_by_std_in_grpo=True",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "data.train_files=/data/merged/train.parquet",
    "data.val_files=/data/merged/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=16384",
    "data.max_response_length=4096",
    "data.filter_overlong_prompts=True",
    "data.truncation=left",
    "data.seed=42",
    "custom_reward_function.path=/recipe/reward.py",
    "custom_reward_function.name=compute_score",
    "actor_rollout_ref.model.path=Qwen/Qwen3-32B",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40960",
    "actor_rollout_ref.actor.clip_ratio=0.2",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
    "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
    "actor_rollout_ref.rollout.free_cache_engine=True",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.enforce_eager=False",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
    "actor_rollout_ref.rollout.val_kwargs.temperature=0",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
    "trainer.default_local_dir=/checkpoint/run",
    "trainer.resume_mode=disable",
    "trainer.logger=['console']",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=4",
    "trainer.save_freq=-1",
    "trainer.test_freq=10",
    "trainer.total_epochs=20",
]
# ... the same run in longqa's own keys (written by hand: the independent reference) ...
RECIPE_IN_LONGQA_KEYS = [
    "algo.adv_estimator=grpo",
    "algo.norm_adv_by_std=true",
    "algo.kl_coef=0",
    "data.train_files=/data/merged/train.parquet",
    "data.val_files=/data/merged/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=16384",
    "data.max_response_length=4096",
    "data.filter_overlong_prompts=true",
    "data.truncation=left",
    "trainer.seed=42",
    "reward.path=/recipe/reward.py",
    "reward.name=compute_score",
    "model.path=Qwen/Qwen3-32B",
    "model.gradient_checkpointing=true",
    "actor.strategy=fsdp2",
    "actor.ppo_mini_batch_size=64",
    "actor.max_tokens_per_micro_batch=auto",
    "algo.clip_ratio=0.2",
    "algo.kl_type=low_var_kl",
    "algo.entropy_coeff=0",
    "actor.lr=1e-6",
    "actor.warmup_ratio=0.05",
    "actor.betas=[0.9, 0.95]",
    "actor.cpu_offload=true",
    "rollout.tensor_model_parallel_size=2",
    "rollout.engine=vllm",
    "rollout.gpu_memory_utilization=0.7",
    "rollout.free_cache_engine=true",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "rollout.top_p=1.0",
    "rollout.enforce_eager=false",
    "trainer.output_dir=/checkpoint/run",
    "trainer.resume=none",
    "trainer.logger=[console]",
    "trainer.launcher=ray",
    "trainer.ray_workers=32",
    "trainer.save_freq=0",
    "trainer.test_freq=10",
    "trainer.total_epochs=20",
]
# ... the keys of verl's machinery with no longqa counterpart, which change no result (taken, and said) ...
RECIPE_NOTED = [
    "data.filter_overlong_prompts_workers=8",
    "actor_rollout_ref.model.use_liger=True",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.rollout.max_num_seqs=256",
    "actor_rollout_ref.rollout.max_num_batched_tokens=40960",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.nccl_timeout=1800",
    "trainer.use_legacy_worker_impl=disable",
    "trainer.balance_batch=False",
]
# ... keys that are longqa settings under another name or value ...
RECIPE_MAPPED = {
    "actor_rollout_ref.actor.data_loader_seed=42": ("trainer.seed", 42),
    "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_3": (
        "model.attn_implementation",
        "sdpa",
    ),
    "actor_rollout_ref.actor.use_torch_compile=False": ("actor.compile_layers", False),
    "actor_rollout_ref.rollout.calculate_log_probs=False": None,  # longqa recomputes them: the only value
    "trainer.project_name=arctic_rl_long_context": ("trainer.project_name", "arctic_rl_long_context"),
    "trainer.experiment_name=longcontext_grpo": ("trainer.experiment_name", "longcontext_grpo"),
    "trainer.val_before_train=False": ("trainer.val_before_train", False),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2": ("actor.sequence_parallel_size", 2),
}
# ... and a value longqa cannot run.
RECIPE_REFUSED = [
    "trainer.critic_warmup=1",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
]


def test_the_recipe_launch_maps_to_the_same_run_in_longqa_keys():
    cfg = load_config(None, RECIPE_TAKEN)
    assert cfg == load_config(None, RECIPE_IN_LONGQA_KEYS)
    assert cfg.trainer.ray_workers == 32 and cfg.actor.cpu_offload and cfg.rollout.engine == "vllm"
    assert cfg.model.attn_implementation == "sdpa"  # what the line leaves out keeps longqa's default


def test_keys_without_a_counterpart_are_taken_and_each_said_once():
    """Every key of verl's machinery that changes no result is taken at any value, changes no setting, and
    gets one line saying why; the mapped ones land on their longqa settings."""
    plain = load_config(None, RECIPE_TAKEN)
    cfg = load_config(None, RECIPE_TAKEN + RECIPE_NOTED + list(RECIPE_MAPPED))
    changed = {key for key in all_keys() if _get(cfg, key) != _get(plain, key)}
    assert changed == {key for key, value in filter(None, RECIPE_MAPPED.values()) if _get(plain, key) != value}
    for text, mapped in RECIPE_MAPPED.items():
        if mapped:
            assert _get(cfg, mapped[0]) == mapped[1], text
    notes = verl_notes(RECIPE_TAKEN + RECIPE_NOTED + list(RECIPE_MAPPED))
    for text in RECIPE_NOTED:
        assert sum(line.startswith(f"{text}: ") for line in notes) == 1, text
    assert any(
        line.startswith("actor_rollout_ref.model.override_config.attn_implementation=flash_attention_3: runs as sdpa")
        for line in notes
    )
    assert len(notes) == len(RECIPE_NOTED) + 2  # and the FlashAttention 3 and token budget values
    assert set(NOTED) >= {text.partition("=")[0] for text in RECIPE_NOTED}
    for key in NOTED:  # any value at all
        assert load_config(None, [f"{key}=not_a_value"]) == load_config(None, [])


def _get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_every_refused_key_of_the_recipe_is_named_in_one_error():
    with pytest.raises(ConfigError) as e:
        load_config(None, RECIPE_TAKEN + RECIPE_NOTED + RECIPE_REFUSED)
    message = str(e.value)
    assert message.startswith(f"{len(RECIPE_REFUSED)} overrides cannot be used")
    problems = message.splitlines()[1:]
    assert len(problems) == len(RECIPE_REFUSED)
    for text in RECIPE_REFUSED:
        key = text.partition("=")[0]
        assert sum(key in line for line in problems) == 1, key
    for text in RECIPE_TAKEN + RECIPE_NOTED:
        assert not any(f"{text.partition('=')[0]}'" in line or f"{text}:" in line for line in problems), text
    assert "recomputes the samples' log-probs" in message  # a fixed key says what longqa does


def test_a_mixed_line_takes_both_vocabularies():
    cfg = load_config(
        None,
        [
            "data.train_files=a.parquet",
            "actor_rollout_ref.rollout.n=4",
            "rollout.engine=hf",
            "actor_rollout_ref.actor.optim.lr=2e-6",
            "trainer.max_steps=5",
            "rollout.n=4",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "algo.clip_ratio=0.2",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "trainer.total_training_steps=5",
        ],
    )
    assert (cfg.data.train_files, cfg.rollout.n, cfg.rollout.engine, cfg.actor.lr) == (["a.parquet"], 4, "hf", 2e-6)
    assert (cfg.algo.clip_ratio, cfg.algo.clip_ratio_high, cfg.trainer.max_steps) == (0.2, 0.28, 5)
    assert is_verl_line(["rollout.n=8", "+actor_rollout_ref.rollout.n=8"])
    assert not is_verl_line(["rollout.n=8", "data.train_files=a.parquet", "trainer.save_freq=-1"])  # shared names


@pytest.mark.parametrize(
    "line",
    [
        ["rollout.n=8", "actor_rollout_ref.rollout.n=4"],
        ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=0.2"],
        ["data.max_response_length=4096", "actor_rollout_ref.rollout.response_length=2048"],
        ["trainer.launcher=local", "trainer.n_gpus_per_node=8"],
        ["algo.kl_coef=0.1", "actor_rollout_ref.actor.use_kl_loss=False"],
        ["actor.grad_clip=1.0", "actor_rollout_ref.actor.optim.clip_grad=0.5"],
        ["trainer.nnodes=2", "trainer.nnodes=4"],
        ["actor.strategy=deepspeed", "actor_rollout_ref.actor.strategy=fsdp"],
    ],
)
def test_one_setting_given_two_values_under_two_names_is_an_error(line):
    with pytest.raises(ConfigError) as e:
        load_config(None, line)
    message = str(e.value)
    assert "is given different values" in message and all(text in message for text in line)


def test_the_same_value_under_two_names_and_longqa_repeats_are_fine():
    assert load_config(None, ["actor.lr=1e-6", "actor_rollout_ref.actor.optim.lr=0.000001"]).actor.lr == 1e-6
    assert load_config(None, ["rollout.n=8", "rollout.n=4"]).rollout.n == 4  # longqa's own keys: the last wins


@pytest.mark.parametrize(
    "line, key, value",
    [
        (["actor_rollout_ref.rollout.name=hf"], "rollout.engine", "hf"),
        (["algorithm.adv_estimator=rloo_vectorized"], "algo.adv_estimator", "rloo"),
        (["algorithm.norm_adv_by_std_in_grpo=False"], "algo.norm_adv_by_std", False),
        (["actor_rollout_ref.actor.kl_loss_type=k2"], "algo.kl_type", "mse"),
        (["actor_rollout_ref.rollout.top_k=0"], "rollout.top_k", -1),
        (["trainer.save_freq=-1"], "trainer.save_freq", 0),
        (["trainer.test_freq=-1"], "trainer.test_freq", 0),
        (["actor_rollout_ref.actor.use_kl_loss=True"], "algo.kl_coef", 0.001),  # verl's default coefficient
        (
            ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01"],
            "algo.kl_coef",
            0.01,
        ),
        (["actor_rollout_ref.actor.kl_loss_coef=0.01"], "algo.kl_coef", 0.0),  # verl adds no KL without use_kl_loss
        (["trainer.nnodes=2"], "trainer.ray_workers", 16),  # verl's default 8 GPUs per node
        (["trainer.n_gpus_per_node=1"], "trainer.launcher", "ray"),
        (["trainer.resume_mode=resume_path", "trainer.resume_from_path=ckpt/step_7"], "trainer.resume", "ckpt/step_7"),
        (["trainer.resume_from_path=ckpt/step_7"], "trainer.resume", "auto"),  # verl reads it only with resume_path
        (["++reward.custom_reward_function.path=r.py"], "reward.path", "r.py"),
        (["trainer.default_local_dir=007"], "trainer.output_dir", "007"),  # read as the longqa key's type: a string
        (["actor_rollout_ref.actor.optim.betas=[0.9,0.999]"], "actor.betas", [0.9, 0.999]),
        (["actor_rollout_ref.actor.strategy=fsdp"], "actor.strategy", "fsdp2"),  # verl's FSDP1: longqa's is FSDP2
        (["actor_rollout_ref.actor.strategy=fsdp2"], "actor.strategy", "fsdp2"),
        (["actor_rollout_ref.actor.strategy=deepspeed"], "actor.strategy", "deepspeed"),
        (["actor_rollout_ref.actor.fsdp_config.model_dtype=fp32"], "actor.master_weights", "float32"),
        (["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"], "actor.master_weights", "model"),
    ],
)
def test_values_verl_spells_differently(line, key, value):
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, line), section), name) == value


@pytest.mark.parametrize(
    "line, says",
    [
        (["actor_rollout_ref.rollout.name=sglang"], "rollout.engine=fast (its own engine; verl's arctic), hf or vllm"),
        (
            ["actor_rollout_ref.actor.strategy=megatron"],
            "actor_rollout_ref.actor.strategy=megatron: longqa shards the "
            "actor with FSDP2 (fsdp, fsdp2) or DeepSpeed ZeRO-3 (deepspeed)",
        ),
        (["actor_rollout_ref.actor.fsdp_config.strategy=zero3"], "longqa's FSDP is FSDP2"),
        (["algorithm.adv_estimator=gae"], "estimators are grpo"),
        (["actor_rollout_ref.actor.kl_loss_type=full"], "KL estimators are"),
        (["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], "set both to the same value"),
        (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.01"], "no KL penalty in the reward"),
        (["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"], "one greedy answer per question"),
        (["actor_rollout_ref.actor.use_dynamic_bsz=False"], "token budget"),
        (["trainer.resume_mode=resume_path"], "needs trainer.resume_from_path"),
        (["trainer.nnodes=0"], "integers > 0"),
        (["actor_rollout_ref.actor.use_kl_loss=maybe"], "use_kl_loss must be true or false"),
        (
            ["actor_rollout_ref.rollout.n=0"],
            "config key 'rollout.n' must be > 0, got 0 (given as actor_rollout_ref.rollout.n=0)",
        ),
        (["actor_rollout_ref.actor.optim.lrr=1"], "'actor_rollout_ref.actor.optim.lrr': neither a longqa setting nor"),
        (["trainer.max_step=3"], "did you mean 'trainer.max_steps'?"),
    ],
)
def test_what_longqa_cannot_run_is_refused_saying_why(line, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, line)
    assert says in str(e.value) and str(e.value).count("\n") == 0  # one problem: one line


def test_every_translation_lands_on_a_longqa_key():
    longqa = set(all_keys())
    assert {rename.key for rename in RENAMED.values()} <= longqa
    for group in GROUPS:  # read with verl's defaults for every key of the group
        assert {key for key, _ in group.resolve({})} <= longqa
    assert not (set(RENAMED) | set(FIXED)) & longqa  # a verl key never shadows a longqa key


def test_the_table_uses_verl_s_own_key_names():
    """Every verl key longqa takes is a key of verl's own trainer config (read from the installed package)."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed")
    config = Path(spec.submodule_search_locations[0]) / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    tree = yaml.safe_load(config.read_text())

    def exists(key: str) -> bool:
        node = tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    free_form = "actor_rollout_ref.model.override_config."  # a mapping handed to the model config as it is
    # the Arctic remote backend's keys are Snowflake's verl fork's (the reference recipe runs it), not upstream's
    fork = {"trainer.remote_backend", "trainer.use_legacy_worker_impl"}
    keys = [
        key
        for key, _ in verl_key_table()
        if not key.startswith(free_form) and key.split(".")[0] != "remote_backend" and key not in fork
    ]
    assert [key for key in keys if not exists(key)] == []
    assert exists(free_form.rstrip("."))


def test_config_keys_lists_the_verl_keys(capsys):
    assert main(["config", "keys", "--verl"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.rollout.n" in out and "trainer.n_gpus_per_node" in out
    assert len(out.splitlines()) == len(verl_key_table())


@pytest.mark.slow
def test_a_verl_launch_line_trains(tmp_path, tokenizer, data_dir, capsys):
    """``longqa train`` with verl's keys alone, console logging only as verl lines often have: it trains the
    steps asked for, and a run that logs no metrics file simply writes no report."""
    out = tmp_path / "run"
    line = [
        f"actor_rollout_ref.model.path={save_tiny_qwen3(tmp_path / 'model', tokenizer)}",
        f"data.train_files={data_dir}/merged/train.parquet",
        "data.max_prompt_length=4096",
        "data.max_response_length=4",
        "data.train_batch_size=2",
        f"data.cache_dir={tmp_path}/cache",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={out}",
        "trainer.logger=['console']",
        "trainer.device=cpu",
    ]
    assert main(["train", *line]) == 0
    assert "step 1/1" in capsys.readouterr().out
    assert not (out / "checkpoints").exists() and not (out / "report").exists()


LAUNCH_LINE = Path(__file__).parent / "data" / "recipe_verl_launch_line.txt"


def recipe_launch_line(**values: str) -> list[str]:
    """The reference recipe's own verl launch line, 89 arguments (tests/data), with paths filled in."""
    lines = [line for line in LAUNCH_LINE.read_text().splitlines() if line and not line.startswith("#")]
    return [line.format(**values) for line in lines]


def test_the_recipe_s_own_launch_line_runs_as_it_is(capsys):
    """Given to longqa unchanged, nothing is refused: each key becomes a longqa setting or is said, on stderr,
    with why it changes nothing; under the Arctic remote backend the GPUs are its 32 training GPUs (ZeRO-3,
    the optimizer on the CPU, the packed shared-prompt update, the shared-prefix fast engine)."""
    line = recipe_launch_line(data="/data", model="Qwen/Qwen3-32B", reward="/recipe/reward.py", output="/ckpt/run")
    assert len(line) == 89
    assert main(["config", "show", *line]) == 0
    captured = capsys.readouterr()
    cfg = load_config(None, line, base=VERL_DEFAULTS)
    assert yaml.safe_load(captured.out) == yaml.safe_load(to_yaml(cfg))
    notes = [text.removeprefix("note: ") for text in captured.err.splitlines()]
    assert notes[0].startswith("verl keys and no config file: starting from longqa's defaults with verl's")
    assert notes[1:] == verl_notes(line)
    said = {note.partition("=")[0] for note in notes[1:]}
    run_as_another_value = {
        "actor_rollout_ref.model.override_config.attn_implementation",  # FlashAttention 3
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    }  # a budget counted verl's way
    read_by_vllm_alone = {
        "actor_rollout_ref.rollout." + key
        for key in (  # and this line samples with the fast engine
            "gpu_memory_utilization",
            "free_cache_engine",
            "enforce_eager",
        )
    }
    without_effect = said - run_as_another_value - read_by_vllm_alone
    assert len(said) == 28 and (run_as_another_value | read_by_vllm_alone) <= said and len(without_effect) == 23
    assert (cfg.trainer.launcher, cfg.trainer.ray_workers) == ("ray", 32)  # not verl's driver's 1 x 1
    assert (cfg.actor.strategy, cfg.actor.cpu_offload, cfg.actor.shared_prompt) == ("deepspeed", True, True)
    assert (cfg.rollout.engine, cfg.rollout.speculative) == ("fast", "prompt_lookup")
    assert (cfg.trainer.val_before_train, cfg.trainer.project_name) == (False, "arctic_rl_long_context")
    assert (cfg.algo.dual_clip_c, cfg.actor.weight_decay, cfg.actor.betas) == (3.0, 0.01, [0.9, 0.95])


def test_the_recipe_config_computes_what_the_recipe_s_launch_line_does():
    """configs/loongrl-qwen3-32b.yaml against the recipe's launch line on every setting that changes what a run
    computes (those a resume refuses to change), but the files it reads and where the optimizer's state
    lives: the reward is the recipe's reward.py in its default mode (pure_exact_match, which longqa's mode of
    that name reproduces), and ZeRO-3 versus FSDP2 is the same update."""
    line = recipe_launch_line(data="data/loongrl", model="Qwen/Qwen3-32B", reward="/recipe/reward.py", output="runs/x")
    recipe = load_config(None, line, base=VERL_DEFAULTS)
    ours = load_config("configs/loongrl-qwen3-32b.yaml")
    where = {"reward.path", "reward.name", "reward.mode", "actor.strategy", "actor.cpu_offload_ratio"}
    differ = {key for key in REFUSED_ON_RESUME - where if _get(recipe, key) != _get(ours, key)}
    assert differ == set()
    assert (recipe.reward.path, recipe.reward.name) == ("/recipe/reward.py", "compute_score")
    assert (ours.reward.mode, ours.reward.path) == ("pure_exact_match", None)
    # the bf16 the recipe samples and trains in, on float32 masters, as verl does
    assert (recipe.model.dtype, recipe.actor.master_weights) == ("bfloat16", "float32")


def test_the_recipe_s_launch_line_plans_on_its_32_gpus(capsys):
    """`longqa plan` with the line sizes its 32 GPUs (the remote backend's, not verl's driver's one). Its token
    budget (Arctic's, counted its way) becomes longqa's auto, said: the largest packed micro-batch that fits."""
    line = recipe_launch_line(data="/data", model="Qwen/Qwen3-32B", reward="/recipe/reward.py", output="/ckpt/run")
    assert main(["plan", *line, "--shape", "qwen3-32b"]) == 0
    captured = capsys.readouterr()
    assert "on 32 GPU(s) of 141 GiB" in captured.out and captured.out.rstrip().endswith("fits")
    assert re.search(r"actor.max_tokens_per_micro_batch=auto: [\d,]+ tokens a micro-batch \(the largest", captured.out)
    assert "note: actor_rollout_ref.actor.ppo_max_token_len_per_gpu=81920: verl's budget counts" in captured.err
    with pytest.raises(ConfigError, match="given different values"):  # one budget: verl's key or longqa's
        load_config(None, [*line, "actor.max_tokens_per_micro_batch=20480"])
    assert (
        load_config(
            None,
            [text for text in line if "ppo_max_token_len" not in text] + ["actor.max_tokens_per_micro_batch=20480"],
        ).actor.max_tokens_per_micro_batch
        == 20480
    )


@pytest.mark.parametrize("engine, said", [("vllm", False), ("hf", True), ("arctic", True), (None, True)])
def test_vllm_settings_are_said_unread_when_another_engine_samples(engine, said):
    line = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "actor_rollout_ref.rollout.enforce_eager=True"]
    line += [f"actor_rollout_ref.rollout.name={engine}"] if engine else []
    notes = verl_notes(line)
    assert len(notes) == (2 if said else 0) and all("does not read it" in note for note in notes)
    assert load_config(None, line).rollout.gpu_memory_utilization == 0.7  # the setting itself is taken either way


BASELINE_LINE = Path(__file__).parent / "data" / "recipe_verl_baseline_launch_line.txt"


def test_the_recipe_s_stock_verl_baseline_line_is_taken_whole(capsys, tmp_path):
    """The recipe's stock verl baseline (vLLM rollout with tensor parallelism 2 over its 32 ranks, FSDP2, Ulysses
    sequence parallelism 2), given unchanged: every key is taken and nothing is refused (both parallelisms were,
    once). The model is Qwen3-32B's config alone (no weights): the checks read its heads and positions."""
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES

    Qwen3Config(**SHAPES["qwen3-32b"]).save_pretrained(tmp_path / "Qwen3-32B")
    lines = [line for line in BASELINE_LINE.read_text().splitlines() if line and not line.startswith("#")]
    line = [
        text.format(data="/data", model=tmp_path / "Qwen3-32B", reward="/recipe/reward.py", output="/ckpt/run")
        for text in lines
    ]
    assert len(line) == 71
    cfg = load_config(None, line, base=VERL_DEFAULTS)
    assert (cfg.actor.sequence_parallel_size, cfg.actor.strategy, cfg.actor.cpu_offload) == (2, "fsdp2", True)
    assert (cfg.rollout.engine, cfg.rollout.tensor_model_parallel_size, cfg.trainer.ray_workers) == ("vllm", 2, 32)
    assert main(["config", "show", *line]) == 0
    captured = capsys.readouterr()
    assert "error" not in captured.err and yaml.safe_load(captured.out) == yaml.safe_load(to_yaml(cfg))
