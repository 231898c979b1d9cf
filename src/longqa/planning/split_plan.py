"""How to split a job's GPUs between sampling and training (``rollout.sampler_ranks``), and the step each split gives.

With S sampler ranks and T = G - S training ranks under ``rollout.mode=one_step_off``, the samplers sample step
k + 1 while the training ranks update on step k, so a step takes the longer of the two, then the new weights'
gather over the training ranks and broadcast to the samplers. Each side is timed with the step-time model
(``step_time``): the samplers' prefill and decode of the whole batch over S GPUs that hold only the model and
their KV cache; the training ranks' old log-probs, update and optimizer over T GPUs that hold no engine. A split
fits when its T training ranks could run the config (``training_error``: the batch shared out as the trainer
requires, their memory plan fitting their GPUs). ``longqa plan --split`` prints every split next to the
synchronous, colocated step on all G GPUs, which must meet the same rule with T = G, and proposes the fastest
layout that fits.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from longqa.config import ConfigError
from longqa.config.checks import check_data_parallel
from longqa.config.command_options import check_split_gpus
from longqa.planning.fit import Machine
from longqa.planning.planner import DTYPE_BYTES, ModelSizes, PlanError, check_config, kv_bytes_per_group, plan_config
from longqa.planning.step_time import NETWORK_BYTES_PER_S, NVLINK_BYTES_PER_S, StepTime, seconds, step_time_config
from longqa.rollout.base import SAMPLER_KV_SHARE


@dataclass
class SplitPlan:
    samplers: int
    trainers: int
    rollout_s: float  # the samplers' prefill and decode of one step
    training_s: float  # the training ranks' old log-probs, update and optimizer steps
    weights_s: float  # the new weights gathered over the training ranks and broadcast to the samplers
    error: str | None = None  # why this split cannot run (None: it fits)

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.training_s) + self.weights_s


@dataclass
class Colocated:
    step: StepTime  # every GPU sampling, then training
    error: str | None = None  # why the G GPUs cannot run it so (None: it fits)


def training_error(cfg, sizes: ModelSizes, ranks: int, plan) -> str | None:
    """Why ``ranks`` training ranks cannot run ``cfg`` under their memory ``plan``, in the words `longqa plan
    --gpus` and the trainer refuse it with (None: they can): the one rule for every layout ``--split`` shows."""
    try:
        check_data_parallel(cfg, ranks)
        check_config(cfg, plan, sizes)
    except (ConfigError, PlanError) as e:
        return str(e)
    return None


def sampler_kv_groups(cfg, sizes: ModelSizes, gpu_bytes: int, groups: int) -> int:
    """Groups a sampler's KV cache holds at once: its budget (``rollout.kv_cache_bytes``, or a sampler's share of
    what the model leaves free on its GPU) over one group's, at most the ``groups`` it samples."""
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    budget = cfg.rollout.kv_cache_bytes or int(SAMPLER_KV_SHARE * max(0, gpu_bytes - param_bytes * sizes.params))
    one = kv_bytes_per_group(
        sizes, cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.rollout.n, param_bytes
    )
    return max(1, min(groups, budget // one))


def plan_split(
    cfg, sizes: ModelSizes, machine: Machine, samplers: int, response_length: int | None = None
) -> SplitPlan:
    """The step of ``samplers`` sampler ranks and ``machine.gpus - samplers`` training ranks (see the module)."""
    trainers = machine.gpus - samplers
    per_node = machine.gpus_per_node
    apart = copy.deepcopy(cfg)
    apart.rollout.sampler_ranks, apart.rollout.mode = samplers, "one_step_off"
    train_plan = plan_config(apart, sizes, trainers, machine.gpu_bytes)  # (a training rank's: no engine)
    error = training_error(apart, sizes, trainers, train_plan)
    training = step_time_config(apart, sizes, train_plan, per_node, response_length)
    groups = -(-cfg.data.train_batch_size // samplers)
    sample_plan = dataclasses.replace(
        plan_config(cfg, sizes, samplers, machine.gpu_bytes),
        kv_groups=sampler_kv_groups(cfg, sizes, machine.gpu_bytes, groups),
    )
    rollout = step_time_config(cfg, sizes, sample_plan, per_node, response_length)
    link = NVLINK_BYTES_PER_S if machine.gpus <= per_node else NETWORK_BYTES_PER_S
    weights = DTYPE_BYTES[cfg.model.dtype] * sizes.params / link * (2 if trainers > 1 else 1)
    return SplitPlan(
        samplers,
        trainers,
        rollout.prefill + rollout.decode,
        training.old_logprobs + training.update + training.optimizer,
        weights,
        error,
    )


def plan_splits(
    cfg, sizes: ModelSizes, machine: Machine, response_length: int | None = None
) -> tuple[Colocated, list[SplitPlan]]:
    """The synchronous, colocated step on all the GPUs, and every split of them (1 to G - 1 samplers)."""
    check_split_gpus(machine.gpus)
    together = copy.deepcopy(cfg)
    together.rollout.sampler_ranks = 0  # (whatever the config sets: each split sets its own)
    plan = plan_config(together, sizes, machine.gpus, machine.gpu_bytes)
    colocated = Colocated(
        step_time_config(together, sizes, plan, machine.gpus_per_node, response_length),
        training_error(together, sizes, machine.gpus, plan),
    )
    return colocated, [plan_split(together, sizes, machine, s, response_length) for s in range(1, machine.gpus)]


def best_split(splits: list[SplitPlan]) -> SplitPlan | None:
    """The fastest split that fits (the fewest samplers among equals), or None."""
    fitting = [s for s in splits if s.error is None]
    return min(fitting, key=lambda s: (s.step_s, s.samplers)) if fitting else None


def _fits(error: str | None) -> str:
    return "yes" if error is None else "no: " + error.splitlines()[0]


def splits_table(colocated: Colocated, splits: list[SplitPlan]) -> str:
    lines = [
        f"  {'sampler ranks':>13} {'training ranks':>14} {'rollout s':>10} {'training s':>10} {'weights s':>9} "
        f"{'step s':>8}  fits"
    ]
    for s in splits:
        lines.append(
            f"  {s.samplers:>13} {s.trainers:>14} {seconds(s.rollout_s):>10} {seconds(s.training_s):>10} "
            f"{seconds(s.weights_s):>9} {seconds(s.step_s):>8}  {_fits(s.error)}"
        )
    lines.append(
        f"  synchronous, every GPU sampling then training: {seconds(colocated.step.total)} s a step; fits: "
        f"{_fits(colocated.error)}"
    )
    return "\n".join(lines)
