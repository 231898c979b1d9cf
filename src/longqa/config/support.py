"""What a machine supports of what a config or a command asks for: the devices and packages some choices need.

The config checks each value on its own (``config/schema.py``); whether this machine can run it depends on its
devices and installed packages, which a config file does not know. These checks run before any work, the same
in ``longqa config show`` and ``longqa train`` (the trainer once it has picked its device; under
``trainer.launcher=ray`` the driver, then each worker on its own machine) and in the benches for their flags.
Each problem is said in words naming the setting, instead of a traceback from deep inside a kernel after the
model has loaded and sampled, or an exit status of 0 from ``config show`` for what ``train`` refuses.

Nothing here imports torch but ``run_device_type``, which asks it for the devices.
"""

from __future__ import annotations

import importlib.util
import os

from longqa.config.schema import Config, ConfigError

# The optional package a setting's value needs, and how to install it (each is imported where it is used).
PACKAGES = {"trainer.logger=tensorboard": ("tensorboard", "pip install tensorboard"),
            "trainer.logger=wandb": ("wandb", "pip install wandb"),
            "rollout.engine=vllm": ("vllm", "pip install 'longqa[vllm]'"),
            "actor.strategy=deepspeed": ("deepspeed", "pip install 'longqa[deepspeed]'"),
            "trainer.launcher=ray": ("ray", "pip install 'longqa[ray]'")}


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module left half-imported
        return False


def attention_backend_problem(backend: str, device_type: str) -> str | None:
    """Why the packed update cannot use ``backend`` (``actor.attention_backend``) on ``device_type``; None if it can."""
    if backend == "flex" and device_type != "cuda":
        return f"flex_attention has no backward pass on {device_type}: use dense or split (auto picks dense there)"
    return None


def attn_implementation_problem(implementation: str, device_type: str) -> str | None:
    """Why transformers cannot load a model with ``implementation`` (``model.attn_implementation``) here."""
    if implementation == "flash_attention_2":
        if device_type != "cuda":
            return f"FlashAttention 2 runs on CUDA devices, not on {device_type}: use sdpa"
        if not installed("flash_attn"):
            return "FlashAttention 2 needs the flash_attn package: pip install flash-attn, or use sdpa"
    return None


def decode_kernel_problem(kernel: str, device_type: str) -> str | None:
    """Why the fast engine cannot decode with ``kernel`` on ``device_type``; None if it can."""
    if kernel != "triton":
        return None
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # (the first thing to fix)
        return (f"the Triton kernel runs on CUDA devices, not on {device_type} (there only in Triton's interpreter, "
                f"with TRITON_INTERPRET=1): use bmm")
    if not installed("triton"):
        return "the Triton kernel needs the triton package: pip install triton, or use bmm"
    return None


def run_device_type(cfg: Config) -> str | None:
    """The device type a run of ``cfg`` started here trains on: ``trainer.device`` as the trainer picks it (auto:
    a GPU when there is one), refused in the trainer's words where this machine has no such device; None under
    ``trainer.launcher=ray``, whose workers pick theirs on their own machines."""
    if cfg.trainer.launcher == "ray":
        return None
    from longqa.model.load import pick_device

    return pick_device(cfg.trainer.device).type


def _package_problems(cfg: Config) -> list[str]:
    """The settings of ``cfg`` whose package is not installed here. Under ``trainer.launcher=ray`` this machine
    only drives the Ray Train workers: it needs Ray, and each worker checks the rest on its own machine."""
    if cfg.trainer.launcher == "ray":
        chosen = ["trainer.launcher=ray"]
    else:
        chosen = [f"rollout.engine={cfg.rollout.engine}", f"actor.strategy={cfg.actor.strategy}",
                  *(f"trainer.logger={sink}" for sink in cfg.trainer.logger)]
    return [f"{setting} needs the {PACKAGES[setting][0]} package: {PACKAGES[setting][1]}"
            for setting in chosen if setting in PACKAGES and not installed(PACKAGES[setting][0])]


def check_machine(cfg: Config, device_type: str | None) -> None:
    """Refuse, in one ConfigError naming the settings, what this machine cannot run of ``cfg`` on ``device_type``
    (None: not this machine's, so only the package checks): the packages its settings need, and what the device
    cannot do."""
    problems = _package_problems(cfg)
    if device_type is not None:
        checks = {f"actor.attention_backend={cfg.actor.attention_backend}":
                  attention_backend_problem(cfg.actor.attention_backend, device_type),
                  f"model.attn_implementation={cfg.model.attn_implementation}":
                  attn_implementation_problem(cfg.model.attn_implementation, device_type)}
        problems += [f"{setting}: {problem}" for setting, problem in checks.items() if problem]
    if problems:
        raise ConfigError("; ".join(problems))
