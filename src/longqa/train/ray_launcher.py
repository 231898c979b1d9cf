"""``trainer.launcher=ray``: the same training function on Ray Train workers, restarted after failures.

Ray Train's ``TorchTrainer`` starts one worker per GPU slot (or ``trainer.ray_workers``), joins them
in a torch process group (NCCL on GPUs, gloo otherwise) and sets RANK/LOCAL_RANK/WORLD_SIZE, so each
worker runs ``longqa.train`` exactly as a torchrun rank would. When a worker dies, Ray tears the group
down and starts it again, up to ``trainer.max_failures`` times; the trainer resumes from the last
checkpoint in ``trainer.output_dir`` (``trainer.resume=auto``), which must be on storage every node
sees. Relative paths are made absolute first, since Ray workers run in their own folders.

SIGTERM to the driver (the ``longqa train`` process) stops the workers after a step with a checkpoint,
as it stops a torchrun run (``longqa.train.preemption``): the workers train in threads, where no signal
handler can be installed, so the driver passes the request on through a file in the run folder, and
rank 0 answers with the step it stopped at through another. (Ray Train answers Ctrl-C in the driver
itself, by aborting the run.)

Ray starts its workers with the cluster's environment, not the driver's: the variables the reward reads when it
scores (``longqa.reward.ENVIRONMENT_VARIABLES``: ``REWARD_CALC_TYPE`` and the recipe's knobs) that are set where
``longqa train`` runs go to the workers through ``ray.init``'s ``runtime_env``, and the launch says which.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from longqa.config import Config, ConfigError, load_config_dict, to_dict
from longqa.reward import ENVIRONMENT_VARIABLES
from longqa.train.preemption import forward_stop_requests, preempted_message


class RayClusterError(ConfigError):
    """``trainer.launcher=ray`` cannot start as set: Ray Train is not installed, or the cluster has too few GPUs (or
    CPUs) for ``trainer.ray_workers`` workers. The message says what to install, add or set."""


def _folder(path: str) -> str:
    """A folder as an absolute path, ``~`` expanded (resolved as it stands, it would be a folder named ``~`` in the
    working folder)."""
    return str(Path(path).expanduser().resolve())


def _absolute(cfg: Config) -> Config:
    """The config the workers run: every path absolute (with ``~`` expanded), since they run in folders of their
    own, and ``trainer.resume=none`` as ``auto``: the driver has checked that the run folder holds no other run
    (``check_before_workers``), so a first start finds nothing to resume and starts fresh, and a restart after a
    failure resumes this run's own last checkpoint instead of refusing (or replacing) it."""

    def fix(path):
        return _folder(path) if path and Path(path).expanduser().exists() else path

    resume = cfg.trainer.resume
    resume = "auto" if resume == "none" else resume if resume == "auto" else fix(resume)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=fix(cfg.model.path), tokenizer_path=fix(cfg.model.tokenizer_path)),
        data=dataclasses.replace(
            cfg.data,
            train_files=[fix(p) for p in cfg.data.train_files],
            val_files=[fix(p) for p in cfg.data.val_files],
            cache_dir=_folder(cfg.data.cache_dir) if cfg.data.cache_dir else None,
        ),
        reward=dataclasses.replace(cfg.reward, path=fix(cfg.reward.path)),
        trainer=dataclasses.replace(
            cfg.trainer, launcher="local", output_dir=_folder(cfg.trainer.output_dir), resume=resume
        ),
    )


def _user_error_types() -> tuple[type[Exception], ...]:
    """The errors that are the user's to fix (a config, data file, checkpoint or model mistake), which the command
    line reports in one line."""
    from longqa.data.io import DataFileError
    from longqa.model.load import ModelError
    from longqa.model.tokenizer import TokenizerError
    from longqa.train.actor import TrainingError
    from longqa.train.checkpoint import CheckpointError

    return ConfigError, DataFileError, CheckpointError, ModelError, TokenizerError, TrainingError


def user_error(error: BaseException | None) -> Exception | None:
    """The user's mistake behind an error Ray Train gives back, if it is one: a worker's ConfigError comes back
    wrapped (a TrainingFailedError whose worker failures hold a RayTaskError whose cause is the ConfigError),
    and shown as it is, it is a page of Ray's tracebacks for what the local launcher says in one line."""
    kinds, seen, todo = _user_error_types(), set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # a RayTaskError (which is also an instance of its cause's class)
        if isinstance(cause, kinds):
            return cause
        if isinstance(e, kinds) and not hasattr(e, "traceback_str"):
            return e
        failures = getattr(e, "worker_failures", None) or {}
        todo += [*failures.values(), cause, getattr(e, "controller_failure", None), e.__cause__, e.__context__]
    return None


def _worker_loop(loop_config: dict) -> None:
    loop_config["train"](load_config_dict(loop_config["config"]), stop_file=loop_config["stop_file"])


def ray_worker_count(cfg, cluster_gpus: int, use_gpu: bool) -> int:
    """``trainer.ray_workers``, or one worker per GPU of the cluster. More workers than GPUs, one GPU each, would
    wait for GPUs that never come: refused, never quietly fewer (the run's batches are split by that count)."""
    workers = cfg.trainer.ray_workers or cluster_gpus
    if workers < 1:
        raise RayClusterError("the Ray cluster has no GPUs: set trainer.ray_workers to the number of CPU workers")
    if use_gpu and workers > cluster_gpus:
        raise RayClusterError(
            f"trainer.ray_workers={workers} asks for one GPU each but the Ray cluster has {cluster_gpus}: "
            f"add nodes to the cluster, or set trainer.ray_workers (a verl line's trainer.nnodes x "
            f"n_gpus_per_node, or remote_backend.training_gpus) to the GPUs there are"
        )
    return workers


def check_placeable(workers: int, use_gpu: bool, resources: dict) -> None:
    """Refuse workers the Ray cluster cannot place (one GPU each on a GPU run, one CPU each otherwise): Ray Train
    would wait for them and retry its start for ever, whatever trainer.max_failures says."""
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    unit = "GPU" if use_gpu else "CPU"
    if workers <= (gpus if use_gpu else cpus):
        return
    raise RayClusterError(
        f"trainer.ray_workers={workers} Ray workers need one {unit} each, but the Ray cluster has "
        f"{gpus} GPUs and {cpus} CPUs: set trainer.ray_workers (a verl line's trainer.n_gpus_per_node "
        f"x trainer.nnodes) to what there is, add nodes, or train here with trainer.launcher=local"
    )


def _failure_config(failure_config: type, max_failures: int):
    """``trainer.max_failures`` restarts, and as many failed starts of the worker group: Ray Train's second API
    counts those apart (``controller_failure_limit``), without a bound by default, so a start that can never
    succeed would loop for ever. Its first API has no such count."""
    try:
        return failure_config(max_failures=max_failures, controller_failure_limit=max_failures)
    except TypeError:
        return failure_config(max_failures=max_failures)


def describe_launch(workers: int, use_gpu: bool) -> str:
    """The line saying the run goes to Ray workers, which a verl line's n_gpus_per_node chooses without naming
    trainer.launcher."""
    return (
        f"trainer.launcher=ray: {workers} Ray Train workers, one {'GPU' if use_gpu else 'CPU'} each "
        f"(a verl line's trainer.n_gpus_per_node x trainer.nnodes sets trainer.launcher=ray and "
        f"trainer.ray_workers)"
    )


def reward_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables the reward reads when it scores (``longqa.reward.ENVIRONMENT_VARIABLES``: the mode and the
    recipe's knobs, which the recipe's own reward file reads too) that are set in the driver's environment: Ray
    starts its workers with the cluster's environment, not the driver's, so these go to them by name."""
    return {name: environ[name] for name in ENVIRONMENT_VARIABLES if name in environ}


def describe_environment(environment: dict[str, str]) -> str:
    """The line saying which of the driver's variables the workers get."""
    given = ", ".join(f"{name}={value}" for name, value in environment.items())
    return f"Ray workers get the driver's {given} (what the reward reads when it scores)"


def _scaling(scaling_config: type, workers: int, use_gpu: bool):
    """``workers`` workers, and Ray Train's coordinator on no CPU of its own. Ray Train's first API (Ray 2.40 to
    about 2.50) reserves one CPU for its coordinator by default, so a cluster with exactly one CPU per worker
    waits forever for it; the coordinator only coordinates. Its second API runs the coordinator on none and
    refuses the setting (raising DeprecationWarning), so there it is left out."""
    try:
        return scaling_config(num_workers=workers, use_gpu=use_gpu, trainer_resources={"CPU": 0})
    except DeprecationWarning:
        return scaling_config(num_workers=workers, use_gpu=use_gpu)


def _raise_failure(error: BaseException):
    """The user's mistake behind a failed run alone (one line from the command line), else Ray's error."""
    mistake = user_error(error)
    if mistake is not None:
        raise mistake from None
    raise error


def run_with_ray(cfg: Config, train: Callable[..., dict]) -> dict:
    """Run ``train(cfg, stop_file=...)``, the one-process training function (passed in, so this module
    does not import the trainer that launches it), on Ray Train workers."""
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as e:
        raise RayClusterError("trainer.launcher=ray needs Ray Train: pip install 'longqa[ray]'") from e
    environment = reward_environment()
    ray.init(
        address=os.environ.get("RAY_ADDRESS"),
        ignore_reinit_error=True,
        log_to_driver=True,
        runtime_env={"env_vars": environment} if environment else None,
    )
    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = gpus > 0 and cfg.trainer.device != "cpu"
    workers = ray_worker_count(cfg, gpus, use_gpu)
    check_placeable(workers, use_gpu, ray.cluster_resources())
    print(describe_launch(workers, use_gpu), flush=True)
    if environment:
        print(describe_environment(environment), flush=True)
    local = _absolute(cfg)
    run_dir = Path(local.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop_file = run_dir / ".stop-request"  # one driver per run folder, as one process saves into it
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"config": to_dict(local), "stop_file": str(stop_file), "train": train},
        scaling_config=_scaling(ScalingConfig, workers, use_gpu),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            name="longqa",
            storage_path=str(run_dir / "ray"),
            failure_config=_failure_config(FailureConfig, cfg.trainer.max_failures),
        ),
    )
    with forward_stop_requests(stop_file) as forwarded:
        try:
            result = trainer.fit()
        except Exception as e:  # (Ray Train's second API raises what its first returns as result.error)
            _raise_failure(e)
        stopped = forwarded.stopped()
    if result.error is not None:
        _raise_failure(result.error)
    if stopped is not None:
        print(preempted_message(stopped["step"], stopped["checkpoint"]), flush=True)  # the driver's log is kept
        return {"steps": stopped["step"], "report": None, "preempted": stopped}
    from longqa.train.report import read_metrics

    steps = max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")), default=0)
    report = run_dir / "report" / "summary.md"
    return {"steps": steps, "report": str(report) if report.exists() else None, "preempted": None}
