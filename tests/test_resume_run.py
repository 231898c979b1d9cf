"""A resume at or past the run's last step trains nothing and says so; the final line counts the steps truly."""

import json
import types

from longqa.cli import _steps_done
from longqa.config import load_config
from longqa.train.trainer import Trainer


def trainer_at(tmp_path, checkpoint_step: int, overrides: list[str], total_steps: int) -> Trainer:
    """A Trainer with only what deciding whether to train needs: the config, the checkpoint and the run's length."""
    checkpoint = tmp_path / "checkpoints" / f"step_{checkpoint_step:08d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": checkpoint_step}))
    trainer = object.__new__(Trainer)
    trainer.cfg, trainer.resume_from, trainer.total_steps = load_config(None, overrides), checkpoint, total_steps
    trainer.env = types.SimpleNamespace(is_main=True)
    return trainer


def test_a_checkpoint_past_max_steps_trains_nothing_and_says_why(tmp_path, capsys):
    trainer = trainer_at(tmp_path, 3, ["trainer.max_steps=1"], 1)
    assert trainer._run() == {"steps": 3, "trained": 0, "report": None, "preempted": None}
    line = capsys.readouterr().out.strip()
    assert line.endswith(
        "is already at step 3 >= trainer.max_steps=1: nothing to train; raise trainer.max_steps "
        "(or trainer.total_epochs) to go on"
    )


def test_a_checkpoint_at_the_last_epoch_step_names_the_epochs(tmp_path, capsys):
    trainer = trainer_at(tmp_path, 6, ["trainer.max_steps=null", "trainer.total_epochs=2"], 6)
    assert trainer._run()["trained"] == 0
    assert "already at step 6 >= the 6 steps of trainer.total_epochs=2" in capsys.readouterr().out


def test_a_checkpoint_before_the_last_step_trains_on(tmp_path):
    assert trainer_at(tmp_path, 3, ["trainer.max_steps=5"], 5)._already_done() is None


def test_the_final_line_counts_the_steps_this_run_trained():
    assert _steps_done({"steps": 3, "trained": 3}) == "3 steps"
    assert _steps_done({"steps": 5, "trained": 1}) == "at step 5, 1 of them trained in this run"
    assert _steps_done({"steps": 4}) == "4 steps"  # the Ray launcher's result
