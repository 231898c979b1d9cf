"""Will a run's checkpoints fit on its disk? Asked at the start, not at the first save.

A checkpoint holds the weights the optimizer steps and AdamW's two moments: float32 master weights under
ZeRO-3 and FSDP2 (and for a float32 model), ``model.dtype`` with ``actor.master_weights=model``; 12 bytes
a parameter (6 in bf16), about 98 GB for an 8B model, whatever the number of ranks. A save writes the new
checkpoint in full before it deletes the oldest beyond ``trainer.keep_last``, so at its peak the disk holds
``keep_last + 1`` of them. A run whose first save cannot fit is refused before any weight loads (it would
otherwise die of a full disk after ``trainer.save_freq`` steps of work); one whose later saves cannot is
warned, with the save that would fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from longqa.config import ConfigError
from longqa.outputs.layout import checkpoints_dir
from longqa.planning.planner import master_bytes
from longqa.train.checkpoint import is_complete

GB = 1e9


class DiskSpaceError(ConfigError):
    """The disk of ``trainer.output_dir`` has no room for the run's first checkpoint: another folder, more free
    space or no checkpoints is what to change. A ``ConfigError``, reported in one line."""


def checkpoint_bytes(cfg, params: int, world_size: int) -> int:
    """Bytes of one checkpoint on disk, all ranks' files together: the stepped weights and two moments (the
    scheduler, random states and trainer state are kilobytes; ZeRO-3's model-states file holds no weights)."""
    per_value = 4 if cfg.actor.strategy == "deepspeed" else master_bytes(cfg, world_size)
    return 3 * per_value * params


def save_steps(save_freq: int, start_step: int, total_steps: int) -> list[int]:
    """The steps after which a run from ``start_step`` to ``total_steps`` saves (the trainer's cadence: every
    ``save_freq`` steps and the last)."""
    if not save_freq:
        return []
    return [done for done in range(start_step + 1, total_steps + 1) if done % save_freq == 0 or done == total_steps]


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (or would, once made)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def count_parameters(model_config) -> int:
    """Parameters of a transformers model config, counted on the meta device (no memory, any architecture)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())


def check_checkpoint_space(
    cfg, run_dir: Path, params: int, world_size: int, start_step: int, total_steps: int
) -> str | None:
    """Refuse a run whose first checkpoint cannot fit in the free space of ``run_dir``'s disk; return a warning
    naming the first save that would find the disk full, if a later one would; None when all fit."""
    saves = save_steps(cfg.trainer.save_freq, start_step, total_steps)
    if not saves:
        return None
    size = checkpoint_bytes(cfg, params, world_size)
    free = free_bytes(run_dir)
    folder = checkpoints_dir(run_dir)
    existing = sum(is_complete(p) for p in folder.glob("step_*")) if folder.is_dir() else 0
    keep = cfg.trainer.keep_last
    what = (
        f"a checkpoint of this run takes about {size / GB:,.1f} GB ({params / 1e9:.2f}B parameters: the weights "
        f"the optimizer steps and AdamW's two moments, {size // params // 3} bytes each), and {run_dir}'s disk "
        f"has {free / GB:,.1f} GB free"
    )
    for number, step in enumerate(saves, 1):
        # A save writes its checkpoint whole, then deletes the oldest beyond keep_last (those found at the start
        # too): what this run has added by then stays on disk with it.
        before = existing if number == 1 else min(existing + number - 1, keep)
        added = before + 1 - existing
        if added * size <= free:
            continue
        if number == 1:
            raise DiskSpaceError(
                f"{what}: the first save, after step {step}, would find the disk full. Point "
                f"trainer.output_dir at a disk with room, free space, or set trainer.save_freq=0 "
                f"(no checkpoints)"
            )
        room = free // size
        fitting = room - 1 + existing  # the keep_last whose peak (fitting + 1 on disk, existing found) fits
        lower = f"trainer.keep_last={fitting} keeps it within the free space, " if fitting >= 1 else ""
        return (
            f"warning: {what}, room for {room} more: with trainer.keep_last={keep} a save writes its checkpoint "
            f"before deleting the oldest, so save {number} of this run (after step {step}) would find the disk "
            f"full; {lower}or free space or point trainer.output_dir at a disk with room"
        )
    return None
