"""Sharding the model with PyTorch's FSDP2: ``fully_shard`` per decoder layer, then the root.

Each rank keeps 1/world of every parameter (and of its gradient and optimizer state); a layer's
full weights exist only while it runs (all-gathered in its forward, and again for the backward).
On GPUs the forward runs in bf16 with gradients reduced in fp32 into float32 shards, the optimizer's
master weights (``actor.master_weights``); ``cpu_offload`` keeps the shards,
their gradients and the AdamW step on the CPU (the recipe's ZeRO-3 + CPU optimizer offload), pinning
host memory only when CUDA is there to use it.
"""

from __future__ import annotations

import torch


def shard_model(
    root,
    layers,
    device: torch.device,
    cpu_offload: bool = False,
    mixed_precision: bool | None = None,
    master_weights: str = "float32",
):
    """Shard each of ``layers`` and then ``root`` (which holds them and the remaining parameters: the
    embedding, final norm and LM head) in place over the default process group; returns ``root``.

    Under mixed precision (on GPUs) the shards are the optimizer's master weights: float32 unless
    ``master_weights="model"`` keeps the loaded dtype. A model loaded in bfloat16 (half the memory to load,
    and the engine's copy made from it stays bfloat16) is cast a module at a time, just before that module is
    sharded, so no whole float32 copy of it ever exists on one device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from longqa.distributed.env import training_group

    # The mesh says where the shards live: on the training device, not on whatever accelerator the host
    # has (FSDP's default mesh would move a CPU run's shards to cuda:0 on a machine with a GPU).
    # Over the training ranks alone when the job has ranks that only sample (``env.init_split``).
    group = training_group()
    options = {
        "mesh": init_device_mesh(device.type, (dist.get_world_size(),))
        if group is None
        else DeviceMesh.from_group(group, device.type)
    }
    if mixed_precision is None:
        mixed_precision = device.type == "cuda"
    if mixed_precision:
        # No input casting: the inputs are token ids and longqa's own batch objects (FSDP's cast rebuilds
        # dataclasses field by field, which a dataclass with derived fields refuses), and the hidden
        # states between layers come out of bf16 weights already.
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    masters = torch.float32 if mixed_precision and master_weights == "float32" else None
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    cast([p for p in root.parameters() if id(p) not in in_layers], masters)
    for layer in layers:
        cast(layer.parameters(), masters)
        fully_shard(layer, **options)
    fully_shard(root, **options)
    return root


def cast(parameters, dtype: torch.dtype | None) -> None:
    """Parameters to ``dtype`` in place (the same Parameter objects: tied weights stay tied); None: as they are."""
    if dtype is None:
        return
    for p in parameters:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def full_state_dict(model) -> dict:
    """Every parameter unsharded, on the CPU, on every rank (collective: all ranks must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
