"""Ulysses sequence parallelism: one packed row computed by several ranks, each holding a contiguous shard.

Everything a decoder does per token (embedding, norms, MLP, the LM head) runs on a rank's own shard of the
row. Attention needs the whole row, so around it an all-to-all trades the sequence shards of every head for
whole rows of a share of the heads (``heads/size`` of them): the shared-prompt attention then runs unchanged,
on whole rows, and a second all-to-all trades back (as DeepSpeed-Ulysses does). Each exchange is its own
inverse's backward, so gradients flow back to the ranks whose tokens they belong to.

Key/value heads fewer than the ranks (grouped-query attention) are repeated until each rank has whole ones:
to the least common multiple of the two counts, which keeps each query head with the key/value head it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


class SequenceParallelError(ValueError):
    """A tensor or layout that cannot be split over the sequence-parallel ranks."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a packed row: shard ``rank`` of ``size`` contiguous shards, exchanged over ``group``
    (the ranks that share the row; None: the default group)."""

    rank: int
    size: int
    group: object = None

    def bounds(self, length: int) -> tuple[int, int]:
        """The rows ``[start, end)`` of a ``length``-row sequence this rank holds (``length`` a multiple of size)."""
        if length % self.size:
            raise SequenceParallelError(f"a row of {length} tokens does not split into {self.size} equal shards")
        step = length // self.size
        return self.rank * step, (self.rank + 1) * step


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` is ``[size, ...]``: part ``j`` goes to rank ``j``; returns ``[size, ...]``, part ``j`` from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # (contiguous too: the exchange reads and writes whole parts in order)
    dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``[b, heads, s, d]`` (this rank's sequence shard) -> ``[b, heads/size, size*s, d]`` (whole rows)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, shard.size, h // shard.size, s, d).transpose(0, 1)  # [size, b, h/size, s, d]
    got = _exchange(parts, shard.group)  # part j: rank j's sequence shard of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // shard.size, shard.size * s, d)


def _to_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``[b, heads/size, size*s, d]`` (whole rows) -> ``[b, heads, s, d]`` (this rank's sequence shard)."""
    b, h, t, d = x.shape
    parts = x.reshape(b, h, shard.size, t // shard.size, d).permute(2, 0, 1, 3, 4)  # [size, b, h, s, d]
    got = _exchange(parts, shard.group)  # part j: rank j's heads of this rank's sequence shard
    return got.transpose(0, 1).reshape(b, shard.size * h, t // shard.size, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _to_heads(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad, ctx.shard), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _to_sequence(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.shard), None


def sequence_to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Differentiable: this rank's sequence shard of every head to whole rows of its share of the heads."""
    if x.shape[1] % shard.size:
        raise SequenceParallelError(f"{x.shape[1]} heads do not split over {shard.size} sequence-parallel ranks")
    return _SequenceToHeads.apply(x, shard)


def heads_to_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Differentiable: whole rows of this rank's share of the heads back to its sequence shard of every head."""
    return _HeadsToSequence.apply(x, shard)


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that ``size`` ranks get whole ones, each query head's
    own among them: up to the least common multiple of the two counts."""
    return math.lcm(kv_heads, size) // kv_heads


def split_heads(query, key, value, shard: SequenceShard):
    """Queries, keys and values of this rank's sequence shard (``[b, heads, s, d]``) as whole rows of its share of
    the heads; key/value heads repeated first where they are fewer than the ranks would need."""
    repeat = kv_repeats(key.shape[1], shard.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    return sequence_to_heads(query, shard), sequence_to_heads(key, shard), sequence_to_heads(value, shard)
