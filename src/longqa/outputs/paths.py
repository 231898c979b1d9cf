"""Where a command may write: never over a file it reads, and never into a folder another command made.

Every command that writes checks its output paths here before any work, against the paths it reads and against
the folders the commands leave: a model folder (``longqa export``, ``longqa sft``), a training run folder and its
checkpoints (``longqa train``), a data folder (``longqa data``). Those folders are told apart by what they hold
(``folder_kind``). A command may go on in a folder of its own kind (``train`` resumes its run, ``export`` replaces
an export, ``data synth`` rewrites its files); any other kind is refused in one line naming the setting to change,
so an export is never overwritten by ``sft``, a data folder never gets model files and no ``--samples`` replaces
the parquet it was read from.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from longqa.config import Config, ConfigError
from longqa.outputs.layout import (
    EXPORT_FILES,
    MARKER,
    METRICS_FILE,
    MODEL_CARD,
    MODEL_CONFIG,
    REPORT_DIR,
    SFT_SUMMARY,
    TRAINER_STATE,
    WANDB_ID_FILE,
    checkpoints_dir,
)

# The kinds of folder the commands make, as ``folder_kind`` names them (in the order it looks for them).
CHECKPOINT, RUN, SFT_MODEL, MODEL, DATA = (
    "a training checkpoint",
    "a training run folder",
    "a model folder made by longqa sft",
    "a model folder",
    "a data folder",
)

# What a command may be given instead of a new or empty folder: a folder of the kind it makes, and what it does there.
GOES_ON_IN = {
    RUN: "a run folder, which the run resumes",
    SFT_MODEL: "a previous longqa sft folder, which is replaced",
    MODEL: "a previous export, which is replaced",
    DATA: "a data folder, whose files are rewritten",
}


class OutputPathError(ConfigError):
    """An output path a command was given is one it reads, or a file or folder another command made: the setting
    that names it is what to change. A ``ConfigError``, reported in one line."""


def _path(path: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(path))).resolve()


def folder_kind(path: str | os.PathLike) -> str | None:
    """The kind of folder ``path`` is by what it holds, or None for a folder no command made (or no folder): a
    checkpoint (its trainer state or completion marker), a run folder (its checkpoints folder or metrics; also
    the checkpoints folder itself), a model folder (a config.json or a GGUF file; one made by ``longqa sft``
    holds its summary), a data folder (parquet files in it or in its subfolders, as ``longqa data`` lays out)."""
    folder = Path(os.path.expanduser(str(path)))
    if not folder.is_dir():
        return None
    if (folder / TRAINER_STATE).is_file() or (folder / MARKER).is_file():
        return CHECKPOINT
    if folder.name == checkpoints_dir("").name or checkpoints_dir(folder).is_dir() or (folder / METRICS_FILE).is_file():
        return RUN
    if (folder / MODEL_CONFIG).is_file() or any(folder.glob("*.gguf")):
        return SFT_MODEL if (folder / SFT_SUMMARY).is_file() else MODEL
    if any(folder.glob("*.parquet")) or any(folder.glob("*/*.parquet")):
        return DATA
    return None


# The paths a command reads, by the setting that names them: files or folders (None: not given).
Reads = Mapping[str, Iterable[str | os.PathLike | None]]


def _reads(reads: Reads | None) -> list[tuple[str, str, Path]]:
    """``(setting, as given, resolved path)`` of every path a command reads."""
    return [(setting, str(p), _path(p)) for setting, paths in (reads or {}).items() for p in paths if p]


def _kind_files(kind: str | None) -> tuple[str, ...]:
    """The files that make a folder of ``kind`` what it is, as patterns of their paths inside it: what its command
    wrote there (a folder no command made: all its files). Others, such as an eval's JSON kept in a run or model
    folder, belong to whoever wrote them."""
    model = (*EXPORT_FILES, MODEL_CARD, SFT_SUMMARY, "*.gguf")
    return {
        RUN: (METRICS_FILE, WANDB_ID_FILE, f"{REPORT_DIR}/*", f"{checkpoints_dir('').name}/*"),
        SFT_MODEL: model,
        MODEL: model,
        DATA: ("*.parquet",),
    }.get(kind, ("*",))


def _belongs(path: Path, folder: Path, kind: str | None) -> bool:
    """Whether the file ``path`` inside ``folder``, a folder of ``kind``, is one of the files that make it what
    it is."""
    inside = str(path.relative_to(folder))
    return any(fnmatch.fnmatch(inside, pattern) for pattern in _kind_files(kind))


def check_output_file(path: str | os.PathLike, setting: str, reads: Reads | None = None) -> None:
    """Refuse a file to write that is one the command reads (``reads``: each setting's paths, files or folders,
    whose files count as read), or an existing file of a folder another command made, found in the file's folder
    or the one above: a model's config.json, a data folder's parquet, a run's metrics or report."""
    target = _path(path)
    for read_setting, given, read in _reads(reads):
        if target == read:
            raise OutputPathError(
                f"{setting} {path} is {read_setting}'s file, which this command reads: give another path"
            )
        if target.is_file() and read in target.parents and _belongs(target, read, folder_kind(read)):
            raise OutputPathError(
                f"{setting} {path} is a file of {read_setting} {given}, which this command reads: give another path"
            )
    if target.is_file():
        for folder in list(target.parents)[:2]:
            if (kind := folder_kind(folder)) and _belongs(target, folder, kind):
                raise OutputPathError(f"{setting} {path} is a file of {kind}, {folder}: give another path")


def check_output_folder(
    path: str | os.PathLike,
    setting: str,
    reads: Reads | None = None,
    makes: str | None = None,
    files: Iterable[str] | None = None,
    writer: str = "",
) -> None:
    """Refuse a folder to write in that is a folder the command reads or the folder of a file it reads
    (``reads``), or a folder another command made: any kind of ``folder_kind`` other than ``makes``, the kind
    this command makes. With ``files`` (the names and patterns ``writer`` writes: a folder it replaces whole),
    an existing folder may hold nothing else, so that nothing is left beside files it does not describe."""
    target = _path(path)
    for read_setting, given, read in _reads(reads):
        if target == read:
            raise OutputPathError(
                f"{setting} {path} is {read_setting}'s folder, which this command reads: give another folder"
            )
        if target == read.parent and read.is_file():
            raise OutputPathError(
                f"{setting} {path} holds {read_setting} {given}, which this command reads: give another folder"
            )
    instead = f", or {GOES_ON_IN[makes]}" if makes else ""
    if (kind := folder_kind(target)) not in (None, makes):
        raise OutputPathError(f"{setting} {path} is {kind}: give a new or empty folder{instead}")
    if files is None or not target.is_dir():
        return
    patterns = tuple(files)
    others = sorted(p.name for p in target.iterdir() if not any(fnmatch.fnmatch(p.name, f) for f in patterns))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise OutputPathError(
            f"{setting} {path} holds files no {writer} writes ({shown}): give a new or empty folder{instead}"
        )


def config_reads(cfg: Config) -> dict[str, list]:
    """The paths a training run of ``cfg`` reads, by setting (a hub id among them names no local path)."""
    return {
        "model.path": [cfg.model.path],
        "model.tokenizer_path": [cfg.model.tokenizer_path],
        "data.train_files": list(cfg.data.train_files),
        "data.val_files": list(cfg.data.val_files),
        "reward.path": [cfg.reward.path],
        "actor.deepspeed_config": [cfg.actor.deepspeed_config],
    }


def check_config_outputs(cfg: Config, run: bool = True) -> None:
    """The folders a config writes in: the prompt cache (``data.cache_dir``) and, with ``run``, the run folder
    (``trainer.output_dir``)."""
    reads = config_reads(cfg)
    if run:
        check_output_folder(cfg.trainer.output_dir, "trainer.output_dir", reads, makes=RUN)
    check_output_folder(cfg.data.cache_dir, "data.cache_dir", reads)
