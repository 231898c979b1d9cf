"""Which reward scores a run, said and held to one rule: the recipe's ``REWARD_CALC_TYPE`` and a config's
``reward.mode`` that disagree are refused by every command that reads a config, ``config show`` says what scores
(the function of ``reward.path``, beside which ``reward.mode`` is unused), and the shipped configs' headers say the
mode they set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from cli_refusal import refusal

import longqa
from longqa.cli import main
from longqa.config import load_config

CONFIGS = Path(longqa.__file__).parent / "configs"
EMPTY_BOX = "<think>it is</think> The answer is \\boxed{}."


def _no_work(*args, **kwargs):
    raise AssertionError("the work began before the disagreeing reward mode was refused")


@pytest.mark.parametrize("config", ["configs/loongrl-qwen3-32b.yaml", "configs/loongrl-qwen3-8b.yaml"])
def test_a_shipped_config_s_mode_against_reward_calc_type_is_refused_by_every_command(
    config, tmp_path, monkeypatch, capsys
):
    """`REWARD_CALC_TYPE=format_f1_score longqa train configs/loongrl-qwen3-32b.yaml` ran pure_exact_match, whose
    substring match scores an empty box 1.0, and said nothing: now train, config show, plan, data prepare and the
    Ray driver refuse it in one line naming both and the file."""
    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    monkeypatch.setattr("longqa.train.ray_launcher.run_with_ray", _no_work)
    monkeypatch.setenv("REWARD_CALC_TYPE", "format_f1_score")
    expected = (
        f"REWARD_CALC_TYPE=format_f1_score but reward.mode=pure_exact_match (from {config}): a run scores with one "
        f"mode; set reward.mode=format_f1_score, or unset REWARD_CALC_TYPE"
    )
    run = [f"trainer.output_dir={tmp_path}/run"]
    for argv in (
        ["train", config, *run],
        ["train", config, *run, "trainer.launcher=ray", "trainer.ray_workers=2"],
        ["config", "show", config],
        ["plan", config, "--gpus", "32"],
        ["data", "prepare", config],
    ):
        assert refusal(capsys, argv) == expected, argv


def test_a_mode_given_on_the_command_line_is_held_to_the_same_rule(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    monkeypatch.setenv("REWARD_CALC_TYPE", "pure_exact_match")
    expected = (
        "REWARD_CALC_TYPE=pure_exact_match but reward.mode=hardened (from the command line): a run scores with one "
        "mode; set reward.mode=pure_exact_match, or unset REWARD_CALC_TYPE"
    )
    assert refusal(capsys, ["train", "reward.mode=hardened", f"trainer.output_dir={tmp_path}/run"]) == expected
    assert refusal(capsys, ["plan", "reward.mode=hardened", "--gpus", "1"]) == expected
    verl = ["actor_rollout_ref.rollout.n=4", "data.train_files=x.parquet", "reward.mode=hardened"]
    assert refusal(capsys, ["config", "show", *verl]) == expected  # a verl line, the same


@pytest.mark.parametrize(
    "argv, mode",
    [
        (["config", "show"], "format_f1_score"),  # the demo names no mode: the variable's
        (["config", "show", "actor_rollout_ref.rollout.n=4", "data.train_files=x.parquet"], "format_f1_score"),  # verl
        (["config", "show", "configs/loongrl-qwen3-32b.yaml", "reward.mode=format_f1_score"], "format_f1_score"),
        (["config", "show", "configs/loongrl-qwen3-32b.yaml", "reward.path=REWARD"], "pure_exact_match"),  # unused
    ],
)
def test_reward_calc_type_is_honoured_where_nothing_disagrees(argv, mode, tmp_path, monkeypatch, capsys):
    """The variable is the mode's default (a config or a verl line that names none runs it), a config that names
    the same mode runs, and with reward.path the user's function scores (and reads the variable itself)."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def compute_score(**kwargs):\n    return 0.0\n")
    monkeypatch.setenv("REWARD_CALC_TYPE", "format_f1_score")
    assert main([arg.replace("REWARD", str(reward_file)) for arg in argv]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["reward"]["mode"] == mode


def test_what_train_scores_an_empty_box_with_under_reward_calc_type(monkeypatch):
    """The defect as a user met it: the 32B config under REWARD_CALC_TYPE=format_f1_score scored an empty box 1.0
    (pure_exact_match's substring match); asked for that mode, the run scores it 0, as the recipe's format_f1_score
    does."""
    from longqa.cli import build_parser, run_config
    from longqa.config import ConfigError
    from longqa.train.trainer import reward_function

    monkeypatch.setenv("REWARD_CALC_TYPE", "format_f1_score")
    with pytest.raises(ConfigError, match="^REWARD_CALC_TYPE=format_f1_score but reward.mode=pure_exact_match"):
        run_config(build_parser().parse_args(["train", "configs/loongrl-qwen3-32b.yaml"]))
    args = build_parser().parse_args(["train", "configs/loongrl-qwen3-32b.yaml", "reward.mode=format_f1_score"])
    assert reward_function(run_config(args))("hotpotqa", EMPTY_BOX, "Paris").score == 0.0


def test_config_show_says_what_scores_and_train_reads_it_back(tmp_path, monkeypatch, capsys):
    """The recipe's verl line sets custom_reward_function.path: config show printed `reward.mode: hardened` as if it
    scored. It now says, in a YAML comment, that the function scores and reward.mode is unused; the output stays
    a config that load_config reads back to the same settings."""
    from longqa.config.verl_keys import VERL_DEFAULTS

    monkeypatch.delenv("REWARD_CALC_TYPE", raising=False)
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def compute_score(**kwargs):\n    return 0.0\n")
    line = [
        f"custom_reward_function.path={reward_file}",
        "custom_reward_function.name=compute_score",
        "data.train_files=x.parquet",
    ]
    assert main(["config", "show", *line]) == 0
    shown = capsys.readouterr().out
    said = (
        f"# each response is scored by compute_score (reward.name) of reward.path={reward_file}; "
        f"reward.mode=hardened is unused\nreward:\n"
    )
    assert said in shown
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    verl = load_config(None, [f"reward.path={reward_file}", "data.train_files=x.parquet"], base=VERL_DEFAULTS)
    assert load_config(path) == verl
    assert main(["config", "show", str(path)]) == 0
    assert capsys.readouterr().out == shown
    assert main(["config", "show"]) == 0  # a mode that scores is said as such
    assert "# each response is scored by longqa.reward in reward.mode=hardened\nreward:\n" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["loongrl-qwen3-32b.yaml", "loongrl-qwen3-8b.yaml"])
def test_a_shipped_config_s_header_names_the_mode_it_sets(name, monkeypatch):
    """The headers said the configs run the hardened reward while they set pure_exact_match."""
    monkeypatch.delenv("REWARD_CALC_TYPE", raising=False)
    path = CONFIGS / name
    header = path.read_text().split("\nmodel:")[0]
    said = re.search(r"What scores:.*?reward\.mode=(\w+)", header, re.DOTALL)
    assert said is not None and said.group(1) == load_config(path).reward.mode == "pure_exact_match"
