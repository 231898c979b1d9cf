"""ConfigError says that a setting's value is wrong or that two settings disagree, so it is raised only where the
settings rules live: the config package, and the command line, where a command reads its own arguments. A setting
that conflicts with the world (an output path that is an input, a run folder another run holds, a checkpoint a
resume cannot continue, a disk too small) has an error class of its own in the module that knows that world; each
is a subclass of ConfigError, so that the command line and the Ray launcher still report it in one line."""

import ast
import importlib
import pickle
from pathlib import Path

import pytest

from longqa import cli
from longqa.config import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "longqa"

# Where ConfigError may be made, as paths under the package's source folder: a folder (ending in "/") or a file.
ALLOWED = ("config/", "cli.py")


def _config_error_names(tree: ast.AST) -> set[str]:
    """The names ConfigError goes by in a module: its own, and any it is imported as."""
    return {"ConfigError"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name == "ConfigError" and alias.asname
    }


def _outside_allowed(root: Path) -> list[tuple[str, ast.AST]]:
    """Each module under ``root`` (a package's source folder) outside ALLOWED: its path relative to ``root`` and its
    syntax tree."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if not any(where.startswith(a) if a.endswith("/") else where == a for a in ALLOWED):
            found.append((where, ast.parse(path.read_text(), str(path))))
    return found


def config_errors_made(root: Path) -> list[str]:
    """Each place under ``root`` outside ALLOWED that makes a ConfigError, as ``path:line``: ``raise ConfigError``,
    or a ``ConfigError(...)`` built to be raised or returned, by any name it is imported as. Catching one, or
    defining a subclass of it, is not making one."""
    places = set()
    for where, tree in _outside_allowed(root):
        names = _config_error_names(tree)

        def is_config_error(node: ast.AST) -> bool:
            return (isinstance(node, ast.Name) and node.id in names) or (
                isinstance(node, ast.Attribute) and node.attr == "ConfigError"
            )

        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and is_config_error(node.func)) or (
                isinstance(node, ast.Raise) and node.exc is not None and is_config_error(node.exc)
            ):
                places.add((where, node.lineno))
    return [f"{where}:{line}" for where, line in sorted(places)]


def config_error_subclasses(root: Path) -> list[str]:
    """The ``module:Class`` of every class under ``root`` outside ALLOWED that subclasses ConfigError directly."""
    found = []
    for where, tree in _outside_allowed(root):
        module = ".".join(["longqa", *Path(where).with_suffix("").parts]).removesuffix(".__init__")
        names = _config_error_names(tree)
        found += [
            f"{module}:{node.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in names for b in node.bases)
        ]
    return sorted(found)


def test_config_error_is_made_only_by_the_config_package_and_the_command_line():
    made = config_errors_made(PACKAGE)
    assert made == [], (
        f"ConfigError made at {made}: move a settings rule into longqa/config/, or raise an "
        f"error class of the module's own (a subclass of ConfigError) for a setting that "
        f"conflicts with the world"
    )


def test_the_check_finds_a_config_error_made_outside_the_config_package(tmp_path):
    """The search itself sees every form of a planted raise, and leaves the allowed places, subclasses and
    catching alone."""
    modules = {
        "config/load.py": "class ConfigError(ValueError):\n    pass\ndef f():\n    raise ConfigError('x')\n",
        "cli.py": "from longqa.config import ConfigError\ndef f():\n    raise ConfigError('x')\n",
        "outputs/lock.py": "from longqa.config import ConfigError\nclass RunFolderBusy(ConfigError):\n    pass\n"
        "def f():\n    try:\n        raise RunFolderBusy('x')\n    except ConfigError:\n"
        "        pass\n",
        "data/io.py": "from longqa.config import ConfigError\ndef f():\n    raise ConfigError('x') from None\n",
        "train/a.py": "from longqa.config import ConfigError as Wrong\ndef f():\n    return Wrong('x')\n",
        "train/b.py": "import longqa.config\ndef f():\n    raise longqa.config.ConfigError\n",
    }
    for name, text in modules.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert config_errors_made(tmp_path) == ["data/io.py:3", "train/a.py:3", "train/b.py:3"]
    assert config_error_subclasses(tmp_path) == ["longqa.outputs.lock:RunFolderBusy"]


SUBCLASSES = config_error_subclasses(PACKAGE)


def _class(name: str) -> type[Exception]:
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def test_the_errors_of_the_world_are_found():
    assert {
        "longqa.outputs.paths:OutputPathError",
        "longqa.outputs.lock:RunFolderBusy",
        "longqa.train.resume:ResumeError",
    } <= set(SUBCLASSES)


@pytest.mark.parametrize("name", SUBCLASSES)
def test_the_command_line_reports_each_error_of_the_world_in_one_line(name, monkeypatch, capsys):
    error = _class(name)
    assert issubclass(error, ConfigError)

    def command(args):
        raise error(f"trainer.output_dir=/runs/a is taken ({error.__name__}): give another folder")

    monkeypatch.setattr(cli, "cmd_config_keys", command)
    assert cli.main(["config", "keys"]) == 2
    assert capsys.readouterr().err == (
        f"longqa: error: trainer.output_dir=/runs/a is taken ({error.__name__}): give another folder\n"
    )


@pytest.mark.parametrize("name", SUBCLASSES)
def test_a_ray_workers_error_of_the_world_comes_back_alone(name):
    """A worker's error reaches the driver pickled, then wrapped by Ray; the launcher finds it to say in one line."""
    RayTaskError = pytest.importorskip("ray.exceptions").RayTaskError
    from longqa.train.ray_launcher import user_error

    mistake = pickle.loads(pickle.dumps(_class(name)("trainer.output_dir=/runs/a is taken")))
    assert type(mistake) is _class(name) and str(mistake) == "trainer.output_dir=/runs/a is taken"
    outer = RuntimeError("Training failed")
    outer.__cause__ = RayTaskError("train", "Traceback ...", mistake).as_instanceof_cause()
    assert user_error(outer) is mistake


def test_a_rule_of_the_options_alone_is_a_config_error_and_one_that_needs_the_data_is_its_own():
    """The test ratio is refused by the config package's rule; a ratio that leaves no training row of the rows
    given is refused by the data module's error."""
    from longqa.data.io import TooFewRowsError, split_train_test

    with pytest.raises(ConfigError, match=r"test ratio must be in \(0, 1\), got 1.5") as e:
        split_train_test(10, 1.5, 0)
    assert type(e.value) is ConfigError
    with pytest.raises(TooFewRowsError, match="1 rows are too few for a test ratio of 0.05: no training row"):
        split_train_test(1, 0.05, 0)


def test_plan_split_s_gpus_and_synth_s_options_are_settings_rules():
    from longqa.config.command_options import MAX_HOPS, SYNTH_TASKS, check_split_gpus, check_synth_options

    with pytest.raises(ConfigError, match="sampler ranks of their own need at least 2 GPUs: plan with --gpus 2"):
        check_split_gpus(1)
    check_split_gpus(2)
    with pytest.raises(ConfigError, match=r"unknown tasks \['squad'\]; choose from hotpotqa, musique, 2wikimqa"):
        check_synth_options(["squad"], 2, 3, [1024])
    with pytest.raises(ConfigError, match=r"unknown tasks \[\]"):
        check_synth_options([], 2, 3, [1024])
    with pytest.raises(ConfigError, match=f"need 2 <= min_hops <= max_hops <= {MAX_HOPS}, got 2..7"):
        check_synth_options(SYNTH_TASKS, 2, MAX_HOPS + 1, [1024])
    with pytest.raises(ConfigError, match="context lengths must be at least 256 tokens, got 100"):
        check_synth_options(SYNTH_TASKS, 2, 3, [1024, 100])
    check_synth_options(SYNTH_TASKS, 2, MAX_HOPS, [256, 1024])
