"""What a machine supports of what a config or a command asks for: the devices and packages some choices need.

The config checks each value on its own (``config_schema.py``); whether this machine can run it depends on its
devices and installed packages, which a config file does not know. These checks run before any work:
``longqa config show`` and ``longqa train`` (where ``trainer.device`` names the device, else the trainer
once it has picked one) and the benches for their flags. Each problem is said in words naming the setting,
instead of a traceback from deep inside a kernel after the model has loaded and sampled.

Nothing here imports torch: ``longqa config show`` stays quick.
"""

from __future__ import annotations

import importlib.util
import os

from longqa.config import Config, ConfigError

# The optional package each metric sink needs (report.py imports it).
SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


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


def named_device_type(device: str) -> str | None:
    """The device type a ``trainer.device`` value names, None for ``auto`` (known only when the run starts)."""
    return None if device == "auto" else device.split(":")[0]


def check_machine(cfg: Config, device_type: str | None) -> None:
    """Refuse, in one ConfigError naming the settings, what this machine cannot run of ``cfg`` on ``device_type``
    (None: not known yet, so only the package checks)."""
    problems = [f"trainer.logger={sink} needs the {package} package: pip install {package}"
                for sink, package in SINK_PACKAGES.items() if sink in cfg.trainer.logger and not installed(package)]
    if device_type is not None:
        checks = {f"actor.attention_backend={cfg.actor.attention_backend}":
                  attention_backend_problem(cfg.actor.attention_backend, device_type),
                  f"model.attn_implementation={cfg.model.attn_implementation}":
                  attn_implementation_problem(cfg.model.attn_implementation, device_type)}
        problems += [f"{setting}: {problem}" for setting, problem in checks.items() if problem]
    if problems:
        raise ConfigError("; ".join(problems))
