"""Does a run fit a machine, GPUs and host memory together, and which is the largest known shape that does?

``longqa plan`` answers both: one config on one machine (the GPU plan, the node's host memory and the step
time, refused with advice when either memory does not fit), or with ``--largest`` every Qwen3 shape of
``longqa.model.shapes`` from the largest down, as the config asks and with the training state offloaded
(under ZeRO-3, where all of it does not fit the host, with the share of it that does), until one fits; and
for every shape the longest prompt it trains on the machine, without sequence parallelism and with the degree
that trains the longest (``longest_prompts``), beside the longest whose group's KV the fast engine holds on one
GPU at all (``longest_kv_prompt``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from longqa.planning.host_memory import HostPlan, check_host_plan, fitting_offload_ratio, plan_host_config
from longqa.planning.planner import (
    DTYPE_BYTES,
    MemoryPlan,
    ModelSizes,
    PlanError,
    check_config,
    longest_kv_prompt,
    one_sample_tokens,
    plan_config,
    resolve_auto,
    sequence_parallel_degrees,
    with_sequence_parallel,
)

PROMPT_STEP = 1024  # the longest prompts are found in steps of this many tokens
LONGEST_PROMPT = 1 << 20  # and searched up to this length


@dataclass
class Machine:
    gpus: int
    gpu_bytes: int
    gpus_per_node: int
    host_bytes: int  # per node

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


def plan_run(cfg, sizes: ModelSizes, machine: Machine) -> tuple[MemoryPlan, HostPlan]:
    """The GPU plan and the node's host plan of a config (its ``actor.max_tokens_per_micro_batch=auto`` filled for
    this model and machine first, as the trainer fills it; ``cfg`` is left as it is)."""
    cfg, _ = resolve_auto(cfg, machine.gpus, machine.gpu_bytes, sizes)
    return (
        plan_config(cfg, sizes, machine.gpus, machine.gpu_bytes),
        plan_host_config(cfg, sizes, machine.gpus, machine.ranks_per_node, machine.host_bytes),
    )


def check_run_plan(
    cfg, gpu: MemoryPlan, host: HostPlan, sizes: ModelSizes | None = None, gpus_per_node: int | None = None
) -> None:
    """Refuse the run when either memory cannot hold it (PlanError naming what to change; with the model's
    ``sizes``, the largest micro-batch token budget and the smallest sequence-parallel degree that fit)."""
    check_config(cfg, gpu, sizes, gpus_per_node)
    check_host_plan(host, gpu.world_size, DTYPE_BYTES[cfg.model.dtype])


def shape_sizes(shape: str) -> ModelSizes:
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES

    return ModelSizes.from_config(Qwen3Config(**SHAPES[shape]))


@dataclass
class Attempt:
    shape: str
    cpu_offload: bool
    error: str | None  # None: it fits
    gpu: MemoryPlan
    host: HostPlan
    offload_ratio: float = 1.0  # actor.cpu_offload_ratio


def largest_shape(cfg, machine: Machine) -> list[Attempt]:
    """Every Qwen3 shape from the largest down, as ``cfg`` asks and then with ``actor.cpu_offload=true`` (and
    under ZeRO-3 the largest ``actor.cpu_offload_ratio`` the host holds, if the whole optimizer is too much
    for it), until one fits; the last attempt is the answer when its ``error`` is None."""
    from longqa.model.shapes import SHAPES

    sizes = {shape: shape_sizes(shape) for shape in SHAPES}
    attempts = []
    for shape in sorted(SHAPES, key=lambda s: sizes[s].params, reverse=True):
        trials = [(offload, cfg.actor.cpu_offload_ratio) for offload in sorted({cfg.actor.cpu_offload, True})]
        while trials:
            offload, ratio = trials.pop(0)
            trial = copy.deepcopy(cfg)
            trial.actor.cpu_offload, trial.actor.cpu_offload_ratio = offload, ratio if offload else 1.0
            trial, _ = resolve_auto(
                trial, machine.gpus, machine.gpu_bytes, sizes[shape]
            )  # (the check's advice names it)
            gpu, host = plan_run(trial, sizes[shape], machine)
            try:
                check_run_plan(trial, gpu, host)
            except PlanError as e:
                attempts.append(Attempt(shape, offload, str(e), gpu, host, trial.actor.cpu_offload_ratio))
                host_alone = gpu.total <= gpu.gpu_bytes and host.peak > host.host_bytes  # the host alone is short
                share = fitting_offload_ratio(host) if offload and host_alone else None
                if share is not None and share < trial.actor.cpu_offload_ratio:
                    trials.append((True, share))
                continue
            attempts.append(Attempt(shape, offload, None, gpu, host, trial.actor.cpu_offload_ratio))
            return attempts
    return attempts


@dataclass
class LongestPrompt:
    """The longest prompts one shape trains on a machine (None: not even ``PROMPT_STEP`` tokens)."""

    shape: str
    plain: int | None  # without sequence parallelism
    parallel: int | None  # with ``degree``, the degree that trains the longest
    degree: int
    kv_limit: int  # the longest whose group's KV one GPU holds beside the engine's weights alone
    cpu_offload: bool = False  # actor.cpu_offload, as the config asks or turned on where nothing trains without


def trains_prompt(cfg, sizes: ModelSizes, machine: Machine, prompt_length: int) -> bool:
    """Whether ``cfg`` trains prompts of ``prompt_length`` tokens on ``machine``: its GPU and host plans fit at the
    least micro-batch budget, one sample's (a smaller one saves nothing: a sample never splits)."""
    trial = copy.deepcopy(cfg)
    trial.data.max_prompt_length = prompt_length
    trial.actor.max_tokens_per_micro_batch = one_sample_tokens(trial)
    gpu = plan_config(trial, sizes, machine.gpus, machine.gpu_bytes)
    host = plan_host_config(trial, sizes, machine.gpus, machine.ranks_per_node, machine.host_bytes)
    fits_gpu = gpu.loading <= gpu.gpu_bytes and gpu.total <= gpu.gpu_bytes
    return fits_gpu and host.peak <= host.host_bytes


def longest_prompt(cfg, sizes: ModelSizes, machine: Machine) -> int | None:
    """The longest ``data.max_prompt_length``, in steps of ``PROMPT_STEP`` up to ``LONGEST_PROMPT``, that ``cfg``
    trains on ``machine`` (its responses, n and batch as they are). Memory grows with the prompt, so a bisection
    finds it."""
    if not trains_prompt(cfg, sizes, machine, PROMPT_STEP):
        return None
    low, high = 1, LONGEST_PROMPT // PROMPT_STEP  # in steps: trains at low
    if trains_prompt(cfg, sizes, machine, high * PROMPT_STEP):
        return high * PROMPT_STEP
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if trains_prompt(cfg, sizes, machine, middle * PROMPT_STEP) else (low, middle)
    return low * PROMPT_STEP


def longest_prompts(cfg, machine: Machine) -> list[LongestPrompt]:
    """For every Qwen3 shape, largest first, the longest prompt ``cfg`` trains on ``machine`` without sequence
    parallelism and with each degree the machine allows (``sequence_parallel_degrees``: within a node), the
    longest of those kept, and the fast engine's own limit (``longest_kv_prompt``). Where the config keeps the
    training state on the GPUs, also with ``actor.cpu_offload=true``, which is kept where it trains longer."""
    from longqa.model.shapes import SHAPES

    rows = []
    for shape in sorted(SHAPES, key=lambda s: shape_sizes(s).params, reverse=True):
        sizes = shape_sizes(shape)
        row = shape_longest_prompts(cfg, shape, sizes, machine)
        if not cfg.actor.cpu_offload:
            offloaded = copy.deepcopy(cfg)
            offloaded.actor.cpu_offload = True
            other = shape_longest_prompts(offloaded, shape, sizes, machine)
            row = other if (other.parallel or 0) > (row.parallel or 0) else row
        rows.append(row)
    return rows


def shape_longest_prompts(cfg, shape: str, sizes: ModelSizes, machine: Machine) -> LongestPrompt:
    """One shape's row of ``longest_prompts``, as ``cfg`` asks."""
    plain = longest_prompt(with_sequence_parallel(cfg, 1), sizes, machine)
    best, degree = plain, 1
    for trial in sequence_parallel_degrees(sizes, machine.gpus, machine.gpus_per_node)[1:]:
        length = longest_prompt(with_sequence_parallel(cfg, trial), sizes, machine)
        if length is not None and (best is None or length > best):
            best, degree = length, trial
    kv_limit = longest_kv_prompt(
        sizes, machine.gpu_bytes, cfg.data.max_response_length, cfg.rollout.n, DTYPE_BYTES[cfg.model.dtype]
    )
    return LongestPrompt(shape, plain, best, degree, kv_limit, cfg.actor.cpu_offload)
