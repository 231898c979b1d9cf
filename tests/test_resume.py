"""What a resumed run may change from its checkpoint's config: every key applied or refused, never silent.

The end-to-end checks (a changed learning rate in metrics.jsonl after a resume, a refused resume that trains
nothing) are in test_train.py; here each key is changed alone and all at once, on the comparison itself."""

import json
import typing
from pathlib import Path

import pytest

from longqa.config import Config, ConfigError, all_keys, checked, load_config, to_dict
from longqa.train.resume import (
    APPLIED_ON_RESUME,
    REFUSED_ON_RESUME,
    ResumeError,
    check_resume,
    config_changes,
    data_fingerprint,
    describe_changes,
)

CHECKPOINT = Path("run/checkpoints/step_00000003")


def test_every_config_key_is_either_applied_or_refused_on_resume():
    """A new key must be put in one class or the other: whether a resumed run may change it is a decision."""
    keys = set(all_keys())
    assert not APPLIED_ON_RESUME & REFUSED_ON_RESUME
    assert APPLIED_ON_RESUME | REFUSED_ON_RESUME == keys, (
        f"unclassified: {sorted(keys - APPLIED_ON_RESUME - REFUSED_ON_RESUME)}; "
        f"not keys: {sorted((APPLIED_ON_RESUME | REFUSED_ON_RESUME) - keys)}"
    )


def default_of(key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(Config(), section), name)


def another_value(key: str):
    """A valid value of ``key`` other than its default."""
    section, _, name = key.partition(".")
    kind = typing.get_type_hints(type(getattr(Config(), section)))[name]
    default = default_of(key)
    candidates = [*typing.get_args(kind), not default if isinstance(default, bool) else None]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        candidates += [default * 2, default + 1, default / 2]
    candidates += ["other", ["other"], ["jsonl"], "cpu", [0.8, 0.9], 3, 0.5]
    for value in candidates:
        try:
            value = checked(key, value)
        except (ConfigError, TypeError):
            continue
        if value is not None and value != default:
            return value
    raise AssertionError(f"no other value found for {key}")


def shown(value) -> str:
    return json.dumps(value)


def with_value(key: str, value) -> Config:
    cfg = Config()
    section, _, name = key.partition(".")
    setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize("key", all_keys())
def test_each_key_changed_alone_is_applied_or_refused_as_classified(key):
    recorded = to_dict(Config())
    new = another_value(key)
    cfg = with_value(key, new)
    difference = f"{key} {shown(default_of(key))} -> {shown(new)}"
    if key in APPLIED_ON_RESUME:
        changes = check_resume(CHECKPOINT, recorded, cfg)
        assert [str(c) for c in changes] == [difference] and not changes[0].refused
        assert describe_changes(changes, 3) == [f"  changed since the checkpoint, applied from step 4 on: {difference}"]
    else:
        with pytest.raises(ResumeError) as e:
            check_resume(CHECKPOINT, recorded, cfg)
        message = str(e.value)
        assert "\n" not in message and f"checkpoint {CHECKPOINT} was written with other settings" in message
        assert f"what the run computes: {difference}; resume with" in message
        assert "trainer.resume_allow_changes=true" in message
        allowed = with_value(key, new)
        allowed.trainer.resume_allow_changes = True
        changes = check_resume(CHECKPOINT, recorded, allowed)
        assert [str(c) for c in changes if c.refused] == [difference]
        assert f"(trainer.resume_allow_changes=true): {difference}" in describe_changes(changes, 3)[-1]


def test_every_refused_difference_is_named_at_once_beside_those_that_would_apply():
    recorded = to_dict(Config())
    cfg = Config()
    for key in all_keys():
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, another_value(key))
    cfg.trainer.resume_allow_changes = False
    with pytest.raises(ResumeError) as e:
        check_resume(CHECKPOINT, recorded, cfg)
    message = str(e.value)
    refused, _, applied = message.partition(" (these would apply: ")
    for key in REFUSED_ON_RESUME:
        assert f"{key} {shown(default_of(key))} -> " in refused, key
    for key in APPLIED_ON_RESUME - {"trainer.resume_allow_changes"}:
        assert f"{key} {shown(default_of(key))} -> " in applied, key


def test_an_unchanged_config_resumes_without_a_word():
    cfg = load_config(None, ["rollout.n=4", "actor.lr=1e-4", "data.train_files=[a.parquet, b.parquet]"])
    assert check_resume(CHECKPOINT, json.loads(json.dumps(to_dict(cfg))), cfg) == []


def test_a_file_given_relative_or_absolute_is_the_same_setting(tmp_path, monkeypatch):
    """The Ray launcher hands its workers absolute paths: their checkpoints resume under a plain run."""
    monkeypatch.chdir(tmp_path)
    relative = load_config(None, ["data.train_files=d/train.parquet", "model.path=models/m"])
    absolute = load_config(None, [f"data.train_files={tmp_path}/d/train.parquet", f"model.path={tmp_path}/models/m"])
    assert config_changes(to_dict(absolute), relative) == []
    assert [
        c.key for c in config_changes(to_dict(relative), load_config(None, ["data.train_files=e/train.parquet"]))
    ] == ["model.path", "data.train_files"]


def test_a_key_the_checkpoint_does_not_record_is_compared_with_its_default():
    """A checkpoint written before a key existed ran as its default."""
    recorded = to_dict(Config())
    del recorded["rollout"]["speculative"], recorded["rollout"]["n"]
    assert check_resume(CHECKPOINT, recorded, Config()) == []
    with pytest.raises(ResumeError, match="rollout.n 8 -> 4"):
        check_resume(CHECKPOINT, recorded, load_config(None, ["rollout.n=4"]))


def test_data_replaced_under_the_same_name_is_refused_unless_allowed(tmp_path, monkeypatch):
    """The checkpoint's data position and order hold for the rows it was trained on, not for others."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.parquet").write_bytes(b"first rows")
    cfg = load_config(None, ["data.train_files=[d/train.parquet]"])
    recorded, then = to_dict(cfg), data_fingerprint(cfg)
    assert check_resume(CHECKPOINT, recorded, cfg, then, data_fingerprint(cfg)) == []
    (tmp_path / "d" / "train.parquet").write_bytes(b"other rows")
    with pytest.raises(
        ResumeError,
        match=r"data.train_files: the contents of d/train.parquet changed since the "
        r"checkpoint; resume with",
    ):
        check_resume(CHECKPOINT, recorded, cfg, then, data_fingerprint(cfg))
    cfg.trainer.resume_allow_changes = True
    changes = check_resume(CHECKPOINT, recorded, cfg, then, data_fingerprint(cfg))
    assert [c.key for c in changes] == ["trainer.resume_allow_changes", "data.train_files"]
    assert "data.train_files: the contents of d/train.parquet changed" in describe_changes(changes, 1)[-1]


def test_a_checkpoint_without_a_data_fingerprint_resumes_as_before(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"rows")
    cfg = load_config(None, [f"data.train_files=[{tmp_path}/train.parquet]"])
    assert check_resume(CHECKPOINT, to_dict(cfg), cfg, None, data_fingerprint(cfg)) == []


def test_data_given_under_another_name_is_one_change_of_its_key(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.parquet").write_bytes(name.encode())
    before = load_config(None, [f"data.train_files=[{tmp_path}/a.parquet]"])
    after = load_config(None, [f"data.train_files=[{tmp_path}/b.parquet]", "trainer.resume_allow_changes=true"])
    changes = check_resume(CHECKPOINT, to_dict(before), after, data_fingerprint(before), data_fingerprint(after))
    assert [c.key for c in changes] == ["data.train_files", "trainer.resume_allow_changes"]


# A fresh run never replaces another run's checkpoints or metrics in its folder without being told to.

from longqa.train.trainer import check_fresh_folder  # noqa: E402


def folder_config(out, resume):
    return load_config(None, [f"trainer.output_dir={out}", f"trainer.resume={resume}"])


def earlier_run(out, steps=(2, 4), records=4):
    for step in steps:
        folder = out / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMPLETE").write_text("{}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, records + 1)))


def test_resume_none_refuses_a_folder_holding_another_run(tmp_path):
    out = tmp_path / "x9"
    earlier_run(out)
    with pytest.raises(ConfigError) as e:
        check_fresh_folder(folder_config(out, "none"), None)
    message = str(e.value)
    assert "\n" not in message
    assert "step_00000002, step_00000004" in message and "metrics.jsonl with 4 records" in message
    assert "another trainer.output_dir" in message and "trainer.resume=auto" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # nothing touched


def test_resume_none_refuses_metrics_alone(tmp_path):
    out = tmp_path / "x"
    earlier_run(out, steps=(), records=1)
    with pytest.raises(ConfigError, match="metrics.jsonl with 1 record,"):
        check_fresh_folder(folder_config(out, "none"), None)


def test_a_fresh_folder_or_a_resume_passes(tmp_path):
    check_fresh_folder(folder_config(tmp_path / "new", "none"), None)
    (tmp_path / "empty").mkdir()
    check_fresh_folder(folder_config(tmp_path / "empty", "none"), None)
    out = tmp_path / "x9"
    earlier_run(out)
    check_fresh_folder(folder_config(out, "auto"), out / "checkpoints" / "step_00000004")


def test_auto_without_a_checkpoint_says_the_metrics_are_replaced(tmp_path):
    out = tmp_path / "x"
    earlier_run(out, steps=(), records=3)
    said = []
    check_fresh_folder(folder_config(out, "auto"), None, say=said.append)
    assert len(said) == 1 and "metrics.jsonl with 3 records" in said[0] and "starts at step 0" in said[0]
