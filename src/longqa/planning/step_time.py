"""How long will a GRPO step take? A first-order model, per phase, from the config and the hardware.

Every rank does the same work on its own share of the step's groups, so a step takes one rank's time:

- rollout: the rank's prompts prefilled once each (forward FLOPs at ``PREFILL_MFU``), then decode steps
  (``max_response_length`` tokens each, a mean response length if given, or under
  ``rollout.response_lengths=lognormal`` each sample's drawn length, a group holding its slot until its
  longest sample ends; with as many groups in flight as the GPU plan's KV cache holds), each at the HBM
  floor of ``longqa.planning.flops.decode_floor_s`` (the weights once per step, each group's prompt KV once, each
  sample's own KV) over ``DECODE_FRACTION_OF_FLOOR``;
- old log-probs: when a step has several mini-batches (or epochs), one forward pass over all samples;
- update: the packed micro-batches' training FLOPs (``longqa.planning.flops.group_flops`` on the packs
  ``plan_packs`` makes, plus a third of the forward for each recomputed layer): the matrix products at
  ``UPDATE_MFU``, attention's (query, key) pairs at ``attention_mfu(head_dim)``, since the attention
  kernels' rate falls with the head dimension (a small model at long prompts spends most of its update
  there). A
  sharded micro-batch also moves its weights and gradients: FSDP2 all-gathers bf16 weights for the forward
  and again for the backward and reduce-scatters fp32 gradients (8 bytes a parameter over the GPUs'
  link), and offloaded activations (``model.activation_offload``) go out over PCIe and come back. Those
  transfers overlap the compute, so a micro-batch takes the longest of compute, link and either PCIe
  direction. With ``actor.cpu_offload`` that last part also holds the offload's own traffic and host work,
  at the rate measured per backend (``OFFLOAD_BYTES_PER_S``): FSDP2 brings its shards in for the
  forward and again for the backward and sends the gradients out to be added on the host; ZeRO-3 keeps
  its bf16 partitions on the GPU and sends only the gradients out (those of its offloaded share, when
  ``actor.cpu_offload_ratio`` keeps the rest on the GPU);
- sequence parallelism (``actor.sequence_parallel_size`` = sp): a data-parallel rank's groups (the groups its
  sp ranks sampled) are packed as without it, and each micro-batch's FLOPs are split over the sp ranks, which
  also exchange every layer's queries, keys, values and output by all-to-all, four in the forward pass and
  four in the backward pass (and four more for a recomputed layer), each moving (sp - 1)/sp of the rank's
  share in bf16, key/value heads fewer than sp repeated to sp first (``all_to_all_s``). Those wait for
  attention and attention for them: they add to the compute. They run at ``ALL_TO_ALL_BYTES_PER_S`` within a
  node (``longqa plan`` keeps sp within one);
- optimizer steps: on the GPU at the measured AdamW time per parameter; offloaded, at the time per
  parameter measured on the host for each backend's optimizer (torch's AdamW, DeepSpeed's CPU Adam), and
  a partial offload's GPU share at the GPU's time;
- weight refresh: the rollout engine's own copy gathered over the link once per step (after FSDP2's
  offloaded shards came to the GPU over PCIe); nothing when one process shares its model.

The efficiency factors are this repository's measurements (benchmarks/RESULTS.md, one H200); the link
bandwidths are assumptions, not yet measured here. Reward scoring (milliseconds) and validation are left
out.
"""

from __future__ import annotations

from dataclasses import dataclass

from longqa.planning.activations import saved_activation_widths
from longqa.planning.flops import H200_BF16_PEAK, decode_floor_s, group_flops, per_sample_lengths
from longqa.planning.planner import (
    DTYPE_BYTES,
    MemoryPlan,
    ModelSizes,
    master_bytes,
    offload_fraction,
    offloads,
    recomputed_fraction,
)
from longqa.rollout.lengths import draw_response_lengths

# Fast engine, 16 groups x 8, Qwen3-1.7B, 8,192-token prompts, 1,024 new tokens: 79.5% (8cd9084), 80.0% and
# 79.5% (a7e656b) and 73.7% (4317a29) of the HBM floor.
DECODE_FRACTION_OF_FLOOR = 0.77
# Two 8,192-token prompts prefilled in 0.124 s at Qwen3-1.7B (8cd9084): 50% of the bf16 peak.
PREFILL_MFU = 0.50
# The packed update's two rates (RESULTS.md, packed training and realistic steps, one H200, compiled layers,
# flex attention). Attention, as model FLOPs (12 x head_dim x heads per pair) over its kernels' time inside the
# update: 2.3 + 6.3 ms forward and backward a layer for Qwen3-1.7B's group, 8,192 + 8 x 1,024 at head dim 128
# (30.3% of the peak); 3.10 s over SmolLM2-135M's 64 groups x 30 layers, 8,192 + 8 x 157 at head dim 64 (19.1%).
ATTENTION_MFU = {64: 0.191, 128: 0.303}
# The matrix products (with the norms and activations fused around them): the flex Qwen3-1.7B group's 0.509 s
# (096ba9b) less its attention at the rate above. With these two rates the model gives 0.99x that group, 0.95x
# the 16 x 8 step's update at 1.7B (8.46 s, 8cd9084), 0.83x SmolLM2-135M's 64 x 8 update at 8,192-token prompts
# (4.55-4.60 s, 3026ca7; one rate for everything gave 0.44x) and 1.08x the flex Qwen3-8B group with a quarter of
# its layers recomputed (4.93 s, 096ba9b).
UPDATE_MFU = 0.59
# AdamW and clipping of Qwen3-1.7B's 1.72B parameters in 0.05 s on one H200 (b2faf3d).
GPU_ADAM_S_PER_PARAM = 0.05 / 1.72e9
# The offloaded optimizer's step of float32 master weights on the host of one H200 (16 cores; a rank of a
# larger node is counted with as many): torch's AdamW under FSDP2 2.28 s and DeepSpeed's CPU Adam 0.90 s per
# billion parameters (9a0c60b, RESULTS.md, offloaded optimizer). Weights stepped in bf16 are counted at half
# torch's figure: the step is bound by the host's memory traffic.
HOST_ADAM_S_PER_PARAM = {"fsdp2": 2.28e-9, "deepspeed": 0.90e-9}
PCIE_BYTES_PER_S = 55e9  # pinned copies each way on the H200 host (RESULTS.md, packed training)
# An offloaded micro-batch's own traffic and host work, as bytes (float32) over the seconds they took in whole
# offloaded Qwen3-1.7B updates of 8 micro-batches on one H200 (e4fccee, RESULTS.md, offloaded optimizer): FSDP2
# 3 x 6.9 GB (shards in twice, gradients out) in 4.46 s a micro-batch, far below PCIe (not profiled: the copies
# and the host's gradient additions together); ZeRO-3 6.9 GB of gradients out in 0.39 s.
OFFLOAD_BYTES_PER_S = {"fsdp2": 4.6e9, "deepspeed": 17.9e9}
NVLINK_BYTES_PER_S = 300e9  # assumed: NCCL all-gather bus bandwidth between the H200s of one node
NETWORK_BYTES_PER_S = 45e9  # assumed: one 400 Gb/s network link per GPU between nodes
# assumed, not measured here: bytes a GPU sends per second in an NCCL all-to-all among the GPUs of one NVLink node
# (about two thirds of NVLink 4's 450 GB/s each way, as the all-gathers above).
ALL_TO_ALL_BYTES_PER_S = NVLINK_BYTES_PER_S


@dataclass
class StepTime:
    """Seconds of one GRPO step on one rank, by phase."""

    prefill: float
    decode: float
    old_logprobs: float
    update: float
    optimizer: float
    refresh: float
    micro_batches: int  # per rank, per pass over the step's samples
    optimizer_steps: int

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.old_logprobs + self.update + self.optimizer + self.refresh

    def table(self) -> str:
        rows = [
            ("rollout: prefill", self.prefill),
            ("rollout: decode", self.decode),
            ("old log-probs (forward)", self.old_logprobs),
            (f"update ({self.micro_batches} micro-batches)", self.update),
            (f"optimizer ({self.optimizer_steps} step{'s' if self.optimizer_steps > 1 else ''})", self.optimizer),
            ("weight refresh (engine's copy)", self.refresh),
            ("step", self.total),
        ]
        return "\n".join(f"  {name:<40} {seconds(value):>8} s" for name, value in rows)


def seconds(value: float) -> str:
    """A time as the plans print it: one decimal from a second up, two significant digits below, so that a
    small model's milliseconds are not all shown as 0.0."""
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.2g}"


def attention_mfu(head_dim: int) -> float:
    """The packed update's attention rate at ``head_dim`` (``ATTENTION_MFU``, linear between the measured head
    dimensions and held at the nearest outside them)."""
    (low, slow), (high, fast) = sorted(ATTENTION_MFU.items())
    share = min(1.0, max(0.0, (head_dim - low) / (high - low)))
    return slow + share * (fast - slow)


def micro_batch_flops(
    config, prompt_length: int, lengths: list[list[int]], budget: int
) -> list[tuple[float, float, int]]:
    """Forward+backward FLOPs of each micro-batch the actor packs these groups into (``lengths``: each group's
    response lengths; ``plan_packs``: a group over the budget is cut into packs that each carry the prompt):
    (the matrix products', attention's, the micro-batch's tokens)."""
    from longqa.model.packing import plan_packs

    n = len(lengths[0])
    prompts = [range(prompt_length)] * (len(lengths) * n)
    responses = [range(length) for group in lengths for length in group]
    members = [list(range(g * n, (g + 1) * n)) for g in range(len(lengths))]
    out = []
    for micro in plan_packs(prompts, responses, members, budget):
        counts = [group_flops(config, prompt_length, pack.response_lengths, True) for pack in micro]
        out.append(
            (
                sum(c.flops - c.attention for c in counts),
                sum(c.attention for c in counts),
                sum(c.tokens for c in counts),
            )
        )
    return out


def all_to_all_s(config, tokens: int, sequence_parallel: int, bandwidth: float = ALL_TO_ALL_BYTES_PER_S) -> float:
    """Seconds of one pass's all-to-alls over a row of ``tokens`` split over ``sequence_parallel`` ranks: per layer,
    the queries, keys, values and output (bf16) of the rank's share of the row, each sending (sp - 1)/sp of it;
    key/value heads fewer than sp are repeated to sp before theirs. A backward pass moves as much again."""
    sp = sequence_parallel
    if sp == 1:
        return 0.0
    heads = config.num_attention_heads
    kv = max(getattr(config, "num_key_value_heads", None) or heads, sp)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local = -(-tokens // sp)
    sent = 2 * local * head_dim * (2 * heads + 2 * kv) * (sp - 1) / sp
    return config.num_hidden_layers * sent / bandwidth


def plan_step_time(
    sizes: ModelSizes,
    plan: MemoryPlan,
    *,
    gpus_per_node: int,
    prompt_length: int,
    response_length: int | list[list[int]],
    n: int,
    batch_size: int,
    mini_batch_size: int,
    epochs: int,
    micro_batch_tokens: int,
    recomputed: float,
    cpu_offload: bool,
    strategy: str = "fsdp2",
    param_bytes: int = 2,
    activation_offload: float = 0.0,
    state_bytes: int | None = None,
    offloaded: float = 1.0,
    sequence_parallel: int = 1,
) -> StepTime:
    """One rank's seconds per phase of a GRPO step under ``plan`` (the module docstring says how); ``response_length``:
    every sample's, or each of the rank's groups' list of its samples' lengths; ``offloaded``: the share of an
    offloaded optimizer on the host (ZeRO-3's partial offload); ``sequence_parallel``: the ranks each packed row is
    split over (the groups a data-parallel rank updates are its sp ranks' samples: the rank's lengths, sp times)."""
    config, world, params = sizes.config, plan.world_size, sizes.params
    groups = max(1, batch_size // world)
    lengths = per_sample_lengths(response_length, n, groups)
    peak = H200_BF16_PEAK
    prefill = groups * group_flops(config, prompt_length, [], True).flops / 3 / (peak * PREFILL_MFU)
    floor = decode_floor_s(
        config, prompt_length, lengths, in_flight=min(groups, plan.kv_groups), dtype_bytes=param_bytes
    )
    decode = floor / DECODE_FRACTION_OF_FLOOR

    link = NVLINK_BYTES_PER_S if world <= gpus_per_node else NETWORK_BYTES_PER_S
    state_bytes = param_bytes if state_bytes is None else state_bytes  # the stepped weights' (FSDP2's shards)
    # Offloaded bytes a micro-batch brings in for each pass (forward, backward) and sends out after its backward.
    weights_in = gradients_out = 0.0
    if cpu_offload and strategy == "deepspeed":  # the bf16 partitions stay on the GPU; fp32 gradients go out
        gradients_out = offloaded * 4 * params / world
    elif cpu_offload:
        weights_in = gradients_out = state_bytes * params / world
    offload_rate = OFFLOAD_BYTES_PER_S[strategy]
    activations = (
        round(activation_offload * sizes.layers) * 2 * micro_batch_tokens * sum(saved_activation_widths(sizes))
    )
    sp = sequence_parallel
    activations = -(-activations // sp)  # (the rank's share of each row)
    update_lengths = lengths * sp  # the data-parallel rank's groups: its sp ranks' samples
    own = max(1, mini_batch_size // (world // sp))  # the data-parallel rank's share of each mini-batch
    minis = [update_lengths[start : start + own] for start in range(0, len(update_lengths), own)]
    flops = [f for mini in minis for f in micro_batch_flops(config, prompt_length, mini, micro_batch_tokens)]
    attention_rate = attention_mfu(config.head_dim)

    def pass_time(work: float, offloaded: float, activation_bytes: float, link_bytes: int, exchanges: float) -> float:
        """One pass over the micro-batches: ``work`` times their training FLOPs (a sp-th of them on this rank) and
        ``exchanges`` forward passes' worth of all-to-alls, against ``offloaded`` bytes of the offload's traffic,
        ``activation_bytes`` over PCIe each way and ``link_bytes`` per parameter over the link (sharded), whichever
        takes longest."""
        transfers = offloaded / offload_rate + activation_bytes / PCIE_BYTES_PER_S
        comm = link_bytes * params / link if world > 1 else 0.0
        return sum(
            max(
                work * (dense / (peak * UPDATE_MFU) + attention / (peak * attention_rate)) / sp
                + exchanges * all_to_all_s(config, tokens, sp),
                transfers,
                comm,
            )
            for dense, attention, tokens in flops
        )

    # a forward: its offloaded weights in once, one gather of bf16 weights
    old = pass_time(1 / 3, weights_in, 0.0, 2, 1) if epochs > 1 or len(minis) > 1 else 0.0
    # forward and backward: two gathers and a scatter
    update = epochs * pass_time(1 + recomputed / 3, 2 * weights_in + gradients_out, activations, 8, 2 + recomputed)
    steps = epochs * len(minis)
    if cpu_offload:
        host = HOST_ADAM_S_PER_PARAM[strategy] * (state_bytes / 4 if strategy == "fsdp2" else 1)
        per_param = offloaded * host + (1 - offloaded) * GPU_ADAM_S_PER_PARAM
    else:
        per_param = GPU_ADAM_S_PER_PARAM
    optimizer = steps * per_param * params / world
    refresh = 0.0
    if plan.rollout_weights:
        refresh = (param_bytes * params / link if world > 1 else 0.0) + weights_in / PCIE_BYTES_PER_S
    return StepTime(
        prefill=prefill,
        decode=decode,
        old_logprobs=old,
        update=update,
        optimizer=optimizer,
        refresh=refresh,
        micro_batches=len(flops),
        optimizer_steps=steps,
    )


def planned_lengths(cfg, world_size: int, response_length: int | None = None) -> int | list[list[int]]:
    """The response lengths a step is planned for: ``response_length`` for every sample if given; under
    ``rollout.response_lengths=lognormal`` a draw of a rank's groups' lengths from the trainer's distribution (seeded
    by ``trainer.seed`` and the group), since a group holds its slot until its longest sample ends, which a mean
    length misses; else every response at ``data.max_response_length``."""
    if response_length:
        return response_length
    top = cfg.data.max_response_length
    if cfg.rollout.response_lengths == "model":
        return top
    groups = max(1, cfg.data.train_batch_size // world_size)
    return [
        draw_response_lengths(cfg.rollout.response_lengths, cfg.rollout.n, top, (cfg.trainer.seed, 0, g, 0))
        for g in range(groups)
    ]


def step_time_config(
    cfg, sizes: ModelSizes, plan: MemoryPlan, gpus_per_node: int, response_length: int | None = None
) -> StepTime:
    """The step time of a longqa config under its memory plan; ``response_length``: the mean response
    length to plan for (default: ``planned_lengths``)."""
    return plan_step_time(
        sizes,
        plan,
        gpus_per_node=gpus_per_node,
        prompt_length=cfg.data.max_prompt_length,
        response_length=planned_lengths(cfg, plan.world_size, response_length),
        n=cfg.rollout.n,
        batch_size=cfg.data.train_batch_size,
        mini_batch_size=cfg.actor.ppo_mini_batch_size,
        epochs=cfg.actor.ppo_epochs,
        micro_batch_tokens=cfg.actor.max_tokens_per_micro_batch,
        recomputed=recomputed_fraction(cfg),
        cpu_offload=offloads(cfg)[0],
        strategy=cfg.actor.strategy,
        param_bytes=DTYPE_BYTES[cfg.model.dtype],
        activation_offload=cfg.model.activation_offload,
        state_bytes=master_bytes(cfg, plan.world_size),
        offloaded=offload_fraction(cfg, plan.world_size, sizes.params),
        sequence_parallel=cfg.actor.sequence_parallel_size,
    )
