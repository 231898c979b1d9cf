"""What a resumed run may change from the checkpoint it continues, and what it may not.

A checkpoint records the whole config it was written with (``trainer_state.json``). Resuming with other
values is one of two things:

- applied (``APPLIED_ON_RESUME``): how long the run goes, the optimizer's step size and schedule, what is
  validated, saved and logged, and how the work is done (devices, memory, speed, launcher), which leaves
  the numbers as they were up to float rounding. Changing these is a decision about the rest of the run:
  the new values hold from the resumed step on, and the run says which changed.
- refused (``REFUSED_ON_RESUME``): what the run computes: the model, the data (its files' names and, through
  ``DATA_KEY``, their contents) and its filtering, the batch,
  the group size and sampling, the objective, the reward, the seed. A resumed run with another value would
  match neither the run it continues nor any uninterrupted run, so it is refused, naming every such
  difference at once, unless ``trainer.resume_allow_changes=true`` says the change is meant.

Either way the new checkpoints record the config that ran after the resume, and ``CHANGES_KEY`` in their
trainer state keeps, step by step, every change made on resuming.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longqa.config import Config, ConfigError, to_dict
from longqa.config.schema import APPLIED_ON_RESUME, REFUSED_ON_RESUME  # noqa: F401 (each key's on_resume)

DATA_KEY = "data_fingerprint"  # in trainer_state.json: {"data.train_files": [digest of each file], ...}
DATA_FILE_KEYS = ("data.train_files", "data.val_files")

CHANGES_KEY = "resumed_with_changes"  # in trainer_state.json: [{"step": N, "changes": {key: [old, new]}}, ...]


class ResumeError(ConfigError):
    """The checkpoint a run resumes was written with settings (or data) that change what the run computes: resume
    with its values, allow the changes, or start a new run elsewhere. A ``ConfigError``, reported in one line."""


# Keys naming files: the same file given relative to the working folder or absolute (as the Ray launcher gives
# its workers) is the same setting.
PATH_KEYS = frozenset({"model.path", "model.tokenizer_path", "data.train_files", "data.val_files", "reward.path"})


def _compared(key: str, value: Any) -> Any:
    if key not in PATH_KEYS or value is None:
        return value
    absolute = lambda path: os.path.abspath(os.path.expanduser(path))  # noqa: E731
    return [absolute(v) for v in value] if isinstance(value, list) else absolute(value)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix:
            flat.update(_flat(value, f"{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _shown(value: Any) -> str:
    return json.dumps(value)


@dataclass(frozen=True)
class Change:
    """One key whose value differs from the checkpoint's."""

    key: str
    recorded: Any
    now: Any

    @property
    def refused(self) -> bool:
        """Whether it changes what the run computes (a key not yet classified counts as such)."""
        return self.key not in APPLIED_ON_RESUME

    def __str__(self) -> str:
        return f"{self.key} {_shown(self.recorded)} -> {_shown(self.now)}"


def config_changes(recorded: dict, cfg: Config) -> list[Change]:
    """Every key whose value in ``cfg`` differs from ``recorded`` (the checkpoint's config, nested as ``to_dict``
    gives it), in the config's key order. A key the checkpoint does not record (it was written before the key
    existed) is compared with the key's default, which is how that version ran."""
    then = {**_flat(to_dict(Config())), **_flat(recorded)}
    return [
        Change(key, then[key], value)
        for key, value in _flat(to_dict(cfg)).items()
        if _compared(key, then[key]) != _compared(key, value)
    ]


@dataclass(frozen=True)
class DataChange(Change):
    """Files of ``key`` whose contents differ from the checkpoint's under the same names: the data position
    and order the checkpoint holds would be laid over other rows."""

    files: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.key}: the contents of {', '.join(self.files)} changed since the checkpoint"


def _digest(path: str) -> str | None:
    """The file's content digest, as the prompt cache keys its entries by (None for a missing file, which the
    data loading reports)."""
    from longqa.data.prompts import file_digest

    path = Path(os.path.expanduser(path))
    return file_digest(path) if path.is_file() else None


def data_fingerprint(cfg: Config) -> dict[str, list[str | None]]:
    """A digest of the bytes of each training and validation file, in order, for the checkpoint to record: a
    file replaced under the same name is a change of data that the config alone would not show."""
    d = cfg.data
    return {key: [_digest(f) for f in files or []] for key, files in zip(DATA_FILE_KEYS, (d.train_files, d.val_files))}


def data_changes(recorded: dict, then: dict | None, cfg: Config, now: dict) -> list[Change]:
    """The data files whose contents changed since the checkpoint under the names it records (``then``: its
    fingerprint; None in checkpoints written before fingerprints, which resume as they did). A file given under
    another name is already a change of its key."""
    if not then:
        return []
    recorded = {**_flat(to_dict(Config())), **_flat(recorded)}
    changes = []
    for key, files in zip(DATA_FILE_KEYS, (cfg.data.train_files, cfg.data.val_files)):
        if key not in then or _compared(key, recorded[key]) != _compared(key, files):
            continue
        changed = tuple(f for f, old, new in zip(files or [], then[key], now[key]) if old != new)
        if changed:
            changes.append(DataChange(key, then[key], now[key], changed))
    return changes


def check_resume(
    checkpoint: Path, recorded: dict, cfg: Config, data_then: dict | None = None, data_now: dict | None = None
) -> list[Change]:
    """The changes resuming from ``checkpoint`` with ``cfg`` makes; a ResumeError naming every change that
    alters what the run computes, unless ``trainer.resume_allow_changes`` allows them. ``data_then`` and
    ``data_now``: the data fingerprints (``data_fingerprint``) of the checkpoint and of this run."""
    changes = config_changes(recorded, cfg)
    if data_now is not None:
        changes += data_changes(recorded, data_then, cfg, data_now)
    refused = [c for c in changes if c.refused]
    if refused and not cfg.trainer.resume_allow_changes:
        applied = [c for c in changes if not c.refused]
        also = f" (these would apply: {'; '.join(map(str, applied))})" if applied else ""
        raise ResumeError(
            f"checkpoint {checkpoint} was written with other settings that change what the run computes: "
            f"{'; '.join(map(str, refused))}{also}; resume with the checkpoint's values, set "
            f"trainer.resume_allow_changes=true to go on with the new ones, or start a new run in another "
            f"trainer.output_dir"
        )
    return changes


def describe_changes(changes: list[Change], step: int) -> list[str]:
    """Lines saying what a resume at ``step`` changed, those that alter what the run computes apart."""
    applied = [str(c) for c in changes if not c.refused]
    allowed = [str(c) for c in changes if c.refused]
    lines = []
    if applied:
        lines.append(f"  changed since the checkpoint, applied from step {step + 1} on: {'; '.join(applied)}")
    if allowed:
        lines.append(
            f"  changed since the checkpoint, altering what the run computes (trainer.resume_allow_changes"
            f"=true): {'; '.join(allowed)}"
        )
    return lines


def change_history(state: dict, step: int, changes: list[Change]) -> list[dict]:
    """The checkpoint's record of changes made on resuming, with this resume's added (when it made any)."""
    history = list(state.get(CHANGES_KEY, []))
    if changes:
        history.append({"step": step, "changes": {c.key: [c.recorded, c.now] for c in changes}})
    return history
