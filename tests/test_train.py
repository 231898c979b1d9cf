"""The GRPO loop end to end on a tiny random model: metrics, checkpoints, exact resume, clear errors."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_qwen3

from longqa.cli import main
from longqa.config import load_config
from longqa.rollout.lengths import draw_response_lengths
from longqa.train.actor import Actor, Samples, TrainingError, lr_lambda

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("time/", "perf/", "val/seconds")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-model"), tokenizer)


def overrides(model_dir, data_dir, out, **extra) -> list[str]:
    values = {
        "model.path": model_dir,
        "data.train_files": f"{data_dir}/merged/train.parquet",
        "data.val_files": f"{data_dir}/merged/test.parquet",
        "data.max_prompt_length": 4096,
        "data.max_response_length": 6,
        "data.train_batch_size": 4,
        "data.cache_dir": f"{out}/cache",
        "rollout.n": 2,
        "actor.lr": 1e-3,
        "actor.ppo_mini_batch_size": 2,
        "actor.warmup_ratio": 0.25,
        "actor.lr_schedule": "cosine",
        "trainer.max_steps": 4,
        "trainer.test_freq": 2,
        "trainer.save_freq": 1,
        "trainer.keep_last": 2,
        "trainer.output_dir": out,
        "trainer.device": "cpu",
        "trainer.logger": "[jsonl]",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_training_end_to_end(tiny_model_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *overrides(tiny_model_dir, data_dir, out)]) == 0
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2] and "val/accuracy" in rows[4]
    for key in (
        "reward/mean",
        "reward/full_fraction",
        "clip_fraction",
        "entropy",
        "grad_norm",
        "lr",
        "response_length/mean",
        "response_length/max",
        "response/truncated",
        "zero_variance_groups",
        "reward_errors",
    ):
        assert key in rows[1], key
    assert rows[1]["lr"] < rows[2]["lr"]  # warmup then cosine
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    host = [r["perf/host_memory_peak_gb"] for r in raw if "perf/host_memory_peak_gb" in r]
    assert len(host) == 4 and 0 < host[0] and host == sorted(host)  # this process's peak, never falling
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert host[-1] <= round(now, 3)  # (logged to 3 places)
    assert not [k for r in raw for k in r if k.startswith("perf/max_memory")]  # GPU peaks only on CUDA
    assert all(r["perf/update_tflops_per_gpu"] > 0 for r in raw)  # (its FLOPs: test_bench's counter test)
    assert not [k for r in rows for k in r if k.startswith("val/accuracy@")]  # no lengths in these rows
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000003", "step_00000004"]
    assert (out / "report" / "summary.md").is_file() and (out / "report" / "reward.png").is_file()
    assert not (out / "report" / "accuracy_by_length.png").exists()
    exported = tmp_path / "hf"
    assert main(["export", str(out / "checkpoints" / "step_00000004"), str(exported)]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported) is not None
    # the run folder, or its checkpoints/ folder: the latest complete checkpoint; an interrupted one: refused
    weights = (exported / "model.safetensors").read_bytes()
    for given in (out, out / "checkpoints"):
        assert main(["export", str(given), str(tmp_path / "latest")]) == 0
        assert (tmp_path / "latest" / "model.safetensors").read_bytes() == weights
    (out / "checkpoints" / "step_00000004" / "COMPLETE").unlink()
    capsys.readouterr()
    assert main(["export", str(out / "checkpoints" / "step_00000004"), str(tmp_path / "x")]) == 2
    assert "step_00000004 is incomplete" in capsys.readouterr().err
    assert main(["export", str(out), str(tmp_path / "step3")]) == 0
    assert "step_00000003, the run's latest complete checkpoint" in capsys.readouterr().out
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2
    assert f"{tmp_path} is neither a checkpoint" in capsys.readouterr().err


def test_steps_without_a_gradient_are_said_with_their_reasons(tiny_model_dir, data_dir, tmp_path, capsys):
    """A random model never writes \\boxed{}: every group scores 0 alike, so no update changes anything. The run
    says so at its first such step and at every tenth after, with the reasons: responses cut at
    data.max_response_length (here all of them) before the answer at their end, or, where they ended, no
    \\boxed{} answer; a reward that scores every sample alike is said too."""
    extra = {"trainer.total_epochs": 3, "trainer.max_steps": 12, "trainer.test_freq": 0, "trainer.save_freq": 0}
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "a", **extra)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "no gradient" in line]
    logged = {r["step"]: r for r in records(tmp_path / "a")}

    def cut(step: int) -> str:
        return (
            f"{round(8 * logged[step]['response/truncated'])} of 8 samples were cut at data.max_response_length=6 "
            f"tokens before they ended, so the answer a response ends with was never written; raise "
            f"data.max_response_length"
        )

    assert said == [
        f"warning: step 1: no gradient: all 4 groups scored alike (mean reward 0.000; reasons: no_boxed 8 of 8 "
        f"samples): {cut(1)}",
        f"warning: step 10: no gradient for 10 steps in a row: all 4 groups scored alike (mean reward 0.000; "
        f"reasons: no_boxed 8 of 8 samples): {cut(10)}",
    ]
    assert all(r["zero_variance_groups"] == 4 and r["response/truncated"] > 0.5 for r in logged.values())

    # A stop string the random model writes at once ends every response well before the limit: no cut
    extra = {
        "trainer.max_steps": 1,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "rollout.stop": "[e]",
        "data.max_response_length": 64,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "ended", **extra)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "no gradient" in line]
    assert records(tmp_path / "ended")[-1]["response/truncated"] == 0.0
    assert said == [
        "warning: step 1: no gradient: all 4 groups scored alike (mean reward 0.000; reasons: no_boxed 8 of 8 "
        "samples): the model writes no \\boxed{} answer for the reward to read. A short `longqa sft` teaches the "
        "format (or an instruction in the prompts may ask for it)"
    ]

    reward_file = tmp_path / "always.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    extra = {"trainer.max_steps": 1, "trainer.test_freq": 0, "trainer.save_freq": 0, "reward.path": reward_file}
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "b", **extra)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "no gradient" in line]
    assert said == [
        "warning: step 1: no gradient: all 4 groups scored alike (mean reward 1.000): every sample "
        "earned the same reward; harder questions give GRPO something to learn"
    ]


def test_validation_by_length_is_logged_and_drawn(tiny_model_dir, data_dir, tmp_path):
    """Validation rows that carry their context length (one question set at two lengths, measured with the
    approximate counter) add the accuracy at each length to the metrics, and the report draws it."""
    from longqa.data.synth import generate

    by_length = tmp_path / "by-length"
    generate(by_length, rows_per_task=4, context_lengths=(256, 512), max_hops=2, test_ratio=0.25, seed=5)
    out = tmp_path / "run"
    extra = {
        "data.val_files": f"{by_length}/merged/test.parquet",
        "trainer.max_steps": 1,
        "trainer.test_freq": 1,
        "trainer.save_freq": 0,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **extra)]) == 0
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert 0 <= row["val/accuracy@256"] <= 1 and 0 <= row["val/accuracy@512"] <= 1
        assert row["val/accuracy"] == pytest.approx((row["val/accuracy@256"] + row["val/accuracy@512"]) / 2)
    assert (out / "report" / "accuracy_by_length.png").is_file()
    summary = (out / "report" / "summary.md").read_text()
    assert "![accuracy_by_length](accuracy_by_length.png)" in summary and "| val/accuracy@512 |" in summary


def test_compilations_during_a_step_are_counted_in_its_metrics(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """perf/recompiles counts what torch.compile built during the step (here one function compiled in the
    second update alone); perf/graph_captures the engine's CUDA graphs (none on the CPU)."""
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    update, calls = Actor.update, []

    def update_and_compile_once(self, samples):
        calls.append(1)
        if len(calls) == 2:
            double(torch.zeros(7))
        return update(self, samples)

    monkeypatch.setattr(Actor, "update", update_and_compile_once)
    out = tmp_path / "run"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 3, "trainer.test_freq": 0})])
        == 0
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/recompiles" in r]
    assert [r["perf/recompiles"] for r in steps] == [0, 1, 0]
    assert [r["perf/graph_captures"] for r in steps] == [0, 0, 0]


def test_what_a_warm_step_compiled_again_is_said_with_why(tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys):
    """Once the process has run a step, a step that compiles again is said, with the function and the guard that
    failed (here a new static size in the second update); the first step's recompilations (it builds what the run
    needs) and a step that reuses what was built are not."""

    def halve(x):
        return x / 2

    compiled = torch.compile(halve, backend="eager", dynamic=False)
    sizes = {1: (3, 4), 2: (5,), 3: (5,)}  # update call -> the sizes it compiles for
    update, calls = Actor.update, []

    def update_and_compile(self, samples):
        calls.append(1)
        for size in sizes[len(calls)]:
            compiled(torch.zeros(size))
        return update(self, samples)

    monkeypatch.setattr(Actor, "update", update_and_compile)
    out = tmp_path / "run"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 3, "trainer.test_freq": 0})])
        == 0
    )
    [note] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: step")]
    assert note.startswith(
        "note: step 2 (or a validation before it) compiled or captured again, which a warm step "
        "should not: recompiled halve (test_train.py:"
    )
    assert note.endswith("tensor 'x' size mismatch at index 0. actual 5 (2 cached graphs)")  # (sizes 3 and 4)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/recompiles"] for r in steps if "perf/recompiles" in r] == [2, 1, 0]


def test_validation_answers_through_the_rollout_engine(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """The fast engine answers the held-out questions (greedy, without touching the run's random state):
    the metrics are those of transformers' unpadded greedy generate on the same model."""
    import longqa.evaluation.evaluate as evaluation
    from longqa.train.trainer import Trainer

    cfg = load_config(None, overrides(tiny_model_dir, data_dir, tmp_path / "run", **{"data.max_response_length": 12}))
    trainer = Trainer(cfg)
    asked = []
    monkeypatch.setattr(evaluation, "greedy_responses", lambda *a, **k: asked.append("generate"))
    rng = torch.get_rng_state()
    got = trainer.validate()
    assert not asked and torch.equal(rng, torch.get_rng_state())
    monkeypatch.undo()
    reference = evaluation.evaluate(trainer.model, trainer.tokenizer, trainer.val_set, 12, batch_size=1)
    assert got["val/accuracy"] == reference["all"]["accuracy"] and got["val/f1"] == reference["all"]["f1"]
    questions = [trainer.val_set.ids(i) for i in range(4)]
    assert evaluation.engine_greedy_responses(
        trainer.engine, trainer.tokenizer, questions, 12
    ) == evaluation.greedy_responses(trainer.model, trainer.tokenizer, questions, 12, batch_size=1)


def test_a_sharded_validation_puts_every_answer_back_in_its_place(tokenizer):
    """Under data parallelism each rank answers every world-th question; the gathered answers must be
    scored against their own questions (an engine that echoes the prompt gets every one right)."""
    import numpy as np

    from longqa.data.prompts import PromptSet
    from longqa.evaluation.evaluate import engine_greedy_responses, evaluate
    from longqa.rollout.base import RolloutEngine, Sample

    class Echo(RolloutEngine):
        seeded = True

        def generate(self, prompts, params, generator=None, **options):
            return [[Sample(list(p), "stop", None)] for p in prompts]

    names = [f"city {chr(97 + i)}" for i in range(7)]
    ids = [tokenizer.encode(f"\\boxed{{{name}}}", add_special_tokens=False) for name in names]
    prompts = PromptSet(
        np.concatenate(ids).astype(np.int32),
        np.cumsum([0] + [len(x) for x in ids]),
        [{"data_source": "hotpotqa", "ground_truth": name} for name in names],
    )
    world = 3
    for rank in range(world):

        def gather(mine, rank=rank):  # what every rank would contribute, checked against this rank's own
            parts = [engine_greedy_responses(Echo(), tokenizer, ids[r::world], 8) for r in range(world)]
            assert parts[rank] == mine
            return parts

        result = evaluate(None, tokenizer, prompts, 8, engine=Echo(), shard=(rank, world, gather))
        assert result["all"]["n"] == 7 and result["all"]["em"] == 1.0


FIVE_STEPS = {"trainer.total_epochs": 2, "trainer.max_steps": 5}  # into the second epoch (4 steps each)


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir, data_dir, tmp_path_factory) -> Path:
    """Five uninterrupted steps, a checkpoint after each (the last two kept): what a resumed run must equal."""
    straight = tmp_path_factory.mktemp("straight")
    assert main(["train", *overrides(tiny_model_dir, data_dir, straight, **FIVE_STEPS)]) == 0
    return straight


def start_training(args: list[str]) -> subprocess.Popen:
    """``longqa train`` in its own process, so that it can be signalled; its output read as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "longqa.cli", "train", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait_for(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    """Until ``ready()`` or the process ends (or the timeout)."""
    deadline = time.time() + timeout
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)


def logged_step(run: Path, step: int) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and any(
        json.loads(line)["step"] == step for line in path.read_text().splitlines() if line.endswith("}")
    )


def same_weights(a: Path, b: Path) -> bool:
    first, second = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_resume_after_kill_reproduces_the_uninterrupted_run(tiny_model_dir, data_dir, tmp_path, straight_run):
    killed = tmp_path / "killed"
    args = overrides(tiny_model_dir, data_dir, killed, **FIVE_STEPS)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "longqa.cli", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = killed / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert main(["train", *args]) == 0  # trainer.resume=auto
    assert records(killed) == records(straight_run)


PREEMPTED = re.compile(r"^preempted at step (\d+): saved checkpoint (\S+); rerun the same command to resume$", re.M)


@pytest.mark.slow
def test_sigterm_saves_the_finished_step_and_the_rerun_continues_exactly(
    tiny_model_dir, data_dir, tmp_path, straight_run
):
    """SIGTERM once step 2 is logged: the run stops after the step it was in (or the one before, when its
    update had not begun), saves it, says so and exits 75; the same command then ends where the
    uninterrupted run did, metrics and weights alike. Checkpoints only at the end, so the stop's is its own."""
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, data_dir, run, **FIVE_STEPS, **{"trainer.save_freq": 5})
    proc = start_training(args)
    wait_for(proc, lambda: logged_step(run, 2))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output[-2000:]
    stopped = PREEMPTED.search(output)
    assert stopped, output[-2000:]
    step, checkpoint = int(stopped.group(1)), Path(stopped.group(2))
    assert 2 <= step < 5 and checkpoint == run / "checkpoints" / f"step_{step:08d}"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]
    assert (checkpoint / "COMPLETE").is_file() and [r["step"] for r in records(run)] == list(range(step + 1))
    assert not (run / "report").exists()  # written by the run that finishes

    assert main(["train", *args]) == 0
    assert records(run) == records(straight_run)
    assert same_weights(run / "checkpoints" / "step_00000005", straight_run / "checkpoints" / "step_00000005")


def test_ctrl_c_during_validation_says_at_once_that_the_run_is_stopping(
    tiny_model_dir, data_dir, tmp_path, capfd, monkeypatch
):
    """Ctrl-C while the baseline validation runs: the run says at once that it is stopping (the validation still
    ends first), then stops before the first step, with nothing to save, and exits 75."""
    from longqa.train.trainer import Trainer

    monkeypatch.delenv("RANK", raising=False)
    said_while_validating = []
    validate = Trainer.validate

    def interrupted(self):
        if not said_while_validating:
            signal.raise_signal(signal.SIGINT)
            said_while_validating.append(capfd.readouterr().err)
        return validate(self)

    monkeypatch.setattr(Trainer, "validate", interrupted)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        code = main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "run")])
    finally:
        signal.signal(signal.SIGINT, before)
    assert code == 75
    assert "longqa: SIGINT: stopping once the sampling, update or validation in flight ends" in said_while_validating[0]
    assert "preempted at step 0: no step finished, nothing to save" in capfd.readouterr().out


SIGNAL_WHILE_SCORING = '''
import os
import random
import signal
from pathlib import Path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    """Draws from the global random state (which a dropped step must give back) and, once, while step 3
    is being scored, sends this process SIGTERM."""
    metrics, marker = Path(RUN_DIR, "metrics.jsonl"), Path(MARKER)
    if not marker.exists() and metrics.exists() and '"step": 2,' in metrics.read_text():
        marker.write_text("sent")
        os.kill(os.getpid(), signal.SIGTERM)
    return float(random.random() < 0.5)
'''


def signalling_reward(folder: Path, run: Path, sent: bool) -> Path:
    folder.mkdir()
    path, marker = folder / "reward.py", folder / "sent"
    if sent:
        marker.write_text("never")
    path.write_text(f"RUN_DIR = {str(run)!r}\nMARKER = {str(marker)!r}\n" + SIGNAL_WHILE_SCORING)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("grace, stopped_at", [(0, 2), (600, 3)])
def test_a_step_in_flight_is_finished_within_the_grace_period_or_dropped(
    tiny_model_dir, data_dir, tmp_path, capsys, grace, stopped_at
):
    """The signal comes while step 3's samples are scored. With time to spare the step is finished and
    saved; with none its samples are dropped and step 2 saved, the random state put back as step 3 found
    it. Either way the rerun logs what an uninterrupted run with the same reward logs."""
    extra = {
        "trainer.max_steps": 4,
        "trainer.save_freq": 4,
        "trainer.test_freq": 0,
        "trainer.preemption_grace_s": grace,
    }
    straight, run = tmp_path / "straight", tmp_path / "run"
    quiet = signalling_reward(tmp_path / "quiet", straight, sent=True)
    assert main(["train", *overrides(tiny_model_dir, data_dir, straight, **extra, **{"reward.path": quiet})]) == 0
    loud = signalling_reward(tmp_path / "loud", run, sent=False)
    args = overrides(tiny_model_dir, data_dir, run, **extra, **{"reward.path": loud})
    handler = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    assert main(["train", *args]) == 75
    assert f"preempted at step {stopped_at}: saved checkpoint {run / 'checkpoints' / f'step_{stopped_at:08d}'}" in (
        capsys.readouterr().out
    )
    assert signal.getsignal(signal.SIGTERM) is handler  # the trainer's handler is gone with the run
    assert main(["train", *args]) == 0
    assert records(run) == records(straight)
    assert same_weights(run / "checkpoints" / "step_00000004", straight / "checkpoints" / "step_00000004")


def test_sampled_logprobs_equal_the_training_recompute(tiny_model_dir):
    from longqa.model.load import load_model
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.hf import HFRolloutEngine

    model, tokenizer = load_model(str(tiny_model_dir))
    cfg = load_config(None, ["rollout.temperature=0.8", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    prompts = [tokenizer.encode("Question: who founded Quillex?"), tokenizer.encode("Passage 1: Tarvos")]
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=7)
    out = HFRolloutEngine(model, tokenizer).generate(prompts, params, torch.Generator().manual_seed(0))
    samples = Samples([p for p in prompts for _ in range(3)], [s.token_ids for o in out for s in o], torch.zeros(6), 3)
    recomputed = Actor(model, cfg, 1, torch.device("cpu")).logprobs(samples)
    for sample, logp in zip([s for o in out for s in o], recomputed):
        assert torch.allclose(torch.tensor(sample.logprobs), logp, atol=1e-5)


def test_drawn_response_lengths_end_each_response_unless_eos_came_first(tiny_model_dir, data_dir, tmp_path):
    """rollout.response_lengths=lognormal: each prompt's responses end at the lengths drawn for (seed, step,
    prompt, round), or earlier where the model sampled EOS; the same step draws the same lengths again."""
    from longqa.train.trainer import Trainer

    extra = {"data.max_response_length": 16, "rollout.n": 4, "rollout.response_lengths": "lognormal"}
    trainer = Trainer(load_config(None, overrides(tiny_model_dir, data_dir, tmp_path / "run", **extra)))
    indices = trainer.step_prompts(3)
    groups = trainer._sample_groups(indices, 3, 1, {})
    shorter = 0
    for i, group in zip(indices, groups):
        drawn = draw_response_lengths("lognormal", 4, 16, (42, 3, i, 1))
        for limit, sample in zip(drawn, group.samples):
            made = len(sample.token_ids)
            assert made == limit or (made < limit and sample.token_ids[-1] in trainer.stops)
            truncated = made == 16 and sample.token_ids[-1] not in trainer.stops
            assert sample.finish_reason == ("length" if truncated else "stop")
            shorter += made < 16
    assert shorter  # drawn lengths, not all the maximum
    again = trainer._sample_groups(indices, 3, 1, {})
    assert [[s.token_ids for s in g.samples] for g in again] == [[s.token_ids for s in g.samples] for g in groups]


def random_samples(tokenizer, groups=3, n=4, seed=0) -> Samples:
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    prompts, responses = [], []
    for k in range(groups):
        prompt = torch.randint(3, vocab, (5 + 4 * k,), generator=g).tolist()
        for j in range(n):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (1 + (3 * j + k) % 7,), generator=g).tolist())
    return Samples(prompts, responses, torch.randn(groups * n, generator=g), n)


@pytest.mark.parametrize("shared", ["true", "false"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_one_big_batch(tiny_model_dir, mode, shared):
    from longqa.model.load import load_model

    grads = []
    for budget in (100_000, 20):  # one micro-batch vs one or two samples per micro-batch
        model, tokenizer = load_model(str(tiny_model_dir))
        cfg = load_config(
            None,
            [
                f"algo.loss_agg_mode={mode}",
                f"actor.max_tokens_per_micro_batch={budget}",
                "data.train_batch_size=3",
                "actor.ppo_mini_batch_size=3",
                "rollout.n=4",
                "data.max_response_length=8",
                "algo.entropy_coeff=0.01",
                f"actor.shared_prompt={shared}",
            ],
        )
        actor = Actor(model, cfg, 1, torch.device("cpu"))
        samples = random_samples(tokenizer)
        old = actor.logprobs(samples)
        old = [o - 0.1 * (i % 3) for i, o in enumerate(old)]  # ratios away from 1 so clipping is exercised
        actor.accumulate_gradients(samples, list(range(len(samples))), old)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        n_micro = len(actor.micro_batches(samples, list(range(len(samples)))))
        assert n_micro == 1 if budget > 1000 else n_micro >= len(samples) // 2
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_old_logprob_pass_only_when_off_policy(tiny_model_dir, monkeypatch):
    from longqa.model.load import load_model

    for minis, expected in ((3, 0), (1, 1)):
        model, tokenizer = load_model(str(tiny_model_dir))
        cfg = load_config(None, ["data.train_batch_size=3", f"actor.ppo_mini_batch_size={minis}", "rollout.n=4"])
        actor = Actor(model, cfg, 1, torch.device("cpu"))
        calls = []
        original = actor.logprobs
        monkeypatch.setattr(actor, "logprobs", lambda s: calls.append(1) or original(s))
        actor.update(random_samples(tokenizer))
        assert len(calls) == expected


def test_non_finite_updates_are_skipped_then_stop(tiny_model_dir):
    from longqa.model.load import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    cfg = load_config(
        None, ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=4", "actor.max_bad_steps=2"]
    )
    actor = Actor(model, cfg, 10, torch.device("cpu"))
    samples = random_samples(tokenizer)
    samples.advantages[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    assert actor.update(samples)["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TrainingError, match="2 updates in a row had a non-finite"):
        actor.update(samples)


def test_learning_rate_schedule():
    cfg = load_config(None, ["actor.warmup_ratio=0.1", "actor.lr_schedule=cosine", "actor.min_lr_ratio=0.1"])
    f = lr_lambda(cfg, 100)
    assert [round(f(i), 4) for i in (0, 9, 10, 55, 100)] == [0.1, 1.0, 1.0, 0.55, 0.1]
    assert lr_lambda(load_config(None, ["actor.warmup_ratio=0"]), 100)(50) == 1.0


def test_the_schedule_can_be_laid_over_a_given_number_of_updates():
    """`actor.schedule_updates`: the warm-up ratio and the cosine count that many updates, not the run's: 0.05 of
    1,000 is a warm-up of 50 updates however long the run (SkyRL's Arctic backend's horizon); 0 keeps the run's."""
    cfg = load_config(None, ["actor.warmup_ratio=0.05", "actor.schedule_updates=1000"])
    for total in (7, 312, 5000):
        f = lr_lambda(cfg, total)
        assert [f(u) for u in (0, 24, 49, 50, 900)] == [1 / 50, 25 / 50, 1.0, 1.0, 1.0]
    assert lr_lambda(load_config(None, ["actor.warmup_ratio=0.05"]), 312)(0) == 1 / 15  # int(0.05 * 312)
    cosine = ["actor.warmup_ratio=0.1", "actor.lr_schedule=cosine", "actor.min_lr_ratio=0.1"]
    over, run = (
        lr_lambda(load_config(None, [*cosine, "actor.schedule_updates=100"]), 7),
        lr_lambda(load_config(None, cosine), 100),
    )
    assert [over(u) for u in range(120)] == [run(u) for u in range(120)]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"data.train_files": "/nope/train.parquet"}, "/nope/train.parquet: no such file"),
        ({"model.path": "/nope/model"}, "model path /nope/model does not exist"),
        ({"data.max_prompt_length": 8}, "no prompt left: 18 rows read, 18 over data.max_prompt_length=8"),
        ({"data.train_batch_size": 98}, "data.train_batch_size=98 is larger than the 18 training prompts"),
        ({"reward.path": "/nope/reward.py"}, "reward.path / reward.name"),
        (
            {"rollout.engine": "hf", "rollout.response_lengths": "lognormal"},
            "rollout.response_lengths=lognormal needs rollout.engine=fast (got rollout.engine=hf)",
        ),
        (
            {"rollout.engine": "hf", "rollout.speculative": "prompt_lookup"},
            "rollout.speculative=prompt_lookup needs rollout.engine=fast (got rollout.engine=hf)",
        ),
        (
            {"rollout.prompt_lookup_min": 5, "rollout.prompt_lookup_max": 4},
            "rollout.prompt_lookup_min=5 must not exceed rollout.prompt_lookup_max=4",
        ),
        (
            {"rollout.temperature": 0},
            "rollout.temperature=0: algo.adv_estimator=grpo compares the samples of each "
            "prompt, and greedy sampling makes the rollout.n=2 samples one response",
        ),
        ({"actor.ppo_mini_batch_size": 3}, "actor.ppo_mini_batch_size=3 must divide data.train_batch_size=4: "),
        ({"rollout.n": 1}, "rollout.n=1: algo.adv_estimator=grpo compares the samples of each prompt"),
        ({"algo.adv_estimator": "rloo", "rollout.n": 1}, "rollout.n=1: algo.adv_estimator=rloo"),
        (
            {"trainer.output_dir": "{tmp}/a-file/run"},
            "trainer.output_dir {tmp}/a-file/run: {tmp}/a-file is a file, so nothing can be made below it",
        ),
        ({"trainer.output_dir": "{tmp}/a-file"}, "trainer.output_dir {tmp}/a-file is a file: give a folder to write"),
        (
            {"trainer.save_freq": -7},
            "config key 'trainer.save_freq' must be >= 0 (0: never; verl's -1 is taken as 0), got -7",
        ),
    ],
)
def test_bad_input_gets_one_clear_message(tiny_model_dir, data_dir, tmp_path, capsys, extra, message):
    (tmp_path / "a-file").write_text("")  # an output folder below a file cannot be made
    extra = {key: str(value).format(tmp=tmp_path) for key, value in extra.items()}
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "run", **extra)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("longqa: error: ") and message.format(tmp=tmp_path) in err


def test_rollout_speculative_reaches_the_engine_and_samples_the_same(tiny_model_dir, data_dir, tmp_path):
    """rollout.speculative=prompt_lookup and its keys build a speculating fast engine, whose step samples
    are the plain engine's."""
    from longqa.rollout.speculative import Speculation
    from longqa.train.trainer import Trainer

    extra = {"data.max_response_length": 16, "rollout.n": 4}
    speculative = {
        "rollout.speculative": "prompt_lookup",
        "rollout.num_speculative_tokens": 3,
        "rollout.prompt_lookup_min": 1,
        "rollout.prompt_lookup_max": 5,
    }
    plain = Trainer(load_config(None, overrides(tiny_model_dir, data_dir, tmp_path / "plain", **extra)))
    drafting = Trainer(
        load_config(None, overrides(tiny_model_dir, data_dir, tmp_path / "spec", **extra, **speculative))
    )
    assert plain.engine.speculation is None and drafting.engine.speculation == Speculation(3, 1, 5)
    indices = plain.step_prompts(1)
    groups = [trainer._sample_groups(indices, 1, 1, {}) for trainer in (plain, drafting)]
    assert [[s.token_ids for s in g.samples] for g in groups[1]] == [
        [s.token_ids for s in g.samples] for g in groups[0]
    ]
    assert drafting.engine.last_run["draft_row_steps"] > 0


def test_a_custom_reward_failing_on_some_answers_is_counted_on_every_one_stops_the_run(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """A few failures cost those answers (counted, and shown on the console line); a function that fails on
    every call would train nothing and still exit 0, so the run stops at the first such step with its error."""
    path = tmp_path / "reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    if extra_info['index'] % 2 or FAIL_ALWAYS:\n"
        "        raise RuntimeError('boom')\n"
        "    return 1.0\n"
        "FAIL_ALWAYS = False\n"
    )
    out = tmp_path / "run"
    args = overrides(
        tiny_model_dir,
        data_dir,
        out,
        **{"reward.path": path, "trainer.max_steps": 1, "trainer.test_freq": 0, "trainer.logger": "[console,jsonl]"},
    )
    assert main(["train", *args]) == 0
    errors = records(out)[0]["reward_errors"]
    assert 0 < errors < 8 and f"| reward errors {errors} |" in capsys.readouterr().out
    validated = tmp_path / "validated"  # validation counts them too, on its own line
    assert main(["train", *args, "trainer.test_freq=1", f"trainer.output_dir={validated}"]) == 0
    val_errors = [r["val/reward_errors"] for r in records(validated) if "val/reward_errors" in r]
    assert val_errors and all(e > 0 for e in val_errors)
    assert f"| val/reward_errors {val_errors[-1]} |" in capsys.readouterr().out
    path.write_text(path.read_text().replace("FAIL_ALWAYS = False", "FAIL_ALWAYS = True"))
    assert main(["train", *args, "trainer.resume=none", f"trainer.output_dir={tmp_path}/again"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"longqa: error: every one of the 8 reward calls of step 1 "
        f"failed, the last with RuntimeError: boom: fix "
        f"reward.path={path} (compute_score)"
    )
    assert not (tmp_path / "again" / "checkpoints").exists()


def test_validation_scores_with_the_custom_reward(tiny_model_dir, data_dir, tmp_path, capsys):
    """reward.path decides validation accuracy (the mean score) as it decides the training reward; a reward of
    0.75 is a full reward for none of the samples, and the console says each under its own name. Failing on every
    validation answer stops the run before the first step."""
    path = tmp_path / "reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.75\n"
    )
    out = tmp_path / "run"
    args = overrides(
        tiny_model_dir,
        data_dir,
        out,
        **{"reward.path": path, "trainer.max_steps": 1, "trainer.test_freq": 1, "trainer.logger": "[console,jsonl]"},
    )
    capsys.readouterr()
    assert main(["train", *args]) == 0
    assert [r["val/accuracy"] for r in records(out)] == [0.75, 0.75]
    step = records(out)[1]
    assert step["reward/mean"] == 0.75 and step["reward/full_fraction"] == 0.0 and "accuracy" not in step
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step 1/1 |"))
    assert "| reward 0.750 | full reward 0.0% |" in line and "| val/accuracy 0.750 |" in line
    assert re.search(r"\| [\d,]+ sample tok/s \|", line)
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 'right'\n"
    )
    assert main(["train", *args, f"trainer.output_dir={tmp_path}/again"]) == 2
    assert "every one of the 6 reward calls of the validation failed: fix reward.path=" in capsys.readouterr().err


def test_a_resume_applies_changed_settings_from_the_resumed_step_and_says_so(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """The learning rate, the optimizer's betas and weight decay, the number of steps (which the schedule is laid
    over) and the validation frequency, changed on resuming, hold from the resumed step on: the learning rate
    logged is the one an uninterrupted run with the new settings logs at that step, the optimizer steps with the
    new settings, and the new checkpoint records the config that ran and what changed where."""
    first = {"trainer.max_steps": 1, "trainer.test_freq": 0}
    changed = {
        "trainer.max_steps": 2,
        "trainer.test_freq": 2,
        "actor.lr": 5e-3,
        "actor.betas": "[0.8,0.9]",
        "actor.weight_decay": 0.1,
    }
    run, straight = tmp_path / "run", tmp_path / "straight"
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **first)]) == 0
    capsys.readouterr()
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **changed)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_00000001'} at step 1\n" in out
    assert (
        "  changed since the checkpoint, applied from step 2 on: actor.lr 0.001 -> 0.005; actor.betas [0.9, "
        "0.95] -> [0.8, 0.9]; actor.weight_decay 0.0 -> 0.1; trainer.max_steps 1 -> 2; trainer.test_freq 0 -> 2\n"
    ) in out
    assert main(["train", *overrides(tiny_model_dir, data_dir, straight, **{**changed, "trainer.test_freq": 0})]) == 0
    resumed = records(run)
    assert [r["step"] for r in resumed] == [1, 2] and "val/accuracy" in resumed[1]
    assert resumed[1]["lr"] == records(straight)[1]["lr"]  # (the old rate on the new schedule: a fifth of it)
    checkpoint = run / "checkpoints" / "step_00000002"
    groups = torch.load(checkpoint / "optimizer.pt", weights_only=True)["param_groups"]
    assert {(tuple(g["betas"]), g["weight_decay"], g["initial_lr"]) for g in groups} == {((0.8, 0.9), 0.1, 5e-3)}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["config"]["actor"]["lr"] == 5e-3 and state["config"]["trainer"]["max_steps"] == 2
    assert state["resumed_with_changes"] == [
        {
            "step": 1,
            "changes": {
                "actor.lr": [1e-3, 5e-3],
                "actor.betas": [[0.9, 0.95], [0.8, 0.9]],
                "actor.weight_decay": [0.0, 0.1],
                "trainer.max_steps": [1, 2],
                "trainer.test_freq": [0, 2],
            },
        }
    ]


def test_a_resume_that_would_compute_something_else_is_refused_naming_every_difference(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """A changed group size, batch size and seed are refused together, before anything loads, beside the changes
    that would apply; nothing is trained. trainer.resume_allow_changes=true goes on with them, saying so."""
    run = tmp_path / "run"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, run, **{"trainer.max_steps": 1, "trainer.test_freq": 0})])
        == 0
    )
    changed = {
        "trainer.max_steps": 2,
        "trainer.test_freq": 0,
        "rollout.n": 4,
        "data.train_batch_size": 2,
        "trainer.seed": 7,
        "actor.lr": 5e-3,
    }
    capsys.readouterr()
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **changed)]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == (
        f"longqa: error: checkpoint {run / 'checkpoints' / 'step_00000001'} was written with other settings that "
        f"change what the run computes: data.train_batch_size 4 -> 2; rollout.n 2 -> 4; trainer.seed 42 -> 7 (these "
        f"would apply: actor.lr 0.001 -> 0.005; trainer.max_steps 1 -> 2); resume with the checkpoint's values, set "
        f"trainer.resume_allow_changes=true to go on with the new ones, or start a new run in another "
        f"trainer.output_dir"
    )
    assert "prompts" not in out  # refused before the data was read
    assert [r["step"] for r in records(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]

    allowed = {**changed, "trainer.resume_allow_changes": "true"}
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **allowed)]) == 0
    out = capsys.readouterr().out
    assert (
        "  changed since the checkpoint, altering what the run computes (trainer.resume_allow_changes=true): "
        "data.train_batch_size 4 -> 2; rollout.n 2 -> 4; trainer.seed 42 -> 7\n"
    ) in out
    assert [r["step"] for r in records(run)] == [1, 2]
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["config"]["rollout"]["n"] == 4 and state["config"]["data"]["train_batch_size"] == 2
    assert state["resumed_with_changes"][0]["changes"]["rollout.n"] == [2, 4]


def test_train_says_what_it_dropped_and_validation_names_the_buckets_that_lost_prompts(
    tiny_model_dir, data_dir, tmp_path, capsys, tokenizer
):
    """Overlong prompts dropped are counted at the start of the run, per data_source, for training and
    validation alike; a validation source or context length that lost prompts logs its accuracy under a name
    that says how many of its rows it scores (none when it lost them all), and the others keep their names."""
    from collections import Counter

    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.data.synth import generate

    files = {"training": f"{data_dir}/merged/train.parquet", "validation": f"{data_dir}/merged/test.parquet"}
    whole = {name: prepare_prompts([path], tokenizer, PromptOptions(100_000)) for name, path in files.items()}
    limit = int(sorted(whole["training"].lengths)[len(whole["training"]) // 2])
    out = tmp_path / "run"
    extra = {
        "data.max_prompt_length": limit,
        "trainer.max_steps": 1,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "data.train_batch_size": 2,
        "actor.ppo_mini_batch_size": 2,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **extra)]) == 0  # (no validation: said only)
    said = capsys.readouterr().out
    for name, prompts in whole.items():
        over = [m["data_source"] for m, n in zip(prompts.meta, prompts.lengths) if n > limit]
        rows = Counter(m["data_source"] for m in prompts.meta)
        if not over:
            assert f"{name} prompts: all {len(prompts)} kept whole\n" in said
            continue
        assert (
            f"{name} prompts: {len(prompts) - len(over)} of {len(prompts)} kept; {len(over)} dropped over "
            f"data.max_prompt_length={limit}\n"
        ) in said
        counts = [
            f"{source}: {k} of {rows[source]} dropped" + (", none left" if k == rows[source] else "")
            for source, k in sorted(Counter(over).items())
        ]
        assert f"  by data_source: {'; '.join(counts)}\n" in said

    by_length = tmp_path / "by-length"
    generate(by_length, rows_per_task=4, context_lengths=(256, 512), max_hops=2, test_ratio=0.25, seed=5)
    val = prepare_prompts([by_length / "merged" / "test.parquet"], tokenizer, PromptOptions(100_000))
    at = {
        length: [int(n) for m, n in zip(val.meta, val.lengths) if m["extra_info"]["target_tokens"] == length]
        for length in (256, 512)
    }
    by_source = Counter(m["data_source"] for m in val.meta)
    limit = sorted(val.lengths)[-3]  # the two longest prompts dropped
    over = {length: [n for n in lengths if n > limit] for length, lengths in at.items()}
    over_by_source = Counter(m["data_source"] for m, n in zip(val.meta, val.lengths) if n > limit)
    extra.update(
        {"data.max_prompt_length": limit, "data.val_files": f"{by_length}/merged/test.parquet", "trainer.test_freq": 1}
    )
    run = tmp_path / "partial"
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **extra)]) == 0
    lost = [
        f"{length}: {len(o)} of {len(at[length])} dropped" + (", none left" if len(o) == len(at[length]) else "")
        for length, o in over.items()
        if o
    ]
    assert f"  by target_tokens: {'; '.join(lost)}\n" in capsys.readouterr().out
    expected = {
        f"val/accuracy@{length}" + (f"_whole_{len(n) - len(over[length])}_of_{len(n)}" if over[length] else "")
        for length, n in at.items()
        if len(n) > len(over[length])
    }
    expected |= {
        f"val/{source}/accuracy" + (f"_whole_{n - over_by_source[source]}_of_{n}" if over_by_source[source] else "")
        for source, n in by_source.items()
        if n > over_by_source[source]
    }
    for record in records(run):
        logged = {k for k in record if k.startswith("val/") and "accuracy" in k and k != "val/accuracy"}
        assert logged == expected
        assert record["val/lost_prompts"] == 2


@pytest.mark.parametrize("before", [True, False])
def test_val_before_train_decides_the_baseline_validation(tiny_model_dir, data_dir, tmp_path, before):
    """trainer.val_before_train=false (verl's key, the recipe's value) skips the validation before the first step;
    the validations every test_freq steps run either way."""
    out = tmp_path / "run"
    extra = {
        "trainer.max_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 0,
        "trainer.val_before_train": str(before).lower(),
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **extra)]) == 0
    validated = [r["step"] for r in records(out) if "val/accuracy" in r]
    assert validated == ([0, 2] if before else [2])


@pytest.mark.parametrize(
    "names, expected",
    [
        ({}, ("longqa", "run")),  # the run folder's name
        (
            {"trainer.project_name": "arctic_rl_long_context", "trainer.experiment_name": "grpo-32b"},
            ("arctic_rl_long_context", "grpo-32b"),
        ),
    ],
)
def test_the_run_logs_to_its_wandb_project_under_its_name(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, names, expected
):
    """trainer.project_name and trainer.experiment_name (verl's keys of the same names) reach W&B."""
    import importlib.machinery
    import sys
    import types

    inits = []
    fake = types.ModuleType("wandb")  # (a module with a spec: the start-up check finds it installed)
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda data, step: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    extra = {
        "trainer.max_steps": 1,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.logger": "[wandb]",
        **names,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "run", **extra)]) == 0
    assert [(init["project"], init["name"]) for init in inits] == [expected]


def test_auto_micro_batch_budget_on_the_cpu_is_said_and_recorded(tiny_model_dir, data_dir, tmp_path, capsys):
    """On the CPU, whose memory the plan does not size, actor.max_tokens_per_micro_batch=auto is 16,384 tokens:
    said at the start, and what the checkpoint records (so a resume with auto again changes nothing)."""
    run = tmp_path / "run"
    extra = {"trainer.max_steps": 1, "trainer.test_freq": 0, "actor.max_tokens_per_micro_batch": "auto"}
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **extra)]) == 0
    said = capsys.readouterr().out
    assert "actor.max_tokens_per_micro_batch=auto: 16,384 tokens a micro-batch (no GPU memory to size it by)" in said
    state = json.loads((run / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["config"]["actor"]["max_tokens_per_micro_batch"] == 16384
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **{**extra, "trainer.max_steps": 2})]) == 0
    said = capsys.readouterr().out
    assert "resumed from" in said and "actor.max_tokens_per_micro_batch" not in said.split("resumed from")[1]


def test_disk_full_while_checkpointing_keeps_the_last_checkpoint(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys
):
    import errno

    from longqa.train import checkpoint

    out = tmp_path / "run"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 2, "trainer.test_freq": 0})])
        == 0
    )
    real = checkpoint._write_temp

    def full(tmp, files, step, *digests):
        real(tmp, dict(list(files.items())[:1]), step, *digests)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_temp", full)
    args = overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 3, "trainer.test_freq": 0})
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "disk full while writing checkpoint step 3" in err and "step_00000002" in err
    assert checkpoint.latest_checkpoint(out).name == "step_00000002"


def test_kl_penalty_uses_a_frozen_reference_only_when_asked(tiny_model_dir):
    from longqa.model.load import load_model

    base = ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=4", "actor.lr=1e-2"]
    model, tokenizer = load_model(str(tiny_model_dir))
    assert Actor(model, load_config(None, base), 1, torch.device("cpu")).reference is None
    actor = Actor(model, load_config(None, [*base, "algo.kl_coef=0.1"]), 4, torch.device("cpu"))
    samples = random_samples(tokenizer)
    first = actor.update(samples)
    second = actor.update(samples)
    assert first["kl_loss"] == 0.0 and second["kl_loss"] > 0.0  # the policy moved away from the reference
    assert all(not p.requires_grad for p in actor.reference.parameters())


def test_dynamic_sampling_keeps_only_informative_groups(tiny_model_dir, data_dir, tmp_path):
    path = tmp_path / "reward.py"  # half the prompts always score 1: their groups carry no signal
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    import random\n"
        "    return 1.0 if extra_info['index'] % 2 else float(random.random() < 0.5)\n"
    )
    out = tmp_path / "run"
    args = overrides(
        tiny_model_dir,
        data_dir,
        out,
        **{
            "reward.path": path,
            "trainer.max_steps": 2,
            "trainer.test_freq": 0,
            "algo.dynamic_sampling": "true",
            "rollout.n": 4,
        },
    )
    assert main(["train", *args]) == 0
    for row in records(out)[1:]:
        assert row["dynamic/rounds"] >= 1 and row["dynamic/dropped_groups"] >= 1
        assert row["dynamic/groups"] <= 4 and row["zero_variance_groups"] <= row["dynamic/groups"]


def test_an_update_raises_the_likelihood_of_better_than_average_responses(tiny_model_dir):
    from longqa.model.load import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    cfg = load_config(
        None,
        [
            "data.train_batch_size=3",
            "actor.ppo_mini_batch_size=3",
            "rollout.n=4",
            "actor.lr=1e-3",
            "actor.warmup_ratio=0",
        ],
    )
    actor = Actor(model, cfg, 1, torch.device("cpu"))
    samples = random_samples(tokenizer)
    before = actor.logprobs(samples)
    actor.update(samples)
    after = actor.logprobs(samples)
    change = torch.tensor([float((a - b).sum()) for a, b in zip(after, before)])
    assert float((samples.advantages * change).sum()) > 0
    assert float(change[samples.advantages > 0].mean()) > float(change[samples.advantages < 0].mean())


def test_budget_batches_count_padded_tokens():
    from longqa.train.batching import budget_batches

    assert budget_batches([5, 3, 9, 2], [0, 1, 2, 3], 12) == [[0, 1], [2], [3]]
    assert budget_batches([20, 1], [1, 0], 4) == [[1], [0]]  # an over-budget sample goes alone


def test_training_half_precision_weights_warns_where_updates_round_away():
    """An AdamW update is about the learning rate: bf16 weights (8 significant bits) lose it above 256 times
    that, which at the recipe's 1e-6 is most weights. Stepping them is a choice (actor.master_weights=model),
    warned of; FSDP2's float32 masters (on any number of ranks) and DeepSpeed's keep the updates."""
    import torch

    from longqa.config import load_config
    from longqa.train.trainer import rounding_warning

    bf16 = ["model.dtype=bfloat16", "actor.lr=1e-6"]
    message = rounding_warning(load_config(None, [*bf16, "actor.master_weights=model"]))
    assert "rounded away on any weight above 0.00026" in message and "actor.master_weights=float32" in message
    weight = torch.tensor(0.001, dtype=torch.bfloat16)  # above 0.00026: the update is lost
    assert weight + torch.tensor(1e-6, dtype=torch.bfloat16) == weight
    assert rounding_warning(load_config(None, bf16)) is None  # float32 masters, one process too
    assert rounding_warning(load_config(None, ["model.dtype=float32", "actor.master_weights=model"])) is None
    assert rounding_warning(load_config(None, [*bf16, "actor.strategy=deepspeed"])) is None


def test_one_process_trains_a_bf16_model_on_float32_masters(tiny_model_dir, data_dir, tmp_path, capsys):
    """`longqa train model.dtype=bfloat16` in one process: no rounding warning, the shards in a group of its own,
    the run resumes from its checkpoint as any run does, and `longqa export` writes the trained weights."""
    out = tmp_path / "run"
    extra = {
        "model.dtype": "bfloat16",
        "actor.lr": 1e-6,
        "trainer.max_steps": 1,
        "trainer.test_freq": 0,
        "trainer.save_freq": 1,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **extra)]) == 0
    assert "rounded away" not in capsys.readouterr().out
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **{**extra, "trainer.max_steps": 2})]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in records(out)] == [1, 2]
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    masters = torch.load(out / "checkpoints" / "step_00000002" / "model.pt", weights_only=True)
    assert masters.keys() <= exported.keys()
    for name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(exported[name], master.to(exported[name].dtype)), name


def test_what_the_epochs_leave_out_is_said():
    from longqa.train.trainer import describe_epochs

    def lines(*extra):
        return describe_epochs(load_config(None, ["data.train_batch_size=6", *extra]), 16)

    capped, left = lines("trainer.max_steps=5", "trainer.total_epochs=1", "data.shuffle=false")
    assert capped == (
        "note: trainer.max_steps=5 is capped at 2 by trainer.total_epochs=1 (16 prompts, 6 a step): raise "
        "trainer.total_epochs to go on"
    )
    assert left.startswith(
        "note: 4 of 16 prompts (the last 4 of the file order) are left out of every epoch: 16 is "
        "not a multiple of data.train_batch_size=6"
    )
    assert "shuffled order, other ones each epoch" in lines("trainer.max_steps=2", "data.shuffle=true")[0]
    assert lines("trainer.max_steps=4", "trainer.total_epochs=2")[0].startswith("note: 4 of 16")
    assert describe_epochs(load_config(None, ["data.train_batch_size=4", "trainer.max_steps=4"]), 16) == []


def test_a_sample_past_the_micro_batch_budget_is_said_once(capsys):
    from longqa.distributed.env import DistEnv
    from longqa.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["actor.max_tokens_per_micro_batch=10"])
    trainer.env, trainer.over_budget_said = DistEnv.from_environment(), False
    trainer._say_over_budget(0, 10)  # (fits)
    assert capsys.readouterr().out == ""
    trainer._say_over_budget(2, 420)
    trainer._say_over_budget(3, 500)
    out = capsys.readouterr().out.splitlines()
    assert out == [line for line in out if "420 tokens, past actor.max_tokens_per_micro_batch=10" in line]
    assert len(out) == 1 and out[0].startswith("warning: step 3 ")


def test_a_validation_s_kv_re_sizing_is_not_said_as_a_warm_step_building_again(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """Validation asks one greedy answer a prompt, so the fast engine re-sizes its KV stores for it and the next
    step's sampling re-sizes them back: that is by design, and no "note: step" line calls it a warm step building
    again (the demo printed one after each validation)."""
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *overrides(
                    tiny_model_dir,
                    data_dir,
                    out,
                    **{"trainer.max_steps": 3, "trainer.test_freq": 1, "rollout.engine": "fast"},
                ),
            ]
        )
        == 0
    )
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: step")] == []


def test_resuming_an_earlier_checkpoint_says_what_it_gives_up(tiny_model_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    settings = {"trainer.max_steps": 3, "trainer.save_freq": 1, "trainer.keep_last": 3, "trainer.test_freq": 0}
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **settings)]) == 0
    capsys.readouterr()
    earlier = out / "checkpoints" / "step_00000001"
    assert (
        main(["train", *overrides(tiny_model_dir, data_dir, out, **settings, **{"trainer.resume": str(earlier)})]) == 0
    )
    said = capsys.readouterr()
    assert (
        f"{out} holds later checkpoints (step_00000002, step_00000003): this run goes on from step 1 instead, "
        f"discards them at its first save, and its metrics from step 2 on replace theirs"
    ) in said.out + said.err


def test_a_damaged_checkpoint_is_refused_by_train_and_export_naming_the_file(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """400 bytes overwritten in place (the size unchanged), or a JSON file cut short: `train` (resuming) and
    `export` refuse it in one line naming the file, before any weight moves or any export is written. A checkpoint
    without digests (an earlier version's) resumes, said once."""
    out = tmp_path / "run"
    settings = {"trainer.max_steps": 1, "trainer.save_freq": 1, "trainer.test_freq": 0}
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **settings)]) == 0
    step = out / "checkpoints" / "step_00000001"
    kept = {p.name: p.read_bytes() for p in step.iterdir() if p.is_file()}
    damage = {
        "model.pt": "the contents of model.pt differ from those written (its sha256 digest)",
        "trainer_state.json": "trainer_state.json is not valid JSON (cut short?)",
        "COMPLETE": "COMPLETE is not valid JSON (cut short?)",
    }
    settings["trainer.max_steps"] = 2
    for name, what in damage.items():
        data = bytearray(kept[name])
        if name == "model.pt":
            middle = len(data) // 2
            data[middle : middle + 400] = bytes(255 - b for b in data[middle : middle + 400])
        else:
            data = data[: len(data) // 2]
        (step / name).write_bytes(data)
        if name == "trainer_state.json":  # its size in the marker too, so that only reading it finds out
            marker = json.loads(kept["COMPLETE"])
            marker["files"][name] = len(data)
            del marker["sha256"]
            (step / "COMPLETE").write_text(json.dumps(marker))
        capsys.readouterr()
        expected = f"longqa: error: checkpoint {step} is damaged: {what}; resume or export an earlier checkpoint"
        assert main(["train", *overrides(tiny_model_dir, data_dir, out, **settings)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected), name  # (after progress bars)
        assert main(["export", str(out), str(tmp_path / "hf")]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected), name
        assert not (tmp_path / "hf").exists() and sorted(p.name for p in (out / "checkpoints").iterdir()) == [step.name]
        for restored, data in kept.items():
            (step / restored).write_bytes(data)

    marker = json.loads(kept["COMPLETE"])  # as an earlier version wrote it: sizes only
    del marker["sha256"]
    (step / "COMPLETE").write_text(json.dumps(marker))
    capsys.readouterr()
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **settings)]) == 0
    said = capsys.readouterr().out
    assert (
        said.count(
            f"note: checkpoint {step} records no digests of its files (an earlier longqa wrote it): they "
            f"are checked by size only\n"
        )
        == 1
    )
    assert f"resumed from {step} at step 1" in said


HOLDER = """
import sys, time
from longqa.outputs.lock import hold_run_folder
with hold_run_folder(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_run_folder_is_held_by_one_run_at_a_time(tiny_model_dir, data_dir, tmp_path, capsys):
    """A second `train` in the folder of a live run is refused in one line naming that run (host, pid, start
    time), with nothing written there; the lock a killed run leaves is taken over, said; a run gives it back."""
    import socket

    out = tmp_path / "run"
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline() == "held\n"
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        assert main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 1})]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(
            rf"longqa: error: trainer.output_dir={re.escape(str(out))} is in use by another run "
            rf"\(host {re.escape(socket.gethostname())}, pid {other.pid}, started "
            rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\): wait for it to end or stop it, or give this run "
            rf"another trainer.output_dir\n",
            err,
        ), err
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # (its lock alone)
    finally:
        other.kill()
        other.wait()
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **{"trainer.max_steps": 1})]) == 0
    said = capsys.readouterr().out
    assert re.search(
        rf"^note: trainer.output_dir={re.escape(str(out))} was held by a run that is gone \(host "
        rf"{re.escape(socket.gethostname())}, pid {other.pid}, started [-\d: ]+; its process is gone\): "
        rf"this run takes it over$",
        said,
        re.M,
    ), said
    assert [r["step"] for r in records(out)] == [0, 1]
    assert sorted(p.name for p in out.iterdir()) == ["cache", "checkpoints", "metrics.jsonl", "report"]


def test_validation_prompts_cut_to_the_limit_are_scored_not_lost(tiny_model_dir, data_dir, tmp_path, capsys, tokenizer):
    """With data.truncation=left (and no filtering) a prompt over the limit is kept, its start cut: said at the
    start as truncated, and validation scores it under the bucket's own name, with no val/lost_prompts."""
    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.data.synth import generate

    by_length = tmp_path / "by-length"
    generate(by_length, rows_per_task=4, context_lengths=(256, 512), max_hops=2, test_ratio=0.25, seed=5)
    val = prepare_prompts([by_length / "merged" / "test.parquet"], tokenizer, PromptOptions(100_000))
    limit = int(sorted(val.lengths)[-3])  # the two longest cut
    extra = {
        "data.max_prompt_length": limit,
        "data.filter_overlong_prompts": False,
        "data.truncation": "left",
        "data.val_files": f"{by_length}/merged/test.parquet",
        "trainer.max_steps": 1,
        "trainer.test_freq": 1,
        "trainer.save_freq": 0,
        "data.train_batch_size": 2,
        "actor.ppo_mini_batch_size": 2,
    }
    run = tmp_path / "run"
    assert main(["train", *overrides(tiny_model_dir, data_dir, run, **extra)]) == 0
    said = capsys.readouterr().out
    assert (
        f"validation prompts: {len(val)} of {len(val)} kept; 2 truncated to data.max_prompt_length={limit} "
        f"(data.truncation=left)\n"
    ) in said
    assert "validation logs a source or length" not in said
    names = {f"val/accuracy@{m['extra_info']['target_tokens']}" for m in val.meta}
    names |= {f"val/{m['data_source']}/accuracy" for m in val.meta}
    for record in records(run):
        assert "val/lost_prompts" not in record
        assert {k for k in record if k.startswith("val/") and "accuracy" in k and k != "val/accuracy"} == names


def test_save_freq_never_is_said_at_the_start_and_a_console_only_run_still_says_done(
    tiny_model_dir, data_dir, tmp_path, capsys
):
    """trainer.save_freq=-1 is verl's never, longqa's 0: the run says at its start that it writes no checkpoint
    (so that an export finding none is no surprise); and a run logging to the console alone, which writes no
    report, still ends with its done line, saying why there is no report."""
    out = tmp_path / "run"
    extra = {"trainer.save_freq": -1, "trainer.logger": "[console]", "trainer.max_steps": 1, "trainer.test_freq": 0}
    assert main(["train", *overrides(tiny_model_dir, data_dir, out, **extra)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert (
        "note: trainer.save_freq=0 (never; verl's -1 is the same): this run writes no checkpoint but on a stop "
        "by SIGTERM/SIGINT, so a crash loses it and longqa export finds nothing to export"
    ) in said
    assert said[-1] == "done: 1 steps; no report: trainer.logger=[console] writes no jsonl to draw it from"
    assert not (out / "checkpoints").exists() and not (out / "report").exists()
