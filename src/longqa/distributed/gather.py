"""Whole parameters out of sharded ones, for the rollout engines' weight refresh.

FSDP2 holds each parameter as a DTensor shard; DeepSpeed ZeRO-3 as an empty placeholder whose
partition lives beside it. A refresh gathers one decoder layer's parameters at a time, as the forward
pass does (FSDP2's flat all-gather of an FSDP2 module, or one ZeRO-3 gather of a ZeRO-3 "leaf" module's
dozen tensors, rather than one collective per tensor), other parameters one tensor at a time, in the
same order on every rank (each gather is a collective), so no second full copy of the model ever exists
at once.
"""

from __future__ import annotations

from collections.abc import Iterator

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


def full_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for every parameter of ``model`` (collective: every rank iterates in the
    same order, to the end). A tensor stays valid until the next item is asked for: its module may be
    resharded then. Parameters tied to one tensor come once, as in ``named_parameters``. Under FSDP2
    mixed precision a module's gathered parameters are in its compute dtype (bf16), the weights its own
    forward pass computes with."""
    from torch.distributed.fsdp import FSDPModule

    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # the parameters no FSDP2 module here swaps when it unshards
    zero3_leaf = lambda module: False  # noqa: E731
    if any(hasattr(p, "ds_id") for p in params.values()):  # ZeRO-3 (DeepSpeed is then installed)
        from deepspeed.utils import z3_leaf_module as zero3_leaf
    sharded = [prefix for prefix, module in modules.items() if isinstance(module, FSDPModule) or zero3_leaf(module)]

    def owner(name: str) -> str | None:  # the innermost FSDP2 module or ZeRO-3 leaf above a parameter
        inside = [prefix for prefix in sharded if prefix == "" or name.startswith(prefix + ".")]
        return max(inside, key=len) if inside else None

    by_owner: dict[str | None, list[str]] = {}
    for name in params:
        by_owner.setdefault(owner(name), []).append(name)
    for prefix in sharded:
        own = by_owner.get(prefix, [])
        if not own:
            continue
        module = modules[prefix]
        if not isinstance(module, FSDPModule):  # a ZeRO-3 leaf: its parameters partitioned again on leaving
            import deepspeed

            with deepspeed.zero.GatheredParameters([params[name] for name in own]):
                for name in own:
                    yield name, params[name].data.detach()
            continue
        module.unshard()  # its own parameters only (not nested FSDP2 modules'), as one all-gather
        try:
            whole = dict(module.named_parameters(prefix=prefix))
            for name in own:
                yield name, whole[name].detach()
        finally:
            module.reshard()
    for name in by_owner.get(None, []):
        yield name, full_tensor(params[name])
