"""Will this run fit? Per-GPU memory of a plan, estimated before any weight is loaded.

A run that dies of out-of-memory after the model loads, the data tokenizes and the first rollout
finishes wastes minutes to hours; the arithmetic to predict it is simple. Per GPU, with the model
sharded over ``world_size`` ranks (FSDP2, ZeRO-3 style):

- training state: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, 16 bytes per
  parameter, divided by the ranks; on the CPU instead when offloaded (the recipe's ZeRO-3 + CPU
  optimizer offload). DeepSpeed ZeRO-3 (``actor.strategy=deepspeed``) keeps a bf16 partition of the
  weights beside them, 18 bytes in all, of which the 2 stay on the GPU when the optimizer is offloaded
  (and leave it too when the parameters are); the offloaded 16 bytes are on the host either way, and
  what differs is who steps them: torch's AdamW under FSDP2, DeepSpeed's CPU Adam under ZeRO-3;
- the unsharded layers being computed: two decoder layers (this one and the prefetched next) and the
  embedding/LM head, in bf16;
- activations of one micro-batch of ``max_tokens_per_micro_batch`` packed tokens: with gradient
  checkpointing, one hidden state per layer plus one layer's recompute and an LM-head chunk;
  without it, every layer's intermediates;
- the rollout engine: a full bf16 copy of the weights (gathered layer by layer after each update),
  and the KV cache of at least one group (the prompt once, n responses).

It is an estimate (allocator fragmentation, NCCL buffers and CUDA context are a fixed margin), meant
to refuse plans that cannot work, naming the setting to change, not to promise a tight fit.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
MARGIN_BYTES = 6 * GIB  # CUDA context, NCCL buffers, allocator fragmentation
LM_HEAD_CHUNK = 2048  # tokens per LM-head chunk (model/logprobs.py)


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

    @classmethod
    def from_config(cls, config) -> "ModelSizes":
        """Counted on the meta device: any transformers architecture, no memory, no download."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.base_model.layers[0].parameters())
        heads = config.num_attention_heads
        return cls(params=params, layer_params=layer, embedding_params=params - layer * config.num_hidden_layers,
                   hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
                   kv_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab=config.vocab_size)


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

    @property
    def total(self) -> int:
        return (self.training_state + self.unsharded_layers + self.activations + self.rollout_weights
                + self.rollout_kv + self.margin)

    def table(self) -> str:
        rows = [("training state (weights, grads, AdamW)", self.training_state),
                ("unsharded layers in flight", self.unsharded_layers), ("activations", self.activations),
                ("rollout weights (bf16 copy)", self.rollout_weights), ("rollout KV cache", self.rollout_kv),
                ("margin (context, NCCL, fragmentation)", self.margin), ("total", self.total),
                ("GPU memory", self.gpu_bytes), ("host memory per rank: offloaded state", self.host_state)]
        return "\n".join(f"  {name:<40} {value / GIB:8.1f} GiB" for name, value in rows)


def training_state(params: int, world_size: int, strategy: str = "fsdp2", cpu_offload: bool = False,
                   offload_params: bool = False) -> tuple[int, int]:
    """``(GPU, host)`` bytes per rank of the weights, gradients and AdamW moments (see the module docstring)."""
    offloaded = 16 * params // world_size
    weights = 2 * params // world_size if strategy == "deepspeed" else 0  # ZeRO-3's bf16 partition
    if not cpu_offload:
        return offloaded + weights, 0
    return (0, offloaded + weights) if offload_params else (weights, offloaded)


def plan_memory(sizes: ModelSizes, *, world_size: int, gpu_bytes: int, micro_batch_tokens: int,
                prompt_length: int, response_length: int, n: int, gradient_checkpointing: float = 1.0,
                cpu_offload: bool = False, kv_cache_bytes: int | None = None,
                activation_offload: float = 0.0, strategy: str = "fsdp2", offload_params: bool = False) -> MemoryPlan:
    """Per-GPU bytes of a plan (see the module docstring for what is counted); ``gradient_checkpointing`` is
    the fraction of decoder layers recomputed (True: all), ``activation_offload`` the fraction whose
    activations wait in host memory (none of theirs stays on the GPU); ``offload_params``: ZeRO-3's
    parameter offload."""
    bf16 = 2
    state, host = training_state(sizes.params, world_size, strategy, cpu_offload, offload_params)
    unsharded = bf16 * (2 * sizes.layer_params + sizes.embedding_params)
    tokens = micro_batch_tokens
    per_token_layer = bf16 * (12 * sizes.hidden + 4 * sizes.intermediate)  # q,k,v,o, norms, residuals, MLP
    recomputed = round(float(gradient_checkpointing) * sizes.layers)  # these keep their input alone
    kept = sizes.layers - recomputed - round(activation_offload * sizes.layers)
    activations = tokens * (bf16 * sizes.hidden * recomputed + per_token_layer * kept)
    if recomputed:
        activations += tokens * per_token_layer  # one recomputed layer's activations during its backward
    activations += 3 * 4 * min(tokens, LM_HEAD_CHUNK) * sizes.vocab  # float32 logits of one chunk, twice + grad
    one_group = 2 * bf16 * sizes.layers * sizes.kv_heads * sizes.head_dim * (prompt_length + n * response_length)
    kv = max(kv_cache_bytes or 0, one_group)
    return MemoryPlan(world_size=world_size, gpu_bytes=gpu_bytes, training_state=state, unsharded_layers=unsharded,
                      activations=activations, rollout_weights=bf16 * sizes.params, rollout_kv=kv, host_state=host)


PARAMETER_OFFLOAD = "zero_optimization.offload_param.device: cpu in actor.deepspeed_config"


def check_plan(plan: MemoryPlan, cpu_offload: bool, gradient_checkpointing: float, micro_batch_tokens: int,
               kv_cache_bytes: int | None, offload_setting: str = "actor.cpu_offload=true") -> None:
    """Refuse a plan over the GPU's memory, naming the settings that would make it fit."""
    if plan.total <= plan.gpu_bytes:
        return
    over = (plan.total - plan.gpu_bytes) / GIB
    advice = []
    if not cpu_offload and plan.training_state > plan.total - plan.gpu_bytes:
        advice.append(f"offload the training state to the CPU ({offload_setting} frees "
                      f"{plan.training_state / GIB:.1f} GiB per GPU)")
    elif not cpu_offload and plan.training_state:
        advice.append(f"offload the training state to the CPU ({offload_setting})")
    elif plan.training_state:  # ZeRO-3's weight partition, still on the GPU beside an offloaded optimizer
        advice.append(f"offload the parameters too ({PARAMETER_OFFLOAD})")
    if not gradient_checkpointing:
        advice.append("turn on model.gradient_checkpointing")
    elif gradient_checkpointing < 1:
        advice.append("raise model.checkpoint_fraction")
    if plan.activations > 0.2 * plan.gpu_bytes:
        advice.append("keep the first layers' activations in host memory (model.activation_offload)")
        advice.append(f"lower actor.max_tokens_per_micro_batch (now {micro_batch_tokens})")
    if kv_cache_bytes and plan.rollout_kv > 0.2 * plan.gpu_bytes:
        advice.append("lower rollout.kv_cache_bytes")
    if plan.training_state and plan.world_size < 64:
        advice.append("use more GPUs (the training state is divided by their number)")
    raise PlanError(f"this plan needs about {plan.total / GIB:.1f} GiB per GPU but a GPU has "
                    f"{plan.gpu_bytes / GIB:.1f} GiB ({over:.1f} GiB over); to fit: " + "; or ".join(advice))


def plan_config(cfg, sizes: ModelSizes, world_size: int, gpu_bytes: int) -> MemoryPlan:
    """The plan of a longqa config on ``world_size`` GPUs of ``gpu_bytes``."""
    cpu_offload, offload_params = offloads(cfg)
    return plan_memory(sizes, world_size=world_size, gpu_bytes=gpu_bytes, prompt_length=cfg.data.max_prompt_length,
                       response_length=cfg.data.max_response_length, n=cfg.rollout.n,
                       micro_batch_tokens=cfg.actor.max_tokens_per_micro_batch,
                       gradient_checkpointing=recomputed_fraction(cfg), cpu_offload=cpu_offload,
                       kv_cache_bytes=cfg.rollout.kv_cache_bytes, activation_offload=cfg.model.activation_offload,
                       strategy=cfg.actor.strategy, offload_params=offload_params)


def offloads(cfg) -> tuple[bool, bool]:
    """Whether a config offloads the optimizer, and the parameters (DeepSpeed's config may ask for either)."""
    if cfg.actor.strategy != "deepspeed":
        return cfg.actor.cpu_offload, cfg.actor.cpu_offload
    import torch

    from longqa.distributed.deepspeed import engine_config, optimizer_offloaded

    config = engine_config(cfg, torch.device("cuda"), torch.bfloat16)
    params = (config["zero_optimization"].get("offload_param") or {}).get("device", "none") in ("cpu", "nvme")
    return optimizer_offloaded(config), params


def recomputed_fraction(cfg) -> float:
    """The fraction of decoder layers a config recomputes in the backward pass."""
    return cfg.model.checkpoint_fraction if cfg.model.gradient_checkpointing else 0.0


def describe_training(cfg) -> str:
    """The sharding and where the optimizer steps, in words, for the plan's heading."""
    optimizer, params = offloads(cfg)
    if cfg.actor.strategy == "deepspeed":
        where = ("optimizer and parameters offloaded" if params else "optimizer offloaded") if optimizer else ""
        return "DeepSpeed ZeRO-3" + (f", {where} (DeepSpeed's CPU Adam steps it on the host)" if where else "")
    return "FSDP2" + (", CPU offload (torch's AdamW steps it on the host)" if optimizer else "")


def check_config(cfg, plan: MemoryPlan) -> None:
    check_plan(plan, offloads(cfg)[0], recomputed_fraction(cfg), cfg.actor.max_tokens_per_micro_batch,
               cfg.rollout.kv_cache_bytes)


def model_sizes(cfg) -> ModelSizes | None:
    """Sizes from the config of ``model.path`` (or the embedded default); None for GGUF files, whose
    config is only known once read."""
    from transformers import AutoConfig

    from longqa.model.load import EMBEDDED_MODEL

    if cfg.model.gguf_file:
        return None
    return ModelSizes.from_config(AutoConfig.from_pretrained(cfg.model.path or str(EMBEDDED_MODEL)))


def check_run(cfg, world_size: int, gpu_bytes: int) -> MemoryPlan | None:
    """The trainer's check before it reads any weight: refuse a config that cannot fit on these GPUs."""
    sizes = model_sizes(cfg)
    if sizes is None:
        return None
    plan = plan_config(cfg, sizes, world_size, gpu_bytes)
    check_config(cfg, plan)
    return plan
