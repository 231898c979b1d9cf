"""The Ray launcher refuses workers the cluster cannot place, bounds failed starts, and says it launches."""

import pytest

from longqa.config import ConfigError
from longqa.train.ray_launcher import _failure_config, check_placeable, describe_launch


def test_cpu_workers_past_the_clusters_cpus_are_refused_naming_what_there_is():
    with pytest.raises(
        ConfigError,
        match=r"trainer.ray_workers=8 Ray workers need one CPU each, but the Ray cluster "
        r"has 0 GPUs and 2 CPUs",
    ):
        check_placeable(8, False, {"CPU": 2.0})
    check_placeable(2, False, {"CPU": 2.0})


def test_gpu_workers_are_counted_against_gpus():
    with pytest.raises(ConfigError, match="need one GPU each, but the Ray cluster has 4 GPUs and 64 CPUs"):
        check_placeable(8, True, {"CPU": 64.0, "GPU": 4.0})
    check_placeable(4, True, {"CPU": 2.0, "GPU": 4.0})


def test_failed_worker_group_starts_are_bounded_by_max_failures():
    from ray.train import FailureConfig

    config = _failure_config(FailureConfig, 0)
    assert config.max_failures == 0
    assert getattr(config, "controller_failure_limit", 0) == 0


def test_a_ray_launch_is_said_in_one_line():
    line = describe_launch(8, True)
    assert "\n" not in line and line.startswith("trainer.launcher=ray: 8 Ray Train workers, one GPU each")
    assert "trainer.n_gpus_per_node" in line


def test_a_workers_user_error_comes_back_alone():
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from longqa.data.io import DataFileError
    from longqa.train.ray_launcher import user_error

    mistake = DataFileError("nope.parquet: no such file")
    wrapped = RayTaskError("train", "Traceback ...", mistake).as_instanceof_cause()
    error = WorkerGroupError("[Rank 0 Error Snippet]: ...", {0: wrapped})
    assert user_error(error) is mistake
    outer = RuntimeError("Training failed")
    outer.__cause__ = error
    assert user_error(outer) is mistake
    assert user_error(WorkerGroupError("boom", {0: RuntimeError("a bug")})) is None


def test_worker_paths_expand_the_home_folder(tmp_path, monkeypatch):
    from longqa.config import load_config
    from longqa.train.ray_launcher import _absolute

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    cfg = _absolute(
        load_config(None, ["data.cache_dir=~/.cache/longqa", "trainer.output_dir=~/runs/x", "trainer.resume=none"])
    )
    assert cfg.data.cache_dir == str(tmp_path / ".cache" / "longqa")
    assert cfg.trainer.output_dir == str(tmp_path / "runs" / "x")
    assert cfg.trainer.resume == "auto"  # (the driver checked the folder: a restart resumes this run's own)
    assert not (tmp_path / "~").exists()


def test_the_driver_checks_before_ray_starts(tmp_path):
    from longqa.config import load_config
    from longqa.data.io import DataFileError
    from longqa.train.trainer import check_before_workers

    with pytest.raises(DataFileError, match="nope.parquet: no such file"):
        check_before_workers(
            load_config(
                None,
                [
                    f"data.train_files={tmp_path}/nope.parquet",
                    "data.val_files=[]",
                    f"trainer.output_dir={tmp_path}/run",
                ],
            )
        )
    with pytest.raises(ConfigError, match="rollout.n=1"):
        check_before_workers(load_config(None, ["rollout.n=1", f"trainer.output_dir={tmp_path}/run"]))


class _Finished(Exception):
    """Raised by the fake Ray Train's fit: the launch is over once what ray.init got is recorded."""


def _fake_ray(monkeypatch) -> dict:
    """A ``ray`` package of the few names ``run_with_ray`` uses, recording what ``ray.init`` is given."""
    import sys
    import types

    got = {}
    ray = types.ModuleType("ray")
    ray.init = lambda **kwargs: got.update(kwargs)
    ray.cluster_resources = lambda: {"CPU": 4.0}
    train = types.ModuleType("ray.train")
    train.FailureConfig = train.RunConfig = train.ScalingConfig = lambda **kwargs: kwargs
    torch_module = types.ModuleType("ray.train.torch")
    torch_module.TorchConfig = lambda **kwargs: kwargs

    class TorchTrainer:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            raise _Finished

    torch_module.TorchTrainer = TorchTrainer
    ray.train, train.torch = train, torch_module
    for name, module in (("ray", ray), ("ray.train", train), ("ray.train.torch", torch_module)):
        monkeypatch.setitem(sys.modules, name, module)
    return got


def test_the_reward_s_environment_reaches_the_ray_workers(tmp_path, monkeypatch, capsys):
    """The recipe's reward reads REWARD_CALC_TYPE and its knobs (MAX_BOXED_LIMIT, ...) when it scores, on the
    workers: those set in the driver's environment go to them through ray.init's runtime_env, said in one line;
    nothing else of the driver's environment does, and with none set ray.init is called as before."""
    from longqa.config import load_config
    from longqa.reward import ENVIRONMENT_VARIABLES
    from longqa.train.ray_launcher import run_with_ray

    got = _fake_ray(monkeypatch)
    for name in ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REWARD_CALC_TYPE", "format_exact_match")
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}/run", "trainer.ray_workers=2"])
    monkeypatch.setenv("MAX_BOXED_LIMIT", "3")
    monkeypatch.setenv("SOMETHING_ELSE", "1")
    with pytest.raises(_Finished):
        run_with_ray(cfg, train=None)
    assert got["runtime_env"] == {"env_vars": {"REWARD_CALC_TYPE": "format_exact_match", "MAX_BOXED_LIMIT": "3"}}
    said = [line for line in capsys.readouterr().out.splitlines() if "MAX_BOXED_LIMIT" in line]
    assert said == [
        "Ray workers get the driver's REWARD_CALC_TYPE=format_exact_match, MAX_BOXED_LIMIT=3 (what the reward "
        "reads when it scores)"
    ]
    for name in ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    got.clear()
    with pytest.raises(_Finished):
        run_with_ray(load_config(None, [f"trainer.output_dir={tmp_path}/run", "trainer.ray_workers=2"]), train=None)
    assert got["runtime_env"] is None and "Ray workers get" not in capsys.readouterr().out


def test_the_forwarded_variables_are_every_one_the_reward_reads():
    """One list (longqa.reward.ENVIRONMENT_VARIABLES) beside the reads: each name the reward file reads is in it."""
    import inspect
    import re

    from longqa import reward

    source = inspect.getsource(reward)
    read = set(re.findall(r'(?:_env_int|os\.getenv|os\.environ\.get)\(\s*"([A-Z0-9_]+)"', source))
    assert read and "os.environ[" not in source
    assert read | {reward.MODE_ENV} == set(reward.ENVIRONMENT_VARIABLES)
    assert "os.getenv(MODE_ENV)" in source
