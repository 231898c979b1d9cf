"""Every setting a user can give, given a bad value, is refused in one line that names it; never a traceback.

The settings are enumerated, not listed: every config key from the config dataclasses, every verl launch key
longqa takes, every option and positional of every subcommand from the argparse parsers. A new key or option
is therefore tried here as soon as it exists: its bad values are made from its declared type, choices and
range, and a text setting must be given a bad value below or be named, with the reason, among those that
accept any text.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

import pytest
from test_cli import _commands  # every (command path, parser) of the command line

from longqa.cli import build_parser, main
from longqa.config import schema as config_module
from longqa.config import verl_keys

# --- running the command line ------------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """The exit status and stderr of ``longqa ARGV``; an exception escaping ``main`` fails the test (it would
    be a traceback)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err


def assert_refused_in_one_line(code: int, err: str, *names: str) -> None:
    """Exit status 2, no traceback, one error line (argparse prints its usage above it, and progress bars may
    come before) naming one of ``names``."""
    assert code == 2, f"exit status {code}, stderr: {err}"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert any(name in errors[0] for name in names), f"{errors[0]!r} names none of {names}"


# --- config keys -------------------------------------------------------------------------------------

# Text keys with no rule a value could break where the config is read: what each holds, and where a bad one
# is refused in one line (tested in test_path_keys_with_a_missing_path_are_refused_by_train below).
ACCEPTS_ANY_TEXT = {
    "model.path": "a folder, hub id or GGUF file: only loading tells",
    "model.tokenizer_path": "a folder or hub id: only loading tells",
    "model.gguf_file": "a file name inside model.path: only loading tells",
    "data.train_files": "files: read before the model loads",
    "data.val_files": "files: read before the model loads",
    "data.cache_dir": "a folder: made before the model loads",
    "reward.path": "a Python file: imported before the model loads",
    "actor.deepspeed_config": "a JSON or YAML file: read before the model loads",
    "trainer.resume": "auto, none or a checkpoint path: resolved before the first step",
    "trainer.output_dir": "a folder: made before the model loads",
}
# Numbers any value of the type is right for.
NUMBERS_WITHOUT_RANGE: set[str] = set()
TEXT_PROBES = ("", "no such thing!", "-1")
INT_PROBES = (-(2**70), -1, 0, 1, 2**70)
FLOAT_PROBES = (-1e30, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 1e30)


def _declared(key: str):
    section, _, name = key.partition(".")
    cls = typing.get_type_hints(config_module.Config)[section]
    tp = typing.get_type_hints(cls)[name]
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp, meta.get("check")


def _refused_by_rule(check, probes) -> list:
    return [p for p in probes if check is not None and not check(p)]


def bad_config_values(key: str) -> list[str]:
    """Values of ``key`` its type, choices or range refuse, as an override's text."""
    tp, check = _declared(key)
    origin = typing.get_origin(tp)
    if origin is list:
        item = typing.get_args(tp)[0]
        bad = ["{a: 1}"]  # a mapping is no list
        if typing.get_origin(item) is typing.Literal:
            bad.append("[not_a_choice]")
        elif item is float:
            bad += ["[x]", "[nan]"]
        elif item is str:
            bad += [f"[{p!r}]" for p in TEXT_PROBES if check is not None and not check([p])]
        return bad
    if origin is typing.Literal:
        return ["not_a_choice"]
    if tp is bool:
        return ["maybe", "2"]
    spelled = set(verl_keys.SHARED_VALUES.get(key, ()))  # verl's way to say a value (-1: never): taken
    if tp is int:
        return ["x", "1.5", "true", *(str(v) for v in _refused_by_rule(check, INT_PROBES) if v not in spelled)]
    if tp is float:
        return ["x", "nan", "inf", "-inf", *(str(v) for v in _refused_by_rule(check, FLOAT_PROBES) if v not in spelled)]
    assert tp is str, f"{key}: a type this test cannot make bad values for: {tp}"
    return [p for p in TEXT_PROBES if check is not None and not check(p)]


def _config_cases():
    for key in config_module.all_keys():
        for value in bad_config_values(key):
            yield pytest.param(key, value, id=f"{key}={value}")


@pytest.mark.parametrize("key, value", list(_config_cases()))
def test_every_config_key_refuses_a_bad_value_in_one_line(capsys, key, value):
    assert_refused_in_one_line(*run_cli(["config", "show", f"{key}={value}"], capsys), key)


def test_every_config_key_has_bad_values_or_is_named_as_taking_any():
    """A key with no bad value above must be in ACCEPTS_ANY_TEXT (text) or NUMBERS_WITHOUT_RANGE (numbers),
    and every key named there must exist and take any value of its type."""
    keys = config_module.all_keys()
    assert not (set(ACCEPTS_ANY_TEXT) | NUMBERS_WITHOUT_RANGE) - set(keys)
    for key in keys:
        tp, check = _declared(key)
        if tp in (int, float, list[float]):
            assert (check is None) == (key in NUMBERS_WITHOUT_RANGE), f"{key}: a number with no range"
        elif tp in (str, list[str]):
            assert (check is None) == (key in ACCEPTS_ANY_TEXT), f"{key}: a text with no rule"
            if check is not None:
                assert bad_config_values(key), f"{key}: none of {TEXT_PROBES} breaks its rule"


@pytest.mark.parametrize("key", sorted(ACCEPTS_ANY_TEXT))
def test_text_keys_named_as_taking_any_text_do(capsys, key):
    code, err = run_cli(["config", "show", f"{key}=any text at all"], capsys)
    assert code == 0, err


# verl launch keys: renamed ones are checked as the longqa key they become; these are read by no one unless
# another key turns them on, in verl as in longqa, so alone any value passes.
VERL_KEYS_READ_BY_NO_ONE = {
    "actor_rollout_ref.actor.kl_loss_coef",  # read only with use_kl_loss=True
    "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.horizon",
    "algorithm.kl_ctrl.target_kl",
    "trainer.resume_from_path",
    # a speculative model's name: any names one (longqa speculates by prompt lookup whichever it is)
    "remote_backend.rollout.speculative_decoding.model",
}


def _verl_cases():
    for key in (*verl_keys.RENAMED, *verl_keys.FIXED, *(k for g in verl_keys.GROUPS for k in g.keys)):
        if key in VERL_KEYS_READ_BY_NO_ONE:
            continue
        rename = verl_keys.RENAMED.get(key)
        values = bad_config_values(rename.key) if rename is not None and rename.convert is None else ["not_a_value"]
        yield pytest.param(key, values[0] if values else None, id=f"{key}={values[0] if values else '(any text)'}")


@pytest.mark.parametrize("key, value", list(_verl_cases()))
def test_every_verl_key_refuses_a_bad_value_in_one_line(capsys, key, value):
    if value is None:  # the longqa key it becomes takes any text
        assert verl_keys.RENAMED[key].key in ACCEPTS_ANY_TEXT
        return
    assert_refused_in_one_line(*run_cli(["config", "show", f"{key}={value}"], capsys), key)


@pytest.mark.parametrize("key", sorted(VERL_KEYS_READ_BY_NO_ONE))
def test_verl_keys_read_by_no_one_take_any_value(capsys, key):
    code, err = run_cli(["config", "show", f"{key}=not_a_value"], capsys)
    assert code == 0, err


def test_path_keys_with_a_missing_path_are_refused_by_train(data_dir, tmp_path, capsys):
    """The text keys that name files or folders: a missing (or unusable) one is one line from ``longqa train``,
    before any weight is read."""
    missing = tmp_path / "missing"
    (tmp_path / "a-file").write_text("")
    base = [
        f"data.train_files={data_dir}/merged/train.parquet",
        f"data.val_files={data_dir}/merged/test.parquet",
        f"data.cache_dir={tmp_path}/cache",
        f"trainer.output_dir={tmp_path}/run",
        "trainer.max_steps=1",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.logger=[jsonl]",
    ]
    bad = {
        "model.path": missing,
        "model.tokenizer_path": missing,
        "model.gguf_file": "missing.gguf",
        "data.train_files": missing,
        "data.val_files": missing,
        "data.cache_dir": tmp_path / "a-file",
        "reward.path": missing,
        "trainer.resume": missing,
        "trainer.output_dir": tmp_path / "a-file",
        "actor.deepspeed_config": missing,
    }
    assert set(bad) == set(ACCEPTS_ANY_TEXT)
    extra = {"actor.deepspeed_config": ["actor.strategy=deepspeed"]}
    for key, value in bad.items():
        code, err = run_cli(["train", *base, *extra.get(key, []), f"{key}={value}"], capsys)
        assert_refused_in_one_line(code, err, key, str(value))


# --- command-line options ----------------------------------------------------------------------------


def _settings():
    """(command path, action) for every option and positional of every subcommand."""
    for path, parser in _commands(build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                yield path, action


def _name(action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


# Bad values of the options and positionals that take text, by (command..., dest). MISSING, FILE, DIR and
# UNDER_FILE are filled in by the `places` fixture: a path that does not exist, an existing file, an
# existing folder, and a path below a file.
BAD_TEXT = {
    ("data", "loongrl", "output_dir"): "FILE",
    ("data", "loongrl", "source"): "no-such-source",
    ("data", "synth", "output_dir"): "FILE",
    ("data", "synth", "tasks"): "no_such_task",
    ("data", "synth", "tokenizer"): "MISSING",
    ("eval", "model"): "MISSING",
    ("eval", "data"): "MISSING",
    ("eval", "longbench"): "MISSING",
    ("eval", "longbench_scores"): "MISSING",
    ("eval", "device"): "gpu",
    ("eval", "output"): "UNDER_FILE",
    ("eval", "samples"): "DIR",
    ("export", "checkpoint"): "MISSING",
    ("export", "output"): "FILE",
    ("sft", "train_files"): "MISSING",
    ("sft", "output_dir"): "FILE",
    ("sft", "eval_files"): "MISSING",
    ("sft", "init"): "MISSING",
    ("sft", "response_key"): "no_such_key",
    ("sft", "device"): "gpu",
    **{("bench", c, "device"): "gpu" for c in ("train", "rollout", "step")},
    **{("bench", c, "json"): "DIR" for c in ("train", "rollout", "step")},
    **{("cluster", c, "hostfile"): "MISSING" for c in ("up", "down", "status")},
    **{(*c, "config"): "MISSING" for c in (("data", "prepare"), ("train",), ("plan",), ("config", "show"))},
    **{(*c, "overrides"): "no.such_key=1" for c in (("data", "prepare"), ("train",), ("plan",), ("config", "show"))},
}
ACCEPTS_ANY_TEXT_OPTION = {
    **{
        ("cluster", c, "ray"): "the ray executable on the hosts: only they can run it" for c in ("up", "down", "status")
    },
}
# Numeric options any number is right for.
ANY_NUMBER_OPTION: set[tuple[str, ...]] = set()


def _kind(action) -> str:
    """What an action takes: a flag, one of its choices, a number, or text."""
    if action.nargs == 0:
        return "flag"
    if action.choices:
        return "choice"
    if action.type is not None and getattr(action.type, "__name__", "") in ("int", "float"):
        return action.type.__name__
    return "text"


def bad_option_values(path: tuple[str, ...], action) -> list[str]:
    key = (*path, action.dest)
    kind = _kind(action)
    if kind == "flag":
        return []  # given as --flag=VALUE below
    if kind == "choice":
        return ["not_a_choice"]
    if kind == "int":
        return ["x", "1.5"] + ([] if key in ANY_NUMBER_OPTION else ["-1"])
    if kind == "float":
        return ["x"] + ([] if key in ANY_NUMBER_OPTION else ["nan", "inf", "-1"])
    return [BAD_TEXT[key]] if key in BAD_TEXT else []


def test_every_text_option_has_a_bad_value_or_is_named_as_taking_any():
    text = {(*path, action.dest) for path, action in _settings() if _kind(action) == "text"}
    assert text - set(ACCEPTS_ANY_TEXT_OPTION) == set(BAD_TEXT)
    assert not set(ACCEPTS_ANY_TEXT_OPTION) - text
    numbers = {(*path, action.dest) for path, action in _settings() if _kind(action) in ("int", "float")}
    assert not ANY_NUMBER_OPTION - numbers


@pytest.fixture(scope="module")
def places(tmp_path_factory, data_dir):
    """Paths for the bad values, and the arguments a valid (and quick) run of each command needs."""
    from test_loongrl import SIZES, loongrl_row

    from longqa.data.io import write_rows

    root = tmp_path_factory.mktemp("places")
    (root / "a-file").write_text("")
    (root / "a-folder").mkdir()
    source = root / "LoongRL-Train-Data"
    for subset, n in SIZES.items():
        write_rows([loongrl_row(subset, i) for i in range(n)], source / f"{subset}.parquet")
    (root / "hostfile").write_text("10.0.0.1 slots=8\n10.0.0.2 slots=8\n")
    data = str(data_dir / "merged" / "test.parquet")
    quick = ["--shape", "qwen3-tiny", "--prompt", "16", "-n", "2", "--device", "cpu"]
    new = str(root / "new")
    base = {
        ("data", "loongrl"): ["--output-dir", new, "--source", str(source)],
        ("data", "synth"): ["--output-dir", new, "--rows-per-task", "4", "--tasks", "hotpotqa"],
        ("data", "prepare"): [f"data.train_files={data}", "data.val_files=[]", f"data.cache_dir={root}/cache"],
        ("train",): [f"data.train_files={data}", "data.val_files=[]", "trainer.max_steps=1"],
        ("eval",): ["--data", data, "--device", "cpu", "--max-new-tokens", "2", "--limit", "1"],
        ("export",): ["{checkpoint}", "{output}"],
        ("sft",): [
            "--train-files",
            data,
            "--output-dir",
            new,
            "--max-steps",
            "1",
            "--hidden-size",
            "32",
            "--num-layers",
            "1",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--vocab-size",
            "300",
            "--eval-rows",
            "1",
            "--device",
            "cpu",
        ],
        ("bench", "train"): [*quick, "--response", "4", "--repeat", "1", "--layouts", "packed"],
        ("bench", "rollout"): [*quick, "--new-tokens", "4", "--groups", "1", "--hf-new-tokens", "0"],
        ("bench", "step"): [*quick, "--response", "4", "--prompts", "1", "--steps", "1"],
        **{("cluster", c): ["--hostfile", str(root / "hostfile"), "--dry-run"] for c in ("up", "down", "status")},
        ("plan",): ["--shape", "qwen3-tiny"],
        ("config", "show"): [],
        ("config", "keys"): [],
    }
    # an input that excludes --data takes its place
    base_for = {
        ("eval", "longbench"): ["--device", "cpu", "--output", str(root / "preds")],
        ("eval", "longbench_scores"): [],
    }
    paths = {
        "MISSING": str(root / "missing"),
        "FILE": str(root / "a-file"),
        "DIR": str(root / "a-folder"),
        "UNDER_FILE": str(root / "a-file" / "x.json"),
    }
    # positionals in the middle of a command line: their valid values, replaced one at a time
    positionals = {"{checkpoint}": str(root / "missing-run"), "{output}": new}
    return base, base_for, paths, positionals


def _option_cases():
    for path, action in _settings():
        name = _name(action)
        values = ["=oops"] if _kind(action) == "flag" else bad_option_values(path, action)
        for value in values:
            yield pytest.param(path, action.dest, value, id=f"{' '.join(path)} {name} {value}")


def _argv(base: list[str], action, value: str, positionals: dict[str, str]) -> list[str]:
    if f"{{{action.dest}}}" in base:  # a positional with its place in the command line
        return [value if arg == f"{{{action.dest}}}" else positionals.get(arg, arg) for arg in base]
    base = [positionals.get(arg, arg) for arg in base]
    if not action.option_strings:  # the config file first, overrides last, as a user types them
        return [value, *base] if action.dest == "config" else [*base, value]
    if value.startswith("="):
        return [*base, action.option_strings[-1] + value]
    return [*base, action.option_strings[-1], value]


@pytest.mark.parametrize("path, dest, value", list(_option_cases()))
def test_every_option_refuses_a_bad_value_in_one_line(places, capsys, path, dest, value):
    base, base_for, paths, positionals = places
    action = next(a for p, a in _settings() if p == path and a.dest == dest)
    value = paths.get(value, value)
    argv = [*path, *_argv(base_for.get((*path, dest), base[path]), action, value, positionals)]
    code, err = run_cli(argv, capsys)
    names = {_name(action), f"--{dest.replace('_', '-')}", value.lstrip("="), value.partition("=")[0]} - {""}
    assert_refused_in_one_line(code, err, *names)
