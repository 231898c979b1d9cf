"""Who am I in a distributed run: rank, world size and device, from torchrun's (or Ray Train's) environment.

A job may set its last ranks apart to sample only (``rollout.sampler_ranks``): the others, the training ranks,
then form a process group of their own, and every collective here (and FSDP2's mesh, and the sharded
checkpoints) runs over that group, so the training code reads the same with or without sampler ranks.
"""

from __future__ import annotations

import os
import time
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
        return cls(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )

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
        if self.world_size > 1 or alone:
            return self._join(device)
        return False

    def init_split(self, device: torch.device, samplers: int) -> "Split":
        """Join the job's process group and set its last ``samplers`` ranks apart: the training ranks' own group
        becomes the one every collective of this module runs over. Every rank of the job calls it (the groups
        are made collectively, in the same order everywhere)."""
        if not 0 < samplers < self.world_size:
            raise ValueError(f"{samplers} sampler ranks in a job of {self.world_size}: at least one must train")
        self._join(device)
        trainers = self.world_size - samplers
        global _TRAINING_GROUP
        _TRAINING_GROUP = dist.new_group(list(range(trainers)))
        weights = dist.new_group([0, *range(trainers, self.world_size)])
        return Split(self, trainers, weights)

    def _join(self, device: torch.device) -> bool:
        if not dist.is_initialized():
            if device.type == "cuda":  # a bare "cuda" names no GPU: this process's own, by its local rank
                torch.cuda.set_device(self.local_rank if device.index is None else device.index)
            backend = "nccl" if device.type == "cuda" else "gloo"
            if self.distributed:
                dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
            else:  # no launcher, no rendezvous: an in-process store
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return True
        return False


@dataclass(frozen=True)
class Split:
    """A job whose ranks ``trainers`` and up only sample: who trains, which sampler serves which training rank,
    and the group (training rank 0 and the samplers) that new weights are broadcast over."""

    job: DistEnv
    trainers: int
    weights_group: object

    @property
    def samplers(self) -> int:
        return self.job.world_size - self.trainers

    @property
    def is_sampler(self) -> bool:
        return self.job.rank >= self.trainers

    def training_env(self) -> DistEnv:
        """The training ranks as a job of their own (data-parallel rank and size)."""
        return DistEnv(self.job.rank, self.trainers, self.job.local_rank)

    def sampler_of(self, trainer: int) -> int:
        """The job rank that samples for training rank ``trainer``: the samplers take the trainers in turn."""
        return self.trainers + trainer % self.samplers

    def served_by(self, sampler: int) -> list[int]:
        """The training ranks that job rank ``sampler`` samples for, in rank order."""
        return [t for t in range(self.trainers) if self.sampler_of(t) == sampler]


# The group every collective below runs over: None is the whole job; under ``init_split``, the training ranks.
_TRAINING_GROUP = None
_LEFT = 0  # groups this process has left (``leave_group``)


def training_group():
    """The process group of the training ranks (None: the default group, every rank of the job)."""
    return _TRAINING_GROUP


def leave_group() -> None:
    """Leave the process group at the end of a finished run, every rank together: a process that exits with
    gloo's threads still up, or while a peer is still tearing its groups down, was seen to abort now and then
    ("terminate called without an active exception"), failing a run that had finished. So the ranks destroy
    their groups after a barrier, then each marks that on the job's store and none returns before all have (or
    a minute has passed)."""
    global _TRAINING_GROUP, _LEFT
    if dist.is_initialized():
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
        dist.barrier()
        dist.destroy_process_group()
        if world > 1:
            key = f"longqa/left/{_LEFT}"  # (a process that joins and leaves again counts anew)
            store.add(key, 1)
            deadline = time.monotonic() + 60
            while store.add(key, 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
        _LEFT += 1
    _TRAINING_GROUP = None


def all_reduce(values: list[float], op: str = "sum", device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few host numbers over the ranks (identity in a single process)."""
    if world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=_TRAINING_GROUP)
    return tensor.tolist()


def world_size() -> int:
    """The training ranks' count (1 in a single process)."""
    return dist.get_world_size(_TRAINING_GROUP) if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank among the training ranks (0 in a single process)."""
    return dist.get_rank(_TRAINING_GROUP) if dist.is_available() and dist.is_initialized() else 0


def gather_objects(value) -> list:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if world_size() == 1:
        return [value]
    out = [None] * world_size()
    dist.all_gather_object(out, value, group=_TRAINING_GROUP)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier(group=_TRAINING_GROUP)


def is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
