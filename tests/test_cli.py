import json

import pyarrow.parquet as pq
import pytest
import torch

from longqa.cli import build_parser, main

GROUPS = {"data": ["loongrl", "synth", "prepare"], "config": ["show", "keys"]}


@pytest.mark.parametrize("argv", [[]] + [[g] for g in GROUPS] + [[g, c] for g, cs in GROUPS.items() for c in cs])
def test_help_on_every_level(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: longqa") and len(out.splitlines()) > 3


def test_config_show_and_keys(capsys, tmp_path):
    assert main(["config", "show", "rollout.n=3", "data.max_prompt_length=2048"]) == 0
    out = capsys.readouterr().out
    assert "  n: 3\n" in out and "max_prompt_length: 2048" in out
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 5\n")
    assert main(["config", "show", str(path), "algo.clip_ratio=0.25"]) == 0
    out = capsys.readouterr().out
    assert "  n: 5\n" in out and "clip_ratio: 0.25" in out
    assert main(["config", "keys"]) == 0
    assert "rollout.n" in capsys.readouterr().out


def test_bad_config_fails_before_any_work(capsys):
    assert main(["config", "show", "rollout.temprature=0.5"]) == 2
    assert capsys.readouterr().err.strip() == ("longqa: error: unknown config key 'rollout.temprature'; "
                                               "did you mean 'rollout.temperature'?")


def test_synth_then_prepare(tmp_path, tokenizer_dir, capsys):
    out_dir = tmp_path / "data"
    assert main(["data", "synth", "--output-dir", str(out_dir), "--rows-per-task", "6", "--tasks", "hotpotqa",
                 "musique"]) == 0
    assert "hotpotqa/train.parquet  5 rows" in capsys.readouterr().out
    args = ["data", "prepare", f"model.path={tokenizer_dir}", f"data.train_files={out_dir}/merged/train.parquet",
            f"data.val_files={out_dir}/merged/test.parquet", f"data.cache_dir={tmp_path}/cache"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train: 10 prompts from 10 rows in 1 file(s)" in out and "val: 2 prompts" in out and "prepared" in out
    assert main(args) == 0
    assert "cache hit" in capsys.readouterr().out


def test_prepare_errors_are_one_line(tmp_path, tokenizer_dir, capsys):
    assert main(["data", "prepare", "data.train_files=x.parquet"]) == 2
    assert "set model.path" in capsys.readouterr().err
    assert main(["data", "prepare", f"model.path={tmp_path}/missing", "data.train_files=x.parquet"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer path" in err and "missing does not exist" in err
    assert main(["data", "prepare", f"model.path={tokenizer_dir}", f"data.train_files={tmp_path}/nope.parquet",
                 f"data.cache_dir={tmp_path}/cache"]) == 2
    assert "nope.parquet: no such file" in capsys.readouterr().err


def test_synth_by_length_then_eval_scores_each_length(tmp_path, capsys):
    out_dir, scores = tmp_path / "data", tmp_path / "scores.json"
    assert main(["data", "synth", "--output-dir", str(out_dir), "--rows-per-task", "4", "--tasks", "hotpotqa",
                 "musique", "--max-hops", "3", "--context-lengths", "512", "256"]) == 0
    out = capsys.readouterr().out
    assert "ctx256/musique/test.parquet  1 rows" in out and "\n  merged/test.parquet  4 rows" in out
    assert main(["eval", "--data", str(out_dir / "merged" / "test.parquet"), "--max-new-tokens", "4",
                 "--device", "cpu", "--output", str(scores)]) == 0
    out = capsys.readouterr().out
    assert "\n\ntarget_tokens " in out and "\n256 " in out and "\n\nhops " in out
    result = json.loads(scores.read_text())
    assert [(g["target_tokens"], g["n"]) for g in result["by_length"]] == [(256, 2), (512, 2)]
    assert sum(g["n"] for g in result["by_hops"]) == result["all"]["n"] == 4
    # --limit: the first rows of each file, so a quick look still covers every length
    files = [out_dir / f"ctx{n}" / "merged" / "test.parquet" for n in (512, 256)]
    samples = tmp_path / "samples.jsonl"
    assert main(["eval", "--data", *map(str, files), "--max-new-tokens", "4", "--device", "cpu", "--limit", "1",
                 "--output", str(scores), "--samples", str(samples)]) == 0
    result = json.loads(scores.read_text())
    assert [(g["target_tokens"], g["n"]) for g in result["by_length"]] == [(256, 1), (512, 1)]
    firsts = [pq.read_table(f).to_pylist()[0]["reward_model"]["ground_truth"] for f in files]
    assert [json.loads(line)["ground_truth"] for line in samples.read_text().splitlines()] == firsts
    assert main(["eval", "--data", str(files[0]), "--max-prompt-length", "5", "--device", "cpu"]) == 2
    assert "no prompt left: 2 rows read, 2 over --max-prompt-length=5" in capsys.readouterr().err


@pytest.mark.parametrize("extra, complaint", [
    (["--longbench-scores", "preds", "--limit", "5", "--device", "cpu"],
     "--longbench-scores takes no --device, --limit: it scores the prediction files as they are"),
    (["--longbench", "data", "--output", "preds", "--mode", "em"], "--longbench takes no --mode: LongBench's"),
])
def test_eval_refuses_options_it_would_not_use(capsys, extra, complaint):
    assert main(["eval", *extra]) == 2
    assert complaint in capsys.readouterr().err


def test_overrides_may_follow_options(capsys):
    """`longqa plan CONFIG --gpus 2 key=value`: the overrides after an option are overrides still, and a command
    given overrides alone reads them as such (argparse alone took the first for a config file)."""
    assert main(["plan", "configs/loongrl-qwen3-8b.yaml", "--shape", "qwen3-8b", "--gpus", "2",
                 "actor.strategy=deepspeed", "actor.cpu_offload=true"]) == 0
    assert "on 2 GPU(s)" in (out := capsys.readouterr().out) and "DeepSpeed ZeRO-3, optimizer offloaded" in out
    assert main(["plan", "actor.strategy=deepspeed", "--shape", "qwen3-tiny", "rollout.n=4"]) == 0
    assert "DeepSpeed ZeRO-3" in (out := capsys.readouterr().out) and "prompts x 4" in out
    for argv in (["plan", "--shape", "qwen3-tiny", "--bogus", "1"], ["data", "synth", "--output-dir", "x", "a=b"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_plan_largest_with_a_shape_is_refused(capsys):
    assert main(["plan", "--largest", "--shape", "qwen3-8b"]) == 2
    assert "--largest tries every known shape, --shape sizes one" in capsys.readouterr().err


def test_a_plan_whose_model_config_cannot_be_read_says_so_in_one_line(tmp_path, capsys):
    assert main(["plan", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"longqa: error: cannot read the model config of model.path={tmp_path} (")
    assert err.rstrip().endswith("give a local model folder, or size a Qwen3 shape instead with longqa plan --shape")
    assert len(err.strip().splitlines()) == 1


def _commands(parser, path=()):
    """Every (command path, its parser) of the ``longqa`` command line."""
    import argparse

    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


# Numeric options left to the library's own checks (one line each, tested below), or with no range to check.
CHECKED_BY_THE_LIBRARY = {"--test-ratio", "--context-tokens", "--context-lengths", "--min-hops", "--max-hops"}
ANY_NUMBER = {"--seed", "--port"}


def _numeric_options():
    for path, parser in _commands(build_parser()):
        if path != ("sft",):  # sft's flags are SFTOptions' fields, checked by it (below)
            for action in parser._actions:
                if action.type is not None and action.option_strings:
                    yield path, action


@pytest.mark.parametrize("path, flag", [pytest.param(path, action.option_strings[-1], id=" ".join(path) + " " +
                                                     action.option_strings[-1])
                                        for path, action in _numeric_options() if action.type not in (int, float)])
def test_every_range_checked_option_refuses_a_value_below_its_range(capsys, path, flag):
    with pytest.raises(SystemExit) as e:
        main([*path, flag, "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: must be " in err
    if "must be at least 1" in err:  # a count: none of it is refused too
        with pytest.raises(SystemExit):
            main([*path, flag, "0"])
        assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_every_numeric_option_is_range_checked_or_listed_as_checked_elsewhere():
    unchecked = {action.option_strings[-1] for _, action in _numeric_options() if action.type in (int, float)}
    assert unchecked == CHECKED_BY_THE_LIBRARY | ANY_NUMBER


@pytest.mark.parametrize("extra, complaint", [
    (["--test-ratio", "1.5"], "test ratio must be in (0, 1), got 1.5"),
    (["--context-tokens", "-3"], "context lengths must be at least 256 tokens, got -3"),
    (["--context-lengths", "512", "100"], "context lengths must be at least 256 tokens, got 100"),
    (["--min-hops", "5", "--max-hops", "3"], "need 2 <= min_hops <= max_hops"),
    (["--rows-per-task", "1"], "1 rows are too few for a test ratio of 0.05"),
])
def test_bad_synth_settings_get_one_clear_line(tmp_path, capsys, extra, complaint):
    assert main(["data", "synth", "--output-dir", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longqa: error: ") and complaint in err and len(err.strip().splitlines()) == 1


def test_every_numeric_sft_option_refuses_a_value_below_its_range():
    import dataclasses
    import typing

    from longqa.config import ConfigError
    from longqa.sft_options import SFTOptions

    hints = typing.get_type_hints(SFTOptions)
    numeric = [f.name for f in dataclasses.fields(SFTOptions) if f.name != "seed"
               and {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}]
    SFTOptions(["x.parquet"], "out")  # the defaults are fine
    for name in numeric:
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be "):
            SFTOptions(["x.parquet"], "out", **{name: -1})


@pytest.mark.parametrize("name, complaint", [
    ("gpu", "--device=gpu names no device: give auto, cpu or cuda[:i]"),
    ("meta", "--device=meta but no META device is available"),
    ("cuda:99", "--device=cuda:99 but " + ("this machine has" if torch.cuda.is_available() else "no CUDA device")),
])
def test_a_device_this_machine_lacks_is_refused_naming_the_flag(tmp_path, capsys, name, complaint):
    data = tmp_path / "data"
    assert main(["data", "synth", "--output-dir", str(data), "--rows-per-task", "4", "--tasks", "hotpotqa"]) == 0
    assert main(["eval", "--data", str(data / "merged" / "test.parquet"), "--device", name]) == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_training_on_a_missing_gpu_names_the_key(capsys):
    assert main(["train", "trainer.device=cuda", "data.train_files=x.parquet"]) == 2
    assert "trainer.device=cuda but no CUDA device is available" in capsys.readouterr().err
