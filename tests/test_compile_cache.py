"""Compiled graphs outlive the process that built them: a second start finds them in the user's cache
folder, and a start on another machine in the run folder's copy, which training writes after the first
step and after any step that compiled something new."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_train import overrides, tiny_model_dir  # noqa: F401 - a fixture

from longqa.cli import main
from longqa.model.compile_cache import RUN_CACHE_FILE, use_user_cache
from longqa.train.actor import Actor

# The same small graph in every process: Inductor finds it in a cache by its content, not by who compiled it.
FUNCTION = "torch.compile(lambda x: torch.nn.functional.silu(x) * x.cos() + 1, dynamic=False)"
COMPILE = textwrap.dedent(f"""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from longqa.model.compile_cache import load_run_cache, use_user_cache
    folder = use_user_cache()
    loaded = load_run_cache(sys.argv[1]) if len(sys.argv) > 1 else False
    {FUNCTION}(torch.randn(8, 16))
    print(json.dumps({{"folder": folder, "loaded": loaded, "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}}))
""")


def compile_in_a_new_process(env: dict, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", COMPILE, *map(str, args)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def fresh_env(**settings) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return {**env, **{k: str(v) for k, v in settings.items()}}


@pytest.mark.slow
def test_a_second_start_finds_its_graphs_in_the_user_s_cache_folder(tmp_path):
    env = fresh_env(XDG_CACHE_HOME=tmp_path / "cache")
    first, second = compile_in_a_new_process(env), compile_in_a_new_process(env)
    assert first["folder"] == str(tmp_path / "cache" / "longqa" / "torch-compile")
    assert first["misses"] >= 1
    assert second["hits"] >= 1 and second["misses"] == 0
    # torch's own setting wins where the user gave it
    mine = compile_in_a_new_process(
        fresh_env(XDG_CACHE_HOME=tmp_path / "cache", TORCHINDUCTOR_CACHE_DIR=tmp_path / "mine")
    )
    assert mine["folder"] == str(tmp_path / "mine") and mine["misses"] >= 1 and any((tmp_path / "mine").iterdir())


def test_the_user_s_folder_follows_xdg_and_home(monkeypatch, tmp_path):
    """Inductor's caches and Triton's (kernels compiled outside Inductor too) in one folder of the user's."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert use_user_cache() == str(tmp_path / ".cache" / "longqa" / "torch-compile")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".cache" / "longqa" / "torch-compile" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's own setting wins
    use_user_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.slow
def test_a_run_folder_carries_its_graphs_to_a_machine_that_never_compiled_them(
    tiny_model_dir, data_dir, tmp_path, monkeypatch
):
    """A run that compiles (here one function, in its second update) leaves ``compile_cache.bin`` in its
    folder; a process with an empty cache folder that loads it compiles nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "this-machine"))
    compiled = eval(FUNCTION)  # noqa: S307 - the shared source above
    update, calls = Actor.update, []

    def update_and_compile_once(self, samples):
        calls.append(1)
        if len(calls) == 2:
            compiled(torch.randn(8, 16))
        return update(self, samples)

    monkeypatch.setattr(Actor, "update", update_and_compile_once)
    run = tmp_path / "run"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, run, **{"trainer.max_steps": 2, "trainer.test_freq": 0})])
        == 0
    )
    assert (run / RUN_CACHE_FILE).stat().st_size > 0
    elsewhere = compile_in_a_new_process(fresh_env(TORCHINDUCTOR_CACHE_DIR=tmp_path / "another-machine"), run)
    assert elsewhere["loaded"] and elsewhere["hits"] >= 1 and elsewhere["misses"] == 0
    without = compile_in_a_new_process(fresh_env(TORCHINDUCTOR_CACHE_DIR=tmp_path / "a-third-machine"))
    assert without["misses"] >= 1  # what the copy saved


@pytest.mark.slow
def test_a_copy_torch_cannot_read_costs_only_the_compile(tmp_path):
    (tmp_path / RUN_CACHE_FILE).write_bytes(b"not a cache")
    result = compile_in_a_new_process(fresh_env(TORCHINDUCTOR_CACHE_DIR=tmp_path / "cache"), tmp_path)
    assert not result["loaded"] and result["misses"] >= 1


@pytest.mark.slow
def test_the_graphs_are_in_the_run_folder_from_the_first_step_on_without_a_checkpoint(
    tiny_model_dir, data_dir, tmp_path, monkeypatch
):
    """A run that saves no checkpoint (trainer.save_freq=0: one whose checkpoints do not fit its disk, or a job
    preempted before its first) has its first step's graphs in the run folder before its second step begins,
    and rewrites the copy only after a step that compiled something new."""
    from longqa.train import trainer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "this-machine"))
    compiled = eval(FUNCTION)  # noqa: S307 - the shared source above
    update, seen, writes = Actor.update, [], []
    run = tmp_path / "run"

    def update_and_compile_first(self, samples):
        seen.append((run / RUN_CACHE_FILE).is_file())
        if len(seen) == 1:
            compiled(torch.randn(8, 16))
        return update(self, samples)

    save = trainer.save_run_cache
    monkeypatch.setattr(Actor, "update", update_and_compile_first)
    monkeypatch.setattr(trainer, "save_run_cache", lambda folder: writes.append(folder) or save(folder))
    assert (
        main(
            [
                "train",
                *overrides(
                    tiny_model_dir,
                    data_dir,
                    run,
                    **{"trainer.max_steps": 3, "trainer.test_freq": 0, "trainer.save_freq": 0},
                ),
            ]
        )
        == 0
    )
    assert seen == [False, True, True] and writes == [run]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    elsewhere = compile_in_a_new_process(fresh_env(TORCHINDUCTOR_CACHE_DIR=tmp_path / "another-machine"), run)
    assert elsewhere["loaded"] and elsewhere["hits"] >= 1 and elsewhere["misses"] == 0
