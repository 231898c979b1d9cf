import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert capsys.readouterr().err.strip() == (
        "longqa: error: unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'?"
    )


def test_synth_then_prepare(tmp_path, tokenizer_dir, capsys):
    out_dir = tmp_path / "data"
    assert (
        main(["data", "synth", "--output-dir", str(out_dir), "--rows-per-task", "6", "--tasks", "hotpotqa", "musique"])
        == 0
    )
    assert "hotpotqa/train.parquet  5 rows" in capsys.readouterr().out
    args = [
        "data",
        "prepare",
        f"model.path={tokenizer_dir}",
        f"data.train_files={out_dir}/merged/train.parquet",
        f"data.val_files={out_dir}/merged/test.parquet",
        f"data.cache_dir={tmp_path}/cache",
        "data.max_prompt_length=4096",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train: 10 prompts from 10 rows in 1 file(s)" in out and "val: 2 prompts" in out and "prepared" in out
    assert main(args) == 0
    assert "cache hit" in capsys.readouterr().out


def test_prepare_errors_are_one_line(tmp_path, tokenizer_dir, capsys):
    assert main(["data", "prepare", f"model.path={tmp_path}/missing", "data.train_files=x.parquet"]) == 2
    assert capsys.readouterr().err == f"longqa: error: model path {tmp_path}/missing does not exist\n"
    assert (
        main(
            [
                "data",
                "prepare",
                f"model.path={tokenizer_dir}",
                f"data.train_files={tmp_path}/nope.parquet",
                f"data.cache_dir={tmp_path}/cache",
            ]
        )
        == 2
    )
    assert "nope.parquet: no such file" in capsys.readouterr().err


def test_a_folder_given_as_a_data_file_is_said_to_be_a_folder(tmp_path, tokenizer_dir, capsys):
    """Where a data file goes, a folder is named as one, with the data files it holds to pick from."""
    (tmp_path / "merged").mkdir()
    for name in ("train.parquet", "test.parquet", "notes.txt"):
        (tmp_path / "merged" / name).write_text("")
    for argv in (
        ["eval", "--data", f"{tmp_path}/merged", "--device", "cpu"],
        [
            "data",
            "prepare",
            f"model.path={tokenizer_dir}",
            f"data.train_files={tmp_path}/merged",
            f"data.cache_dir={tmp_path}/cache",
        ],
    ):
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            f"longqa: error: {tmp_path}/merged is a folder, not a data file: give one "
            f"of its files (test.parquet, train.parquet)\n"
        )
    assert main(["train", f"data.train_files={tmp_path}", "trainer.device=cpu"]) == 2
    assert capsys.readouterr().err == (
        f"longqa: error: {tmp_path} is a folder, not a data file: give a .parquet, .jsonl or .json file\n"
    )


def test_synth_by_length_then_eval_scores_each_length(tmp_path, capsys):
    out_dir, scores = tmp_path / "data", tmp_path / "new-folder" / "scores.json"  # its folder is made
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(out_dir),
                "--rows-per-task",
                "4",
                "--tasks",
                "hotpotqa",
                "musique",
                "--max-hops",
                "3",
                "--context-lengths",
                "512",
                "256",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ctx256/musique/test.parquet  1 rows" in out and "\n  merged/test.parquet  4 rows" in out
    assert (
        main(
            [
                "eval",
                "--data",
                str(out_dir / "merged" / "test.parquet"),
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
                "--output",
                str(scores),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "\n\ntarget_tokens " in out and "\n256 " in out and "\n\nhops " in out
    result = json.loads(scores.read_text())
    assert [(g["target_tokens"], g["n"]) for g in result["by_length"]] == [(256, 2), (512, 2)]
    assert sum(g["n"] for g in result["by_hops"]) == result["all"]["n"] == 4
    # --limit: the first rows of each file, so a quick look still covers every length
    files = [out_dir / f"ctx{n}" / "merged" / "test.parquet" for n in (512, 256)]
    samples = tmp_path / "samples.jsonl"
    assert (
        main(
            [
                "eval",
                "--data",
                *map(str, files),
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
                "--limit",
                "1",
                "--output",
                str(scores),
                "--samples",
                str(samples),
            ]
        )
        == 0
    )
    result = json.loads(scores.read_text())
    assert [(g["target_tokens"], g["n"]) for g in result["by_length"]] == [(256, 1), (512, 1)]
    firsts = [pq.read_table(f).to_pylist()[0] for f in files]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["ground_truth"] for r in rows] == [f["reward_model"]["ground_truth"] for f in firsts]
    # each answer says which question it is: the same question_id at every length, and its length
    assert [(r["file"], r["row"]) for r in rows] == [(str(f), 0) for f in files]
    assert [(r["question_id"], r["target_tokens"], r["hops"]) for r in rows] == [
        (f["extra_info"]["question_id"], f["extra_info"]["target_tokens"], f["extra_info"]["hops"]) for f in firsts
    ]
    assert all(set(r) >= {"index", "score", "reason", "em", "f1", "answer", "response"} for r in rows)
    assert main(["eval", "--data", str(files[0]), "--max-prompt-length", "5", "--device", "cpu"]) == 2
    assert "no prompt left: 2 rows read, 2 over --max-prompt-length=5" in capsys.readouterr().err


def test_help_and_parsing_do_not_load_torch():
    """`longqa --help` and a command's parsing answer at once: torch and transformers load only for the work."""
    code = (
        "import sys; from longqa.cli import build_parser, parse_args; build_parser(); "
        "parse_args(['bench', 'step', '--speculative', 'prompt_lookup']); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_eval_answers_alike_from_the_fast_engine_and_from_generate(tmp_path, capsys):
    """`--engine fast` (the rollout engine, the default on a GPU, where generate's padded batches of 8K-token
    prompts run out of memory) gives generate's answers, a few prompts at a time as --batch-size says."""
    data = tmp_path / "data"
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(data),
                "--rows-per-task",
                "4",
                "--context-lengths",
                "256",
                "512",
                "--max-hops",
                "3",
            ]
        )
        == 0
    )
    answers = {}
    for engine in ("fast", "hf"):
        samples = tmp_path / f"{engine}.jsonl"
        assert (
            main(
                [
                    "eval",
                    "--data",
                    str(data / "merged" / "test.parquet"),
                    "--max-new-tokens",
                    "40",
                    "--batch-size",
                    "3",
                    "--engine",
                    engine,
                    "--device",
                    "cpu",
                    "--samples",
                    str(samples),
                ]
            )
            == 0
        )
        answers[engine] = [(r["response"], r["score"]) for r in map(json.loads, samples.read_text().splitlines())]
    capsys.readouterr()
    assert len(answers["hf"]) == 6 and answers["fast"] == answers["hf"]
    assert len({response for response, _ in answers["hf"]}) > 1  # answers that differ by question


def test_eval_answers_in_the_type_asked_and_says_which(tmp_path, capsys):
    """`--dtype bfloat16` answers as transformers' greedy `generate` does with the model loaded in bfloat16, auto
    as float32 does on the CPU (on a GPU auto is bfloat16: float32 answers took more than twice as long there),
    and the scores say which type answered."""
    from transformers import AutoModelForCausalLM

    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.model.load import EMBEDDED_MODEL as model_dir
    from longqa.model.load import answer_dtype, load_model_tokenizer

    data = tmp_path / "data"
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(data),
                "--rows-per-task",
                "8",
                "--tasks",
                "hotpotqa",
                "--context-lengths",
                "256",
                "--test-ratio",
                "0.5",
            ]
        )
        == 0
    )
    test = data / "merged" / "test.parquet"
    scores, responses = tmp_path / "scores.json", {}
    for dtype in ("bfloat16", "auto"):
        samples = tmp_path / f"{dtype}.jsonl"
        assert (
            main(
                [
                    "eval",
                    "--model",
                    str(model_dir),
                    "--data",
                    str(test),
                    "--max-new-tokens",
                    "24",
                    "--engine",
                    "hf",
                    "--device",
                    "cpu",
                    "--dtype",
                    dtype,
                    "--output",
                    str(scores),
                    "--samples",
                    str(samples),
                ]
            )
            == 0
        )
        assert json.loads(scores.read_text())["dtype"] == {"bfloat16": "bfloat16", "auto": "float32"}[dtype]
        responses[dtype] = [json.loads(line)["response"] for line in samples.read_text().splitlines()]
    capsys.readouterr()

    expected = {}
    tokenizer = load_model_tokenizer(model_dir)
    prompts = prepare_prompts([str(test)], tokenizer, PromptOptions(16384))
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        expected[dtype] = []
        for ids in map(prompts.ids, range(len(prompts))):
            out = model.generate(
                torch.tensor([ids.tolist()]),
                do_sample=False,
                max_new_tokens=24,
                eos_token_id=model.config.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            expected[dtype].append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    assert len(responses["bfloat16"]) == 4 and responses["bfloat16"] == expected[torch.bfloat16]
    assert responses["auto"] == expected[torch.float32]
    assert [answer_dtype("auto", "cuda"), answer_dtype("auto", "cuda:1"), answer_dtype("float16", "cpu")] == [
        "bfloat16",
        "bfloat16",
        "float16",
    ]


def test_eval_engine_auto_is_generate_on_a_cpu_and_fast_refuses_a_model_it_cannot_hold():
    from tiny_models import tiny_lm
    from transformers import MambaConfig, MambaForCausalLM

    from longqa.evaluation.evaluate import EngineChoiceError, answer_engine
    from longqa.rollout.fast import FastRolloutEngine

    mamba = MambaForCausalLM(MambaConfig(num_hidden_layers=1, hidden_size=16, state_size=4, vocab_size=64))
    assert answer_engine(mamba, None, "auto") is None and answer_engine(mamba, None, "hf") is None
    with pytest.raises(
        EngineChoiceError, match="--engine fast cannot answer with this model .*linear_attention.*--engine hf can"
    ):
        answer_engine(mamba, None, "fast")
    assert answer_engine(tiny_lm(), None, "auto") is None  # a CPU model
    engine = answer_engine(tiny_lm(), None, "fast", batch_size=5)
    assert isinstance(engine, FastRolloutEngine) and engine.max_groups == 5
    model = tiny_lm()  # sft's evaluations on a GPU: the engine answers from a bfloat16 copy, training keeps float32
    engine = answer_engine(model, None, "fast", dtype=torch.bfloat16)
    assert engine.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eval_engine_auto_is_the_fast_engine_on_a_gpu():
    from tiny_models import tiny_lm

    from longqa.evaluation.evaluate import answer_engine
    from longqa.rollout.fast import FastRolloutEngine

    assert isinstance(answer_engine(tiny_lm().cuda(), None, "auto"), FastRolloutEngine)


@pytest.mark.parametrize(
    "extra, complaint",
    [
        (
            ["--longbench-scores", "preds", "--limit", "5", "--device", "cpu"],
            "--longbench-scores takes no --device, --limit: it scores the prediction files as they are",
        ),
        (
            ["--longbench", "data", "--output", "preds", "--mode", "format_f1_score"],
            "--longbench takes no --mode: LongBench's",
        ),
    ],
)
def test_eval_refuses_options_it_would_not_use(capsys, extra, complaint):
    assert main(["eval", *extra]) == 2
    assert complaint in capsys.readouterr().err


def test_overrides_may_follow_options(capsys):
    """`longqa plan CONFIG --gpus 2 key=value`: the overrides after an option are overrides still, and a command
    given overrides alone reads them as such (argparse alone took the first for a config file)."""
    assert (
        main(
            [
                "plan",
                "configs/loongrl-qwen3-8b.yaml",
                "--shape",
                "qwen3-8b",
                "--gpus",
                "2",
                "actor.strategy=deepspeed",
                "actor.cpu_offload=true",
            ]
        )
        == 0
    )
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


# Numeric options left to the library's own checks (one line each, tested below).
CHECKED_BY_THE_LIBRARY = {"--test-ratio", "--context-tokens", "--context-lengths", "--min-hops", "--max-hops"}


def _numeric_options():
    for path, parser in _commands(build_parser()):
        if path != ("sft",):  # sft's flags are SFTOptions' fields, checked by it (below)
            for action in parser._actions:
                if action.type is not None and action.option_strings:
                    yield path, action


@pytest.mark.parametrize(
    "path, flag",
    [
        pytest.param(path, action.option_strings[-1], id=" ".join(path) + " " + action.option_strings[-1])
        for path, action in _numeric_options()
        if action.type not in (int, float)
    ],
)
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
    assert unchecked == CHECKED_BY_THE_LIBRARY


@pytest.mark.parametrize(
    "extra, complaint",
    [
        (["--test-ratio", "1.5"], "test ratio must be in (0, 1), got 1.5"),
        (["--context-tokens", "-3"], "context lengths must be at least 256 tokens, got -3"),
        (["--context-lengths", "512", "100"], "context lengths must be at least 256 tokens, got 100"),
        (["--min-hops", "5", "--max-hops", "3"], "need 2 <= min_hops <= max_hops"),
        (["--rows-per-task", "1"], "1 rows are too few for a test ratio of 0.05"),
    ],
)
def test_bad_synth_settings_get_one_clear_line(tmp_path, capsys, extra, complaint):
    assert main(["data", "synth", "--output-dir", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longqa: error: ") and complaint in err and len(err.strip().splitlines()) == 1


def test_every_numeric_sft_option_refuses_a_value_below_its_range():
    import dataclasses
    import typing

    from longqa.config import ConfigError
    from longqa.config.sft_options import SFTOptions

    hints = typing.get_type_hints(SFTOptions)
    numeric = [
        f.name
        for f in dataclasses.fields(SFTOptions)
        if f.name != "seed" and {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}
    ]
    SFTOptions(["x.parquet"], "out")  # the defaults are fine
    for name in numeric:
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be "):
            SFTOptions(["x.parquet"], "out", **{name: -1})


@pytest.mark.parametrize(
    "name, complaint",
    [
        ("gpu", "--device=gpu names no device: give auto, cpu or cuda[:i]"),
        ("meta", "--device=meta but no META device is available"),
        ("cuda:99", "--device=cuda:99 but " + ("this machine has" if torch.cuda.is_available() else "no CUDA device")),
    ],
)
def test_a_device_this_machine_lacks_is_refused_naming_the_flag(tmp_path, capsys, name, complaint):
    data = tmp_path / "data"
    assert main(["data", "synth", "--output-dir", str(data), "--rows-per-task", "4", "--tasks", "hotpotqa"]) == 0
    assert main(["eval", "--data", str(data / "merged" / "test.parquet"), "--device", name]) == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_training_on_a_missing_gpu_names_the_key(capsys):
    assert main(["train", "trainer.device=cuda", "data.train_files=x.parquet"]) == 2
    assert "trainer.device=cuda but no CUDA device is available" in capsys.readouterr().err


# --- what a command line asks for is checked where it is read, and is what runs ----------------------


def test_config_show_shows_what_train_runs(tmp_path, monkeypatch, capsys):
    """For the same arguments (none, overrides of the demo, a config file, a verl launch line), `config show`
    prints the config `train` would run."""
    import longqa.train.trainer
    from longqa.config import to_yaml

    ran = []
    monkeypatch.setattr(
        longqa.train.trainer, "train", lambda cfg: ran.append(cfg) or {"preempted": None, "report": None, "steps": 0}
    )
    monkeypatch.setattr("longqa.data.demo.ensure_demo_data", lambda cfg: None)
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  n: 4\n")
    for args in (
        [],
        ["trainer.max_steps=1"],
        [str(config), "rollout.n=6"],
        ["actor_rollout_ref.rollout.n=4", "data.train_files=x.parquet"],
    ):
        assert main(["config", "show", *args]) == 0
        shown = capsys.readouterr().out
        assert main(["train", *args]) == 0
        assert to_yaml(ran[-1]) == shown, args
    assert main(["config", "show", "trainer.max_steps=1"]) == 0  # the demo's, not longqa's bare defaults
    out = capsys.readouterr().out
    assert "train_batch_size: 16" in out and "output_dir: runs/demo" in out and "device: cpu" in out


def test_data_prepare_reads_the_embedded_model_s_tokenizer_as_train_does(data_dir, tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "prepare",
                "configs/demo.yaml",
                f"data.train_files={data_dir}/merged/train.parquet",
                f"data.val_files={data_dir}/merged/test.parquet",
                f"data.cache_dir={tmp_path}",
            ]
        )
        == 0
    )
    assert "train: 18 prompts from 18 rows" in capsys.readouterr().out


def test_data_prepare_says_what_it_dropped_per_source_as_train_does(data_dir, tmp_path, capsys):
    """At a limit that drops some prompts, data prepare prints the same per-source lines train prints."""
    from longqa.config import load_config
    from longqa.data.prompts import PromptOptions, describe_losses, prepare_prompts
    from longqa.model.load import config_tokenizer

    files = [f"{data_dir}/merged/train.parquet"]
    tokenizer = config_tokenizer(load_config("configs/demo.yaml").model)  # the embedded model's, as prepare reads
    whole = prepare_prompts(files, tokenizer, PromptOptions(100_000))
    limit = int(sorted(whole.lengths)[len(whole) // 2])
    assert (
        main(
            [
                "data",
                "prepare",
                "configs/demo.yaml",
                f"data.train_files={files[0]}",
                "data.val_files=[]",
                f"data.max_prompt_length={limit}",
                f"data.cache_dir={tmp_path}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lost = describe_losses(prepare_prompts(files, tokenizer, PromptOptions(limit)), "train", PromptOptions(limit))
    assert len(lost) > 1 and all(line in out for line in lost[1:])


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["eval", "--data", "x.parquet", "--mode", "foo"], "argument --mode: invalid choice: 'foo'"),
        (["config", "show", "algo.clip_ratio_high=-0.5"], "config key 'algo.clip_ratio_high' must be > 0"),
        (
            ["config", "show", "trainer.logger=foo"],
            "config key 'trainer.logger' must be a list of 'console', 'jsonl', 'tensorboard' or 'wandb', got 'foo'",
        ),
        (["config", "show", "actor.betas=[0.9]"], "config key 'actor.betas' must be two numbers in [0, 1), got [0.9]"),
        (["config", "show", "actor.betas=0.9"], "config key 'actor.betas' must be two numbers in [0, 1), got [0.9]"),
        (["config", "show", "actor.betas=[0.9,1.5]"], "must be two numbers in [0, 1), got [0.9, 1.5]"),
        (
            ["config", "show", "actor.attention_backend=flex"],  # the demo runs on the CPU
            "actor.attention_backend=flex: flex_attention has no backward pass on cpu",
        ),
        (
            ["config", "show", "model.attn_implementation=flash_attention_2"],
            "model.attn_implementation=flash_attention_2: FlashAttention 2 runs on CUDA devices, not on cpu",
        ),
        (
            ["data", "synth", "--output-dir", "{tmp}/out", "--tokenizer", "/nonexistent"],
            "tokenizer /nonexistent is neither a tokenizer.json file nor a tokenizer folder",
        ),
        (["plan", "--gpu-memory-gib", "nan"], "argument --gpu-memory-gib: must be a finite number, got nan"),
        (["plan", "--gpu-memory-gib", "inf"], "argument --gpu-memory-gib: must be a finite number, got inf"),
        (
            [
                "bench",
                "train",
                "--backend",
                "flex",
                "--device",
                "cpu",
                "--shape",
                "qwen3-tiny",
                "--prompt",
                "16",
                "-n",
                "2",
                "--response",
                "4",
                "--repeat",
                "1",
                "--layouts",
                "packed",
            ],
            "--backend flex: flex_attention has no backward pass on cpu",
        ),
        (
            [
                "sft",
                "--train-files",
                "x.parquet",
                "--output-dir",
                "{tmp}/out",
                "--hidden-size",
                "64",
                "--num-heads",
                "3",
            ],
            "--hidden-size 64 must be --num-heads 3 times an even head size",
        ),
        (
            [
                "sft",
                "--train-files",
                "x.parquet",
                "--output-dir",
                "{tmp}/out",
                "--num-heads",
                "8",
                "--num-kv-heads",
                "3",
            ],
            "--num-heads 8 must be a multiple of --num-kv-heads 3",
        ),
        (
            ["sft", "--train-files", "x.parquet", "--output-dir", "{tmp}/out", "--init", "m", "--hidden-size", "64"],
            "--init takes no --hidden-size",
        ),
        (
            ["plan", "configs/loongrl-qwen3-32b.yaml", "--gpus", "24", "--shape", "qwen3-32b"],
            "data.train_batch_size=256 must be a multiple of the 24 ranks",
        ),
        (
            ["plan", "--gpus", "3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "--shape", "qwen3-tiny"],
            "data.train_batch_size=4 must be a multiple of the 3 ranks",
        ),
        (
            ["plan", "--gpus", "8", "--gpus-per-node", "3", "--shape", "qwen3-tiny"],
            "--gpus 8 spans nodes of --gpus-per-node 3 but is not a whole number of them: plan --gpus 6 or 9, or give "
            "the nodes' own --gpus-per-node",
        ),
        (
            ["plan", "--gpus", "12", "--shape", "qwen3-tiny"],
            "--gpus 12 spans nodes of --gpus-per-node 8 (the default) but is not a whole number of them: plan --gpus 8 "
            "or 16",
        ),
        (
            ["plan", "--response-length", "999999", "--shape", "qwen3-tiny"],
            "--response-length 999999 is longer than data.max_response_length=128, the longest response a step "
            "samples: give at most 128, or raise data.max_response_length",
        ),
        (["cluster", "up", "--hostfile", "h", "--port", "0"], "argument --port: must be at least 1, got 0"),
        (["cluster", "up", "--hostfile", "h", "--port", "99999"], "argument --port: must be at most 65535, got 99999"),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_setting(tmp_path, capsys, argv, complaint):
    try:
        code = main([arg.format(tmp=tmp_path) for arg in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert complaint in err and len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("sink, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_logger_whose_package_is_missing_is_refused_before_any_work(monkeypatch, capsys, sink, package):
    import longqa.config.support

    monkeypatch.setattr(longqa.config.support, "installed", lambda name: name != package)
    assert main(["config", "show", f"trainer.logger=[console,{sink}]"]) == 2
    assert capsys.readouterr().err == (
        f"longqa: error: trainer.logger={sink} needs the {package} package: pip install {package}\n"
    )
    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    assert main(["train", f"trainer.logger=[console,{sink}]", "data.train_files=x.parquet"]) == 2
    assert f"trainer.logger={sink} needs the {package} package" in capsys.readouterr().err


def _no_work(*args, **kwargs):
    raise AssertionError("the work began before the bad setting was refused")


@pytest.mark.parametrize(
    "setting, package",
    [
        ("rollout.engine=vllm", "vllm"),
        ("actor.strategy=deepspeed", "deepspeed"),
        ("trainer.launcher=ray", "ray"),
        ("trainer.device=cuda", None),
    ],
)
def test_config_show_refuses_what_this_machine_cannot_run_as_train_does(monkeypatch, capsys, setting, package):
    """A setting whose package is missing here, or a device this machine lacks: `config show` fails in the words
    `train` refuses it with, before any work."""
    import longqa.config.support

    if package is None:
        if torch.cuda.is_available():
            pytest.skip("a machine without a GPU")
        refusal = "longqa: error: trainer.device=cuda but no CUDA device is available\n"
    else:
        monkeypatch.setattr(longqa.config.support, "installed", lambda name: name != package)
        refusal = f"longqa: error: {setting} needs the {package} package: pip install 'longqa[{package}]'\n"
    assert main(["config", "show", setting]) == 2
    assert capsys.readouterr().err == refusal
    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    assert main(["train", setting, "data.train_files=x.parquet"]) == 2
    assert capsys.readouterr().err == refusal


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_the_flex_backend_on_the_cpu_is_refused_before_the_model_loads(monkeypatch, capsys):
    """trainer.device=auto is the CPU here: the trainer refuses once it has picked the device."""
    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    assert main(["train", "actor.attention_backend=flex", "trainer.device=auto", "data.train_files=x.parquet"]) == 2
    assert "actor.attention_backend=flex: flex_attention has no backward pass on cpu" in capsys.readouterr().err


def test_the_triton_decode_kernel_off_a_gpu_is_refused_before_the_bench(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("longqa.bench.speed.bench_rollout", _no_work)
    assert main(["bench", "rollout", "--decode-kernel", "triton", "--device", "cpu"]) == 2
    assert "--decode-kernel triton: the Triton kernel runs on CUDA devices, not on cpu" in capsys.readouterr().err


def test_the_environment_s_reward_mode_is_checked_and_is_the_default(monkeypatch, capsys):
    monkeypatch.setenv("REWARD_CALC_TYPE", "foo")
    for argv in (["config", "show"], ["eval", "--data", "x.parquet"], ["train"]):
        assert main(argv) == 2
        assert "the environment variable REWARD_CALC_TYPE='foo' names no reward mode" in capsys.readouterr().err
    monkeypatch.setenv("REWARD_CALC_TYPE", "format_f1_score")
    assert main(["config", "show"]) == 0
    assert "mode: format_f1_score" in capsys.readouterr().out
    assert main(["config", "show", "reward.mode=format_f1_score"]) == 0  # a setting that agrees
    assert "mode: format_f1_score" in capsys.readouterr().out


def test_outputs_are_checked_before_the_work(tmp_path, monkeypatch, capsys):
    """An output that cannot be written is refused before the model loads or the bench runs, not after."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr("longqa.model.load.load_model", _no_work)
    monkeypatch.setattr("longqa.bench.speed.bench_train", _no_work)
    cases = [
        (
            ["eval", "--data", "x.parquet", "--output", f"{tmp_path}/afile/x.json"],
            f"--output {tmp_path}/afile/x.json: {tmp_path}/afile is a file, so nothing can be made below it",
        ),
        (["eval", "--data", "x.parquet", "--samples", str(tmp_path)], f"--samples {tmp_path} is a folder"),
        (
            ["export", str(tmp_path), f"{tmp_path}/afile"],
            f"the output folder {tmp_path}/afile is a file: give a folder to write",
        ),
        (["bench", "train", "--device", "cpu", "--json", str(tmp_path)], f"--json {tmp_path} is a folder"),
        (["data", "synth", "--output-dir", f"{tmp_path}/afile"], f"--output-dir {tmp_path}/afile is a file"),
    ]
    for argv, complaint in cases:
        assert main(argv) == 2
        assert complaint in capsys.readouterr().err


def test_a_bad_row_names_the_flag_that_skips_it(tmp_path, capsys):
    from conftest import qa_row

    from longqa.data.io import write_rows

    rows = [qa_row(i) for i in range(3)]
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": [" "]}  # a blank answer
    path = tmp_path / "rows.parquet"
    write_rows(rows, path)
    assert main(["eval", "--data", str(path), "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}, row 1:" in err and "(--skip-bad-rows skips and counts such rows)" in err
    assert "data.skip_bad_rows" not in err
    assert main(["eval", "--data", str(path), "--device", "cpu", "--max-new-tokens", "2", "--skip-bad-rows"]) == 0
    assert re.search(r"\nall +2 ", capsys.readouterr().out)


def test_plan_sizes_small_models_and_the_host_of_the_gpus_it_uses(capsys):
    assert main(["plan"]) == 0  # the embedded model: a few million parameters
    assert re.match(r"\d+\.\d\dM parameters on 1 GPU\(s\)", capsys.readouterr().out)
    assert main(["plan", "--gpus", "8", "--gpus-per-node", "16", "--shape", "qwen3-tiny"]) == 0
    assert (
        "8 GPU(s) of 141 GiB, 8 per node (nodes of 16: the host memory is the share of the GPUs used) with 1000 GiB "
        "of host memory"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("args", [["configs/demo.yaml"], ["data.val_files=[]"], []])
def test_the_demo_s_own_files_are_made_whichever_line_names_them(tmp_path, monkeypatch, args):
    """The demo's data files, missing, are made on first use from its config file or with an override, as from
    no arguments; another config's files are not."""
    import longqa.train.trainer
    from longqa.data.demo import DEMO_CONFIG

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text(DEMO_CONFIG.read_text())
    made = []
    monkeypatch.setattr("longqa.data.demo.ensure_demo_data", lambda cfg: made.append(cfg.data.train_files))
    monkeypatch.setattr(longqa.train.trainer, "train", lambda cfg: {"preempted": None, "report": None, "steps": 0})
    assert main(["train", *args, "trainer.max_steps=1"]) == 0
    assert made == [["runs/demo-data/merged/train.parquet"]]
    made.clear()
    assert main(["train", *args, "data.train_files=mine.parquet", "trainer.max_steps=1"]) == 0
    assert made == []


def test_a_verl_line_without_a_config_says_in_one_line_every_way_its_start_differs_from_the_demo(capsys):
    """verl keys and no config file start from longqa's defaults with verl's, not the demo: one note says so,
    naming every value of that start which differs from the demo's."""
    from longqa.config import load_config, to_dict
    from longqa.config.verl_keys import VERL_DEFAULTS
    from longqa.data.demo import DEMO_CONFIG

    assert main(["config", "show", "actor_rollout_ref.rollout.n=4"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "not the embedded demo" in notes[0] and "data.train_files is empty" in notes[0]
    start, demo = to_dict(load_config(None, base=VERL_DEFAULTS)), to_dict(load_config(DEMO_CONFIG))
    differing = [f"{s}.{k}={v}" for s in start for k, v in start[s].items() if v != demo[s][k]]
    assert "data.train_batch_size=256" in differing and "model.dtype=bfloat16" in differing
    assert all(item in notes[0] for item in differing)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.overlap=true", "rollout.mode=sync"], "rollout.overlap=true samples the next step"),
        (["actor.cpu_offload_ratio=0.5"], "actor.cpu_offload_ratio=0.5 needs actor.strategy=deepspeed"),
        (["rollout.engine=hf", "rollout.speculative=prompt_lookup"], "rollout.speculative=prompt_lookup needs"),
        (["rollout.n=1"], "rollout.n=1"),
        (
            ["rollout.temperature=0"],
            "rollout.temperature=0: algo.adv_estimator=grpo compares the samples of each prompt",
        ),
    ],
)
def test_config_show_refuses_what_train_refuses_before_loading(overrides, message, capsys):
    assert main(["config", "show", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_version_is_said(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"longqa {version('longqa')}\n"


def test_a_source_checkout_runs_without_being_installed():
    """The GPU scripts run `PYTHONPATH=src python -m longqa.cli ...` from a checkout with no install, where the
    package's metadata does not exist: hidden here, the command still parses, says its version (the installed one
    when there is one: both are ``longqa.__version__``) and its help."""
    import longqa

    hide = (
        "import importlib.metadata as m, runpy, sys\n"
        "def missing(name, *args, **kwargs):\n    raise m.PackageNotFoundError(name)\n"
        "m.version = m.distribution = m.metadata = missing\n"
        "sys.argv = ['longqa', *sys.argv[1:]]\n"
        "runpy.run_module('longqa.cli', run_name='__main__')\n"
    )
    src = Path(longqa.__file__).resolve().parent.parent
    for argv, says in ((["--version"], f"longqa {longqa.__version__}"), (["train", "--help"], "usage: longqa train")):
        done = subprocess.run(
            [sys.executable, "-c", hide, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(src)},
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(says), done.stdout


def _commands(parser, path=()):
    import argparse

    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for name, sub in subparsers[0].choices.items() if subparsers else ():
        yield from _commands(sub, (*path, name))


def test_every_option_says_its_default_in_help(capsys):
    """`longqa COMMAND --help` says each option's default (a switch is off unless given; a required option has
    none): a default nobody can see is a setting nobody knows they ran with."""
    import argparse

    for command, parser in _commands(build_parser()):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        shown = "".join(capsys.readouterr().out.split())  # (lines wrap at spaces and hyphens)
        required = {a for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions}
        for action in parser._actions:
            if (
                isinstance(action, (argparse._HelpAction, argparse._VersionAction))
                or action.nargs == 0
                or action.required
                or action in required
            ):
                continue
            text = "".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
            assert "default" in text and text in shown, (command, action.dest, text)
