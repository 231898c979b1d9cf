"""`longqa eval`, `export` and `sft` as a new user meets them: what was left out is said and recorded, folders that
hold no model (or that an export would spoil) are refused in one line, written weights follow the umask, and
Ctrl-C during set-up ends in one line."""

import json
import os
import stat

import pytest
import torch

from longqa.cli import main


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_eval_says_and_records_the_prompts_it_dropped_and_the_reward_mode(tmp_path, monkeypatch, capsys):
    from conftest import qa_row

    from longqa.data.io import iter_rows, write_rows

    data, scores = tmp_path / "data", tmp_path / "scores.json"
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(data),
                "--rows-per-task",
                "4",
                "--tasks",
                "hotpotqa",
                "musique",
                "--context-lengths",
                "512",
                "256",
            ]
        )
        == 0
    )
    rows = list(iter_rows(data / "merged" / "test.parquet"))
    bad = qa_row(9)
    bad["reward_model"] = {"style": "rule", "ground_truth": [" "]}  # a blank answer: a bad row
    write_rows([*rows, bad], tmp_path / "test.parquet")
    monkeypatch.setenv("REWARD_CALC_TYPE", "format_f1_score")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--data",
                str(tmp_path / "test.parquet"),
                "--max-prompt-length",
                "450",
                "--skip-bad-rows",
                "--max-new-tokens",
                "2",
                "--device",
                "cpu",
                "--output",
                str(scores),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prompts: 2 of 5 kept; 2 dropped over --max-prompt-length=450; 1 bad rows dropped (--skip-bad-rows)" in out
    assert "by data_source: " in out and "by target_tokens: 512: 2 of 2 dropped, none left" in out
    assert "data.max_prompt_length" not in out
    assert "acc: reward mode format_f1_score (REWARD_CALC_TYPE)\ndata_source " in out
    result = json.loads(scores.read_text())
    assert (result["rows_read"], result["kept"], result["dropped_overlong"], result["bad_rows_skipped"]) == (5, 2, 2, 1)
    assert {entry["data_source"] for entry in result["lost_by_source"]} == {
        "synth_hotpotqa",
        "synth_musique",
        "custom_hotpotqa",
    }
    assert (result["reward_mode"], result["reward_mode_from"]) == ("format_f1_score", "REWARD_CALC_TYPE")
    monkeypatch.delenv("REWARD_CALC_TYPE")
    assert (
        main(
            [
                "eval",
                "--data",
                str(data / "merged" / "test.parquet"),
                "--max-new-tokens",
                "2",
                "--device",
                "cpu",
                "--mode",
                "hardened",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prompts: all 4 kept whole\n" in out and "acc: reward mode hardened (--mode)\n" in out


def test_eval_refuses_a_run_a_checkpoint_or_an_empty_folder_as_the_model_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    cases = {
        run: f"--model {run} is a training run folder, not a model folder: run `longqa export {run} OUT` first",
        run / "checkpoints": "is a training run folder",
        step: f"--model {step} is a training checkpoint, not a model folder: run `longqa export {step} OUT`",
        tmp_path / "empty": f"--model {tmp_path / 'empty'} holds no model (it is empty)",
        tmp_path / "other": "holds no model (no config.json)",
    }
    for model, complaint in cases.items():
        assert main(["eval", "--model", str(model), "--data", "x.parquet", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert complaint in err and err.count("\n") == 1 and "sentencepiece" not in err


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder with one complete checkpoint of the embedded model, as `longqa train` leaves it."""
    from longqa.config import Config, to_dict
    from longqa.model.load import load_model
    from longqa.train.checkpoint import save_checkpoint

    run = tmp_path_factory.mktemp("run")
    model, _ = load_model(None)
    save_checkpoint(
        run,
        2,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state={"config": to_dict(Config()), "step": 2},
        keep_last=2,
    )
    return run


def test_export_writes_weights_others_can_read_and_replaces_only_an_export(run_folder, tmp_path, capsys, umask_022):
    out = tmp_path / "hf"
    assert main(["export", str(run_folder), str(out)]) == 0
    assert _mode(out / "model.safetensors") == _mode(out / "config.json") == 0o644
    assert main(["export", str(run_folder), str(out)]) == 0  # a previous export: replaced
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "README.md").write_text("an sft model card")
    (sft / "config.json").write_text("{}")
    inside = run_folder / "checkpoints" / "hf"
    capsys.readouterr()
    assert main(["export", str(run_folder), str(sft)]) == 2
    assert capsys.readouterr().err == (
        f"longqa: error: the output folder {sft} holds files no export writes "
        f"(README.md): give a new or empty folder, or a previous export, which is "
        f"replaced\n"
    )
    assert main(["export", str(run_folder), str(inside)]) == 2
    assert "is inside" in capsys.readouterr().err and not inside.exists()
    assert main(["export", str(run_folder), str(run_folder)]) == 2  # the run folder itself, which it reads
    assert (
        f"the output folder {run_folder} is the checkpoint's folder, which this command reads"
        in capsys.readouterr().err
    )


def test_export_refuses_weights_that_are_not_finite_naming_the_parameter(tmp_path, capsys):
    """A checkpoint of a run whose weights went NaN (its files intact) exports nothing, in one line."""
    from longqa.config import Config, to_dict
    from longqa.model.load import load_model
    from longqa.train.checkpoint import save_checkpoint

    model, _ = load_model(None)
    name, weight = next(iter(model.named_parameters()))
    with torch.no_grad():
        weight.view(-1)[:5] = float("nan")
    run = tmp_path / "run"
    step = save_checkpoint(
        run,
        1,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state={"config": to_dict(Config()), "step": 1},
        keep_last=1,
    )
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"longqa: error: checkpoint {step} holds weights that are not finite: {name} has 5 NaN or infinite values; "
        f"resume or export an earlier checkpoint (trainer.resume=PATH, longqa export PATH)"
    )
    assert not (tmp_path / "hf").exists()


def test_export_folder_rule():
    """The rule `longqa export --help` states, on paths alone."""
    from pathlib import Path

    from longqa.train.checkpoint import CheckpointError, check_export_folder

    step = Path("/runs/r1/checkpoints/step_00000002")
    for out in ("/runs/r1/checkpoints", "/runs/r1/checkpoints/hf", "/runs/r1/checkpoints/step_00000002/hf"):
        with pytest.raises(CheckpointError, match="inside /runs/r1/checkpoints"):
            check_export_folder(out, step)
    check_export_folder("/runs/r1/hf", step)  # (a folder that does not exist yet)
    with pytest.raises(CheckpointError, match="inside /elsewhere/step_2"):
        check_export_folder("/elsewhere/step_2/hf", "/elsewhere/step_2")


def test_sft_says_what_it_dropped_and_writes_weights_others_can_read(tmp_path, capsys, umask_022):
    from longqa.data.synth import generate

    generate(
        tmp_path / "data",
        rows_per_task=4,
        context_tokens=256,
        max_hops=2,
        test_ratio=0.25,
        seed=5,
        context_lengths=[256, 1024],
    )
    out = tmp_path / "model"
    assert (
        main(
            [
                "sft",
                "--train-files",
                str(tmp_path / "data/merged/train.parquet"),
                "--output-dir",
                str(out),
                "--max-prompt-length",
                "700",
                "--vocab-size",
                "400",
                "--hidden-size",
                "32",
                "--num-layers",
                "2",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--max-steps",
                "1",
                "--warmup-steps",
                "1",
                "--batch-tokens",
                "8192",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    summary = json.loads((out / "sft_summary.json").read_text())
    counts = summary["train_prompts"]
    assert counts["dropped_overlong"] > 0 and counts["kept"] == summary["examples"]
    assert (
        f"train: {counts['kept']} of {counts['rows_read']} kept; {counts['dropped_overlong']} dropped over "
        f"--max-prompt-length=700"
    ) in printed
    assert _mode(out / "model.safetensors") == _mode(out / "README.md") == 0o644


def test_ctrl_c_in_a_command_ends_in_one_line_with_status_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("longqa.model.load.load_model_tokenizer", interrupted)
    assert main(["eval", "--data", "x.parquet", "--device", "cpu"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "longqa: interrupted\n" and "Traceback" not in captured.out + captured.err


def test_eval_counts_and_says_the_responses_max_new_tokens_cut(tmp_path, capsys):
    """A response cut by --max-new-tokens is scored as it stands (most often 0, for an answer it never wrote):
    how many were cut is said beside the scores and recorded, apart from the prompts cut to --max-prompt-length,
    and each sample says why it ended."""
    data, scores, samples = tmp_path / "data", tmp_path / "scores.json", tmp_path / "samples.jsonl"
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
                "--context-tokens",
                "256",
                "--max-hops",
                "2",
                "--test-ratio",
                "0.5",
            ]
        )
        == 0
    )
    test = str(data / "merged" / "test.parquet")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--data",
                test,
                "--max-new-tokens",
                "3",
                "--device",
                "cpu",
                "--output",
                str(scores),
                "--samples",
                str(samples),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "responses: 4 of 4 cut at --max-new-tokens=3 before they ended, scored as they stand (most often "
        "without an answer): raise --max-new-tokens to let them finish\n"
    ) in out
    result = json.loads(scores.read_text())
    assert (result["responses_cut"], result["prompts_truncated"], result["max_new_tokens"]) == (4, 0, 3)
    assert "truncated" not in result
    assert [json.loads(line)["finish_reason"] for line in samples.read_text().splitlines()] == ["length"] * 4
    # the embedded model ends its answers well within 200 tokens
    assert (
        main(
            [
                "eval",
                "--data",
                test,
                "--max-new-tokens",
                "200",
                "--device",
                "cpu",
                "--limit",
                "2",
                "--output",
                str(scores),
                "--samples",
                str(samples),
            ]
        )
        == 0
    )
    assert "responses: none cut at --max-new-tokens=200\n" in capsys.readouterr().out
    assert json.loads(scores.read_text())["responses_cut"] == 0
    assert [json.loads(line)["finish_reason"] for line in samples.read_text().splitlines()] == ["stop"] * 2


def test_sft_replaces_only_a_folder_of_its_own(run_folder, tmp_path, capsys):
    """`longqa sft --output-dir` refuses a model folder it did not make (an export: its weights stay as they
    were), as export refuses an sft folder; a folder of its own it replaces."""
    from longqa.data.synth import generate

    generate(tmp_path / "data", rows_per_task=4, context_tokens=256, max_hops=2, test_ratio=0.25, seed=5)
    export = tmp_path / "export"
    assert main(["export", str(run_folder), str(export)]) == 0
    weights = (export / "model.safetensors").read_bytes()
    sft = [
        "sft",
        "--train-files",
        str(tmp_path / "data/merged/train.parquet"),
        "--vocab-size",
        "400",
        "--hidden-size",
        "32",
        "--num-layers",
        "2",
        "--num-heads",
        "4",
        "--num-kv-heads",
        "2",
        "--max-steps",
        "1",
        "--warmup-steps",
        "1",
        "--batch-tokens",
        "8192",
        "--device",
        "cpu",
        "--output-dir",
    ]
    capsys.readouterr()
    assert main([*sft, str(export)]) == 2
    assert capsys.readouterr().err == (
        f"longqa: error: --output-dir {export} is a model folder: give a new or empty "
        f"folder, or a previous longqa sft folder, which is replaced\n"
    )
    assert (export / "model.safetensors").read_bytes() == weights
    out = tmp_path / "sft"
    assert main([*sft, str(out)]) == 0 and main([*sft, str(out)]) == 0  # its own folder: replaced
    assert main(["export", str(run_folder), str(out)]) == 2
    assert f"the output folder {out} is a model folder made by longqa sft" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_says_how_its_mode_stands_to_the_reward_of_the_exported_run(tmp_path, monkeypatch, capsys):
    """A run of the recipe configs validates with pure_exact_match and `longqa eval` scored its export with hardened
    by default, without a word. The export now records the run's reward beside the model, and eval says which mode
    scored and whether it is the run's, in its table and its --output."""
    import dataclasses

    from conftest import qa_row

    from longqa.config import Config, to_dict
    from longqa.data.io import write_rows
    from longqa.model.load import load_model
    from longqa.train.checkpoint import save_checkpoint

    monkeypatch.delenv("REWARD_CALC_TYPE", raising=False)
    run, out, data, scores = tmp_path / "run", tmp_path / "hf", tmp_path / "test.parquet", tmp_path / "scores.json"
    cfg = Config()
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, mode="pure_exact_match"))
    model, _ = load_model(None)
    state = {"config": to_dict(cfg), "step": 2}
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(run, 2, model=model, optimizer=optimizer, trainer_state=state, keep_last=1)
    assert main(["export", str(run), str(out)]) == 0
    recorded = json.loads((out / "longqa_reward.json").read_text())
    assert recorded["reward"] == {"mode": "pure_exact_match", "path": None, "name": "compute_score"}
    assert main(["export", str(run), str(out)]) == 0  # the folder is a previous export, the record one of its files
    write_rows([qa_row(i) for i in range(2)], data)
    evaluate = ["eval", "--model", str(out), "--data", str(data), "--max-new-tokens", "2", "--device", "cpu"]
    capsys.readouterr()
    assert main([*evaluate, "--output", str(scores)]) == 0
    assert (
        "acc: reward mode hardened (the default); the run that made this model validated with "
        "reward.mode=pure_exact_match, not hardened: --mode pure_exact_match scores as it did\n"
    ) in capsys.readouterr().out
    result = json.loads(scores.read_text())
    assert (result["reward_mode"], result["run_reward_mode"]) == ("hardened", "pure_exact_match")
    assert main([*evaluate, "--mode", "pure_exact_match"]) == 0
    assert (
        "acc: reward mode pure_exact_match (--mode); the mode the run that made this model validated with\n"
        in capsys.readouterr().out
    )
