"""A run's checkpoints against its disk: the size a checkpoint will take is the size `longqa train` writes, a run
whose first save cannot fit is refused before any weight loads, and the warning about a later save names the one a
simulation of saves and deletions says fails."""

import importlib.util

import pytest
from test_train import overrides, tiny_model_dir  # noqa: F401
from transformers import AutoModelForCausalLM

from longqa.cli import main
from longqa.config import load_config
from longqa.model.load import load_model_config
from longqa.train import checkpoint_space
from longqa.train.checkpoint_space import (
    DiskSpaceError,
    check_checkpoint_space,
    checkpoint_bytes,
    count_parameters,
    save_steps,
)

SETTINGS = {  # name: overrides; every strategy and precision of the stepped weights
    "float32": {},
    "bf16, float32 masters": {"model.dtype": "bfloat16"},
    "bf16, bf16 weights stepped": {"model.dtype": "bfloat16", "actor.master_weights": "model"},
    "fsdp2 offloaded": {"actor.cpu_offload": "true"},
    "zero-3": {"actor.strategy": "deepspeed"},
    "zero-3 offloaded": {"actor.strategy": "deepspeed", "actor.cpu_offload": "true"},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_predicted_size_is_the_written_checkpoint_s(name, tiny_model_dir, data_dir, tmp_path):
    extra = SETTINGS[name]
    if extra.get("actor.strategy") == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    out = tmp_path / "run"
    args = overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 1, "trainer.test_freq": 0, **extra})
    assert main(["train", *args]) == 0
    folder = out / "checkpoints" / "step_00000001"
    small = {"rng.json", "trainer_state.json", "scheduler.pt", "COMPLETE", "zero_to_fp32.py", "zero_to_torch.py"}
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in small)
    cfg = load_config(None, args)
    config = load_model_config(str(tiny_model_dir))
    predicted = checkpoint_bytes(cfg, count_parameters(config), 1)
    tensors = 3 * len(AutoModelForCausalLM.from_config(config).state_dict())  # (each with a header of its own)
    assert predicted <= written <= predicted * 1.01 + 1024 * tensors, (written, predicted)


def test_a_run_whose_first_checkpoint_cannot_fit_is_refused_before_loading(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(checkpoint_space, "free_bytes", lambda folder: 1000)
    out = tmp_path / "run"
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.save_freq": 2})]) == 2
    err = capsys.readouterr().err
    assert "the first save, after step 2, would find the disk full" in err and "trainer.save_freq=0" in err
    assert "Traceback" not in err and not (out / "metrics.jsonl").exists()
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.save_freq": 0, "trainer.max_steps": 1})])
        == 0
    )


def simulated_failing_save(existing: int, saves: int, keep_last: int, room: int) -> int | None:
    """Save by save, as the trainer does: the new checkpoint written whole, then the oldest beyond keep_last
    deleted; the first save (1-based) for which the disk, with room for ``room`` more checkpoints, is full."""
    on_disk = existing
    for number in range(1, saves + 1):
        if on_disk + 1 - existing > room:
            return number
        on_disk = min(on_disk + 1, keep_last)
    return None


@pytest.mark.parametrize("existing", [0, 1, 2])
@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("room", [0, 1, 2, 3, 4])
def test_the_warning_names_the_save_that_a_simulation_finds_failing(tmp_path, monkeypatch, existing, keep_last, room):
    run = tmp_path / "run"
    for step in range(1, existing + 1):  # complete checkpoints already in the run folder
        folder = run / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMPLETE").write_text("{}")
    size = 10**6
    params = size // 12  # (a float32 checkpoint: 12 bytes a parameter)
    monkeypatch.setattr(checkpoint_space, "free_bytes", lambda folder: room * size + size // 2)
    cfg = load_config(None, ["trainer.save_freq=2", f"trainer.keep_last={keep_last}"])
    saves = save_steps(2, existing, 11)  # after steps 2, 4, ..., 10 and the last, 11
    expected = simulated_failing_save(existing, len(saves), keep_last, room)
    if expected == 1:
        with pytest.raises(DiskSpaceError, match="the first save, after step"):
            check_checkpoint_space(cfg, run, params, 1, existing, 11)
        return
    warning = check_checkpoint_space(cfg, run, params, 1, existing, 11)
    if expected is None:
        assert warning is None
        return
    assert f"save {expected} of this run (after step {saves[expected - 1]})" in warning
    if "trainer.keep_last=" in warning.split("full;")[1]:  # the suggestion holds in the simulation
        suggested = int(warning.split("full; trainer.keep_last=")[1].split()[0])
        assert 1 <= suggested < keep_last
        assert simulated_failing_save(existing, len(saves), suggested, room) is None


def test_the_recipe_s_8b_checkpoint_is_98_gb():
    """12 bytes a parameter under ZeRO-3 (float32 masters and two moments): the size the recipe-shape run needs."""
    cfg = load_config("configs/loongrl-qwen3-8b.yaml", ["actor.strategy=deepspeed"])
    assert checkpoint_bytes(cfg, 8_190_735_360, 1) == pytest.approx(98.3e9, rel=1e-3)


def test_save_steps_follow_the_trainer_s_cadence():
    assert save_steps(0, 0, 10) == []
    assert save_steps(4, 0, 10) == [4, 8, 10]
    assert save_steps(4, 8, 10) == [10]
    assert save_steps(5, 0, 10) == [5, 10]
