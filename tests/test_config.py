import argparse
import os

import pytest

from longqa.cli import main, run_config
from longqa.config import ConfigError, all_keys, load_config, parse_override, path_keys, to_yaml


def test_defaults_follow_the_recipe():
    cfg = load_config()
    assert (cfg.rollout.n, cfg.algo.clip_ratio, cfg.actor.betas, cfg.data.truncation) == (8, 0.2, [0.9, 0.95], "left")
    assert cfg.data.filter_overlong_prompts and cfg.algo.kl_coef == 0.0 and cfg.reward.mode == "hardened"


def test_the_grace_period_after_sigterm():
    assert load_config().trainer.preemption_grace_s == 30.0  # what Kubernetes, Slurm and torchrun give by default
    assert load_config(None, ["trainer.preemption_grace_s=0"]).trainer.preemption_grace_s == 0.0  # never finish


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_files: a.parquet\n  max_prompt_length: 2048\nrollout:\n  n: 4\n")
    cfg = load_config(
        path,
        [
            "rollout.n=16",
            "algo.clip_ratio=0.3",
            "actor.lr=5e-4",
            "data.val_files=[x.parquet, y.parquet]",
            "algo.clip_ratio_high=0.28",
            "trainer.output_dir=007",
        ],
    )
    assert cfg.data.train_files == ["a.parquet"]  # a single file is a list of one
    assert cfg.data.max_prompt_length == 2048 and cfg.rollout.n == 16 and cfg.algo.clip_ratio == 0.3
    assert cfg.actor.lr == 5e-4
    assert cfg.data.val_files == ["x.parquet", "y.parquet"] and cfg.algo.clip_ratio_high == 0.28
    assert cfg.trainer.output_dir == "007"  # a string key keeps its text


def test_show_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.n=3", "data.train_files=f.parquet"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.temprature=0.7", "unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'?"),
        ("rolout.n=8", "did you mean 'rollout.n'?"),
        ("rollout=8", "unknown config key 'rollout'"),
        ("rollout.n=eight", "config key 'rollout.n' must be an integer, got 'eight'"),
        ("rollout.n=2.5", "must be an integer"),
        ("rollout.n=0", "config key 'rollout.n' must be > 0, got 0"),
        ("rollout.n=true", "must be an integer"),
        ("algo.clip_ratio=1.5", "config key 'algo.clip_ratio' must be in (0, 1), got 1.5"),
        ("algo.loss_agg_mode=mean", "must be one of 'token-mean'"),
        ("data.truncation=middle", "config key 'data.truncation' must be one of 'error', 'left', 'right'"),
        ("data.filter_overlong_prompts=maybe", "must be true or false"),
        ("reward.mode=substring", "config key 'reward.mode' must be one of 'hardened'"),
        ("rollout.top_k=0", "must be -1 or > 0"),
        ("rollout.speculative=ngram", "config key 'rollout.speculative' must be one of 'off', 'prompt_lookup'"),
        ("rollout.num_speculative_tokens=0", "config key 'rollout.num_speculative_tokens' must be > 0, got 0"),
        ("trainer.preemption_grace_s=-1", "config key 'trainer.preemption_grace_s' must be >= 0, got -1.0"),
        ("trainer.preemption_grace_s=soon", "config key 'trainer.preemption_grace_s' must be a finite number"),
        ("no_equals_sign", "must look like key=value"),
    ],
)
def test_bad_overrides_fail_with_one_clear_message(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist$"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="rollout.n is a config key; give it a value"):
        load_config("rollout.n")  # `longqa config show rollout.n`: a key where a file was expected
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  max_promt_length: 10\n")
    with pytest.raises(ConfigError, match="did you mean 'data.max_prompt_length'"):
        load_config(typo)
    flat = tmp_path / "flat.yaml"
    flat.write_text("data: 3\n")
    with pytest.raises(ConfigError, match="config section 'data' must be a mapping of its keys"):
        load_config(flat)


def test_every_key_has_help_and_parses():
    from longqa.config import key_help

    assert len(all_keys()) == len(key_help()) > 30
    assert all(text for _, text, _ in key_help())
    assert parse_override("data.train_files=a.parquet") == ("data.train_files", "a.parquet")


def test_reward_modes_match_the_reward_module():
    import typing

    from longqa import reward
    from longqa.config import schema as config_schema

    assert set(typing.get_args(typing.get_type_hints(config_schema.RewardConfig)["mode"])) == set(reward.REWARD_MODES)


def test_logger_sinks_match_the_report_module():
    import typing

    from longqa.config import schema as config_schema
    from longqa.config import support
    from longqa.train import report

    (sink,) = typing.get_args(typing.get_type_hints(config_schema.TrainerConfig)["logger"])
    sinks = {setting.removeprefix("trainer.logger=") for setting in support.PACKAGES}
    assert set(typing.get_args(sink)) == set(report.SINKS) >= sinks & set(report.SINKS)
    for setting in support.PACKAGES:  # each names a value its key takes
        key, value = setting.split("=")
        config_schema.checked(key, [value] if key == "trainer.logger" else value)


def test_the_reward_mode_s_default_comes_from_the_environment_when_set(monkeypatch, tmp_path):
    monkeypatch.setenv("REWARD_CALC_TYPE", "pure_exact_match")
    assert load_config().reward.mode == "pure_exact_match"
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  mode: pure_exact_match\n")
    assert load_config(path).reward.mode == "pure_exact_match"  # a file or an override that agrees
    assert load_config(None, ["reward.mode=pure_exact_match"]).reward.mode == "pure_exact_match"
    monkeypatch.setenv("REWARD_CALC_TYPE", "typo")
    with pytest.raises(ConfigError, match="REWARD_CALC_TYPE='typo' names no reward mode: set it to one of hardened"):
        load_config(None, ["reward.mode=hardened"])


def test_every_shipped_config_loads():
    from pathlib import Path

    import longqa

    shipped = sorted((Path(longqa.__file__).parent / "configs").glob("*.yaml"))
    assert {p.name for p in shipped} >= {"demo.yaml", "loongrl-qwen3-32b.yaml", "loongrl-qwen3-8b.yaml"}
    for path in shipped:
        load_config(path)


@pytest.mark.parametrize(
    "argv, environment, expected",
    [
        (["train"], "pure_exact_match", 1.0),  # the demo config names no mode: the environment's
        (["train"], None, 0.0),  # longqa's hardened default refuses the empty box
        (["train", "configs/loongrl-qwen3-32b.yaml"], None, 1.0),  # the recipe config: the recipe's mode
        (["train", "configs/loongrl-qwen3-32b.yaml", "reward.mode=hardened"], "hardened", 0.0),  # the two agree
    ],
)
def test_reward_calc_type_decides_what_train_scores_as_the_recipe_does(monkeypatch, argv, environment, expected):
    """What `longqa train` scores with (its config and reward function, before any model loads): the recipe's
    pure_exact_match finds any answer in an empty \\boxed{} (its two-way substring), as the recipe's reward.py
    does under REWARD_CALC_TYPE=pure_exact_match; longqa's hardened mode gives it 0."""
    from longqa.cli import build_parser, run_config
    from longqa.train.trainer import reward_function

    if environment:
        monkeypatch.setenv("REWARD_CALC_TYPE", environment)
    else:
        monkeypatch.delenv("REWARD_CALC_TYPE", raising=False)
    score = reward_function(run_config(build_parser().parse_args(argv)))
    assert score("hotpotqa", "<think>it is</think> The answer is \\boxed{}.", "Paris").score == expected


# The reference recipe's single-node 8B run (recipes/rl/skyrl/long_context_qa/run_qwen3_8b_loongrl_grpo_arl.sh in
# Snowflake-AI-Research/Arctic-Platform): the settings longqa takes as the script gives them, or as SkyRL and its
# Arctic backend default them where the script gives none (their source named in docs/verl-launch-line.md):
# (the launcher's name, longqa's key, value). The settings longqa takes otherwise, each with its reason, are in that
# table too (test_docs.py reads it against the config).
RECIPE_8B = [
    ("MODEL", "model.path", "Qwen/Qwen3-8B"),
    ("PROMPT_LEN", "data.max_prompt_length", 16384),
    ("RESPONSE_LEN", "data.max_response_length", 2048),
    ("TRAIN_BSZ", "data.train_batch_size", 16),
    ("N_SAMPLES", "rollout.n", 4),
    ("trainer.update_epochs_per_batch", "actor.ppo_epochs", 1),
    ("TOTAL_EPOCHS", "trainer.total_epochs", 1),
    ("EVAL_INTERVAL", "trainer.test_freq", 50),
    ("EVAL_BEFORE_TRAIN", "trainer.val_before_train", False),
    ("LR", "actor.lr", 1e-6),
    ("trainer.arctic_rl.lr_warmup_ratio", "actor.warmup_ratio", 0.05),
    ("SkyRL's schedule horizon", "actor.schedule_updates", 1000),
    ("trainer.arctic_rl.lr_scheduler_type", "actor.lr_schedule", "constant"),
    ("trainer.arctic_rl.optimizer_betas", "actor.betas", [0.9, 0.95]),
    ("trainer.policy.optimizer_config.weight_decay", "actor.weight_decay", 0.01),
    ("trainer.policy.optimizer_config.max_grad_norm", "actor.grad_clip", 1.0),
    ("trainer.algorithm.use_kl_loss", "algo.kl_coef", 0.0),
    ("trainer.algorithm.advantage_estimator", "algo.adv_estimator", "grpo"),
    ("trainer.algorithm.grpo_norm_by_std", "algo.norm_adv_by_std", True),
    ("clip_ratio", "algo.clip_ratio", 0.2),
    ("clip_ratio_c", "algo.dual_clip_c", 3.0),
    ("loss_agg_mode", "algo.loss_agg_mode", "token-mean"),
    ("entropy_coeff", "algo.entropy_coeff", 0.0),
    ("generator.sampling_params.temperature", "rollout.temperature", 1.0),
    ("generator.sampling_params.top_p", "rollout.top_p", 1.0),
    ("generator.sampling_params.top_k", "rollout.top_k", -1),
    ("REWARD_CALC_TYPE", "reward.mode", "pure_exact_match"),
    ("bf16", "model.dtype", "bfloat16"),
]


@pytest.mark.parametrize("name, key, value", RECIPE_8B, ids=[key for _, key, _ in RECIPE_8B])
def test_the_8b_config_is_the_recipe_s_8b_run(name, key, value):
    section, field = key.split(".")
    assert getattr(getattr(load_config("configs/loongrl-qwen3-8b.yaml"), section), field) == value, name


# Config mistakes a new user makes, each met with one line naming what to do, never a traceback; and a YAML file
# takes the keys the command line takes (verl's included).


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("text", ["foo:\n  bar: 1\n", "foo: 1\n", "rollout:\n  nn: 4\n"])
def test_an_unknown_key_or_section_in_a_file_is_one_line(tmp_path, text):
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(write(tmp_path / "u.yaml", text))


@pytest.mark.parametrize(
    "text",
    [
        "actor_rollout_ref:\n  rollout:\n    n: 4\n",
        "actor_rollout_ref.rollout.n: 4\n",
        "actor_rollout_ref:\n  rollout.n: 4\n",
    ],
)
def test_verl_keys_in_a_file_are_read_as_on_the_command_line(tmp_path, text):
    assert load_config(write(tmp_path / "v.yaml", text)).rollout.n == 4


def test_a_file_of_verl_sections_matches_the_same_command_line(tmp_path):
    path = write(
        tmp_path / "v.yaml",
        "algorithm: {adv_estimator: rloo}\nactor_rollout_ref:\n  actor:\n"
        "    optim: {lr: 2.0e-6}\n    use_kl_loss: true\n    kl_loss_coef: 0.01\n"
        "  rollout: {name: hf, n: 3}\ntrainer: {default_local_dir: out}\n",
    )
    line = [
        "algorithm.adv_estimator=rloo",
        "actor_rollout_ref.actor.optim.lr=2.0e-6",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=3",
        "trainer.default_local_dir=out",
    ]
    assert load_config(path) == load_config(None, line)


def test_verl_values_without_a_counterpart_in_a_file_are_refused_together(tmp_path):
    path = write(tmp_path / "v.yaml", "actor_rollout_ref:\n  rollout: {name: sglang}\nalgorithm: {bogus: 1}\n")
    with pytest.raises(ConfigError, match="2 keys of config file .* cannot be used"):
        load_config(path)


def test_a_string_key_keeps_a_file_s_string(tmp_path):
    assert load_config(write(tmp_path / "s.yaml", "trainer:\n  output_dir: '001'\n")).trainer.output_dir == "001"


def test_the_command_line_still_overrides_a_verl_key_of_the_file(tmp_path):
    path = write(tmp_path / "v.yaml", "actor_rollout_ref.rollout.n: 4\n")
    assert load_config(path, ["rollout.n=6"]).rollout.n == 6


@pytest.mark.parametrize("text", ["data:\n", "data: 5\n", "trainer: [1, 2]\n"])
def test_a_section_given_no_mapping_says_so(tmp_path, text):
    with pytest.raises(ConfigError, match="config section '(data|trainer)' must be a mapping of its keys"):
        load_config(write(tmp_path / "d.yaml", text))


def test_a_data_file_as_the_config_is_named_as_data(tmp_path):
    parquet = tmp_path / "train.parquet"
    parquet.write_bytes(b"PAR1\x15\x04\x15\x80\xff\x00")
    with pytest.raises(ConfigError, match=r"is not a YAML config file .*data\.train_files="):
        load_config(parquet)
    binary = tmp_path / "blob"
    binary.write_bytes(b"\xff\xfe\x00\x81\x90")
    with pytest.raises(ConfigError, match="is not a YAML config file .*not UTF-8 text"):
        load_config(binary)
    listing = write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="is not a YAML config file .*not a mapping"):
        load_config(listing)


def test_a_folder_as_the_config_is_called_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)


def test_the_cli_says_one_line_for_a_data_file(tmp_path, capsys):
    parquet = tmp_path / "some.parquet"
    parquet.write_bytes(b"PAR1\xff\xfe\x00")
    assert main(["config", "show", str(parquet)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "is not a YAML config file" in err


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400"])
def test_an_infinite_integer_is_refused_as_not_an_integer(tmp_path, value):
    with pytest.raises(ConfigError, match="'data.train_batch_size' must be an integer"):
        load_config(None, [f"data.train_batch_size={value}"])
    with pytest.raises(ConfigError, match="'rollout.n' must be an integer"):
        load_config(write(tmp_path / "i.yaml", f"rollout:\n  n: {value}\n"))


def test_every_path_key_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = path_keys()
    assert {
        "model.path",
        "data.train_files",
        "data.cache_dir",
        "reward.path",
        "trainer.output_dir",
        "actor.deepspeed_config",
        "trainer.resume",
    } <= set(keys)
    for key in keys:
        section, _, name = key.partition(".")
        got = getattr(getattr(load_config(None, [f"{key}=~/x"]), section), name)
        assert got in (str(tmp_path / "x"), [str(tmp_path / "x")]), key
        path = write(tmp_path / "p.yaml", f"{section}:\n  {name}: '~/y'\n")
        got = getattr(getattr(load_config(path), section), name)
        assert got in (str(tmp_path / "y"), [str(tmp_path / "y")]), key
    assert load_config(None).data.cache_dir == os.path.join(str(tmp_path), ".cache", "longqa")


@pytest.mark.parametrize("key", ["trainer.output_dir", "data.train_files", "reward.path"])
def test_an_empty_path_is_refused(key):
    with pytest.raises(ConfigError, match=f"'{key}' is given an empty path"):
        load_config(None, [f"{key}="])


def test_messages_name_the_keys_listing_and_read_as_english():
    with pytest.raises(ConfigError, match=r"`longqa config keys` lists the \d+ keys"):
        load_config(None, ["zzz.qqq=1"])
    with pytest.raises(ConfigError, match="must be a list of strings"):
        load_config(None, ["rollout.stop={a: 1}"])


def test_a_verl_key_in_a_file_is_noted_like_on_the_command_line(tmp_path, capsys):
    path = write(tmp_path / "n.yaml", "trainer:\n  balance_batch: true\n")
    run_config(argparse.Namespace(config=str(path), overrides=[]))
    assert "trainer.balance_batch" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["model.gguf", "model.safetensors", "pytorch_model.bin", "a_model_folder"])
def test_a_model_given_as_the_config_is_named_a_model(tmp_path, name):
    path = tmp_path / name
    if name == "a_model_folder":
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path.write_bytes(b"\x00\xff GGUF")
    with pytest.raises(ConfigError, match=f"is a model, not a YAML config file: give it as model.path={path}$"):
        load_config(path)
