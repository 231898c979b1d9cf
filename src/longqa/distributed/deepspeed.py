"""DeepSpeed ZeRO-3 as the actor's sharding (``actor.strategy=deepspeed``), beside FSDP2.

The reference recipe trains with ZeRO-3 and steps its offloaded optimizer with DeepSpeed's CPU Adam
(vectorised C++ over the host's cores, where torch's Adam on host tensors is far slower), and its users
bring DeepSpeed config files. The engine is built here from longqa's own settings, with the user's file
merged over them, and keeps what the actor's update relies on:

- exact accumulation: every micro-batch loss is already divided by the global mini-batch's counts, so
  the engine must not divide it again by its accumulation steps, and the accumulation boundary is the
  mini-batch's last micro-batch (however many the token budget cut), set by the actor, not counted;
- clipping as longqa clips: ZeRO-3's step scales the gradient by ``grad_clip / (norm + 1e-6)`` above the
  limit (torch's ``clip_grad_norm_`` rule) and skips a step whose norm is not finite;
- the precision of FSDP2's: bf16 compute where the model is bf16 or on a GPU, fp32 master weights,
  gradients accumulated and reduced in fp32.

Checkpoints are DeepSpeed's own (each rank writes its partitions) and resume on the same number of
ranks; ``fp32_state_dict`` rebuilds whole weights from them in one process, for an HF export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from longqa.config import Config, ConfigError

INSTALL = "pip install 'longqa[deepspeed]'"
TAG = "deepspeed"  # the engine's folder inside a longqa checkpoint

# What longqa sets itself; a user's file may leave these out or set them to "auto" (as files written for
# the HF Trainer or verl do), and any other value is refused rather than silently overridden.
OWNED = {
    "train_batch_size": "data.train_batch_size",
    "train_micro_batch_size_per_gpu": "actor.max_tokens_per_micro_batch",
    "gradient_accumulation_steps": "actor.ppo_mini_batch_size (each mini-batch is accumulated exactly)",
    "gradient_clipping": "actor.grad_clip",
    "optimizer": "actor.lr, actor.betas and actor.weight_decay (AdamW; DeepSpeed's CPU Adam when offloaded)",
    "scheduler": "actor.warmup_ratio, actor.schedule_updates, actor.lr_schedule and actor.min_lr_ratio",
}


class DeepSpeedError(ConfigError):
    """DeepSpeed cannot run the update as set up: not installed, its CPU Adam not built, an
    ``actor.deepspeed_config`` file that cannot be read or sets what longqa sets, a device it does not train on, or
    a checkpoint written by another number of ranks. Each message names the setting or the step to take."""


def import_deepspeed():
    """The ``deepspeed`` package, or a DeepSpeedError saying how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise DeepSpeedError(
            f"actor.strategy=deepspeed needs DeepSpeed, which cannot be imported ({e}): {INSTALL}"
        ) from None
    return deepspeed


# ------------------------------------------------------------------------------------------------ config


def generated_config(cfg: Config, device: torch.device, dtype: torch.dtype) -> dict:
    """The engine's config from longqa's settings alone. Micro-batch and accumulation counts are bookkeeping
    for DeepSpeed only: the actor forms its own micro-batches and sets every accumulation boundary.

    ZeRO-3's memory-efficient linear is off: it replaces ``torch.nn.functional.linear`` for the whole process
    with an autograd function that reads each weight's ZeRO attributes, so compiled decoder layers guarded on
    every weight's id and recompiled for each (on an H200 the update's warm-up did not end in 280 s; without
    it, 40 s), and the engine's decode ran through it too. Each layer is gathered whole around its backward
    anyway (``wrap``), which is what that function would gather a weight for."""
    zero = {
        "stage": 3,
        "overlap_comm": device.type == "cuda",
        "contiguous_gradients": True,
        "memory_efficient_linear": False,
    }
    if cfg.actor.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        if cfg.actor.cpu_offload_ratio != 1:
            zero["offload_optimizer"]["ratio"] = cfg.actor.cpu_offload_ratio
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.actor.grad_clip,
        "bf16": {"enabled": dtype == torch.bfloat16 or device.type == "cuda"},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": zero,
        "steps_per_print": 2**62,
    }


def read_user_config(path: str) -> dict:
    """A DeepSpeed config file: JSON, or YAML (which also reads JSON)."""
    file = Path(path)
    if not file.is_file():
        raise DeepSpeedError(f"actor.deepspeed_config={path}: no such file")
    try:
        tree = json.loads(file.read_text()) if file.suffix == ".json" else yaml.safe_load(file.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise DeepSpeedError(f"actor.deepspeed_config={path} cannot be read: {e}") from None
    if not isinstance(tree, dict):
        raise DeepSpeedError(f"actor.deepspeed_config={path} must hold a mapping of DeepSpeed settings")
    return tree


def _without_auto(tree: dict) -> dict:
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in tree.items() if v != "auto"}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def engine_config(cfg: Config, device: torch.device, dtype: torch.dtype) -> dict:
    """The generated config with ``actor.deepspeed_config`` merged over it, checked."""
    config = generated_config(cfg, device, dtype)
    path = cfg.actor.deepspeed_config
    if not path:
        return config
    user = _without_auto(read_user_config(path))
    clashes = [f"'{key}' (longqa sets it from {OWNED[key]})" for key in OWNED if key in user]
    if clashes:
        raise DeepSpeedError(f'actor.deepspeed_config={path} sets {", ".join(clashes)}: remove it or set it to "auto"')
    config = _merge(config, user)
    zero = config["zero_optimization"]
    if zero.get("stage") != 3:
        raise DeepSpeedError(
            f"actor.deepspeed_config={path} sets zero_optimization.stage={zero.get('stage')}: "
            f"actor.strategy=deepspeed runs ZeRO stage 3"
        )
    if zero.get("memory_efficient_linear"):
        raise DeepSpeedError(
            f"actor.deepspeed_config={path} sets zero_optimization.memory_efficient_linear: it "
            f"replaces torch.nn.functional.linear in the whole process, which makes the compiled "
            f"decoder layers recompile for every weight; remove it (longqa gathers each layer whole)"
        )
    return config


def optimizer_offloaded(config: dict) -> bool:
    """Whether the engine steps the optimizer off the accelerator (then with DeepSpeed's CPU Adam)."""
    offload = config["zero_optimization"].get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme")


# --------------------------------------------------------------------------------------------- CPU Adam


def load_cpu_adam() -> None:
    """Build (on first use; cached afterwards) or load DeepSpeed's CPU Adam, or say why it cannot be."""
    from deepspeed.git_version_info import installed_ops

    compiler = os.environ.get("CXX", "c++")
    if not installed_ops.get("cpu_adam") and shutil.which(compiler) is None:
        raise DeepSpeedError(
            f"DeepSpeed's CPU Adam (the offloaded optimizer under actor.strategy=deepspeed) is compiled "
            f"on first use, but there is no C++ compiler ({compiler} is not on PATH): install one "
            f"(apt-get install g++), or install DeepSpeed with it prebuilt (DS_BUILD_CPU_ADAM=1 "
            f"pip install deepspeed), or set actor.cpu_offload=false"
        )
    from deepspeed.ops.op_builder import CPUAdamBuilder

    try:
        CPUAdamBuilder().load()
    except (RuntimeError, OSError, ImportError) as e:
        raise DeepSpeedError(
            f"DeepSpeed's CPU Adam (the offloaded optimizer under actor.strategy=deepspeed) could not "
            f"be built: {e}; or set actor.cpu_offload=false"
        ) from e


def make_optimizer(params, cfg: Config, offloaded: bool) -> torch.optim.Optimizer:
    """AdamW on the accelerator, or DeepSpeed's CPU Adam (in its AdamW mode) for an offloaded optimizer."""
    a = cfg.actor
    options = {"lr": a.lr, "betas": tuple(a.betas), "weight_decay": a.weight_decay}
    if not offloaded:
        return torch.optim.AdamW(params, **options)
    load_cpu_adam()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **options)


def check_deepspeed(cfg: Config, device: torch.device) -> None:
    """What ``actor.strategy=deepspeed`` needs of its file and of this machine, checked before any weight loads: a
    usable ``actor.deepspeed_config``, and CPU Adam built where it will be used. (Its rules between settings are in
    ``config/checks.py``, its import in ``config/support.py``'s ``check_imports``.)"""
    if cfg.actor.strategy != "deepspeed":
        return
    config = engine_config(cfg, device, getattr(torch, cfg.model.dtype))
    if optimizer_offloaded(config):
        load_cpu_adam()


# --------------------------------------------------------------------------------------------- the engine


def skip_inference_comm_op() -> None:
    """On its CPU accelerator DeepSpeed compiles a shared-memory all-reduce (a C++ op, about a minute on
    2 cores) whenever its communication backend starts, for its inference kernels only: training's
    collectives go through the process group (gloo) either way. The op is marked unavailable instead, so
    ZeRO-3 on the CPU compiles nothing unless the optimizer is offloaded (then CPU Adam)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def use_accelerator(device: torch.device) -> None:
    """Make DeepSpeed's accelerator the training device's. DeepSpeed picks one from what the host has, so a CPU
    run on a host with a GPU would have its engine move the model to cuda:0 and give rank r GPU r (an invalid
    device where there are fewer GPUs than ranks)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == device.type:
        return
    if device.type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    elif device.type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        raise DeepSpeedError(f"actor.strategy=deepspeed trains on a CPU or a CUDA GPU, not on {device.type}")
    set_accelerator(Accelerator())


def wrap(scorer: torch.nn.Module, cfg: Config, device: torch.device):
    """``(engine, optimizer)``: ``scorer`` inside a ZeRO-3 engine over the default process group, and the
    optimizer the engine steps (the one a learning-rate schedule is attached to).

    Each decoder layer is gathered whole around its forward and backward (a ZeRO-3 "leaf", as FSDP2 shards
    per layer): no hooks run inside a layer, so compiling its forward traces none of DeepSpeed's (with
    hooks on every projection, Dynamo recompiled each hook per layer). The scorer reads the LM head's
    weight without calling the head module, so that weight is registered with the scorer: ZeRO-3 gathers
    it around the scorer's forward and backward like a module's own."""
    import torch.distributed as dist

    deepspeed = import_deepspeed()
    if not dist.is_initialized():
        raise RuntimeError("actor.strategy=deepspeed needs a process group, even of one rank (the trainer makes one)")
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; torchrun and Ray set it, a lone process need not
    dtype = next(scorer.parameters()).dtype
    config = engine_config(cfg, device, dtype)
    optimizer = make_optimizer(scorer.parameters(), cfg, optimizer_offloaded(config))
    for layer in scorer.model.base_model.layers:
        deepspeed.utils.set_z3_leaf_module(layer, True)
    use_accelerator(device)
    skip_inference_comm_op()  # (on the accelerator just chosen: the op is the CPU accelerator's)
    forget_world_group_clone()
    engine, _, _, _ = deepspeed.initialize(model=scorer, optimizer=optimizer, config=config)
    head = scorer.model.get_output_embeddings()
    deepspeed.zero.register_external_parameter(scorer, head.weight)
    return engine, optimizer


def forget_world_group_clone() -> None:
    """Drop DeepSpeed's cached clone of the world process group. It clones the group once per process and keeps
    it, so a second run in the same process (a process group destroyed and made anew, as the trainer does around
    each run) would hand ZeRO-3 a group of the old one and fail ("Group ... is not registered")."""
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None


def backward(engine, loss: torch.Tensor, boundary: bool) -> None:
    """Add ``loss``'s gradient as it is (no division by accumulation steps); ``boundary``: the mini-batch's
    last micro-batch, after which the gradient is complete and the step may follow."""
    engine.set_gradient_accumulation_boundary(boundary)
    engine.backward(loss, scale_wrt_gas=False)


def accelerator_part(engine) -> tuple[torch.optim.Optimizer | None, dict[int, torch.Tensor]]:
    """Under a partial offload (``offload_optimizer.ratio`` below 1), the torch AdamW that ZeRO-3 steps its
    sub-groups left on the accelerator with, and those sub-groups' float32 weights by sub-group index; else
    ``(None, {})``. DeepSpeed builds that optimizer once, from the offloaded one's settings at that moment, and
    its checkpoints hold the offloaded optimizer's state alone: longqa keeps both in step."""
    zero = engine.optimizer
    backup = getattr(zero, "backup_optimizer", None)
    if backup is None:
        return None, {}
    flats = zero.fp32_partitioned_groups_flat
    return backup, {i: flats[i] for i, where in zero.subgroup_to_device.items() if where != "cpu"}


def step(engine) -> float:
    """Clip and apply the accumulated gradient; returns its global norm before clipping (not finite: the
    engine skipped the step and dropped the gradient).

    Under a partial offload the accelerator's AdamW first takes the offloaded one's learning rate (the
    schedule moves only that one) and its other settings."""
    backup, _ = accelerator_part(engine)
    if backup is not None:
        for source, target in zip(engine.optimizer.optimizer.param_groups, backup.param_groups):
            target.update({key: source[key] for key in ("lr", "betas", "eps", "weight_decay")})
    engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def zero_grad(engine) -> None:
    """Drop an accumulated gradient without stepping."""
    engine.optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------- checkpoints


def save(engine, folder: Path) -> None:
    """Every rank writes its partitions of the weights and optimizer state under ``folder / TAG``."""
    engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
    backup, flats = accelerator_part(engine)
    if backup is not None:
        state = {
            i: {key: value.cpu() for key, value in backup.state.get(flat, {}).items()} for i, flat in flats.items()
        }
        torch.save(state, folder / TAG / accelerator_state_file(engine))


def saved_ranks(folder: Path) -> int:
    """How many ranks wrote the engine checkpoint in ``folder``."""
    return len(list((folder / TAG).glob("*_optim_states.pt")))


def load(engine, folder: Path) -> None:
    """Restore weights and optimizer state written by :func:`save` (on the same number of ranks, and with the
    optimizer split between host and accelerator as it was)."""
    _, flats = accelerator_part(engine)
    path = folder / TAG / accelerator_state_file(engine)
    state = torch.load(path, weights_only=True) if path.is_file() else {}
    if sorted(state) != sorted(flats):
        saved, now = (
            f"the optimizer's sub-groups {sorted(groups)} on the accelerator, the rest offloaded"
            if groups
            else "no partly offloaded optimizer"
            for groups in (state, flats)
        )
        raise DeepSpeedError(
            f"checkpoint {folder} was written with {saved}, this run has {now}: resume it with the "
            f"actor.cpu_offload_ratio (and zero_optimization.sub_group_size) it was written with"
        )
    engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    backup, flats = accelerator_part(engine)  # (the partitions the engine holds now)
    for i, moments in state.items():
        if moments:  # (none before the first step)
            backup.state[flats[i]] = {
                key: value if key == "step" else value.to(flats[i].device) for key, value in moments.items()
            }


def accelerator_state_file(engine) -> str:
    """This rank's file of the accelerator's AdamW state under a partial offload, beside DeepSpeed's own."""
    return f"rank{engine.global_rank}_accelerator_adamw.pt"


def fp32_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The model's whole fp32 weights from a checkpoint written by :func:`save`, in one process (no group),
    keyed as the HF model's own ``state_dict``."""
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}
