"""Checkpoints that survive a crash at any moment and resume training bit for bit.

Layout of one checkpoint, ``<run_dir>/checkpoints/step_00000012/``:

``model.pt``, ``optimizer.pt`` (one process)
    ``torch.save`` of the model's state dict and of the optimizer's, keyed by parameter name (the
    ``torch.distributed.checkpoint.state_dict`` convention), so sharded runs can load them.
``state/`` (several ranks)
    A ``torch.distributed.checkpoint`` folder of the same two state dicts, each rank writing its shards;
    it loads on any number of ranks, one included (the shards are redistributed on load). Every other
    file is written by rank 0 alone.
``deepspeed/`` (``actor.strategy=deepspeed``, any number of ranks)
    DeepSpeed's own checkpoint of the ZeRO-3 engine, each rank writing its partitions of the weights and
    optimizer state; it resumes on the same number of ranks, and its weights export to an HF folder.
``scheduler.pt``
    The learning-rate scheduler's state dict, when the trainer has a scheduler.
``rng.json``
    The global random states (python ``random``, numpy, torch CPU and every CUDA device), so that data
    shuffles, sampling and dropout continue exactly where they stopped.
``trainer_state.json``
    The trainer's own JSON-able dict: step, epoch, position in the epoch's data order, data seed, history.
``COMPLETE``
    Written last; lists every file with its size and its content digest (sha256). A folder without it is never
    resumed from, and a file whose size or digest differs from it is refused by name on resume and export: a
    file damaged in place, at its own size, would otherwise load as weights and train (or export) as NaN.
    The digests cost no second read of what this process writes (hashed on its way to the file); the files
    the ranks write themselves (``state/``, ``deepspeed/``) are read once, each rank hashing its share.

Why a crash cannot leave a half checkpoint that looks whole: everything is written (and fsynced) into a
hidden ``.tmp-*`` folder next to the final one, the marker last, and only then is the folder renamed to
its final name; a rename within one directory is atomic. Old checkpoints are deleted the same way round:
renamed to a hidden ``.trash-*`` name first, then removed, so a crash while deleting leaves nothing that
looks like a checkpoint. Hidden leftovers of a crash are removed by the next save.

A run folder holds one timeline: saving step N removes checkpoints of later steps (left by a run that was
resumed from an older checkpoint), so that ``trainer.resume=auto`` can never jump back to the abandoned
run. One run saves into a run folder at a time (``outputs.lock``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from longqa.distributed.deepspeed import TAG as DEEPSPEED
from longqa.outputs.layout import MARKER, RUN_REWARD, TRAINER_STATE, checkpoints_dir

__all__ = [
    "CheckpointError",
    "checkpoints_dir",
    "export_hf",
    "is_complete",
    "latest_checkpoint",
    "later_checkpoints",
    "latest_of_folder",
    "load_checkpoint",
    "load_model_weights",
    "read_trainer_state",
    "resolve_resume",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

DIGESTS = "sha256"  # the marker's {file: hex digest of its bytes}; checkpoints of earlier versions have none
MODEL, OPTIMIZER, SCHEDULER, RNG, SHARDED = "model.pt", "optimizer.pt", "scheduler.pt", "rng.json", "state"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP, _TRASH = ".tmp-", ".trash-"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read; the message says what to do about it."""


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint folder whose writing finished (its marker exists)."""
    return (Path(path) / MARKER).is_file()


def _complete_checkpoints(run_dir: str | os.PathLike) -> dict[int, Path]:
    """Complete checkpoints of the run by step; hidden temp/trash folders and unmarked folders are skipped."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and is_complete(path):
            found[int(match.group(1))] = path
    return found


def later_checkpoints(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """The run's complete checkpoints past ``step``, oldest first: what a run resumed at ``step`` abandons (its
    first save discards them, see ``_prune``)."""
    found = _complete_checkpoints(run_dir)
    return [found[s] for s in sorted(found) if s > step]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None when the run has none."""
    found = _complete_checkpoints(run_dir)
    return found[max(found)] if found else None


def latest_of_folder(path: str | os.PathLike) -> Path | None:
    """The latest complete checkpoint of a run folder or of its ``checkpoints/`` folder (what ``longqa export``
    also accepts), or None when ``path`` holds none: a user naming the run means its latest checkpoint."""
    path = Path(path)
    return latest_checkpoint(path.parent if path.name == checkpoints_dir("").name else path)


def _is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a checkpoint's own folder (finished or not), rather than a run or checkpoints folder."""
    return (path / MARKER).exists() or (path / TRAINER_STATE).exists() or _STEP_DIR.fullmatch(path.name) is not None


def resolve_resume(run_dir: str | os.PathLike, resume: str, say: Callable[[str], Any] | None = None) -> Path | None:
    """The checkpoint that ``trainer.resume`` designates: ``auto`` (latest, or None), ``none``, a checkpoint
    folder, or a run folder (or its ``checkpoints/``), which means its latest complete checkpoint (said with
    ``say``, since the user did not name it)."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"trainer.resume={resume}: no checkpoint folder at {path}; "
            f"use trainer.resume=auto for the latest one in {checkpoints_dir(run_dir)}"
        )
    if not _is_checkpoint_folder(path):
        latest = latest_of_folder(path)
        if latest is None:
            raise CheckpointError(
                f"trainer.resume={resume}: {path} is neither a checkpoint nor a run folder with a "
                f"complete one: give runs/NAME/checkpoints/step_XXXXXXXX or runs/NAME"
            )
        if say is not None:
            say(f"trainer.resume={resume}: resuming its latest complete checkpoint, {latest}")
        return latest
    if not is_complete(path):
        raise CheckpointError(
            f"trainer.resume={resume}: {path} is incomplete (no {MARKER} marker; its writing "
            f"was interrupted); use trainer.resume=auto for the latest complete checkpoint"
        )
    return path


# ---------------------------------------------------------------------------------------------- saving


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable, not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing:
    """A file object whose writes are hashed on their way to the file: the digest costs no second read."""

    def __init__(self, f: IO[bytes]):
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_file(path: Path, write: Callable[[IO[bytes]], Any]) -> str:
    """Write through a Python file object and fsync it; returns the digest of what was written.

    ``torch.save`` given a path reports a full disk as an opaque RuntimeError from its C++ writer; given a
    file object, the OSError (ENOSPC) surfaces, so a full disk can be told apart from a bug.
    """
    with open(path, "wb") as f:
        hashing = _Hashing(f)
        write(hashing)
        f.flush()
        os.fsync(f.fileno())
    return hashing.hash.hexdigest()


def _file_digest(path: Path) -> str:
    """The digest of a file's bytes, in one streaming pass."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGESTS).hexdigest()


def _files_of(folder: Path) -> list[str]:
    """Every file below ``folder``, as paths relative to it, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _spread(names: list[str], work: Callable[[str], Any]) -> dict[str, Any]:
    """``work`` on each of ``names``, shared out over the training ranks (every rank calls it, with the same
    names), the results of all gathered on every rank: one pass over a sharded checkpoint, not one per rank."""
    from longqa.distributed.env import gather_objects, rank, world_size

    mine = {name: work(name) for name in names[rank() :: world_size()]}
    return {name: result for part in gather_objects(mine) for name, result in part.items()}


def _torch_file(obj: Any) -> Callable[[IO[bytes]], Any]:
    return lambda f: torch.save(obj, f)


def _json_file(obj: Any) -> Callable[[IO[bytes]], Any]:
    text = json.dumps(obj, indent=1) + "\n"
    return lambda f: f.write(text.encode())


def rng_state() -> dict:
    """Every global random state that training draws from, as plain JSON.

    Public because the trainer takes one at the start of each step: a step dropped before its update
    (see ``preemption``) puts it back, so its checkpoint is the one the step before would have written.
    """
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            **numpy_state,
            "state": {"key": numpy_state["state"]["key"].tolist(), "pos": numpy_state["state"]["pos"]},
        },
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured (CUDA states only for the devices present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            **numpy_state,
            "state": {
                "key": np.array(numpy_state["state"]["key"], dtype=np.uint32),
                "pos": numpy_state["state"]["pos"],
            },
        }
    )
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        cuda = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in cuda])


def _remove_hidden(folder: Path) -> None:
    """Remove the temp and trash folders that an interrupted save or prune left behind."""
    for path in folder.iterdir():
        if path.name.startswith((_TMP, _TRASH)):
            shutil.rmtree(path, ignore_errors=True)


def _discard(path: Path) -> None:
    """Delete a checkpoint so that no crash can leave it half deleted under its real name."""
    trash = path.with_name(f"{_TRASH}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def _describe_previous(run_dir: Path) -> str:
    previous = latest_checkpoint(run_dir)
    return f"the previous checkpoint {previous.name} is intact" if previous else "there is no previous checkpoint"


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, if any.

    A write that fails inside ``torch.save`` is re-raised by its zip writer's cleanup as a RuntimeError
    ("unexpected pos ..."), with the OSError only as its context.
    """
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _ranks_digests(tmp: Path) -> dict[str, str]:
    """The digests of the files the ranks wrote into ``tmp`` (shards), each rank hashing its share of them. The
    names are rank 0's listing: another node may not see every file in its own listing yet (a shared file
    system caches folders), though it reads each file whole once opened."""
    from longqa.distributed.env import gather_objects, is_main

    names = gather_objects(_files_of(tmp) if is_main() and tmp.is_dir() else None)[0]
    return _spread(names, lambda name: _file_digest(tmp / name))


def _write_temp(tmp: Path, files: dict[str, Callable[[IO[bytes]], Any]], step: int, digests: dict[str, str]) -> None:
    """Write every file into ``tmp`` (which may already hold the ranks' shards, of ``digests``), then the marker
    naming them all with their sizes and digests, and make it all durable."""
    tmp.mkdir(exist_ok=True)
    digests = {**digests, **{name: _write_file(tmp / name, write) for name, write in files.items()}}
    names = _files_of(tmp)
    sizes = {name: (tmp / name).stat().st_size for name in names}
    _write_file(tmp / MARKER, _json_file({"step": step, "files": sizes, DIGESTS: {n: digests[n] for n in names}}))
    _fsync_dir(tmp)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temp folder to its final name (replacing a same-step checkpoint)."""
    if final.exists():
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _prune(run_dir: Path, step: int, keep_last: int) -> None:
    """Keep the ``keep_last`` newest checkpoints up to ``step``; drop later (abandoned) ones and leftovers."""
    found = _complete_checkpoints(run_dir)
    kept = sorted(s for s in found if s <= step)[-keep_last:]
    for s, path in found.items():
        if s not in kept:
            _discard(path)
    _remove_hidden(checkpoints_dir(run_dir))


def _state_dicts(model, optimizer, *, full: bool = False):
    """Name-keyed model and optimizer state dicts: each rank's shards, or with ``full`` whole plain tensors
    (what one process writes, so that its files load into any model, sharded over a one-rank mesh or not)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full))


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    trainer_state: dict,
    keep_last: int,
    engine: Any = None,
) -> Path:
    """Write checkpoint ``step`` atomically, then keep only the ``keep_last`` newest; returns its folder.

    A write error (a full disk above all) removes the partial folder and raises :class:`CheckpointError`;
    the checkpoints already on disk are untouched, so training can stop and resume from the last one.
    With several ranks every rank must call it (each writes its shards; rank 0 the rest). ``engine``: a
    DeepSpeed engine holding ``model`` and ``optimizer``, which writes them itself.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    from longqa.distributed.env import barrier, is_main, training_group, world_size

    sharded = world_size() > 1
    run_dir = Path(run_dir)
    folder = checkpoints_dir(run_dir)
    final = folder / f"step_{step:08d}"
    tmp = folder / f"{_TMP}{final.name}-{'ranks' if sharded else os.getpid()}"
    if is_main():
        folder.mkdir(parents=True, exist_ok=True)
        _remove_hidden(folder)  # space freed before writing, in case the last save died for lack of it
    barrier()
    files = {}
    if engine is None:
        model_state, optimizer_state = _state_dicts(model, optimizer, full=not sharded)
        if not sharded:
            files = {MODEL: _torch_file(model_state), OPTIMIZER: _torch_file(optimizer_state)}
    if scheduler is not None:
        files[SCHEDULER] = _torch_file(scheduler.state_dict())
    files[RNG] = _json_file(rng_state())
    try:
        files[TRAINER_STATE] = _json_file(trainer_state)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"trainer_state must be JSON-able: {exc}") from exc

    try:
        if engine is not None:
            from longqa.distributed import deepspeed

            deepspeed.save(engine, tmp)
            barrier()
        elif sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(
                {"model": model_state, "optimizer": optimizer_state},
                checkpoint_id=tmp / SHARDED,
                process_group=training_group(),
            )
            barrier()
        digests = _ranks_digests(tmp) if engine is not None or sharded else {}
        if is_main():
            _write_temp(tmp, files, step, digests)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = _os_error(exc)
        if os_error is None:
            raise
        what = "disk full" if os_error.errno in _DISK_FULL else (os_error.strerror or str(os_error)).lower()
        raise CheckpointError(
            f"{what} while writing checkpoint step {step} to {final}; {_describe_previous(run_dir)}"
        ) from exc
    if is_main():
        _publish(tmp, final)
        _prune(run_dir, step, keep_last)
    barrier()
    return final


# --------------------------------------------------------------------------------------------- loading


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged: {what}; resume or export an earlier checkpoint "
        f"(trainer.resume=PATH, longqa export PATH)"
    )


def _read_json(path: Path, name: str) -> Any:
    """A JSON file of checkpoint ``path``; one cut short (a crash or a full disk outside the save) is damaged."""
    try:
        return json.loads((path / name).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _damaged(path, f"{name} is not valid JSON (cut short?)") from None


def _marker(path: Path) -> dict:
    """The marker's record of the checkpoint's files: {"files": {name: size}, DIGESTS: {name: digest}}."""
    marker = _read_json(path, MARKER)
    if not (isinstance(marker, dict) and isinstance(marker.get("files"), dict)):
        raise _damaged(path, f"{MARKER} lists no files")
    return marker


def _check_size(path: Path, name: str, size: int) -> None:
    actual = (path / name).stat().st_size if (path / name).is_file() else None
    if actual != size:
        raise _damaged(path, f"{name} has {actual} bytes, expected {size}")


def _changed(path: Path, name: str) -> CheckpointError:
    return _damaged(path, f"the contents of {name} differ from those written (its {DIGESTS} digest)")


def _check(path: Path, skip: Iterable[str] = (), say: Callable[[str], Any] | None = None) -> None:
    """Refuse a folder that is not a finished checkpoint, or whose files (but those in ``skip``, which the caller
    does not read) changed since they were written: size, then content, the files hashed by all the training
    ranks together (every rank calls this). A checkpoint of a version that recorded no digests is checked by
    size alone, which ``say`` is told."""
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    marker, skip = _marker(path), set(skip)
    names = sorted(name for name in marker["files"] if name not in skip)
    for name in names:
        _check_size(path, name, marker["files"][name])
    digests = marker.get(DIGESTS)
    if digests is None:
        if say is not None:
            say(
                f"note: checkpoint {path} records no digests of its files (an earlier longqa wrote it): they are "
                f"checked by size only"
            )
        return
    found = _spread(names, lambda name: _file_digest(path / name) == digests.get(name))
    if changed := [name for name in names if not found[name]]:
        raise _changed(path, changed[0])


def _check_file(path: Path, name: str) -> None:
    """One file of a complete checkpoint checked alone (size and digest): one small file read before the rest."""
    if not is_complete(path):
        return
    marker = _marker(path)
    if name in marker["files"]:
        _check_size(path, name, marker["files"][name])
    digest = (marker.get(DIGESTS) or {}).get(name)
    if digest is not None and _file_digest(path / name) != digest:
        raise _changed(path, name)


def _check_finite(path: Path, model: torch.nn.Module) -> None:
    """Refuse weights holding NaN or infinity, naming the first such parameter: a model that cannot compute
    anything, whatever wrote it (a run that diverged, a file damaged before its digest was taken). Each rank
    looks at its shard (a ZeRO-3 partition, an FSDP2 local shard), and every rank raises alike."""
    from longqa.distributed.env import gather_objects

    mine = {}
    for name, param in model.named_parameters():
        local = getattr(param, "ds_tensor", None)
        local = local if local is not None else param.to_local() if hasattr(param, "to_local") else param
        if local.is_floating_point() and (count := int((~torch.isfinite(local.detach())).sum())):
            mine[name] = count
    bad: dict[str, int] = {}
    for part in gather_objects(mine):
        for name, count in part.items():
            bad[name] = bad.get(name, 0) + count
    if bad:
        name = next(n for n, _ in model.named_parameters() if n in bad)
        others = f" ({len(bad) - 1} more parameters have some)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} holds weights that are not finite: {name} has {bad[name]} NaN or "
            f"infinite values{others}; resume or export an earlier checkpoint (trainer.resume=PATH, "
            f"longqa export PATH)"
        )


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model weights' shapes recorded in a sharded checkpoint's metadata, by parameter name."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path / SHARDED)).read_metadata().state_dict_metadata
    return {
        key.removeprefix("model."): tuple(getattr(item, "size", ()))
        for key, item in metadata.items()
        if key.startswith("model.")
    }


def _check_shapes(path: Path, model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse, in one line, weights of another shape than the model's (a checkpoint of another model): loading
    them would fail deep in torch with a long list of every mismatching tensor."""
    mine = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    common = [name for name in mine if name in shapes]
    mismatched = [name for name in common if shapes[name] != mine[name]]
    if mismatched:
        name = mismatched[0]
        what = f"{name} is {list(shapes[name])} in the checkpoint but {list(mine[name])} in the model" + (
            f" ({len(mismatched) - 1} more differ)" if len(mismatched) > 1 else ""
        )
    elif mine and shapes and not common:
        what = f"none of the model's parameter names is in it (the model has {next(iter(mine))})"
    else:
        return
    raise CheckpointError(
        f"checkpoint {path} holds weights that do not fit model.path: {what}; resume with the "
        f"model it was trained from, or start a new run in another trainer.output_dir"
    )


def _load_states(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Model (and optimizer) state from either layout, into a model sharded over any number of ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if (path / SHARDED).is_dir():
        import torch.distributed.checkpoint as dcp

        from longqa.distributed.env import training_group

        _check_shapes(path, model, _saved_shapes(path))

        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_state, optimizer_state = _state_dicts(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path / SHARDED, process_group=training_group())
        model_state, optimizer_state = state["model"], state.get("optimizer")
        full = False
    else:
        model_state = _load(path / MODEL)
        optimizer_state = _load(path / OPTIMIZER) if optimizer is not None else None
        full = True  # whole tensors: each rank keeps its shard of them
        _check_shapes(
            path,
            model,
            {name: tuple(value.shape) for name, value in model_state.items() if isinstance(value, torch.Tensor)},
        )
    options = StateDictOptions(full_state_dict=full)
    if optimizer is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )


def load_model_weights(
    path: str | os.PathLike, model: torch.nn.Module, say: Callable[[str], Any] | None = None
) -> None:
    """Load only the model weights of checkpoint ``path`` into ``model`` (same architecture, not sharded
    by DeepSpeed: a DeepSpeed checkpoint's partitions are put together here, in this process). The files it
    does not read (the optimizer's, scheduler's and random states) are not checked; ``say``: see ``_check``."""
    path = Path(path)
    _check(path, skip=(OPTIMIZER, SCHEDULER, RNG), say=say)
    if (path / DEEPSPEED).is_dir():
        from longqa.distributed import deepspeed

        model.load_state_dict(deepspeed.fp32_state_dict(path))
    else:
        _load_states(path, model, None)
    _check_finite(path, model)


def _check_strategy(path: Path, engine: Any) -> None:
    """A DeepSpeed checkpoint resumes under DeepSpeed only, and the other layouts without it."""
    written = (path / DEEPSPEED).is_dir()
    if written != (engine is not None):
        by, now = ("deepspeed", "fsdp2") if written else ("fsdp2", "deepspeed")
        raise CheckpointError(
            f"checkpoint {path} was written under actor.strategy={by} and cannot resume under "
            f"actor.strategy={now}: resume with actor.strategy={by}, or export its weights "
            f"(longqa export) and start a new run from them"
        )


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    engine: Any = None,
    say: Callable[[str], Any] | None = None,
) -> dict:
    """Restore model, optimizer, scheduler and random states in place; returns the trainer_state dict.
    ``engine``: the DeepSpeed engine holding ``model`` and ``optimizer``, which reads them itself. With several
    ranks every rank calls it. ``say``: see ``_check``."""
    path = Path(path)
    _check(path, say=say)
    _check_strategy(path, engine)
    if scheduler is not None and not (path / SCHEDULER).is_file():
        raise CheckpointError(f"checkpoint {path} holds no scheduler state, but a scheduler was given")
    if engine is not None:
        from longqa.distributed import deepspeed
        from longqa.distributed.env import world_size

        if (ranks := deepspeed.saved_ranks(path)) != world_size():
            raise CheckpointError(
                f"checkpoint {path} holds DeepSpeed partitions of {ranks} ranks: resume it on "
                f"{ranks} ranks (not {world_size()}), or export its weights (longqa export) and "
                f"start a new run from them"
            )
        deepspeed.load(engine, path)
    else:
        _load_states(path, model, optimizer)
    _check_finite(path, model)
    if scheduler is not None:
        scheduler.load_state_dict(_load(path / SCHEDULER))
    set_rng_state(_read_json(path, RNG))
    return read_trainer_state(path)


def read_trainer_state(path: str | os.PathLike) -> dict:
    """The trainer_state dict of checkpoint ``path`` alone (the config it was written with, its step), read
    before anything is loaded into a model: checked against the marker first, so a damaged one is refused as
    such rather than read as other settings."""
    path = Path(path)
    _check_file(path, TRAINER_STATE)
    return _read_json(path, TRAINER_STATE)


def export_hf(
    checkpoint_path_or_model: str | os.PathLike | torch.nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    say: Callable[[str], Any] | None = None,
) -> Path:
    """Write a Hugging Face folder (safetensors weights, config, tokenizer) for ``from_pretrained``.

    Given a checkpoint path, its weights are loaded into ``model`` (a skeleton of the same architecture,
    such as the loaded base model; it is modified in place), checked first (``load_model_weights``, which
    ``say`` is for). Given a model, that model is written as it is.
    safetensors is the only format transformers 5 writes and the default since 4.35, so no flag is passed.
    """
    if isinstance(checkpoint_path_or_model, torch.nn.Module):
        model = checkpoint_path_or_model
    elif model is None:
        raise ValueError("export_hf from a checkpoint path needs model=<a model of the same architecture>")
    else:
        load_model_weights(checkpoint_path_or_model, model, say=say)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    follow_umask(out_dir.glob("*.safetensors"))
    return out_dir


def write_run_reward(out_dir: str | os.PathLike, checkpoint: str | os.PathLike, reward: dict[str, Any]) -> Path:
    """Write beside an exported model the reward section of the config its run trained with (``RUN_REWARD``): the
    model's weights do not say which reward their validation scored with, and ``longqa eval`` compares it with the
    mode it scores in."""
    path = Path(out_dir) / RUN_REWARD
    path.write_text(json.dumps({"checkpoint": str(checkpoint), "reward": reward}, indent=1) + "\n")
    return path


def follow_umask(paths: Iterable[str | os.PathLike]) -> None:
    """Give ``paths`` the mode the process umask gives any new file. ``save_pretrained`` writes safetensors
    weights with mode 0600 while its other files follow the umask: on a shared cluster the others in a group
    could read a model's config but not its weights."""
    umask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def check_export_folder(out_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """Refuse, before any weight is read, an output folder inside the checkpoint or its run's checkpoints folder,
    where saving and ``keep_last`` delete step folders. (What an existing folder may hold is the rule of every
    command's outputs, ``longqa.outputs.paths.check_output_folder``.)"""
    out, checkpoint = Path(out_dir).resolve(), Path(checkpoint).resolve()
    folder = checkpoint.parent if checkpoint.parent.name == checkpoints_dir("").name else checkpoint
    if out == folder or folder in out.parents:
        raise CheckpointError(
            f"the output folder {out_dir} is inside {folder}, whose checkpoints training deletes "
            f"as it goes: write the export elsewhere, such as next to the checkpoints folder"
        )
