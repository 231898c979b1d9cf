"""Whole parameters out of sharded ones, one at a time, for the rollout engines' weight refresh.

FSDP2 holds each parameter as a DTensor shard; DeepSpeed ZeRO-3 as an empty placeholder whose
partition lives beside it. A refresh gathers one tensor at a time, in the same order on every rank
(each gather is a collective), so no second full copy of the model ever exists at once.
"""

from __future__ import annotations

import torch


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param`` whole and detached (collective when it is sharded: every rank must ask, in the same order)."""
    if hasattr(param, "full_tensor"):  # an FSDP2 DTensor
        return param.full_tensor().detach()
    if hasattr(param, "ds_id"):  # a ZeRO-3 parameter: its gathered storage is freed again when the context ends
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().clone()
    return param.detach()
