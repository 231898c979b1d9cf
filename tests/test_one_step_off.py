"""rollout.mode=one_step_off: each step's prompts are sampled before the previous step's update, with weights
exactly one update old, the PPO ratio taken against the log-probs of those weights; with max_staleness=0 the
mode is the synchronous run; a resumed run updates on the very samples the uninterrupted one did; with
rollout.overlap the sampling runs beside the update and samples exactly what it samples before it."""

import json
import re
import threading
from pathlib import Path

import pytest
from test_train import overrides, records, same_weights, tiny_model_dir  # noqa: F401 - a fixture

from longqa.cli import main
from longqa.config import ConfigError, load_config
from longqa.rollout.base import weights_version
from longqa.rollout.fast import FastRolloutEngine
from longqa.train.actor import Actor

STEPS = {"trainer.max_steps": 4, "trainer.test_freq": 0, "trainer.keep_last": 4, "trainer.total_epochs": 2}
OFF = {"rollout.mode": "one_step_off"}


def without(rows: list[dict], key: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != key} for r in rows]


def test_with_max_staleness_0_the_mode_is_the_synchronous_run(tiny_model_dir, data_dir, tmp_path):
    sync, off = tmp_path / "sync", tmp_path / "off"
    assert main(["train", *overrides(tiny_model_dir, data_dir, sync, **STEPS)]) == 0
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, off, **STEPS, **OFF, **{"rollout.max_staleness": 0})]) == 0
    )
    logged = records(off)
    assert [r["rollout/staleness"] for r in logged] == [0] * 4
    assert without(logged, "rollout/staleness") == records(sync)
    assert same_weights(off / "checkpoints" / "step_00000004", sync / "checkpoints" / "step_00000004")


@pytest.mark.parametrize("overlap", [False, True])
def test_every_update_is_on_samples_of_the_weights_one_update_old(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, overlap
):
    """Each sample is traced from the engine call that drew it (the version of the weights it read then) to the
    update that uses it (the weights' version then): the first step's are the weights it updates, every later
    one's the weights before the previous update, and the ratio's denominator is the log-probs they were drawn
    with; sampled beside the update or before it."""
    generate, update = FastRolloutEngine.generate, Actor.update
    drawn, updates = {}, []

    def traced_generate(self, prompts, params, *args, **kwargs):
        read = self.version if self.model is not self.source else weights_version(self.source)
        out = generate(self, prompts, params, *args, **kwargs)
        for group in out:
            for sample in group:
                drawn[tuple(sample.token_ids), tuple(sample.logprobs)] = read
        return out

    def traced_update(self, samples):
        versions = (
            [drawn[tuple(r), tuple(lp)] for r, lp in zip(samples.response_ids, samples.old_logprobs)]
            if samples.old_logprobs is not None
            else None
        )
        updates.append({"version": weights_version(self.model), "sampled_with": versions})
        return update(self, samples)

    monkeypatch.setattr(FastRolloutEngine, "generate", traced_generate)
    monkeypatch.setattr(Actor, "update", traced_update)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *overrides(tiny_model_dir, data_dir, run, **STEPS, **OFF, **{"rollout.overlap": str(overlap).lower()}),
            ]
        )
        == 0
    )
    assert [r["rollout/staleness"] for r in records(run)] == [0, 1, 1, 1]
    assert updates[0]["sampled_with"] is None  # the weights it updates drew them: recomputed, ratio 1 at first
    for before, now in zip(updates, updates[1:]):
        assert now["version"] > before["version"]
        assert set(now["sampled_with"]) == {before["version"]}  # every sample: exactly one update old


def test_a_resumed_run_updates_on_the_samples_the_uninterrupted_run_did(tiny_model_dir, data_dir, tmp_path):
    """The checkpoint after step 2 holds step 3's groups, sampled with weights no checkpoint keeps; a new process
    resuming from it ends where the uninterrupted run did, metrics and weights alike."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *overrides(tiny_model_dir, data_dir, straight, **STEPS, **OFF)]) == 0
    state = json.loads((straight / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["sampled_ahead"]["step"] == 2 and state["sampled_ahead"]["sampled_with"] == 1
    middle = straight / "checkpoints" / "step_00000002"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, resumed, **STEPS, **OFF, **{"trainer.resume": middle})])
        == 0
    )
    assert records(resumed) == records(straight)[2:]
    assert same_weights(resumed / "checkpoints" / "step_00000004", straight / "checkpoints" / "step_00000004")


def test_a_mode_without_the_sampling_log_probs_is_refused(tiny_model_dir, data_dir, tmp_path):
    from longqa.config.checks import check_one_step_off

    cfg = load_config(
        None,
        overrides(
            tiny_model_dir,
            data_dir,
            tmp_path,
            **OFF,
            **{"rollout.engine": "vllm", "rollout.temperature": 0.7, "rollout.top_k": 20},
        ),
    )
    with pytest.raises(ConfigError, match="rollout.mode=one_step_off takes the PPO ratio against the sampling"):
        check_one_step_off(cfg)
    check_one_step_off(load_config(None, overrides(tiny_model_dir, data_dir, Path(tmp_path), **OFF)))


def test_sampling_beside_the_update_samples_what_sampling_before_it_does(
    tiny_model_dir, data_dir, tmp_path, monkeypatch
):
    """rollout.overlap=true: each step samples its successor in the sampling thread, started as its update starts
    in the main one, from the engine's own copy of the weights; the run logs the metrics and ends with the weights
    of the run that samples first and updates after, to the bit."""
    generate, calls = FastRolloutEngine.generate, []

    def traced_generate(self, prompts, params, *args, **kwargs):
        calls.append({"thread": threading.current_thread().name, "copy": self.model is not self.source})
        return generate(self, prompts, params, *args, **kwargs)

    first, beside = tmp_path / "first", tmp_path / "beside"
    assert main(["train", *overrides(tiny_model_dir, data_dir, first, **STEPS, **OFF)]) == 0
    monkeypatch.setattr(FastRolloutEngine, "generate", traced_generate)
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, beside, **STEPS, **OFF, **{"rollout.overlap": "true"})])
        == 0
    )
    sampling = [c for c in calls if c["thread"].startswith("longqa-sampling")]
    assert len(sampling) == 3 and all(c["copy"] for c in calls)  # steps 2-4, each sampled during the step before
    assert records(beside) == records(first)
    assert same_weights(beside / "checkpoints" / "step_00000004", first / "checkpoints" / "step_00000004")


def test_a_resumed_overlapped_run_updates_on_the_samples_the_uninterrupted_run_did(tiny_model_dir, data_dir, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    beside = {**OFF, "rollout.overlap": "true"}
    assert main(["train", *overrides(tiny_model_dir, data_dir, straight, **STEPS, **beside)]) == 0
    middle = straight / "checkpoints" / "step_00000002"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, resumed, **STEPS, **beside, **{"trainer.resume": middle})])
        == 0
    )
    assert records(resumed) == records(straight)[2:]
    assert same_weights(resumed / "checkpoints" / "step_00000004", straight / "checkpoints" / "step_00000004")


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"rollout.overlap": "true"},
            "rollout.overlap=true samples the next step during this step's update: it needs rollout.mode=one_step_off",
        ),
        ({**OFF, "rollout.max_staleness": 0, "rollout.overlap": "true"}, "rollout.max_staleness=0"),
        ({**OFF, "rollout.engine": "hf", "rollout.overlap": "true"}, "rollout.overlap=true needs rollout.engine=fast"),
    ],
)
def test_overlap_without_a_step_sampled_ahead_or_the_fast_engine_is_refused(
    tiny_model_dir, data_dir, tmp_path, settings, message
):
    from longqa.config.checks import check_one_step_off

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_one_step_off(load_config(None, overrides(tiny_model_dir, data_dir, tmp_path, **settings)))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({}, "rollout.sampler_ranks=1 sets that many ranks apart to sample, but the job has 1: launch more ranks"),
        ({"rollout.engine": "hf"}, "rollout.sampler_ranks=1 needs rollout.engine=fast (got hf)"),
        ({"actor.strategy": "deepspeed"}, "rollout.sampler_ranks=1 needs actor.strategy=fsdp2 (got deepspeed"),
        ({"trainer.launcher": "ray"}, "rollout.sampler_ranks=1 needs trainer.launcher=local, under torchrun (got ray)"),
    ],
)
def test_sampler_ranks_a_job_cannot_set_apart_are_refused_before_anything_loads(
    tiny_model_dir, data_dir, tmp_path, capsys, settings, message
):
    """`longqa train` in one process (a job of one rank) with rollout.sampler_ranks, or with what sampler ranks
    cannot run beside: the error, not a traceback."""
    args = overrides(tiny_model_dir, data_dir, tmp_path, **{"rollout.sampler_ranks": 1, **settings})
    assert main(["train", *args]) != 0
    assert message in capsys.readouterr().err
