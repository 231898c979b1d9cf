"""Who am I in a distributed run: rank, world size and device, from torchrun's (or Ray Train's) environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> "DistEnv":
        """torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; a plain process is rank 0 of 1."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    def device(self, requested: str = "auto") -> torch.device:
        """This rank's device: on CUDA its local rank's GPU, whichever index ``requested`` names (a device this
        machine lacks is refused, as in a single process)."""
        from longqa.model.load import pick_device

        device = pick_device(requested)
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    def init(self, device: torch.device, alone: bool = False) -> bool:
        """Join the process group (NCCL on GPUs, gloo on CPUs) once; nothing to do for a single process unless
        ``alone`` asks for a group of one (DeepSpeed needs a group even then). True when this call created
        the group (Ray Train makes its own): the caller then ``leave_group``s."""
        if (self.distributed or alone) and not dist.is_initialized():
            if device.type == "cuda":  # a bare "cuda" names no GPU: this process's own, by its local rank
                torch.cuda.set_device(self.local_rank if device.index is None else device.index)
            backend = "nccl" if device.type == "cuda" else "gloo"
            if self.distributed:
                dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
            else:  # no launcher, no rendezvous: an in-process store
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return True
        return False


def leave_group() -> None:
    """Leave the process group at the end of a finished run, after every rank got there: a process that
    exits with gloo's threads still up, or while a peer still talks to it, was seen to abort now and then
    ("terminate called without an active exception"), failing a run that had finished."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce(values: list[float], op: str = "sum", device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few host numbers over the ranks (identity in a single process)."""
    if world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor.tolist()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_objects(value) -> list:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
