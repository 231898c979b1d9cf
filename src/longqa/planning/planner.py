"""Will this run fit? Per-GPU memory of a plan, estimated before any weight is loaded.

A run that dies of out-of-memory after the model loads, the data tokenizes and the first rollout
finishes wastes minutes to hours; the arithmetic to predict it is simple. Per GPU, with the model
sharded over ``world_size`` ranks (FSDP2, ZeRO-3 style):

- training state: the weights, their gradients and AdamW's two moments, divided by the ranks. FSDP2 keeps
  the reduced gradients in the shards' dtype and torch's AdamW makes its moments like the parameters, so
  all four are in the shards' dtype: float32 master weights (``actor.master_weights``, 16 bytes per
  parameter; a 16-bit model in one process is sharded in a group of its own for them), ``model.dtype`` with
  ``actor.master_weights=model`` (8 bytes in bf16) or when the model is float32 anyway. DeepSpeed ZeRO-3
  (``actor.strategy=deepspeed``) keeps fp32 master weights, gradients and moments
  (16 bytes) and a bf16 partition of the weights beside them, 18 bytes in all, of which the 2 stay on the
  GPU when the optimizer is offloaded (and leave it too when the parameters are). Offloaded
  (``actor.cpu_offload``), the rest is in host memory (``host_memory.py``); what differs is who steps it:
  torch's AdamW under FSDP2, DeepSpeed's CPU Adam under ZeRO-3. ZeRO-3 may offload part of it
  (``actor.cpu_offload_ratio``): that share of its sub-groups goes to the host, the others stay on the GPU;
- when sharded, the unsharded layers being computed: two decoder layers (this one and the prefetched
  next) and the embedding/LM head, in bf16;
- activations of one micro-batch of ``max_tokens_per_micro_batch`` packed tokens (``activations.py``, the
  count ``longqa sft``'s check uses too, checked against measured peaks by ``benchmarks/memory_check.py``):
  every kept layer's saved tensors, in the dtype the layers compute in (bf16 when sharded, else
  ``model.dtype``), fewer when the layers are compiled than eager; a recomputed layer's input, and one
  layer's recompute; on the dense attention backend an additive mask per pack in every kept layer, which
  grows with the square of a pack's length; the chunked LM head's backward pass and its weight's gradient.
  With Ulysses sequence parallelism (``actor.sequence_parallel_size`` = sp) the row is split over sp ranks:
  a rank holds 1/sp of it for everything per token and the whole row for heads/sp of the heads in attention;
  the job's ranks are then ranks/sp data-parallel ranks of sp each (FSDP2 still shards over all of them, and
  the rollout is unchanged: each rank samples its own share of the groups);
- the rollout engine: a full copy of the weights in ``model.dtype`` (gathered after each update) when
  the model is sharded (several ranks, ZeRO-3 or an offload) or the engine samples beside the update
  (``rollout.overlap``), none when one process shares its model with the engine; and its KV cache,
  which stays allocated through the update: as many groups (the prompt once, n responses) as
  ``rollout.kv_cache_bytes`` holds, or by default as 40% of the memory free when the first rollout
  starts holds, at most the rank's groups of a step;
- with a KL penalty (``algo.kl_coef``), the frozen reference model's weights (sharded like the policy's
  under FSDP2).

Before any of this, every rank moves the whole model in ``model.dtype`` to its GPU and the engine copies
it there (``load_model``, then the engine, then the actor shards): the load's peak is checked too.

It is an estimate (allocator fragmentation, NCCL buffers and CUDA context are a fixed margin), meant
to refuse plans that cannot work, naming the setting to change, not to promise a tight fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from longqa.config import ConfigError
from longqa.config.checks import check_settings, float32_masters
from longqa.config.support import check_machine
from longqa.planning.activations import Activations, Compute, sft_activations, update_activations
from longqa.rollout.base import ENGINE_KV_SHARE

GIB = 2**30
MARGIN_BYTES = 6 * GIB  # CUDA context, NCCL buffers, allocator fragmentation
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """The plan cannot fit; the message says what to change."""


@dataclass
class ModelSizes:
    params: int
    layer_params: int
    embedding_params: int  # input embedding + LM head (once when tied)
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    shapes: tuple[tuple[int, ...], ...] = ()  # every parameter's shape: FSDP2 shards and pins them one by one
    config: Any = field(default=None, repr=False, compare=False)  # the transformers config, for the FLOP counts
    heads: int = 0  # query heads (0: hidden // head_dim)
    qk_norm: bool = False  # per-head norms of queries and keys (Qwen3): more saved activations in eager layers
    compilable: bool = True  # Llama-family layers the trainer compiles (the fast engine's fused decode runs them)
    tied: bool = False  # the LM head's weight is the input embedding's

    def __post_init__(self) -> None:
        self.heads = self.heads or (self.hidden // self.head_dim if self.head_dim else 0)

    @classmethod
    def from_config(cls, config) -> "ModelSizes":
        """Counted on the meta device: any transformers architecture, no memory, no download."""
        import torch
        from transformers import AutoModelForCausalLM

        from longqa.rollout.decode_step import unsupported_reason

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        first = model.base_model.layers[0]
        layer = sum(p.numel() for p in first.parameters())
        heads = config.num_attention_heads
        attention = getattr(first, "self_attn", None)
        return cls(
            params=params,
            layer_params=layer,
            embedding_params=params - layer * config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            shapes=tuple(tuple(p.shape) for p in model.parameters()),
            config=config,
            heads=heads,
            qk_norm=hasattr(attention, "q_norm") or hasattr(attention, "k_norm"),
            compilable=unsupported_reason(model) is None,
            tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        )


def kv_bytes_per_group(sizes: ModelSizes, prompt_length: int, response_length: int, n: int, dtype_bytes: int) -> int:
    """The fast engine's KV store of one group: the prompt once and n responses (rollout/fast.py)."""
    return 2 * dtype_bytes * sizes.layers * sizes.kv_heads * sizes.head_dim * (prompt_length + n * response_length)


@dataclass
class MemoryPlan:
    """Bytes per GPU by what holds them."""

    world_size: int
    gpu_bytes: int
    training_state: int
    unsharded_layers: int
    activations: int
    rollout_weights: int
    rollout_kv: int
    host_state: int = 0  # per rank, in host memory: the offloaded training state (not part of the total)
    margin: int = MARGIN_BYTES
    kv_groups: int = 1  # groups the engine's KV cache holds at once
    loading: int = 0  # the load's peak, before the model is sharded
    param_bytes: int = 4  # bytes of one parameter in model.dtype (what loads, and the engine's copy)
    activation_parts: Activations | None = None  # what the activations are made of
    reference_weights: int = 0  # the frozen reference model of a KL penalty
    sequence_parallel: int = 1  # ranks each packed row is split over (actor.sequence_parallel_size)
    kv_group: int = 0  # the engine's KV of one group (the prompt once, n responses), on one GPU
    model_bytes: int = 0  # the whole model in model.dtype (what a sampler rank holds beside its KV)

    @property
    def total(self) -> int:
        return (
            self.training_state
            + self.unsharded_layers
            + self.activations
            + self.rollout_weights
            + self.rollout_kv
            + self.reference_weights
            + self.margin
        )

    def table(self) -> str:
        parts = self.activation_parts
        masks = f" (masks {parts.masks / GIB:.1f})" if parts and parts.masks else ""
        split = f", 1/{self.sequence_parallel} of a row" if self.sequence_parallel > 1 else ""
        rows = [
            ("training state (weights, grads, AdamW)", self.training_state),
            ("unsharded layers in flight", self.unsharded_layers),
            (f"activations{masks}{split}", self.activations),
            ("rollout weights (engine's copy)", self.rollout_weights),
            *([("reference model (algo.kl_coef)", self.reference_weights)] if self.reference_weights else []),
            (
                f"rollout KV cache ({self.kv_groups} group{'s' if self.kv_groups > 1 else ''})"
                if self.rollout_kv
                else "rollout KV cache (none here)",
                self.rollout_kv,
            ),
            ("margin (context, NCCL, fragmentation)", self.margin),
            ("total", self.total),
            ("GPU memory", self.gpu_bytes),
            ("while loading (whole model + copy)", self.loading),
        ]
        return "\n".join(f"  {name:<40} {value / GIB:8.1f} GiB" for name, value in rows)


def training_state(
    params: int,
    world_size: int,
    strategy: str = "fsdp2",
    cpu_offload: bool = False,
    offload_params: bool = False,
    param_bytes: int = 4,
    offload_fraction: float = 1.0,
) -> tuple[int, int]:
    """``(GPU, host)`` bytes per rank of the weights, gradients and AdamW moments (see the module docstring);
    ``offload_fraction``: the share of an offloaded optimizer in host memory (ZeRO-3's partial offload)."""
    if strategy == "deepspeed":
        offloaded, weights = 16 * params // world_size, 2 * params // world_size  # fp32 state, bf16 partition
    else:
        offloaded, weights = 4 * param_bytes * params // world_size, 0
    if not cpu_offload:
        return offloaded + weights, 0
    if offload_params:
        return 0, offloaded + weights
    host = int(offload_fraction * offloaded)
    return weights + offloaded - host, host


def plan_memory(
    sizes: ModelSizes,
    *,
    world_size: int,
    gpu_bytes: int,
    micro_batch_tokens: int,
    prompt_length: int,
    response_length: int,
    n: int,
    gradient_checkpointing: float = 1.0,
    cpu_offload: bool = False,
    kv_cache_bytes: int | None = None,
    activation_offload: float = 0.0,
    strategy: str = "fsdp2",
    offload_params: bool = False,
    param_bytes: int = 4,
    sharded: bool = True,
    groups_per_rank: int = 1,
    state_bytes: int | None = None,
    offload_fraction: float = 1.0,
    compute: Compute | None = None,
    backend: str = "flex",
    shared_prompt: bool = True,
    reference_model: bool = False,
    engine_copy: bool | None = None,
    sequence_parallel: int = 1,
) -> MemoryPlan:
    """Per-GPU bytes of a plan (see the module docstring for what is counted); ``gradient_checkpointing`` is
    the fraction of decoder layers recomputed (True: all), ``activation_offload`` the fraction whose
    activations wait in host memory (none of theirs stays on the GPU); ``offload_params``: ZeRO-3's
    parameter offload; ``param_bytes``: one parameter in ``model.dtype``; ``sharded``: whether the model is
    sharded (then layers are gathered to compute and the rollout engine keeps its own copy of the weights);
    ``groups_per_rank``: the prompts a rank samples a step; ``state_bytes``: one parameter of the weights the
    optimizer steps (default ``param_bytes``); ``offload_fraction``: see ``training_state``; ``compute``: how the
    layers compute (default: compiled, in bf16), ``backend``: the packed attention backend, ``shared_prompt``:
    the packed layout (else one padded row per sample); ``reference_model``: a frozen copy of the starting weights
    for a KL penalty (``algo.kl_coef``), in ``model.dtype``, sharded like the policy under FSDP2; ``engine_copy``:
    whether the engine keeps a copy of the weights (default: when sharded); ``sequence_parallel``: the ranks each
    packed row is split over (``micro_batch_tokens`` is the whole row's)."""
    bf16 = 2
    state, host = training_state(
        sizes.params,
        world_size,
        strategy,
        cpu_offload,
        offload_params,
        param_bytes if state_bytes is None else state_bytes,
        offload_fraction,
    )
    unsharded = bf16 * (2 * sizes.layer_params + sizes.embedding_params) if sharded else 0
    activations = update_activations(
        sizes,
        compute or Compute(compiled=True),
        budget=micro_batch_tokens,
        prompt_length=prompt_length,
        response_length=response_length,
        n=n,
        backend=backend,
        recomputed=float(gradient_checkpointing),
        offloaded=activation_offload,
        shared_prompt=shared_prompt,
        sequence_parallel=sequence_parallel,
    )
    copy = param_bytes * sizes.params if (sharded if engine_copy is None else engine_copy) else 0
    reference = 0  # (copied whole from the loaded model, then sharded)
    if reference_model:
        reference = param_bytes * sizes.params // (world_size if sharded and strategy != "deepspeed" else 1)
    # The KV cache is sized when the first rollout starts, before any gradient or AdamW moment exists: FSDP2
    # holds its weight shards alone then (a quarter of its state), ZeRO-3 its whole partitions. The engine
    # measures the memory free then, which the margin still is (nothing has fragmented yet).
    resident = state // 4 if strategy != "deepspeed" else state
    budget = kv_cache_bytes or int(ENGINE_KV_SHARE * max(0, gpu_bytes - resident - copy - reference))
    one_group = kv_bytes_per_group(sizes, prompt_length, response_length, n, param_bytes)
    groups = max(1, min(groups_per_rank, budget // one_group))
    return MemoryPlan(
        world_size=world_size,
        gpu_bytes=gpu_bytes,
        training_state=state,
        unsharded_layers=unsharded,
        activations=activations.total,
        rollout_weights=copy,
        rollout_kv=groups * one_group,
        host_state=host,
        kv_groups=groups,
        loading=param_bytes * sizes.params * (1 + reference_model) + copy + MARGIN_BYTES,
        param_bytes=param_bytes,
        activation_parts=activations,
        reference_weights=reference,
        sequence_parallel=sequence_parallel,
        kv_group=one_group,
        model_bytes=param_bytes * sizes.params,
    )


PARAMETER_OFFLOAD = "zero_optimization.offload_param.device: cpu in actor.deepspeed_config"
DEEPSPEED_SUB_GROUP_SIZE = 10**9  # DeepSpeed's default zero_optimization.sub_group_size


def check_plan(
    plan: MemoryPlan,
    cpu_offload: bool,
    gradient_checkpointing: float,
    micro_batch_tokens: int,
    kv_cache_bytes: int | None,
    offload_setting: str = "actor.cpu_offload=true",
    partly_offloaded: bool = False,
    fitting_tokens: int | None = None,
    backend: str = "flex",
    fitting_parallel: tuple[int, int | None] | None = None,
) -> None:
    """Refuse a plan over the GPU's memory, naming the settings that would make it fit: first the largest
    micro-batch token budget that does (``fitting_tokens``, when one is known), then the smallest sequence-parallel
    degree that does (``fitting_parallel``: the degree, and the budget it needs where the plan's own is too
    large)."""
    if plan.loading > plan.gpu_bytes:
        fix = (
            "load it in bf16 (model.dtype=bfloat16)"
            if plan.param_bytes > 2
            else "use GPUs with more memory (--gpu-memory-gib)"
        )
        raise PlanError(
            f"loading needs about {plan.loading / GIB:.1f} GiB per GPU but a GPU has "
            f"{plan.gpu_bytes / GIB:.1f} GiB: every rank moves the whole model to its GPU, and the rollout "
            f"engine copies it there, before the model is sharded; to fit: {fix}"
        )
    if plan.total <= plan.gpu_bytes:
        return
    over = (plan.total - plan.gpu_bytes) / GIB
    advice = []
    if fitting_tokens:
        advice.append(
            f"set actor.max_tokens_per_micro_batch={fitting_tokens}, the largest that fits (now {micro_batch_tokens})"
        )
    if fitting_parallel:
        degree, tokens = fitting_parallel
        budget = f" with actor.max_tokens_per_micro_batch={tokens} or less" if tokens else ""
        advice.append(
            f"set actor.sequence_parallel_size={degree}{budget}, the smallest sequence-parallel degree that fits "
            f"(now {plan.sequence_parallel}: each rank then holds 1/{degree} of a row)"
        )
    state_matters = plan.training_state >= 0.1 * (plan.total - plan.gpu_bytes)  # else moving it is no fix
    if not cpu_offload and plan.training_state > plan.total - plan.gpu_bytes:
        advice.append(
            f"offload the training state to the CPU ({offload_setting} frees "
            f"{plan.training_state / GIB:.1f} GiB per GPU)"
        )
    elif not state_matters:
        pass
    elif not cpu_offload and plan.training_state:
        advice.append(f"offload the training state to the CPU ({offload_setting})")
    elif partly_offloaded:
        advice.append("offload more of the optimizer (raise actor.cpu_offload_ratio)")
    elif plan.training_state:  # ZeRO-3's weight partition, still on the GPU beside an offloaded optimizer
        advice.append(f"offload the parameters too ({PARAMETER_OFFLOAD})")
    if not gradient_checkpointing:
        advice.append("turn on model.gradient_checkpointing")
    elif gradient_checkpointing < 1:
        advice.append("raise model.checkpoint_fraction")
    masks = plan.activation_parts.masks if plan.activation_parts else 0
    if backend == "dense" and masks > 0.1 * plan.gpu_bytes:
        advice.append(
            f"use actor.attention_backend=flex (the dense backend keeps an attention mask per pack in every "
            f"layer, and in float32 with grouped key/value heads its attention scores: {masks / GIB:.1f} GiB)"
        )
    if plan.activations > 0.2 * plan.gpu_bytes:
        advice.append("keep the first layers' activations in host memory (model.activation_offload)")
        if not fitting_tokens:
            advice.append(f"lower actor.max_tokens_per_micro_batch (now {micro_batch_tokens})")
    if plan.kv_groups == 1 and plan.rollout_kv > 0.2 * plan.gpu_bytes:
        advice.append(kv_advice(plan))
    if plan.kv_groups > 1 and plan.rollout_kv > 0.2 * plan.gpu_bytes:
        advice.append(
            "lower rollout.kv_cache_bytes"
            if kv_cache_bytes
            else f"set rollout.kv_cache_bytes (by default the engine's KV cache takes {ENGINE_KV_SHARE:.0%} of "
            f"the free memory: {plan.kv_groups} groups, {plan.rollout_kv / GIB:.1f} GiB)"
        )
    if plan.training_state and state_matters and plan.world_size < 64:
        advice.append("use more GPUs (the training state is divided by their number)")
    raise PlanError(
        f"this plan needs about {plan.total / GIB:.1f} GiB per GPU but a GPU has "
        f"{plan.gpu_bytes / GIB:.1f} GiB ({over:.1f} GiB over); to fit: " + "; or ".join(advice)
    )


def sampler_room(plan: MemoryPlan) -> int:
    """Bytes a GPU has for the engine's KV where it only samples (``rollout.sampler_ranks``): all but the engine's
    weights and the margin."""
    return plan.gpu_bytes - plan.model_bytes - plan.margin


def kv_advice(plan: MemoryPlan) -> str:
    """What a plan whose one group's KV is a large part of the GPU needs: the fast engine holds a group's prompt KV
    on one GPU, with no tensor parallelism to spread it, so GPUs that only sample, or shorter groups."""
    group = f"one group's KV (the prompt once, its responses) is {plan.kv_group / GIB:.1f} GiB"
    why = "the fast engine holds a group's KV on one GPU (it has no tensor parallelism for the prompt's KV)"
    if plan.kv_group <= sampler_room(plan):
        return (
            f"sample on GPUs of their own (rollout.sampler_ranks, with rollout.mode=one_step_off): {why}, and "
            f"{group}, which fits beside the engine's weights alone"
        )
    return (
        f"shorten the groups (data.max_prompt_length, data.max_response_length or rollout.n) or use GPUs with "
        f"more memory: {why}, and {group}, more than a GPU holds beside the engine's weights alone "
        f"({sampler_room(plan) / GIB:.1f} GiB)"
    )


def longest_kv_prompt(sizes: ModelSizes, gpu_bytes: int, response_length: int, n: int, param_bytes: int) -> int:
    """The longest prompt whose group (the prompt once, ``n`` responses) the fast engine's KV holds on one GPU
    beside the engine's weights alone (a sampler rank's; a GPU that trains too holds less): past it no layout of
    the fast engine samples, since it has no tensor parallelism for the prompt's KV."""
    per_token = kv_bytes_per_group(sizes, 1, 0, 0, param_bytes)
    room = gpu_bytes - param_bytes * sizes.params - MARGIN_BYTES
    return max(0, room // per_token - n * response_length)


def sequence_parallel_degrees(sizes: ModelSizes, world_size: int, gpus_per_node: int | None = None) -> list[int]:
    """The sequence-parallel degrees a run of ``world_size`` training ranks can take for this model: dividing the
    ranks and the query heads, the key/value heads dividing it or it them (fewer are repeated to one a rank),
    within one node (the all-to-alls around every attention stay on its links)."""
    per_node = gpus_per_node or min(world_size, 8)
    return [
        degree
        for degree in range(1, min(world_size, per_node) + 1)
        if world_size % degree == 0
        and sizes.heads % degree == 0
        and (sizes.kv_heads % degree == 0 or degree % sizes.kv_heads == 0)
    ]


def with_sequence_parallel(cfg, degree: int):
    """``cfg`` with ``actor.sequence_parallel_size=degree``, as a new config."""
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, sequence_parallel_size=degree))


def fitting_sequence_parallel(
    cfg, sizes: ModelSizes, world_size: int, gpu_bytes: int, gpus_per_node: int | None = None
) -> tuple[int, int | None] | None:
    """The smallest sequence-parallel degree above the config's at which its plan fits (``sequence_parallel_degrees``),
    and the largest micro-batch budget that does where the config's own is too large (None: it fits as it is);
    None where no degree fits."""
    for degree in sequence_parallel_degrees(sizes, world_size, gpus_per_node):
        if degree <= cfg.actor.sequence_parallel_size:
            continue
        trial = with_sequence_parallel(cfg, degree)
        plan = plan_config(trial, sizes, world_size, gpu_bytes)
        if plan.loading <= gpu_bytes and plan.total <= gpu_bytes:
            return degree, None
        tokens = largest_micro_batch_tokens(trial, sizes, world_size, gpu_bytes)
        if tokens is not None:
            return degree, tokens
    return None


def plan_config(
    cfg, sizes: ModelSizes, world_size: int, gpu_bytes: int, micro_batch_tokens: int | None = None
) -> MemoryPlan:
    """The plan of a longqa config on ``world_size`` GPUs of ``gpu_bytes`` (at another micro-batch token budget
    than the config's, if given). With ``rollout.sampler_ranks`` the plan is a training rank's: ``world_size``
    training ranks and no engine (its weights and KV cache are on the sampler ranks)."""
    cpu_offload, offload_params = offloads(cfg)
    apart = cfg.rollout.sampler_ranks > 0
    plan = plan_memory(
        sizes,
        world_size=world_size,
        gpu_bytes=gpu_bytes,
        prompt_length=cfg.data.max_prompt_length,
        response_length=cfg.data.max_response_length,
        n=cfg.rollout.n,
        micro_batch_tokens=micro_batch_tokens or cfg.actor.max_tokens_per_micro_batch,
        gradient_checkpointing=recomputed_fraction(cfg),
        cpu_offload=cpu_offload,
        kv_cache_bytes=cfg.rollout.kv_cache_bytes,
        activation_offload=cfg.model.activation_offload,
        strategy=cfg.actor.strategy,
        offload_params=offload_params,
        param_bytes=DTYPE_BYTES[cfg.model.dtype],
        sharded=is_sharded(cfg, world_size),
        groups_per_rank=max(1, cfg.data.train_batch_size // world_size),
        state_bytes=master_bytes(cfg, world_size),
        offload_fraction=offload_fraction(cfg, world_size, sizes.params),
        compute=update_compute(cfg, sizes, world_size),
        backend=update_backend(cfg),
        shared_prompt=cfg.actor.shared_prompt,
        reference_model=cfg.algo.kl_coef > 0,
        engine_copy=(is_sharded(cfg, world_size) or cfg.rollout.overlap) and not apart,
        sequence_parallel=cfg.actor.sequence_parallel_size,
    )
    return dataclasses.replace(plan, rollout_kv=0) if apart else plan


def update_compute(cfg, sizes: ModelSizes, world_size: int) -> Compute:
    """How the update's layers compute on a GPU: in bf16 when the model is sharded (FSDP2's mixed precision,
    ZeRO-3's bf16), else in ``model.dtype``; compiled where the trainer compiles them (``actor.compile_layers``
    with the fast engine, for the Llama-family layers its fused decode runs), else eager."""
    dtype = 2 if is_sharded(cfg, world_size) else DTYPE_BYTES[cfg.model.dtype]
    compiled = cfg.actor.compile_layers and cfg.rollout.engine == "fast" and sizes.compilable
    return Compute(dtype_bytes=dtype, param_bytes=dtype, compiled=compiled, mlp_tile=cfg.model.mlp_tile_tokens)


def update_backend(cfg) -> str:
    """The packed attention backend on a GPU (``auto`` is flex there)."""
    backend = cfg.actor.attention_backend
    return "flex" if backend == "auto" else backend


def master_bytes(cfg, world_size: int) -> int:
    """Bytes of one parameter of the weights the optimizer steps under FSDP2 or in one process: sharded (GPUs
    compute in bf16; a 16-bit model in one process too), float32 masters unless ``actor.master_weights=model``;
    otherwise ``model.dtype``."""
    if is_sharded(cfg, world_size) and cfg.actor.master_weights == "float32":
        return 4
    return DTYPE_BYTES[cfg.model.dtype]


def is_sharded(cfg, world_size: int) -> bool:
    """Whether the model is sharded: over several ranks, by ZeRO-3 even on one, or to offload it or keep float32
    masters of a 16-bit model (in a process group of one, as ``longqa bench step`` runs it). Then the rollout
    engine keeps its own copy."""
    return world_size > 1 or cfg.actor.strategy == "deepspeed" or cfg.actor.cpu_offload or float32_masters(cfg)


def offloads(cfg) -> tuple[bool, bool]:
    """Whether a config offloads the optimizer, and the parameters (DeepSpeed's config may ask for either)."""
    if cfg.actor.strategy != "deepspeed":
        return cfg.actor.cpu_offload, cfg.actor.cpu_offload
    import torch

    from longqa.distributed.deepspeed import engine_config, optimizer_offloaded

    config = engine_config(cfg, torch.device("cuda"), torch.bfloat16)
    params = (config["zero_optimization"].get("offload_param") or {}).get("device", "none") in ("cpu", "nvme")
    return optimizer_offloaded(config), params


def offload_fraction(cfg, world_size: int, params: int) -> float:
    """The share of an offloaded optimizer in host memory: all of it, except under ZeRO-3's partial offload
    (``offload_optimizer.ratio``, which ``actor.cpu_offload_ratio`` sets), which divides a rank's partition
    into sub-groups of ``sub_group_size`` parameters (``host_share``)."""
    ratio, sub_group_size = offload_ratio(cfg)
    return host_share(ratio, zero3_sub_groups(params, world_size, sub_group_size))


def zero3_sub_groups(params: int, world_size: int, sub_group_size: int) -> int:
    """How many sub-groups ZeRO-3 cuts a rank's partition of the optimizer into."""
    return max(1, math.ceil(params / world_size / sub_group_size))


def host_share(ratio: float, sub_groups: int) -> float:
    """The share of ``sub_groups`` in host memory at ``offload_optimizer.ratio``: all but the first
    ``int((1 - ratio) * sub_groups)``, which DeepSpeed keeps on the GPU."""
    if ratio >= 1:
        return 1.0
    return (sub_groups - int((1 - ratio) * sub_groups)) / sub_groups


def offload_ratio(cfg) -> tuple[float, int]:
    """ZeRO-3's ``offload_optimizer.ratio`` (1 for FSDP2 or no partial offload) and ``sub_group_size``."""
    if cfg.actor.strategy != "deepspeed":
        return 1.0, DEEPSPEED_SUB_GROUP_SIZE
    import torch

    from longqa.distributed.deepspeed import engine_config

    zero = engine_config(cfg, torch.device("cuda"), torch.bfloat16)["zero_optimization"]
    return (
        (zero.get("offload_optimizer") or {}).get("ratio", 1.0),
        int(zero.get("sub_group_size", DEEPSPEED_SUB_GROUP_SIZE)),
    )


def recomputed_fraction(cfg) -> float:
    """The fraction of decoder layers a config recomputes in the backward pass."""
    return cfg.model.checkpoint_fraction if cfg.model.gradient_checkpointing else 0.0


def describe_training(cfg, model_params: int | None = None, world_size: int = 1) -> str:
    """The sharding and where the optimizer steps, in words, for the plan's heading. With the model's parameter
    count, a partial ZeRO-3 offload says the share that ZeRO-3's whole sub-groups make of the ratio asked for."""
    optimizer, params = offloads(cfg)
    if cfg.actor.strategy == "deepspeed":
        ratio, sub_group_size = offload_ratio(cfg)
        where = ("optimizer and parameters offloaded" if params else "optimizer offloaded") if optimizer else ""
        if where and ratio < 1 and not params:
            share = ratio
            if model_params is not None:
                groups = zero3_sub_groups(model_params, world_size, sub_group_size)
                share = host_share(ratio, groups)
                if share == 1:
                    return (
                        f"DeepSpeed ZeRO-3, the whole optimizer offloaded: actor.cpu_offload_ratio={ratio:g} keeps "
                        f"int({1 - ratio:.2g} x {groups}) = 0 of its {groups} sub-groups of {sub_group_size:,} "
                        f"parameters on the GPU (DeepSpeed's CPU Adam steps it on the host)"
                    )
            return (
                f"DeepSpeed ZeRO-3, {share:.0%} of the optimizer offloaded (DeepSpeed's CPU Adam steps it on the "
                f"host, torch's AdamW the rest on the GPU)"
            )
        return "DeepSpeed ZeRO-3" + (f", {where} (DeepSpeed's CPU Adam steps it on the host)" if where else "")
    return "FSDP2" + (", CPU offload (torch's AdamW steps it on the host)" if optimizer else "")


def check_config(cfg, plan: MemoryPlan, sizes: ModelSizes | None = None, gpus_per_node: int | None = None) -> None:
    """Refuse a config's plan over the GPU's memory; with the model's ``sizes``, name the largest micro-batch
    token budget that fits and the smallest sequence-parallel degree that does (within nodes of
    ``gpus_per_node``, default the ranks up to 8)."""
    fitting = parallel = None
    if sizes is not None and plan.total > plan.gpu_bytes:
        fitting = largest_micro_batch_tokens(cfg, sizes, plan.world_size, plan.gpu_bytes)
        parallel = fitting_sequence_parallel(cfg, sizes, plan.world_size, plan.gpu_bytes, gpus_per_node)
    check_plan(
        plan,
        offloads(cfg)[0],
        recomputed_fraction(cfg),
        cfg.actor.max_tokens_per_micro_batch,
        cfg.rollout.kv_cache_bytes,
        partly_offloaded=offload_ratio(cfg)[0] < 1,
        fitting_tokens=fitting,
        backend=update_backend(cfg),
        fitting_parallel=parallel,
    )


def largest_micro_batch_tokens(
    cfg, sizes: ModelSizes, world_size: int, gpu_bytes: int, ceiling: int | None = None
) -> int | None:
    """The largest ``actor.max_tokens_per_micro_batch`` at which the config's plan fits, up to ``ceiling`` if
    given (None: not even one sample's, prompt and response, under which a smaller budget saves nothing: a
    sample never splits). The plan grows with the budget, so a bisection finds it."""

    def fits(tokens: int) -> bool:
        plan = plan_config(cfg, sizes, world_size, gpu_bytes, micro_batch_tokens=tokens)
        return plan.loading <= gpu_bytes and plan.total <= gpu_bytes

    low = one_sample_tokens(cfg)
    if not fits(low):
        return None
    budget = cfg.actor.max_tokens_per_micro_batch
    high = max(low, budget if isinstance(budget, int) else low)
    while fits(high):  # (the config's own budget fits: the largest is above it)
        if ceiling is not None and high >= ceiling:
            return ceiling
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low if ceiling is None else min(low, ceiling)


AUTO = "auto"
CPU_MICRO_BATCH_TOKENS = 16384  # auto's budget where no device memory sizes it (the CPU)
BUDGET_STEP = 1024  # auto's budgets are multiples of this (a few packed lengths, few compiled shapes)


def one_sample_tokens(cfg) -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def mini_batch_share_tokens(cfg, world_size: int) -> int:
    """The most tokens one data-parallel rank's share of a mini-batch packs (the ranks of a sequence-parallel group
    share one): no micro-batch needs more."""
    data_parallel = max(1, world_size // cfg.actor.sequence_parallel_size)
    groups = max(1, cfg.actor.ppo_mini_batch_size // data_parallel)
    d, n = cfg.data, cfg.rollout.n
    shared = d.max_prompt_length + n * d.max_response_length  # the prompt packed once with its n responses
    per_group = shared if cfg.actor.shared_prompt else n * one_sample_tokens(cfg)
    return groups * per_group


def resolve_auto(cfg, world_size: int, gpu_bytes: int | None, sizes: ModelSizes | None = None):
    """``(config, note)``: ``cfg`` with ``actor.max_tokens_per_micro_batch=auto`` set to a number, as a new config
    (``cfg`` is left as it is), and the line saying which and why; ``(cfg, None)`` where the config gave one.
    On a GPU (``gpu_bytes``, with the model's ``sizes``) it is the largest budget the memory plan of
    ``world_size`` training ranks fits, in steps of ``BUDGET_STEP``, up to a whole mini-batch share (more saves
    nothing); where not even one sample fits it is one sample's, which the memory check then refuses with what to
    change. On the CPU, whose memory the plan does not size, it is ``CPU_MICRO_BATCH_TOKENS``."""
    if cfg.actor.max_tokens_per_micro_batch != AUTO:
        return cfg, None
    tokens, why = auto_micro_batch_tokens(cfg, world_size, gpu_bytes, sizes)
    actor = dataclasses.replace(cfg.actor, max_tokens_per_micro_batch=tokens)
    return dataclasses.replace(cfg, actor=actor), f"actor.max_tokens_per_micro_batch=auto: {why}"


def auto_micro_batch_tokens(cfg, world_size: int, gpu_bytes: int | None, sizes: ModelSizes | None) -> tuple[int, str]:
    """The budget ``auto`` stands for (see ``resolve_auto``), and what it is in words."""
    if gpu_bytes is None:
        return CPU_MICRO_BATCH_TOKENS, f"{CPU_MICRO_BATCH_TOKENS:,} tokens a micro-batch (no GPU memory to size it by)"
    ceiling, one_sample = mini_batch_share_tokens(cfg, world_size), one_sample_tokens(cfg)
    largest = largest_micro_batch_tokens(cfg, sizes, world_size, gpu_bytes, ceiling=ceiling)
    if largest is None:  # (the memory check then refuses one sample's budget, saying what to change)
        return one_sample, f"not even one sample ({one_sample:,} tokens) fits"
    chosen = largest if largest == ceiling else max(one_sample, largest // BUDGET_STEP * BUDGET_STEP)
    why = (
        "a whole mini-batch share"
        if chosen == ceiling
        else f"the largest the memory plan fits in {gpu_bytes / GIB:.0f} GiB"
    )
    return chosen, f"{chosen:,} tokens a micro-batch ({why})"


class ModelSizeError(ConfigError):
    """The sizes of ``model.path`` cannot be read (no config.json or GGUF header there): the plan needs them before
    any weight is read."""


def model_sizes(cfg) -> ModelSizes:
    """Sizes from the config of ``model.path`` (a folder, hub id or GGUF file; or the embedded default), read
    without its weights."""
    from longqa.model.load import ModelError, load_model_config

    try:
        config = load_model_config(cfg.model.path, cfg.model.gguf_file)
    except ModelError as e:
        raise ModelSizeError(
            f"{e}: give a local model folder, or size a Qwen3 shape instead with longqa plan --shape"
        ) from None
    return ModelSizes.from_config(config)


@dataclass(frozen=True)
class CheckedRun:
    """What ``check_run`` gives back: the config to run, its auto values filled (a new config: the one checked
    is left as it was); the line saying what auto chose (None: nothing was auto); the model's sizes where a
    GPU's memory sized the plan (None elsewhere)."""

    config: Any
    note: str | None
    sizes: ModelSizes | None


def check_run(
    cfg,
    ranks: int,
    *,
    machine: bool = True,
    device_type: str | None = None,
    gpu_bytes: int | None = None,
    read_sizes=model_sizes,
) -> CheckedRun:
    """The one sequence that `longqa train` (the trainer, and the Ray driver before its workers start),
    `longqa config show` and `longqa plan` run before any work, so that none passes a config another refuses:
    every rule between settings for a job of ``ranks`` ranks (``config/checks.py``); then, with ``machine``, what
    this machine cannot run of it on ``device_type`` (``config/support.py``; None: not this machine's device, the
    Ray driver's case; `longqa plan` sizes other machines and checks none); then its auto values filled for a
    training rank of ``gpu_bytes`` (None: the CPU's), whose model ``read_sizes`` sizes then."""
    check_settings(cfg, ranks)
    if machine:
        check_machine(cfg, device_type, ranks)
    sizes = read_sizes(cfg) if gpu_bytes is not None else None
    config, note = resolve_auto(cfg, ranks - cfg.rollout.sampler_ranks, gpu_bytes, sizes)
    return CheckedRun(config, note, sizes)


def check_fit(cfg, world_size: int, gpu_bytes: int, sizes: ModelSizes) -> MemoryPlan:
    """The plan of ``cfg`` (its auto values filled: ``check_run``) on ``world_size`` training ranks of
    ``gpu_bytes``, refused (PlanError, naming what to change) where it cannot fit: the trainer's check before it
    reads any weight."""
    plan = plan_config(cfg, sizes, world_size, gpu_bytes)
    check_config(cfg, plan, sizes)
    return plan


SFT_STATE_BYTES = 16  # longqa sft: float32 weights, their gradients and AdamW's two moments, per parameter
SFT_COMPUTE = Compute(dtype_bytes=2, param_bytes=4, autocast=True)  # float32 weights under bf16 autocast (CUDA)


def sft_bytes(sizes: ModelSizes, batch_tokens: int, longest: int) -> int:
    """Bytes ``longqa sft`` needs on its GPU: its training state, one batch's activations (``activations.py``,
    the count the GRPO update's plan uses) and the margin."""
    activations = sft_activations(sizes, SFT_COMPUTE, batch_tokens=batch_tokens, longest=longest)
    return SFT_STATE_BYTES * sizes.params + activations.total + MARGIN_BYTES


def check_sft(sizes: ModelSizes, *, gpu_bytes: int, batch_tokens: int, longest: int) -> int:
    """The bytes ``longqa sft`` needs on its GPU; refused, in one line, where its batches cannot fit, naming the
    largest ``--batch-tokens`` that does. ``longest``: the longest example, which a batch holds whatever the
    budget."""
    need = sft_bytes(sizes, batch_tokens, longest)
    if need <= gpu_bytes:
        return need
    where = (
        f"longqa sft needs about {need / GIB:.1f} GiB at --batch-tokens {batch_tokens} but the GPU has "
        f"{gpu_bytes / GIB:.1f} GiB"
    )
    if sft_bytes(sizes, longest, longest) > gpu_bytes:
        raise PlanError(
            f"{where}, and even a batch of the longest example alone ({longest} tokens) does not fit: "
            f"lower --max-prompt-length, or train a smaller model"
        )
    low, high = longest, batch_tokens  # fits at low, not at high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if sft_bytes(sizes, middle, longest) <= gpu_bytes else (low, middle)
    raise PlanError(f"{where}: use --batch-tokens {low} or lower, the largest that fits")
