"""The documentation can be followed as written.

Every command in the cluster guide's bash blocks must exist: the subcommand, its flags, the config
file and every key=value override (checked in-process, where a typo fails fast), and `python -m
longqa.cli` must accept it with `--help`, or run it with `--dry-run` where the command has one. The
README and the docs must point only at files inside the repository, and no tracked file may speak of
how the work on the project was organised.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from longqa.cli import _split_config_args, build_parser, main
from longqa.config import load_config
from longqa.config.checks import check_data_parallel

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "recipe-on-a-cluster.md"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def guide_commands(text: str) -> list[str]:
    """One string per command of the bash blocks: continuation lines joined, comments and blanks dropped."""
    commands = []
    for block in fenced_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def _pip_extras(tokens: list[str]) -> None:
    """`pip install` of this package: every extra it names must be declared in pyproject.toml."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    targets = [t for t in tokens[2:] if not t.startswith("-")]
    assert tokens[1] == "install" and targets, "only `pip install` of this package belongs in the guide"
    for target in targets:
        match = re.fullmatch(r"(?:\.|longqa)(?:\[([\w,-]+)\])?", target)
        assert match, f"pip installs {target!r}, not this package"
        unknown = set((match[1] or "").split(",")) - set(declared) - {""}
        assert not unknown, f"pip extras {sorted(unknown)} are not declared in pyproject.toml"


def longqa_argv(command: str) -> list[str] | None:
    """The arguments `longqa` gets from one guide command (None for `pip install`); anything else fails."""
    tokens = shlex.split(command)
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # environment assignments
        tokens.pop(0)
    assert tokens, f"empty command: {command!r}"
    if tokens[0] == "pip":
        _pip_extras(tokens)
        return None
    if tokens[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parsed = get_args_parser().parse_args(tokens[1:])
            except SystemExit:
                raise AssertionError(f"torchrun refuses {command!r}: {err.getvalue().strip()}") from None
        assert parsed.module and parsed.training_script == "longqa.cli", f"torchrun must run -m longqa.cli: {command!r}"
        return list(parsed.training_script_args)
    assert tokens[0] == "longqa", f"not a longqa command: {command!r}"
    return tokens[1:]


def check_in_process(argv: list[str]) -> None:
    """The parser accepts argv; its config file and overrides load; plans and dry runs succeed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"longqa {shlex.join(argv)}: {err.getvalue().strip()}") from None
    if hasattr(args, "overrides"):
        cfg = load_config(*_split_config_args(args))  # unknown keys and bad values raise ConfigError
        if args.group == "train" and cfg.trainer.launcher == "ray" and (cfg.trainer.ray_workers or 1) > 1:
            check_data_parallel(cfg, cfg.trainer.ray_workers)  # what its workers check before anything loads
    if args.group == "plan" or getattr(args, "dry_run", False):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
        assert code == 0, f"longqa {shlex.join(argv)} exits {code}: {err.getvalue().strip()}"


def subprocess_argv(argv: list[str]) -> list[str]:
    """How the command is run for real in the test: with its --dry-run where it has one, else --help."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "dry_run"):
        return argv if args.dry_run else [*argv, "--dry-run"]
    return [*argv, "--help"]


@pytest.fixture
def guide_workdir(tmp_path, monkeypatch):
    """A folder laid out like the guide's: the repository's configs and the guide's hostfile."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    hostfile = next(b for b in fenced_blocks(GUIDE.read_text(), "text") if "slots=" in b)
    (tmp_path / "hostfile").write_text(hostfile)
    monkeypatch.chdir(tmp_path)
    return tmp_path


COMMANDS = guide_commands(GUIDE.read_text())


def test_the_guide_covers_the_recipe_in_order():
    order = ["data loongrl", "plan", "cluster up", "train", "export", "eval"]
    firsts = [
        next(i for i, c in enumerate(COMMANDS) if f"longqa.cli {step}" in c or f"longqa {step}" in c) for step in order
    ]
    assert firsts == sorted(firsts), f"the guide's steps are out of order: {order} at {firsts}"


@pytest.mark.parametrize("command", COMMANDS)
def test_guide_command_exists(command, guide_workdir):
    argv = longqa_argv(command)
    if argv is not None:
        check_in_process(argv)


def test_guide_commands_run_through_the_entry_point(guide_workdir):
    """Each command through `python -m longqa.cli`, as a user would type it (a few at a time)."""
    runs = sorted({tuple(subprocess_argv(a)) for a in map(longqa_argv, COMMANDS) if a is not None})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

    def run(argv):
        return argv, subprocess.run(
            [sys.executable, "-m", "longqa.cli", *argv],
            capture_output=True,
            text=True,
            cwd=guide_workdir,
            env=env,
            timeout=300,
        )

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for argv, done in pool.map(run, runs):
            assert done.returncode == 0, f"longqa {shlex.join(argv)}:\n{done.stderr[-2000:]}"
            assert done.stdout.strip(), f"longqa {shlex.join(argv)} printed nothing"


@pytest.mark.parametrize(
    "command, complaint",
    [
        ("longqa trian configs/demo.yaml", "invalid choice"),
        ("longqa train configs/demo.yaml trainer.lancher=ray", "did you mean 'trainer.launcher'"),
        ("longqa plan configs/loongrl-qwen3-32b.yaml --gpus 8 --shape qwen3-32b", "exits 2"),
        ("longqa plan configs/loongrl-qwen3-32b.yaml --gpus 32 --shape qwen3-33b", "invalid choice"),
        ("longqa cluster up --hostfile hostfile --dry-rn", "unrecognized arguments"),
        ("longqa export runs/x/checkpoints/step_00000040", "required"),
        ("ray start --head", "not a longqa command"),
        ("torchrun --nproc_per_node 8 train.py", "must run -m longqa.cli"),
        ("pip install -e '.[ray,tensorbord]'", "tensorbord"),
        (
            "longqa train actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=3 "
            "trainer.n_gpus_per_node=8 trainer.nnodes=4",
            "tensor_model_parallel_size=3 must divide the 32 ranks",
        ),
    ],
)
def test_the_check_fails_on_what_does_not_exist(command, complaint, guide_workdir):
    with pytest.raises(Exception) as failure:
        argv = longqa_argv(command)
        check_in_process(argv)
    assert complaint in str(failure.value)


def _referenced_paths(text: str) -> list[str]:
    """Relative link targets, and code spans that name a source or document file under a folder of the
    repository (``benchmarks/RESULTS.md``, ``model/attention.py``); run outputs such as
    ``report/summary.md`` name no folder of the repository and are left alone."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    links = [p for p in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"[a-z]+://", p)]
    spans = [
        s
        for s in re.findall(r"`([^`\s]+)`", text)
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)+\.(md|py|sh|yaml|json|png)", s)
        and any((base / s.split("/")[0]).is_dir() for base in (ROOT, ROOT / "src" / "longqa"))
    ]
    return links + spans


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_point_only_inside_the_repository(doc):
    text = doc.read_text()
    for path in _referenced_paths(text):
        # Links resolve from the document's folder; code spans name paths from the root or from src/longqa.
        candidates = [doc.parent / path, ROOT / path, ROOT / "src" / "longqa" / path]
        inside = [c.resolve() for c in candidates if c.resolve().is_relative_to(ROOT)]
        assert any(c.exists() for c in inside), f"{doc.name} names {path}, which is not in the repository"


# Phrases that describe how the work was organised rather than the project. Written with character
# classes so that a plain-text search of the repository for those phrases does not find this pattern;
# ordinary words (pytest's fixture scopes, a "known issue") do not match.
ORGANISATION = re.compile(
    r"\bsession[s]? [0-9]|\bthis[ ]session\b|\bdevice[ ](tool|call|kind)|nvidia-h2[0]0"
    r"|\bissue[s]? [0-9]|\bcarry[ ]\[|\bwork[ ]period|\bsub[a]gent",
    re.I,
)


def test_no_file_speaks_of_how_the_work_was_organised():
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in files.splitlines():
        path = ROOT / name
        if path == Path(__file__) or not path.is_file() or path.suffix in (".png", ".safetensors"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [
            f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if ORGANISATION.search(line)
        ]
    assert not hits, "\n".join(hits)


def test_the_launch_line_table_is_the_code_s():
    """docs/verl-launch-line.md's table is what the code does with each argument of the recipe's line."""
    from longqa.config.verl_keys import launch_line_table

    line = [
        text
        for text in (ROOT / "tests" / "data" / "recipe_verl_launch_line.txt").read_text().splitlines()
        if text and not text.startswith("#")
    ]
    assert launch_line_table(line) in (ROOT / "docs" / "verl-launch-line.md").read_text()


def launcher_table(title: str) -> list[list[str]]:
    """The rows (cells) of docs/verl-launch-line.md's table under the heading ``title``."""
    text = (ROOT / "docs" / "verl-launch-line.md").read_text().split(f"### {title}\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def longqa_values(cell: str) -> dict[str, str]:
    """The ``key=value`` settings a longqa cell names."""
    return dict(re.findall(r"`([a-z_]+\.[a-z_]+)=([^`]*)`", cell))


def value_of(cfg, key: str) -> str:
    section, field = key.split(".")
    return str(getattr(getattr(cfg, section), field))


def test_the_32b_launcher_table_is_the_config_and_the_launch_line():
    """docs/verl-launch-line.md's table of the 32B launcher's settings: each longqa value is the config's, and each
    one it calls equal is also what the recipe's own launch line becomes, so neither can drift from the table."""
    from test_verl_keys import recipe_launch_line

    from longqa.config import load_config
    from longqa.config.verl_keys import VERL_DEFAULTS

    ours = load_config("configs/loongrl-qwen3-32b.yaml")
    line = recipe_launch_line(data="data/loongrl", model="Qwen/Qwen3-32B", reward="/recipe/reward.py", output="x")
    recipe = load_config(None, line, base=VERL_DEFAULTS)
    rows = launcher_table("The 32B launcher (verl) and `configs/loongrl-qwen3-32b.yaml`")
    named = 0
    for setting, _, longqa, verdict in rows:
        for key, value in longqa_values(longqa).items():
            named += 1
            assert value_of(ours, key) == value, (setting, key)
            if verdict == "equal":
                assert value_of(recipe, key) == value, (setting, key)
    assert named >= 35


def test_the_8b_launcher_table_is_the_config_and_the_tested_settings():
    """docs/verl-launch-line.md's table of the 8B launcher's settings: each longqa value is the config's, and the
    rows it calls equal are exactly the settings tests/test_config.py checks against the launcher."""
    from test_config import RECIPE_8B

    from longqa.config import load_config

    ours = load_config("configs/loongrl-qwen3-8b.yaml")
    rows = launcher_table("The 8B launcher (SkyRL, Arctic backend) and `configs/loongrl-qwen3-8b.yaml`")
    equal = set()
    for setting, _, longqa, verdict in rows:
        values = longqa_values(longqa)
        for key, value in values.items():
            assert value_of(ours, key) == value, (setting, key)
        if verdict == "equal" and values:
            equal |= {(setting, key, value) for key, value in values.items()}
    assert equal == {(name, key, str(value)) for name, key, value in RECIPE_8B}


def test_the_package_table_names_every_module_where_it_is():
    """docs/architecture.md's table of packages names each package's modules: each one it names exists in that
    package, and each module of a package is named in its row, so the map cannot fall behind the code."""
    package = ROOT / "src" / "longqa"
    rows = re.findall(r"^\| `(\w+)/` \| (.+) \|$", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    folders = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    assert sorted(name for name, _ in rows) == folders
    for name, text in rows:
        named = set(re.findall(r"`(\w+)\.py`", text))
        modules = {p.stem for p in (package / name).glob("*.py") if p.stem != "__init__"}
        assert named == modules, (
            f"{name}/: the table names {sorted(named - modules)} that are not there and "
            f"leaves out {sorted(modules - named)}"
        )
