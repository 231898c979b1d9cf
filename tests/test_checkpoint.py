"""Checkpoints: bitwise-exact resume, pruning, atomicity under failed writes and kill -9, HF export."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from longqa.train.checkpoint import (
    CheckpointError,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    read_trainer_state,
    resolve_resume,
    save_checkpoint,
)

SRC = Path(__file__).resolve().parent.parent / "src"
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_training(seed: int):
    """A tiny random Qwen3 with AdamW and a warmup schedule (so the scheduler state matters)."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> float:
    """One step whose batch draws on all three global RNGs, so any state not restored changes the loss."""
    length = 6 + random.randrange(3)
    ids = torch.randint(0, TINY["vocab_size"], (2, length))
    ids[:, 0] = int(np.random.randint(TINY["vocab_size"]))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def rng_draws():
    cuda = torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() else None
    return torch.rand(3).tolist(), random.random(), float(np.random.rand()), cuda


def save(run_dir, step, training, keep_last=3, **state):
    model, optimizer, scheduler = training
    return save_checkpoint(
        run_dir,
        step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state={"step": step, **state},
        keep_last=keep_last,
    )


def hidden_entries(run_dir) -> list[str]:
    return [p.name for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.startswith(".")]


def test_resume_is_bitwise_exact(tmp_path):
    seed_all(0)
    training = make_training(0)
    for _ in range(3):
        train_step(*training)
    trainer_state = {"step": 3, "epoch": 0, "data_position": 6, "data_seed": 42, "history": [{"loss": 1.5}]}
    path = save_checkpoint(
        tmp_path,
        3,
        model=training[0],
        optimizer=training[1],
        scheduler=training[2],
        trainer_state=trainer_state,
        keep_last=2,
    )
    assert path == tmp_path / "checkpoints" / "step_00000003"
    draws = rng_draws()
    losses = [train_step(*training) for _ in range(2)]
    params = {k: v.clone() for k, v in training[0].state_dict().items()}
    lr = training[2].get_last_lr()

    seed_all(123)
    resumed = make_training(1)
    restored = load_checkpoint(path, model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    assert restored == trainer_state
    assert rng_draws() == draws
    assert [train_step(*resumed) for _ in range(2)] == losses
    assert resumed[2].get_last_lr() == lr
    for name, value in resumed[0].state_dict().items():
        assert torch.equal(value, params[name]), name


def test_keep_last_prunes_and_hidden_or_unmarked_folders_are_never_latest(tmp_path):
    training = make_training(0)
    for step in range(1, 5):
        save(tmp_path, step, training, keep_last=2)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000003", "step_00000004"]

    stale = folder / ".tmp-step_00000009-999"  # a save killed mid-way, even one that got its marker
    stale.mkdir()
    (stale / "COMPLETE").write_text("{}")
    unmarked = folder / "step_00000010"
    unmarked.mkdir()
    assert latest_checkpoint(tmp_path) == folder / "step_00000004"

    save(tmp_path, 5, training, keep_last=2)
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000004", "step_00000005", "step_00000010"]
    assert latest_checkpoint(tmp_path) == folder / "step_00000005"


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(tmp_path):
    training = make_training(0)
    for step in (1, 2, 3):
        save(tmp_path, step, training, run="first")
    save(tmp_path, 2, training, run="second")  # resumed from step 1 and reached step 2 again
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert (
        load_checkpoint(latest_checkpoint(tmp_path), model=training[0], optimizer=training[1], scheduler=training[2])[
            "run"
        ]
        == "second"
    )


def test_disk_full_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    training = make_training(0)
    save(tmp_path, 1, training)
    real_save = torch.save
    written = []

    def save_then_fill_disk(obj, f):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(f)
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_then_fill_disk)
    target = tmp_path / "checkpoints" / "step_00000002"
    message = f"disk full while writing checkpoint step 2 to {target}; the previous checkpoint step_00000001 is intact"
    with pytest.raises(CheckpointError) as caught:
        save(tmp_path, 2, training)
    assert str(caught.value) == message
    monkeypatch.undo()

    assert hidden_entries(tmp_path) == [] and not target.exists()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert (
        load_checkpoint(latest_checkpoint(tmp_path), model=training[0], optimizer=training[1], scheduler=training[2])[
            "step"
        ]
        == 1
    )


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_real_write_error_from_the_kernel_is_reported_and_cleaned_up(tmp_path):
    """RLIMIT_FSIZE makes the kernel fail a write mid-file (EFBIG), as a full disk fails it with ENOSPC."""
    import resource

    training = make_training(0)
    save(tmp_path, 1, training)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ, so write() fails
    try:
        with pytest.raises(CheckpointError, match="while writing checkpoint step 2 .* step_00000001 is intact"):
            save(tmp_path, 2, training)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert hidden_entries(tmp_path) == []
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_a_bug_mid_save_propagates_and_leaves_no_temp_folder(tmp_path, monkeypatch):
    training = make_training(0)

    def broken(obj, f):
        raise RuntimeError("serializer bug")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="serializer bug"):
        save(tmp_path, 1, training)
    assert hidden_entries(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    with pytest.raises(TypeError, match="trainer_state must be JSON-able"):
        save(tmp_path, 1, training, handle=object())


def test_a_damaged_checkpoint_is_refused(tmp_path):
    training = make_training(0)
    path = save(tmp_path, 1, training)
    with open(path / "model.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="damaged: model.pt has 100 bytes"):
        load_checkpoint(path, model=training[0], optimizer=training[1], scheduler=training[2])


def overwrite_middle(path: Path, count: int = 400) -> None:
    """Damage a file in place at its own size, as a bad disk block or a stray write would."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(255 - b for b in path.read_bytes()[size // 2 : size // 2 + count]))
    assert path.stat().st_size == size


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "scheduler.pt", "rng.json", "trainer_state.json"])
def test_a_file_damaged_at_its_own_size_is_refused_by_name(tmp_path, name):
    """Sizes alone would take it for good: the marker's digests name the file, before anything is loaded. The
    weights alone (what an export reads) are refused only for a file they need."""
    training = make_training(0)
    path = save(tmp_path, 1, training)
    overwrite_middle(path / name, count=20)
    fresh = make_training(1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert str(error.value) == (
        f"checkpoint {path} is damaged: the contents of {name} differ from those written "
        f"(its sha256 digest); resume or export an earlier checkpoint (trainer.resume=PATH, "
        f"longqa export PATH)"
    )
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items())  # nothing loaded
    if name in ("model.pt", "trainer_state.json"):
        with pytest.raises(CheckpointError, match=f"damaged: the contents of {name} differ"):
            load_model_weights(path, fresh[0])
    else:
        load_model_weights(path, fresh[0])
    if name == "trainer_state.json":  # read on its own before anything loads (the config a resume compares)
        with pytest.raises(CheckpointError, match=f"damaged: the contents of {name} differ"):
            read_trainer_state(path)


@pytest.mark.parametrize("name", ["COMPLETE", "trainer_state.json", "rng.json"])
def test_a_json_file_cut_short_is_damaged_in_one_line(tmp_path, name):
    """Cut short, and the marker of an earlier version (sizes only) rewritten to match, so that only reading it
    finds out."""
    training = make_training(0)
    path = save(tmp_path, 1, training)
    text = (path / name).read_text()
    (path / name).write_text(text[: len(text) // 2])
    if name != "COMPLETE":
        marker = json.loads((path / "COMPLETE").read_text())
        marker["files"][name] = len(text) // 2
        del marker["sha256"]
        (path / "COMPLETE").write_text(json.dumps(marker))
    reads = [lambda: load_checkpoint(path, model=training[0], optimizer=training[1], scheduler=training[2])]
    if name != "rng.json":
        reads.append(lambda: read_trainer_state(path))
    for read in reads:
        with pytest.raises(CheckpointError) as error:
            read()
        assert str(error.value).startswith(f"checkpoint {path} is damaged: {name} is not valid JSON (cut short?)")
        assert "\n" not in str(error.value)


def test_a_checkpoint_without_digests_still_loads_checked_by_size_and_says_so(tmp_path):
    """A checkpoint written before digests were recorded resumes as before, and says it once per load."""
    training = make_training(0)
    path = save(tmp_path, 1, training)
    marker = json.loads((path / "COMPLETE").read_text())
    del marker["sha256"]
    (path / "COMPLETE").write_text(json.dumps(marker))
    said = []
    fresh = make_training(1)
    assert load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], say=said.append)["step"] == 1
    assert said == [
        f"note: checkpoint {path} records no digests of its files (an earlier longqa wrote it): they "
        f"are checked by size only"
    ]
    assert all(torch.equal(a, b) for a, b in zip(fresh[0].state_dict().values(), training[0].state_dict().values()))


def test_weights_that_are_not_finite_are_refused_naming_the_parameter(tmp_path):
    """A checkpoint of a run whose weights went NaN or infinite (its digests match) is refused on resume and on
    export, naming the first such parameter and how many more have some."""
    training = make_training(0)
    with torch.no_grad():
        training[0].model.layers[0].mlp.up_proj.weight[0, :3] = float("nan")
        training[0].model.norm.weight[0] = float("inf")
    path = save(tmp_path, 1, training)
    fresh = make_training(1)
    expected = (
        f"checkpoint {path} holds weights that are not finite: model.layers.0.mlp.up_proj.weight has 3 NaN "
        f"or infinite values (1 more parameters have some); resume or export an earlier checkpoint"
    )
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert str(error.value).startswith(expected)
    with pytest.raises(CheckpointError) as error:
        load_model_weights(path, make_training(2)[0])
    assert str(error.value).startswith(expected)


KILLED_TRAINER = textwrap.dedent("""
    import sys
    import torch
    from longqa.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    run_dir = sys.argv[1]
    model = torch.nn.Linear(384, 384)
    optimizer = torch.optim.AdamW(model.parameters())
    latest = latest_checkpoint(run_dir)
    step = load_checkpoint(latest, model=model, optimizer=optimizer)["step"] if latest else 0
    while True:
        step += 1
        model(torch.randn(4, 384)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(run_dir, step, model=model, optimizer=optimizer, keep_last=2,
                        trainer_state={"step": step, "weight_sum": model.weight.sum().item()})
""")


def wait_for_step_after(run_dir, step: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        latest = latest_checkpoint(run_dir)
        if latest is not None and int(latest.name.split("_")[1]) > step:
            return
        time.sleep(0.01)
    raise AssertionError(f"the trainer saved nothing after step {step} in time")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_kill_9_at_random_moments_leaves_a_loadable_latest_checkpoint(tmp_path):
    """Kill a saving loop at random moments (mostly mid-save) and resume from what is left, three times."""
    script = tmp_path / "trainer.py"
    script.write_text(KILLED_TRAINER)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    delays = random.Random()
    step = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(run_dir)], env=env)
        try:
            wait_for_step_after(run_dir, step, time.monotonic() + 120)
            time.sleep(delays.uniform(0, 0.3))
        finally:
            proc.kill()
            proc.wait()
        for path in (run_dir / "checkpoints").iterdir():
            assert path.name.startswith(".") or (path / "COMPLETE").is_file(), path
        latest = latest_checkpoint(run_dir)
        model = torch.nn.Linear(384, 384)
        state = load_checkpoint(latest, model=model, optimizer=torch.optim.AdamW(model.parameters()))
        assert latest.name == f"step_{state['step']:08d}" and state["step"] > step
        assert model.weight.sum().item() == state["weight_sum"]
        step = state["step"]

    save_checkpoint(
        run_dir,
        step + 1,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state={"step": step + 1},
        keep_last=2,
    )
    assert hidden_entries(run_dir) == []


def test_resolve_resume(tmp_path):
    assert resolve_resume(tmp_path, "auto") is None
    training = make_training(0)
    save(tmp_path, 1, training)
    latest = save(tmp_path, 2, training)
    assert resolve_resume(tmp_path, "auto") == latest
    assert resolve_resume(tmp_path, "none") is None
    first = tmp_path / "checkpoints" / "step_00000001"
    assert resolve_resume(tmp_path, str(first)) == first
    with pytest.raises(CheckpointError, match="no checkpoint folder at .*step_00000007"):
        resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step_00000007"))
    (first / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_resume(tmp_path, str(first))


def test_resume_accepts_a_run_folder_or_its_checkpoints_folder_and_says_which_checkpoint(tmp_path):
    run = tmp_path / "run"
    training = make_training(0)
    save(run, 1, training)
    latest = save(run, 2, training)
    said = []
    assert resolve_resume(tmp_path / "other", str(run), say=said.append) == latest
    assert resolve_resume(tmp_path / "other", str(run / "checkpoints")) == latest
    assert said == [f"trainer.resume={run}: resuming its latest complete checkpoint, {latest}"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint nor a run folder with a complete one"):
        resolve_resume(tmp_path, str(tmp_path / "empty"))


def test_weights_of_another_shape_are_refused_in_one_line_naming_the_first_parameter(tmp_path):
    path = save(tmp_path, 1, make_training(0))
    wider = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "hidden_size": 48}))
    optimizer = torch.optim.AdamW(wider.parameters())
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model=wider, optimizer=optimizer)
    message = str(error.value)
    assert "\n" not in message and "do not fit model.path" in message
    assert "model.embed_tokens.weight is [64, 32] in the checkpoint but [64, 48] in the model" in message


def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tokenizer):
    training = make_training(0)
    train_step(*training)
    path = save(tmp_path, 1, training)
    skeleton, _, _ = make_training(7)
    out = export_hf(path, tokenizer, tmp_path / "hf", model=skeleton)
    assert (out / "model.safetensors").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, training[0](input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()

    assert (export_hf(training[0], tokenizer, tmp_path / "direct") / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="needs model="):
        export_hf(path, tokenizer, tmp_path / "nothing")
