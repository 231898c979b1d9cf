"""Every command's output paths walked against what it reads and against the folders the other commands make: a
model folder (`longqa export`), a data folder (`longqa data synth`) and a run folder (`longqa train`). Each is
refused in one line with status 2 before any work, and nothing anywhere is changed."""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from tiny_models import save_tiny_qwen3

from longqa.cli import build_parser, main


@dataclass
class Places:
    """The folders the commands read and make, made once for the module."""

    root: Path
    base: Path  # a model folder the run starts from
    tokenizer: Path  # a tokenizer folder (data synth --tokenizer)
    data: Path  # made by `longqa data synth`
    run: Path  # made by `longqa train`
    model: Path  # made by `longqa export`
    longbench: Path  # LongBench files (eval --longbench)
    source: Path  # a local LoongRL source folder (data loongrl --source)

    @property
    def train_file(self) -> Path:
        return self.data / "merged" / "train.parquet"

    @property
    def test_file(self) -> Path:
        return self.data / "merged" / "test.parquet"

    @property
    def checkpoint(self) -> Path:
        return self.run / "checkpoints" / "step_00000001"


def _train_args(places: Places, **settings) -> list[str]:
    values = {
        "model.path": places.base,
        "data.train_files": f"[{places.train_file}]",
        "data.val_files": "[]",
        "data.max_prompt_length": 4096,
        "data.max_response_length": 4,
        "data.train_batch_size": 4,
        "data.cache_dir": places.root / "cache",
        "rollout.n": 2,
        "actor.ppo_mini_batch_size": 4,
        "trainer.max_steps": 1,
        "trainer.save_freq": 1,
        "trainer.output_dir": places.run,
        "trainer.device": "cpu",
        "trainer.logger": "[jsonl]",
    }
    values.update(settings)
    return ["train", *(f"{key}={value}" for key, value in values.items())]


@pytest.fixture(scope="module")
def places(tmp_path_factory, tokenizer) -> Places:
    root = tmp_path_factory.mktemp("places")
    p = Places(
        root,
        root / "base",
        root / "tokenizer",
        root / "data",
        root / "run",
        root / "model",
        root / "longbench",
        root / "loongrl-source",
    )
    save_tiny_qwen3(p.base, tokenizer)
    tokenizer.save_pretrained(p.tokenizer)
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(p.data),
                "--rows-per-task",
                "8",
                "--tasks",
                "hotpotqa",
                "--context-tokens",
                "256",
                "--max-hops",
                "2",
                "--test-ratio",
                "0.25",
            ]
        )
        == 0
    )
    assert main(_train_args(p)) == 0
    assert main(["export", str(p.run), str(p.model)]) == 0
    p.longbench.mkdir()
    (p.longbench / "hotpotqa.jsonl").write_text(
        json.dumps(
            {
                "input": "Where was Ada born?",
                "context": "Passage 1:\nAda was born in Quillex.",
                "answers": ["Quillex"],
                "length": 9,
                "all_classes": None,
                "_id": "h-0",
            }
        )
        + "\n"
    )
    p.source.mkdir()
    return p


@dataclass
class Writer:
    """One output of one command: how to call the command with the output at a path, whether the output is a
    file or a folder, the input it must never take the place of (and the setting naming it), and the folder
    kinds among the targets where the command goes on by design (train resumes a run, export replaces an
    export, data synth rewrites a data folder)."""

    command: tuple[str, ...]
    setting: str
    argv: Callable[[Places, Path], list[str]]
    folder: bool
    own_input: Callable[[Places], Path] | None = None
    input_setting: str = ""
    goes_on_in: set[str] = field(default_factory=set)


TINY_SFT = [
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
TINY_BENCH = ["--shape", "qwen3-tiny", "--prompt", "16", "-n", "2", "--device", "cpu"]


def _eval(p: Places, *extra: str) -> list[str]:
    return ["eval", "--model", str(p.base), "--device", "cpu", "--max-new-tokens", "2", "--limit", "1", *extra]


WRITERS = [
    Writer(
        ("data", "synth"),
        "--output-dir",
        lambda p, out: [
            "data",
            "synth",
            "--output-dir",
            str(out),
            "--rows-per-task",
            "2",
            "--tasks",
            "hotpotqa",
            "--context-tokens",
            "256",
            "--tokenizer",
            str(p.tokenizer),
        ],
        folder=True,
        own_input=lambda p: p.tokenizer,
        input_setting="--tokenizer",
        goes_on_in={"data"},
    ),
    Writer(
        ("data", "loongrl"),
        "--output-dir",
        lambda p, out: ["data", "loongrl", "--output-dir", str(out), "--source", str(p.source)],
        folder=True,
        own_input=lambda p: p.source,
        input_setting="--source",
        goes_on_in={"data"},
    ),
    Writer(
        ("data", "prepare"),
        "data.cache_dir",
        lambda p, out: [
            "data",
            "prepare",
            f"model.path={p.base}",
            f"data.train_files=[{p.train_file}]",
            "data.val_files=[]",
            f"data.cache_dir={out}",
        ],
        folder=True,
        own_input=lambda p: p.train_file.parent,
        input_setting="data.train_files",
    ),
    Writer(
        ("train",),
        "trainer.output_dir",
        lambda p, out: _train_args(p, **{"trainer.output_dir": out}),
        folder=True,
        own_input=lambda p: p.train_file.parent,
        input_setting="data.train_files",
        goes_on_in={"run"},
    ),
    Writer(
        ("train",),
        "data.cache_dir",
        lambda p, out: _train_args(p, **{"data.cache_dir": out, "trainer.output_dir": p.root / "new-run"}),
        folder=True,
        own_input=lambda p: p.train_file.parent,
        input_setting="data.train_files",
    ),
    Writer(
        ("eval",),
        "--output",
        lambda p, out: _eval(p, "--data", str(p.test_file), "--output", str(out)),
        folder=False,
        own_input=lambda p: p.test_file,
        input_setting="--data",
    ),
    Writer(
        ("eval",),
        "--samples",
        lambda p, out: _eval(p, "--data", str(p.test_file), "--samples", str(out)),
        folder=False,
        own_input=lambda p: p.test_file,
        input_setting="--data",
    ),
    Writer(
        ("eval",),
        "--output",
        lambda p, out: _eval(p, "--longbench", str(p.longbench), "--output", str(out)),
        folder=True,
        own_input=lambda p: p.longbench,
        input_setting="--longbench",
    ),
    # --longbench-scores writes result.json beside the prediction files it reads, by design: a folder without
    # them is refused before anything is written
    Writer(("eval",), "--longbench-scores", lambda p, out: ["eval", "--longbench-scores", str(out)], folder=True),
    Writer(
        ("export",),
        "the output folder",
        lambda p, out: ["export", str(p.checkpoint), str(out)],
        folder=True,
        own_input=lambda p: p.checkpoint,
        input_setting="the checkpoint",
        goes_on_in={"model"},
    ),
    Writer(
        ("sft",),
        "--output-dir",
        lambda p, out: ["sft", "--train-files", str(p.train_file), "--output-dir", str(out), *TINY_SFT],
        folder=True,
        own_input=lambda p: p.train_file.parent,
        input_setting="--train-files",
    ),
    Writer(
        ("sft",),
        "--output-dir",
        lambda p, out: [
            "sft",
            "--train-files",
            str(p.train_file),
            "--init",
            str(p.base),
            "--output-dir",
            str(out),
            "--max-steps",
            "1",
            "--device",
            "cpu",
        ],
        folder=True,
        own_input=lambda p: p.base,
        input_setting="--init",
    ),
    Writer(
        ("bench", "train"),
        "--json",
        lambda p, out: ["bench", "train", *TINY_BENCH, "--response", "4", "--repeat", "1", "--json", str(out)],
        folder=False,
    ),
    Writer(
        ("bench", "rollout"),
        "--json",
        lambda p, out: [
            "bench",
            "rollout",
            *TINY_BENCH,
            "--new-tokens",
            "4",
            "--groups",
            "1",
            "--hf-new-tokens",
            "0",
            "--json",
            str(out),
        ],
        folder=False,
    ),
    Writer(
        ("bench", "step"),
        "--json",
        lambda p, out: [
            "bench",
            "step",
            *TINY_BENCH,
            "--response",
            "4",
            "--prompts",
            "1",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        folder=False,
    ),
]

# The commands that write nothing but their console output.
WRITE_NOTHING = {
    ("cluster", "up"),
    ("cluster", "down"),
    ("cluster", "status"),
    ("plan",),
    ("config", "show"),
    ("config", "keys"),
}
# The options that name where a command writes; the config keys that do, for the commands that take a config.
OUTPUT_DESTS = {"output", "output_dir", "samples", "json", "longbench_scores"}
CONFIG_OUTPUTS = {("train",): {"trainer.output_dir", "data.cache_dir"}, ("data", "prepare"): {"data.cache_dir"}}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
        return
    for name, sub in subparsers[0].choices.items():
        yield from _commands(sub, (*path, name))


def test_every_output_of_every_command_is_walked():
    """The table above is every command's every output: a new command, or a new output option, is added to it."""
    walked = {(w.command, w.setting) for w in WRITERS}
    for command, parser in _commands(build_parser()):
        outputs = {
            a.option_strings[-1] if a.option_strings else "the output folder"
            for a in parser._actions
            if a.dest in OUTPUT_DESTS
        }
        if any(a.dest == "overrides" for a in parser._actions) and command not in WRITE_NOTHING:
            outputs |= CONFIG_OUTPUTS[command]
        if command in WRITE_NOTHING:
            assert not outputs, command
        else:
            assert outputs and {(command, o) for o in outputs} <= walked, command
    assert {w.command for w in WRITERS} | WRITE_NOTHING == {c for c, _ in _commands(build_parser())}


def _target(places: Places, writer: Writer, name: str) -> Path:
    """The folder (or, for a file output, a file of it) that ``writer``'s output is pointed at."""
    if name == "own input":
        return writer.own_input(places)
    folder = {"model": places.model, "data": places.data, "run": places.run}[name]
    return (
        folder
        if writer.folder
        else folder / {"model": "config.json", "data": "merged/test.parquet", "run": "metrics.jsonl"}[name]
    )


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


CASES = [
    pytest.param(
        w, name, id=f"{' '.join(w.command)} {w.setting}{' (' + w.input_setting + ')' if w.own_input else ''} -> {name}"
    )
    for w in WRITERS
    for name in ("own input", "model", "data", "run")
    if name not in w.goes_on_in and (name != "own input" or w.own_input)
]


@pytest.mark.parametrize("writer, name", CASES)
def test_no_output_takes_the_place_of_an_input_or_another_commands_folder(places, writer, name, capsys):
    target = _target(places, writer, name)
    before = _digest(places.root)
    capsys.readouterr()
    assert main(writer.argv(places, target)) == 2
    err = capsys.readouterr().err
    assert err.startswith("longqa: error: ") and err.count("\n") == 1, err
    if writer.setting != "--longbench-scores":
        assert f"{writer.setting} {target}" in err
    if name == "own input":
        assert writer.input_setting in err  # both settings named
    assert _digest(places.root) == before


def test_a_file_kept_in_another_commands_folder_is_replaced_by_its_own_command(places, capsys):
    """Only the files that make a folder what it is are refused: an eval's scores and samples kept in a run or
    model folder are the eval's, written again when it runs again."""
    scores, samples = places.run / "eval.json", places.model / "answers.jsonl"
    argv = _eval(places, "--data", str(places.test_file), "--output", str(scores), "--samples", str(samples))
    assert main(argv) == 0 and main(argv) == 0
    assert json.loads(scores.read_text())["all"]["n"] == 1 and len(samples.read_text().splitlines()) == 1
    scores.unlink()
    samples.unlink()
