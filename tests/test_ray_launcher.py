"""The Ray launcher refuses workers the cluster cannot place, bounds failed starts, and says it launches."""

import pytest

from longqa.config import ConfigError
from longqa.distributed.ray_launcher import _failure_config, check_placeable, describe_launch


def test_cpu_workers_past_the_clusters_cpus_are_refused_naming_what_there_is():
    with pytest.raises(ConfigError, match=r"trainer.ray_workers=8 Ray workers need one CPU each, but the Ray cluster "
                                          r"has 0 GPUs and 2 CPUs"):
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
