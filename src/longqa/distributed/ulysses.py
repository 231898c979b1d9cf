"""The job's training ranks as a 2-D layout: data-parallel x sequence-parallel (``actor.sequence_parallel_size``).

Ranks ``k*size .. k*size + size - 1`` form sequence-parallel group ``k``: they update the same groups, each
computing its shard of every packed row (``model/sequence_parallel.py``), and are data-parallel rank ``k`` of
``world / size``. Sharding (FSDP2, ZeRO-3) still spans every training rank: each rank's loss covers its own
tokens, so the gradients summed over all ranks are the whole batch's, as with data parallelism alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longqa.config import ConfigError
from longqa.distributed.env import rank, training_group, world_size
from longqa.model.sequence_parallel import SequenceShard

_GROUPS: dict[tuple, SequenceShard] = {}  # (job's group, world, size) -> this rank's shard, its group made once


class SequenceLayoutError(ConfigError):
    """The training ranks do not split into sequence-parallel groups of the size ``actor.sequence_parallel_size``
    asks (the settings rules refuse it first, where the ranks are known before the job starts)."""


def sequence_shard(size: int) -> SequenceShard | None:
    """This rank's place in its sequence-parallel group of ``size`` ranks (None for size 1). The group is made the
    first time, by its members alone (the other groups' and any sampler ranks need not take part)."""
    if size == 1:
        return None
    world = world_size()
    if world % size:
        raise SequenceLayoutError(
            f"actor.sequence_parallel_size={size} must divide the {world} training ranks, which form groups of "
            f"that many"
        )
    key = (dist.group.WORLD, world, size)  # (a process that joins a new job makes its groups anew)
    if key not in _GROUPS:
        first = rank() // size * size
        members = list(range(first, first + size))
        group = training_group()
        if group is not None:  # the training ranks' own group: its ranks by their number in the job
            members = [dist.get_global_rank(group, r) for r in members]
        made = dist.new_group(members, use_local_synchronization=True)
        _GROUPS[key] = SequenceShard(rank() % size, size, made)
    return _GROUPS[key]


def data_parallel_size(size: int) -> int:
    """How many sequence-parallel groups the training ranks form: the data-parallel degree."""
    return world_size() // size


def data_parallel_rank(size: int) -> int:
    """This rank's sequence-parallel group: its data-parallel rank."""
    return rank() // size


def sum_over_shards(tensor: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """In place, the sum of ``tensor`` over the ranks of ``shard``'s group (unchanged without one): each rank's
    values on its own tokens, zeros elsewhere, become the whole row's."""
    if shard is not None:
        dist.all_reduce(tensor, group=shard.group)
    return tensor


def gather_in_group(value, shard: SequenceShard | None) -> list:
    """Every rank's ``value`` (picklable) in ``shard``'s group, in rank order; ``[value]`` without one."""
    if shard is None:
        return [value]
    out = [None] * shard.size
    dist.all_gather_object(out, value, group=shard.group)
    return out
