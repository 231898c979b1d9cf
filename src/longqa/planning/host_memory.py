"""Will this run fit the node's host memory? The GPU plan's counterpart, per node, before any weight is read.

Host memory runs out differently from a GPU's: the kernel kills a rank (or the whole node swaps), often
while the model loads, long before the first step. What each rank holds, and when:

- while loading: the whole model in ``model.dtype``. ``load_model`` reads the checkpoint on every rank
  (transformers materialises it on the host) and only then moves it to the GPU and shards it, so a node
  of k ranks holds k full copies at once; for a large model this is the node's peak. The checkpoint files'
  page cache is shared and reclaimable, and not counted;
- while training, with ``actor.cpu_offload``: the offloaded training state. Under FSDP2
  (``CPUOffloadPolicy``) every parameter's shard (float32 master weights unless
  ``actor.master_weights=model``) and its gradient are pinned, each its own allocation, and
  torch's caching host allocator rounds every pinned allocation up to a power of two
  (``CachingHostAllocator.h``; recent releases can cap that with
  ``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:N``, which this plan does not read); AdamW's two
  moments are made like the parameters but not pinned. Under ZeRO-3 with DeepSpeed's CPU Adam, 16 bytes
  per parameter (fp32 weights, gradients, moments; 18 with ``offload_param``), in large flat pinned
  buffers whose rounding is not counted;
- while training, with ``model.activation_offload``: the offloaded layers' activations of one micro-batch
  (the GPU plan's per-token-per-layer estimate, tensor by tensor, each rounded up as pinned memory is).
  The allocator keeps freed blocks for reuse, so a pack under half the token budget adds blocks of the
  next smaller size, at most as much again;
- the rollout engine's weights and KV cache live on the GPU: nothing on the host;
- a margin per rank (Python, torch and the CUDA libraries, Inductor's compile workers, NCCL's host
  buffers), and once per node the prompt cache, a memory-mapped int32 file the ranks share.

The node's peak is its ranks times the larger of the two phases, plus the margins and the prompt cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longqa.planning.activations import saved_activation_widths
from longqa.planning.planner import (
    DEEPSPEED_SUB_GROUP_SIZE,
    DTYPE_BYTES,
    GIB,
    ModelSizes,
    PlanError,
    host_share,
    master_bytes,
    offload_ratio,
    offloads,
    training_state,
    zero3_sub_groups,
)

HOST_MARGIN_BYTES = 4 * GIB  # per rank: interpreter, libraries, compile workers, NCCL host buffers
RECIPE_PROMPT_TOKENS = 226_684_298  # the recipe's 13,645 prompts (benchmarks/RESULTS.md, prompt preparation)
# The default: what the measurement machines have, as the kernel counts it (MemTotal: 125 GiB of the 128 GiB
# installed with one H200), which is what a run can use.
HOST_GIB_PER_GPU = 125


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator reserves for a pinned tensor of ``nbytes``: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def fsdp2_offloaded_state(sizes: ModelSizes, world_size: int, param_bytes: int) -> int:
    """Host bytes per rank of FSDP2's offloaded state: each parameter's padded shard (dim 0 split over the
    ranks) and its gradient pinned, and AdamW's two moments unpinned."""
    total = 0
    for shape in sizes.shapes:
        rows = math.ceil(shape[0] / world_size) if shape else 1
        shard = param_bytes * rows * math.prod(shape[1:])
        total += 2 * pinned_bytes(shard) + 2 * shard
    return total


def offloaded_activations(sizes: ModelSizes, micro_batch_tokens: int, activation_offload: float) -> int:
    """Pinned host bytes of the offloaded layers' bf16 activations of one micro-batch."""
    layers = round(activation_offload * sizes.layers)
    return layers * sum(pinned_bytes(2 * micro_batch_tokens * width) for width in saved_activation_widths(sizes))


@dataclass
class HostPlan:
    """Host bytes of one node: per rank by phase, and once per node."""

    ranks: int  # ranks on the node
    host_bytes: int
    loading: int  # per rank: the whole model while it is read
    offloaded_state: int  # per rank, while training
    offloaded_activations: int  # per rank, while training
    prompt_cache: int  # per node
    margin: int = HOST_MARGIN_BYTES  # per rank
    sub_groups: int = 0  # per rank: the sub-groups of ZeRO-3's offloaded optimizer (0: no ZeRO-3 optimizer offload)
    optimizer_bytes: int = 0  # per rank: that optimizer's bytes, on the host or not

    @property
    def training(self) -> int:
        return self.offloaded_state + self.offloaded_activations

    @property
    def peak(self) -> int:
        return self.ranks * (max(self.loading, self.training) + self.margin) + self.prompt_cache

    def table(self) -> str:
        rows = [
            ("per rank, loading: the whole model", self.loading),
            ("per rank, training: offloaded state", self.offloaded_state),
            ("per rank, training: offloaded activations", self.offloaded_activations),
            ("per rank: margin (Python, libraries)", self.margin),
            ("rollout engine (weights, KV on the GPU)", 0),
            ("prompt cache (shared, memory-mapped)", self.prompt_cache),
            (f"node peak ({self.ranks} rank{'s' if self.ranks > 1 else ''})", self.peak),
            ("host memory of a node", self.host_bytes),
        ]
        return "\n".join(f"  {name:<42} {value / GIB:8.1f} GiB" for name, value in rows)


def plan_host_memory(
    sizes: ModelSizes,
    *,
    world_size: int,
    ranks_per_node: int,
    host_bytes: int,
    param_bytes: int,
    micro_batch_tokens: int,
    cpu_offload: bool = False,
    strategy: str = "fsdp2",
    offload_params: bool = False,
    activation_offload: float = 0.0,
    prompt_tokens: int = RECIPE_PROMPT_TOKENS,
    state_bytes: int | None = None,
    offload_fraction: float = 1.0,
    sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE,
) -> HostPlan:
    """Host bytes of a node running ``ranks_per_node`` of the ``world_size`` ranks (the module docstring
    says what is counted); ``param_bytes``: one parameter as loaded, ``state_bytes``: as the optimizer steps
    it (default ``param_bytes``); ``offload_fraction``: the share of ZeRO-3's offloaded optimizer on the host,
    whose rank's partition DeepSpeed cuts into sub-groups of ``sub_group_size`` parameters."""
    state_bytes = param_bytes if state_bytes is None else state_bytes
    if cpu_offload and strategy != "deepspeed":
        state = fsdp2_offloaded_state(sizes, world_size, state_bytes)
    else:
        state = training_state(
            sizes.params, world_size, strategy, cpu_offload, offload_params, state_bytes, offload_fraction
        )[1]
    return HostPlan(
        ranks=ranks_per_node,
        host_bytes=host_bytes,
        loading=param_bytes * sizes.params,
        offloaded_state=state,
        offloaded_activations=offloaded_activations(sizes, micro_batch_tokens, activation_offload),
        prompt_cache=4 * prompt_tokens,
        **zero3_optimizer(sizes.params, world_size, sub_group_size)
        if cpu_offload and strategy == "deepspeed" and not offload_params
        else {},
    )


def zero3_optimizer(params: int, world_size: int, sub_group_size: int) -> dict:
    """A rank's sub-groups of ZeRO-3's optimizer and their bytes (float32 weights, gradients and moments)."""
    return {
        "sub_groups": zero3_sub_groups(params, world_size, sub_group_size),
        "optimizer_bytes": 16 * params // world_size,
    }


def check_host_plan(plan: HostPlan, world_size: int, param_bytes: int) -> None:
    """Refuse a plan over the node's host memory, naming what would make it fit."""
    if plan.peak <= plan.host_bytes:
        return
    advice = []
    if plan.loading >= plan.training:
        advice.append(
            f"fewer ranks per node (--gpus-per-node; each reads the whole model, "
            f"{plan.loading / GIB:.1f} GiB, before it is sharded)"
        )
        if param_bytes > 2:
            advice.append("load it in bf16 (model.dtype=bfloat16)")
    else:
        if plan.offloaded_state:
            advice.append(
                f"use more GPUs (the offloaded state, {plan.offloaded_state / GIB:.1f} GiB per rank, is "
                f"divided by their number, now {world_size})"
            )
            advice.append("keep the training state on the GPUs (actor.cpu_offload=false) if the GPU plan allows it")
            if (ratio := fitting_offload_ratio(plan)) is not None:
                advice.append(
                    f"offload only part of the optimizer (actor.cpu_offload_ratio={ratio:g} or lower) if "
                    f"the GPU plan has room for the rest"
                )
            elif not plan.sub_groups:
                advice.append(
                    "offload only part of the optimizer (actor.strategy=deepspeed with "
                    "actor.cpu_offload_ratio below 1) if the GPU plan has room for the rest"
                )
        if plan.offloaded_activations:
            advice.append(
                f"lower model.activation_offload (recompute those layers instead: "
                f"model.checkpoint_fraction; {plan.offloaded_activations / GIB:.1f} GiB per rank)"
            )
    advice.append("use nodes with more host memory (--host-memory-gib)")
    raise PlanError(
        f"this plan needs about {plan.peak / GIB:.1f} GiB of host memory per node but a node has "
        f"{plan.host_bytes / GIB:.1f} GiB ({(plan.peak - plan.host_bytes) / GIB:.1f} GiB over); to fit: "
        + "; or ".join(advice)
    )


def fitting_offload_ratio(plan: HostPlan) -> float | None:
    """The largest ``actor.cpu_offload_ratio`` (to 2 decimals) whose share of ZeRO-3's offloaded optimizer fits
    the node, counted in DeepSpeed's whole sub-groups (it keeps the first ``int((1 - ratio) * sub-groups)`` on
    the GPU); None if the plan offloads no ZeRO-3 optimizer, or if no share would fit."""
    if not plan.sub_groups or not plan.offloaded_state:
        return None
    room = (plan.host_bytes - plan.prompt_cache) / plan.ranks - plan.margin  # per rank
    on_host = math.floor((room - plan.offloaded_activations) / (plan.optimizer_bytes / plan.sub_groups))
    if plan.loading > room or on_host < 1:
        return None
    return math.floor(100 * min(on_host, plan.sub_groups) / plan.sub_groups) / 100


def plan_host_config(cfg, sizes: ModelSizes, world_size: int, ranks_per_node: int, host_bytes: int) -> HostPlan:
    """The host plan of a longqa config (a rank offloads the activations of its share of a row, 1/sp of it under
    sequence parallelism: attention's tensors over the whole row at heads/sp of the heads are as large)."""
    cpu_offload, offload_params = offloads(cfg)
    ratio, sub_group_size = offload_ratio(cfg)
    return plan_host_memory(
        sizes,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        host_bytes=host_bytes,
        param_bytes=DTYPE_BYTES[cfg.model.dtype],
        state_bytes=master_bytes(cfg, world_size),
        micro_batch_tokens=-(-cfg.actor.max_tokens_per_micro_batch // cfg.actor.sequence_parallel_size),
        cpu_offload=cpu_offload,
        strategy=cfg.actor.strategy,
        offload_params=offload_params,
        activation_offload=cfg.model.activation_offload,
        sub_group_size=sub_group_size,
        offload_fraction=host_share(ratio, zero3_sub_groups(sizes.params, world_size, sub_group_size)),
    )
