"""Does a run fit a machine, GPUs and host memory together, and which is the largest known shape that does?

``longqa plan`` answers both: one config on one machine (the GPU plan, the node's host memory and the step
time, refused with advice when either memory does not fit), or with ``--largest`` every Qwen3 shape of
``longqa.model.shapes`` from the largest down, as the config asks and with the training state offloaded
(under ZeRO-3, where all of it does not fit the host, with the share of it that does), until one fits.
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
    plan_config,
    resolve_auto,
)


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


def check_run_plan(cfg, gpu: MemoryPlan, host: HostPlan, sizes: ModelSizes | None = None) -> None:
    """Refuse the run when either memory cannot hold it (PlanError naming what to change; with the model's
    ``sizes``, the largest micro-batch token budget that fits)."""
    check_config(cfg, gpu, sizes)
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
