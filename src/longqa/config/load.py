"""Loading a config: defaults, then a YAML file, then dotted ``key=value`` overrides (longqa's keys or verl's
launch-line keys), each value checked as it is applied, before any work starts.

The keys themselves, their types and rules live in ``longqa.config.schema``; the names a user imports
(``Config``, ``ConfigError``, ...) are re-exported by the package, ``longqa.config``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from longqa.config.reward_mode import check_environment_mode, environment_reward_mode, what_scores
from longqa.config.schema import (
    Config,
    ConfigError,
    expand_paths,
    flatten,
    sections,
    set_key,
)
from longqa.config.verl_keys import resolve_file_keys, resolve_overrides


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> Config:
    """Defaults (``reward.mode``'s from ``REWARD_CALC_TYPE`` when set) with ``base`` over them (longqa keys, e.g.
    verl's defaults for a verl launch line), then the YAML file, then the overrides (longqa's keys or verl's
    launch-line keys, see ``longqa.config.verl_keys``); each value checked as it is applied, every bad override named
    in one error. A ``reward.mode`` given that differs from ``REWARD_CALC_TYPE``'s mode is refused
    (``config/reward_mode.py``)."""
    cfg = Config()
    if mode := environment_reward_mode():
        cfg.reward.mode = mode
    mode_from = None  # where the reward.mode that stands was given, for the refusal
    if _apply(cfg, (base or {}).items()):
        mode_from = "the base settings"
    if path is not None and _apply(cfg, resolve_file_keys(read_config_file(path), str(path))):
        mode_from = str(path)
    if _apply(cfg, resolve_overrides(overrides)):
        mode_from = "the command line"
    expand_paths(cfg)
    check_environment_mode(cfg, mode_from)
    return cfg


def _apply(cfg: Config, pairs) -> bool:
    """Set each (key, value) of ``pairs`` in ``cfg``; whether ``reward.mode`` was one of them."""
    given = False
    for key, value in pairs:
        set_key(cfg, key, value)
        given = given or key == MODE_KEY
    return given


MODE_KEY = "reward.mode"

# Files that hold data, not a config: named as such when given where the config file goes.
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow", ".csv", ".tsv", ".gz", ".zst")
# Files and folders that hold a model, not a config: named as such (`longqa train model.gguf` is a common first try).
MODEL_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def _not_a_config(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a YAML config file ({why}; data files go in data.train_files={path} or data.val_files=...)"
    )


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML config file's keys, nested sections flattened to dotted keys (longqa's or verl's, not yet checked).
    Whatever else is given where the config file goes (a folder, a data file, a key without its value) is said
    in one line, not met as a decoding traceback."""
    path = Path(path)
    if path.suffix.lower() in MODEL_SUFFIXES or (path / "config.json").is_file():
        raise ConfigError(f"{path} is a model, not a YAML config file: give it as model.path={path}")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder: give a YAML config file")
    if not path.is_file():
        hint = ""
        if str(path) in {key for key, _, _ in key_help()}:  # `longqa config show rollout.n`
            hint = f": {path} is a config key; give it a value ({path}=VALUE), or read it in `longqa config show`"
        raise ConfigError(f"config file {path} does not exist{hint}")
    if path.suffix.lower() in DATA_SUFFIXES:
        raise _not_a_config(path, f"a {path.suffix} file holds data")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _not_a_config(path, "it is not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if tree is not None and not isinstance(tree, dict):
        raise _not_a_config(path, f"it holds a {type(tree).__name__}, not a mapping of keys")
    return flatten(tree or {})


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML that ``load_config`` reads back, with a comment above the reward section that says what
    scores (``reward.mode``, or the function of ``reward.path``, beside which the mode is unused)."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    return text.replace("\nreward:\n", f"\n# {what_scores(cfg)}\nreward:\n", 1)


def key_help() -> list[tuple[str, str, Any]]:
    """(key, help, default) for every key, for `longqa config keys`."""
    rows = []
    for section, cls in sections().items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", f.metadata.get("help", ""), getattr(defaults, f.name)))
    return rows


def load_config_dict(tree: dict) -> Config:
    """A config from its nested dict (as stored in a checkpoint), checked like a YAML file."""
    cfg = Config()
    for key, value in flatten(tree).items():
        set_key(cfg, key, value)
    expand_paths(cfg)
    return cfg
