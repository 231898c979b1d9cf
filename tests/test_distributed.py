"""Data-parallel training with FSDP2 over gloo on the CPU equals the single-process step."""

import hashlib
import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import VOCAB, save_tiny_qwen3, tiny_lm

from longqa.config import load_config
from longqa.train.actor import Actor, Samples

GROUPS, N = 4, 3


def global_samples() -> Samples:
    """Groups of different prompt and response lengths, so ranks get different micro-batch counts."""
    g = torch.Generator().manual_seed(3)
    prompts, responses = [], []
    for k in range(GROUPS):
        prompt = torch.randint(1, VOCAB, (4 + 7 * k,), generator=g).tolist()
        for j in range(N):
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (1 + (5 * j + 3 * k) % 9,), generator=g).tolist())
    return Samples(prompts, responses, torch.randn(GROUPS * N, generator=g), N)


def rank_share(samples: Samples, rank: int, world: int) -> Samples:
    """Rank r owns whole groups: the r-th contiguous share."""
    per = GROUPS // world
    rows = slice(rank * per * N, (rank + 1) * per * N)
    return Samples(samples.prompt_ids[rows], samples.response_ids[rows], samples.advantages[rows], N)


def config(shared: str, mode: str, budget: int, offload: bool = False):
    return load_config(
        None,
        [
            f"actor.shared_prompt={shared}",
            f"algo.loss_agg_mode={mode}",
            "actor.lr=1e-6",
            f"actor.cpu_offload={str(offload).lower()}",
            f"actor.max_tokens_per_micro_batch={budget}",
            f"data.train_batch_size={GROUPS}",
            f"actor.ppo_mini_batch_size={GROUPS}",
            f"rollout.n={N}",
            "data.max_response_length=9",
            "actor.attention_backend=dense",
            "algo.entropy_coeff=0.01",
        ],
    )


def step(actor: Actor, samples: Samples, full=lambda t: t) -> tuple[dict, dict]:
    """Stats and gradients (unsharded by ``full``) of one update, which is then applied."""
    old = [o - 0.05 * (i % 3) for i, o in enumerate(actor.logprobs(samples))]  # exercise clipping
    stats = actor.accumulate_gradients(samples, list(range(len(samples))), old)
    grads = {name.removeprefix("model."): full(p.grad).clone() for name, p in actor.scorer.named_parameters()}
    stats.update(actor.apply_gradients())
    return stats, grads


def _worker(rank, world, port, shared, mode, budget, out, offload=False):
    import os

    import torch.distributed as dist

    from longqa.distributed.fsdp import full_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        actor = Actor(tiny_lm(), config(shared, mode, budget, offload), 1, torch.device("cpu"))  # shards: world > 1
        assert type(next(actor.scorer.parameters())).__name__ == "DTensor"
        stats, grads = step(actor, rank_share(global_samples(), rank, world), lambda t: t.full_tensor())
        state = {k.removeprefix("model."): v for k, v in full_state_dict(actor.scorer).items()}
        if rank == 0:
            torch.save({"state": state, "stats": stats, "grads": grads}, out)
        dist.barrier()  # no collective left in flight when the group goes (gloo aborted a rank at exit now and then)
    finally:
        dist.destroy_process_group()


def _bf16_worker(rank, world, port, out):
    """The GPU setting on the CPU: bf16 compute, fp32 reduction, packed batches through the FSDP root."""
    import functools
    import os

    import torch.distributed as dist

    import longqa.train.actor as actor_module
    from longqa.distributed.fsdp import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        actor_module.shard_model = functools.partial(shard_model, mixed_precision=True)
        actor = Actor(tiny_lm(), config("true", "token-mean", 40), 1, torch.device("cpu"))
        logprobs = actor.logprobs(rank_share(global_samples(), rank, world))
        if rank == 0:
            torch.save(logprobs, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bf16_mixed_precision_takes_packed_batches(tmp_path):
    """FSDP's input casting once rebuilt longqa's PackedBatch and failed (seen on two H200s): inputs are
    not cast, and the bf16 log-probs stay close to the float32 ones."""
    reference = Actor(tiny_lm(), config("true", "token-mean", 40), 1, torch.device("cpu")).logprobs(
        rank_share(global_samples(), 0, 2)
    )
    out = tmp_path / "rank0.pt"
    spawn_ranks(_bf16_worker, 2, free_port(), str(out))
    for got, expected in zip(torch.load(out), reference):
        assert torch.allclose(got.float(), expected, atol=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, *args, nprocs: int = 2) -> None:
    """``mp.spawn(worker, args)``, each process leaving with ``os._exit`` once its worker returned. By then the
    worker has written its results and left the process group; what remains is interpreter shutdown, where
    gloo's threads were seen to abort a rank that had finished ("terminate called without an active
    exception", SIGABRT) and fail a test whose every rank had succeeded. A crash before that still fails the
    test, with each thread's Python stack on stderr (faulthandler)."""
    mp.spawn(_exit_when_done, args=(worker, args), nprocs=nprocs)


def _exit_when_done(rank, worker, args):
    import faulthandler
    import os
    import sys

    faulthandler.enable(all_threads=True)
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _masters_worker(rank, world, port, out, master_weights):
    """The GPU setting on the CPU, with the model loaded in bf16 as the recipe loads it: the engine's copy made
    first (as the trainer makes it), then the actor's shards, one update at lr 1e-6, and the copy refreshed."""
    import functools
    import os

    import torch.distributed as dist

    import longqa.train.actor as actor_module
    from longqa.distributed.fsdp import full_state_dict, shard_model
    from longqa.rollout.fast import FastRolloutEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        actor_module.shard_model = functools.partial(shard_model, mixed_precision=True)
        model = tiny_lm().to(torch.bfloat16)
        engine = FastRolloutEngine(model, own_copy=True)
        cfg = config("true", "token-mean", 40)
        cfg.actor.master_weights = master_weights
        actor = Actor(model, cfg, 1, torch.device("cpu"))
        shards = {p.dtype for p in actor.scorer.parameters()}
        before = {k.removeprefix("model."): v.clone() for k, v in full_state_dict(actor.scorer).items()}
        step(actor, rank_share(global_samples(), rank, world), lambda t: t.full_tensor())
        after = {k.removeprefix("model."): v for k, v in full_state_dict(actor.scorer).items()}
        engine.sync_weights()
        copy = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
        if rank == 0:
            torch.save({"shards": shards, "before": before, "after": after, "copy": copy}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("master_weights", ["float32", "model"])
def test_sharded_bf16_models_step_float32_master_weights(tmp_path, master_weights):
    """A model loaded in bf16 and sharded with mixed precision (as on GPUs) keeps float32 shards, so the recipe's
    update of lr 1e-6 moves every weight by about that much; with the loaded bf16 as the shards
    (actor.master_weights=model) nearly every update rounds away. The engine's copy stays bf16 and takes the
    masters rounded to bf16."""
    out = tmp_path / "rank0.pt"
    spawn_ranks(_masters_worker, 2, free_port(), str(out), master_weights)
    got = torch.load(out)
    moved = torch.cat([(got["after"][k].float() - got["before"][k].float()).flatten() for k in got["after"]])
    if master_weights == "float32":
        assert got["shards"] == {torch.float32}
        # Adam's first step moves each weight by the lr, give or take float32 rounding at weights up to 1.0
        assert (moved != 0).float().mean() > 0.95 and moved.abs().max() <= 1.1e-6
    else:
        assert got["shards"] == {torch.bfloat16}
        assert (moved != 0).float().mean() < 0.05
    assert {p.dtype for p in got["copy"].values()} == {torch.bfloat16}
    for name, weight in got["copy"].items():
        assert torch.equal(weight, got["after"][name].to(torch.bfloat16)), name


@pytest.mark.parametrize("master_weights", ["float32", "model"])
def test_one_process_steps_float32_masters_of_a_bf16_model(master_weights):
    """One process trains as several do: a model loaded in bf16 is sharded in a process group of its own (as
    `longqa train` makes it) with float32 shards, so one update at the recipe's lr 1e-6 moves nearly every
    weight by about that much; with actor.master_weights=model the bf16 weights are stepped and nearly every
    update rounds away."""
    import os

    import torch.distributed as dist

    from longqa.config.checks import float32_masters
    from longqa.distributed.fsdp import full_state_dict

    cfg = config("true", "token-mean", 40)
    cfg.model.dtype, cfg.actor.master_weights = "bfloat16", master_weights
    assert float32_masters(cfg) == (master_weights == "float32")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        actor = Actor(tiny_lm().to(torch.bfloat16), cfg, 1, torch.device("cpu"))
        shards = {p.dtype for p in actor.scorer.parameters()}
        full = (lambda t: t.full_tensor()) if master_weights == "float32" else (lambda t: t)
        state = (lambda: full_state_dict(actor.scorer)) if master_weights == "float32" else actor.scorer.state_dict
        before = {k: v.float().clone() for k, v in state().items()}
        step(actor, global_samples(), full)
        moved = torch.cat([(v.float() - before[k]).flatten() for k, v in state().items()])
    finally:
        dist.destroy_process_group()
    if master_weights == "float32":
        assert shards == {torch.float32}
        assert (moved != 0).float().mean() > 0.95 and moved.abs().max() <= 1.1e-6
    else:
        assert shards == {torch.bfloat16}
        assert (moved != 0).float().mean() < 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    "shared,mode,offload",
    [("true", "token-mean", False), ("false", "seq-mean-token-mean", False), ("true", "seq-mean-token-sum-norm", True)],
)
def test_two_ranks_take_the_single_process_step(tmp_path, shared, mode, offload):
    """The gradient is what a step is made of: equal to 1e-6 of each tensor's largest entry. After
    AdamW (whose first step divides by |g| and so amplifies float noise where g ~ 0) the weights agree
    to float32 rounding (1e-8, a few ulps of these weights) at the recipe's lr of 1e-6."""
    budget = 40  # several micro-batches, a different number on each rank
    model = tiny_lm()
    reference_stats, reference_grads = step(
        Actor(model, config(shared, mode, budget), 1, torch.device("cpu")), global_samples()
    )
    out = tmp_path / "rank0.pt"
    spawn_ranks(_worker, 2, free_port(), shared, mode, budget, str(out), offload)
    result = torch.load(out)
    for name, grad in reference_grads.items():
        rel = ((result["grads"][name] - grad).abs().max() / grad.abs().max()).item()
        assert rel <= 1e-6, (name, rel)
    for name, value in model.state_dict().items():
        gap = (result["state"][name] - value).abs().max().item()
        assert gap <= 1e-8, (name, gap)
    for key in ("pg_loss", "grad_norm", "clip_fraction", "entropy"):
        assert result["stats"][key] == pytest.approx(reference_stats[key], rel=1e-6, abs=1e-9), key


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory, tokenizer):
    from longqa.data.synth import generate

    root = tmp_path_factory.mktemp("dist-run")
    save_tiny_qwen3(root / "model", tokenizer)
    generate(root / "data", rows_per_task=8, context_tokens=256, max_hops=2, test_ratio=0.25, seed=3)
    return root


def run_args(root, out, **extra) -> list[str]:
    values = {
        "model.path": root / "model",
        "data.train_files": root / "data/merged/train.parquet",
        "data.val_files": root / "data/merged/test.parquet",
        "data.max_prompt_length": 4096,
        "data.max_response_length": 6,
        "data.train_batch_size": 4,
        "data.cache_dir": out / "cache",
        "rollout.n": 2,
        "actor.lr": 1e-3,
        "actor.ppo_mini_batch_size": 2,
        "actor.max_tokens_per_micro_batch": 700,
        "trainer.max_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 0,
        "trainer.output_dir": out,
        "trainer.device": "cpu",
        "trainer.logger": "[jsonl]",
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def launch(root, out, ranks: int, **extra) -> list[dict]:
    """``longqa train`` in one process or under torchrun; the metrics it logged."""
    import json
    import os
    import subprocess
    import sys

    command = (
        [sys.executable, "-m", "longqa.cli", "train"]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
            "-m",
            "longqa.cli",
            "train",
        ]
    )
    subprocess.run([*command, *run_args(root, out, **extra)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


MEASURED = (
    "time/",
    "perf/tokens_per_s",
    "perf/update_tflops",
    "perf/max_memory",
    "perf/host_memory",
    "val/seconds",
)  # not computed


def assert_same_records(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    for key, value in a.items():
        if not key.startswith((*MEASURED, *skip)):
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)


GRADED_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A score that differs within a group, so every update moves the weights (a random model earns no reward)."""
    return len(solution_str) % 7 / 6
'''


def moving(tmp_path) -> dict:
    """Settings under which every update moves the weights, and one mini-batch a step: a reward that differs within
    groups (a random model earns none of the hardened reward's), a learning rate that changes samples from step to
    step, and the whole batch in each optimizer step (so the ranks' split of it is no different mini-batches)."""
    path = tmp_path / "graded.py"
    path.write_text(GRADED_REWARD)
    return {"reward.path": path, "actor.lr": 0.05, "actor.ppo_mini_batch_size": 4}


@pytest.mark.slow
def test_torchrun_two_ranks_log_the_single_process_run(run_inputs, tmp_path):
    """`longqa train` unchanged under torchrun: the same samples (seeded per prompt), rewards and
    validation, and the same update statistics, as one process on the same global batch."""
    single, double, extra = tmp_path / "one", tmp_path / "two", moving(tmp_path)
    one, two = launch(run_inputs, single, 1, **extra), launch(run_inputs, double, 2, **extra)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    assert all(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in one[1:])
    for a, b in zip(one, two):
        assert_same_records(a, b)
    assert (double / "report").exists()


@pytest.mark.slow
def test_checkpoints_resume_on_another_number_of_ranks(run_inputs, tmp_path):
    """2 ranks save (sharded), 1 process resumes; 1 process saves, 2 ranks resume: both continue
    exactly as the uninterrupted run."""
    extra = moving(tmp_path)
    straight = launch(run_inputs, tmp_path / "straight", 1, **extra, **{"trainer.max_steps": 3})
    for first, then in ((2, 1), (1, 2)):
        out = tmp_path / f"{first}-then-{then}"
        launch(run_inputs, out, first, **extra, **{"trainer.save_freq": 1})  # steps 1-2, checkpoint at 2
        saved = out / "checkpoints" / "step_00000002"
        assert (saved / "state").is_dir() == (first == 2) and (saved / "model.pt").is_file() == (first == 1)
        marker = json.loads((saved / "COMPLETE").read_text())  # every file's digest, the ranks' shards included
        assert marker["sha256"] == {
            name: hashlib.sha256((saved / name).read_bytes()).hexdigest() for name in marker["files"]
        }
        resumed = launch(run_inputs, out, then, **extra, **{"trainer.max_steps": 3})
        assert [r["step"] for r in resumed] == [0, 1, 2, 3]
        assert_same_records(straight[-1], resumed[-1])


@pytest.mark.slow
def test_one_step_off_under_two_ranks_is_the_single_process_run_and_resumes_on_one(run_inputs, tmp_path):
    """rollout.mode=one_step_off under torchrun: each rank samples its share of the next step before the update, or
    beside it while the ranks' update runs its collectives (rollout.overlap), as one process samples the whole; the
    checkpoint two ranks write after step 2 holds both ranks' groups sampled ahead, and one process resuming from it
    ends where the uninterrupted run did."""
    off = {**moving(tmp_path), "rollout.mode": "one_step_off", "trainer.max_steps": 3, "trainer.test_freq": 0}
    one = launch(run_inputs, tmp_path / "one", 1, **off)
    beside = launch(run_inputs, tmp_path / "beside", 2, **off, **{"rollout.overlap": "true"})
    assert len(beside) == len(one)
    for a, b in zip(one, beside):
        assert_same_records(a, b)
    two = launch(run_inputs, tmp_path / "two", 2, **off, **{"trainer.save_freq": 1})
    assert [r["rollout/staleness"] for r in one] == [0, 1, 1]
    for a, b in zip(one, two):
        assert_same_records(a, b)
    middle = tmp_path / "two" / "checkpoints" / "step_00000002"
    resumed = launch(run_inputs, tmp_path / "resumed", 1, **off, **{"trainer.resume": middle})
    assert [r["step"] for r in resumed] == [3]
    assert_same_records(one[-1], resumed[-1])


STOP_AFTER_STEP_1 = '''
import os
import signal
import time
from pathlib import Path

from longqa.reward import compute_score as hardened


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Once step 1 is logged, the first call on a rank in SENDERS to see it sends SIGTERM to TARGET (its own
    process when None) and, when HOLD_UNTIL is named, scores nothing until that file exists. The signal thus
    lands while a later step is being scored, however short the steps, and never in the run that made MARKER."""
    metrics = Path(RUN_DIR, "metrics.jsonl")
    if os.environ.get("RANK", "0") in SENDERS and metrics.exists() and metrics.read_text():
        try:
            Path(MARKER).open("x").close()
        except FileExistsError:
            pass
        else:
            os.kill(TARGET or os.getpid(), signal.SIGTERM)
            deadline = time.time() + 120
            while HOLD_UNTIL and not Path(HOLD_UNTIL).exists() and time.time() < deadline:
                time.sleep(0.01)
    return hardened(data_source, solution_str, ground_truth, extra_info)
'''


def stopping_reward(path, run, senders: set[str], target: int | None = None, hold_until=None, sent=False):
    """A reward file with :data:`STOP_AFTER_STEP_1` for the run in ``run``; ``sent``: it never signals."""
    marker = path.with_suffix(".sent")
    if sent:
        marker.write_text("never")
    path.write_text(
        f"RUN_DIR = {str(run)!r}\nMARKER = {str(marker)!r}\nSENDERS = {senders!r}\n"
        f"TARGET = {target!r}\nHOLD_UNTIL = {hold_until and str(hold_until)!r}\n" + STOP_AFTER_STEP_1
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ranks, apart", [(2, {}), (3, {"rollout.sampler_ranks": 1})])
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(run_inputs, tmp_path, ranks, apart):
    """Under torchrun only rank 1 gets SIGTERM, while it scores a step after step 1; rank 0, which logs, stops
    after the same step through the per-step agreement (a rank that only samples for them ends when they tell it
    to). Both write their shards of one checkpoint and exit 75, and one process resumes from that checkpoint to the
    end of the uninterrupted run."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from longqa.cli import main

    straight, out = tmp_path / "straight", tmp_path / "two"
    extra = {"trainer.max_steps": 4, "trainer.test_freq": 0}
    quiet = stopping_reward(tmp_path / "quiet.py", straight, {"1"}, sent=True)
    assert main(["train", *run_args(run_inputs, straight, **extra, **{"reward.path": quiet})]) == 0
    extra["reward.path"] = stopping_reward(tmp_path / "stop.py", out, {"1"})
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        "-m",
        "longqa.cli",
        "train",
        *run_args(run_inputs, out, **extra, **apart),
    ]
    src = str(Path(__file__).resolve().parent.parent / "src")
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    output, metrics = done.stdout, out / "metrics.jsonl"
    stopped = re.search(r"^preempted at step (\d+): saved checkpoint (\S+);", output, re.M)
    assert stopped and done.returncode != 0 and "exitcode  : 75" in output, output[-3000:]
    step, checkpoint = int(stopped.group(1)), Path(stopped.group(2))
    assert 1 <= step < 4 and checkpoint == out / "checkpoints" / f"step_{step:08d}"
    assert (checkpoint / "state").is_dir() and (checkpoint / "COMPLETE").is_file()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, step + 1))

    assert main(["train", *run_args(run_inputs, out, **extra)]) == 0  # one process takes it from there
    one = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in resumed] == [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(one, resumed):
        assert_same_records(a, b)


CRASH_ONCE = '''
import os
from pathlib import Path

from longqa.reward import compute_score as hardened


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Kills its worker once, while step 2 is being scored (a checkpoint of step 1 exists then)."""
    marker = Path(MARKER)
    if Path(RUN_DIR, "checkpoints", "step_00000001").is_dir() and not marker.exists():
        marker.write_text("crashed")
        os._exit(1)
    return hardened(data_source, solution_str, ground_truth, extra_info)
'''


@pytest.fixture
def ray_env(tmp_path, monkeypatch):
    """A fresh local Ray per test: loopback only, no usage stats, its own temp folder."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=short)
    yield
    ray.shutdown()
    shutil.rmtree(short, ignore_errors=True)


@pytest.mark.slow
def test_ray_train_workers_restart_from_the_last_checkpoint(run_inputs, tmp_path, ray_env):
    """trainer.launcher=ray: 2 Ray Train workers; one dies mid-run, the group restarts from the last
    checkpoint and finishes with the metrics of an uninterrupted single process. (The killed worker and
    its peer, whose collective broke, may count as one failure or two: max_failures leaves room.)"""
    from longqa.cli import main

    straight = launch(run_inputs, tmp_path / "straight", 1, **{"trainer.max_steps": 3})
    out = tmp_path / "ray-run"
    reward_file = tmp_path / "crash_once.py"  # Ray workers do not see this process's environment
    reward_file.write_text(f"MARKER = {str(tmp_path / 'crashed')!r}\nRUN_DIR = {str(out)!r}\n" + CRASH_ONCE)
    args = run_args(
        run_inputs,
        out,
        **{
            "trainer.max_steps": 3,
            "trainer.save_freq": 1,
            "trainer.launcher": "ray",
            "trainer.ray_workers": 2,
            "trainer.max_failures": 3,
            "reward.path": reward_file,
        },
    )
    assert main(["train", *args]) == 0
    assert (tmp_path / "crashed").exists()  # it did die once
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for a, b in zip(straight, records):
        assert_same_records(a, b, skip=("reward_reason/",))  # a plain float reward gives no reasons


@pytest.mark.slow
def test_sigterm_to_the_ray_driver_stops_its_workers_with_a_checkpoint(run_inputs, tmp_path, ray_env, capsys):
    """trainer.launcher=ray: the driver takes SIGTERM (its workers train in threads, where no handler can be
    installed) and passes it on; both workers stop after the same step with its checkpoint, the driver says
    so and returns 75, and one process resumes to the end of the uninterrupted run.

    A worker sends the signal while it scores a step after step 1 and waits for the driver's request file:
    blocked in Ray's ``get``, the driver runs its handler only when Ray checks for signals, about once a
    second, and steps this small would all be done by then."""
    import json
    import os

    from longqa.cli import main

    straight, out = tmp_path / "straight", tmp_path / "ray-run"
    extra = {"trainer.max_steps": 4, "trainer.test_freq": 0}
    quiet = stopping_reward(tmp_path / "quiet.py", straight, {"0", "1"}, sent=True)
    assert main(["train", *run_args(run_inputs, straight, **extra, **{"reward.path": quiet})]) == 0
    extra["reward.path"] = stopping_reward(
        tmp_path / "stop.py", out, {"0", "1"}, target=os.getpid(), hold_until=out / ".stop-request"
    )
    metrics = out / "metrics.jsonl"
    capsys.readouterr()
    args = run_args(run_inputs, out, **extra, **{"trainer.launcher": "ray", "trainer.ray_workers": 2})
    assert main(["train", *args]) == 75
    said = capsys.readouterr().out.splitlines()
    step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    assert 1 <= step < 4 and (checkpoint / "state").is_dir() and (checkpoint / "COMPLETE").is_file()
    assert f"preempted at step {step}: saved checkpoint {checkpoint}; rerun the same command to resume" in said
    assert not [p.name for p in out.iterdir() if p.name.startswith(".stop-request")]

    assert main(["train", *run_args(run_inputs, out, **extra)]) == 0
    one = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(one, resumed):
        assert_same_records(a, b)


NODE_RECORDER = '''
import os
from pathlib import Path

import ray

from longqa.reward import compute_score as hardened


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Records which Ray node scored (it runs inside the training worker)."""
    Path(OUT, f"node-{os.getpid()}").write_text(ray.get_runtime_context().get_node_id())
    return hardened(data_source, solution_str, ground_truth, extra_info)
'''


@pytest.mark.slow
def test_ray_workers_spread_over_the_nodes_of_a_cluster(run_inputs, tmp_path, monkeypatch):
    """Two one-CPU nodes (ray.cluster_utils: the `ray start` CLI refuses loopback multi-node): the two
    workers land one per node and the run completes."""
    ray = pytest.importorskip("ray")
    import shutil
    import tempfile
    from pathlib import Path

    from ray.cluster_utils import Cluster

    from longqa.cli import main

    for name, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
        ("OMP_NUM_THREADS", "1"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    short = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # socket paths must stay under 108 bytes
    monkeypatch.setenv("RAY_TMPDIR", short)  # where Ray keeps this cluster's files and address
    (Path(short) / "ray").mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        nodes = tmp_path / "nodes"
        nodes.mkdir()
        reward_file = tmp_path / "record_node.py"
        reward_file.write_text(f"OUT = {str(nodes)!r}\n" + NODE_RECORDER)
        out = tmp_path / "run"
        args = run_args(
            run_inputs,
            out,
            **{
                "trainer.max_steps": 1,
                "trainer.test_freq": 0,
                "trainer.launcher": "ray",
                "trainer.ray_workers": 2,
                "reward.path": reward_file,
            },
        )
        assert main(["train", *args]) == 0
        assert len({p.read_text() for p in nodes.iterdir()}) == 2
        assert (out / "metrics.jsonl").exists()
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(short, ignore_errors=True)


def _gather_worker(rank, world, port, out):
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from longqa.distributed.gather import full_parameters, full_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        actor = Actor(tiny_lm(), config("true", "token-mean", 40), 1, torch.device("cpu"))
        model = actor.scorer.model
        unshards = []
        original = FSDPModule.unshard
        FSDPModule.unshard = lambda self, *a, **k: (unshards.append(self), original(self, *a, **k))[1]
        results = []
        for when in ("before any forward", "after a step"):
            if when == "after a step":
                step(actor, rank_share(global_samples(), rank, world))
            unshards.clear()
            gathered = [(name, tensor.clone()) for name, tensor in full_parameters(model)]
            one_by_one = [(name, full_tensor(p).clone()) for name, p in model.named_parameters()]
            results.append(
                {
                    "gathered": gathered,
                    "one_by_one": one_by_one,
                    "unshards": len(unshards),
                    "still_sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
                }
            )
        if rank == 0:
            torch.save({"results": results, "layers": len(model.base_model.layers)}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_engine_refresh_gathers_a_layer_at_a_time(tmp_path):
    """Sharded weights come back whole, equal to gathering each tensor alone, with one gather per decoder
    layer (FSDP2's flat all-gather of its shards) and every shard released after."""
    out = tmp_path / "gathered.pt"
    spawn_ranks(_gather_worker, 2, free_port(), str(out))
    saved = torch.load(out)
    for result in saved["results"]:
        assert sorted(name for name, _ in result["gathered"]) == sorted(name for name, _ in result["one_by_one"])
        one_by_one = dict(result["one_by_one"])
        for name, tensor in result["gathered"]:
            assert torch.equal(tensor, one_by_one[name]), name
        assert result["unshards"] == saved["layers"]
        assert result["still_sharded"]


def reorder_groups(samples: Samples, order: list[int]) -> Samples:
    rows = [g * N + j for g in order for j in range(N)]
    return Samples(
        [samples.prompt_ids[i] for i in rows], [samples.response_ids[i] for i in rows], samples.advantages[rows], N
    )


def _minis_worker(rank, world, port, out):
    import os

    import torch.distributed as dist

    from longqa.distributed.fsdp import full_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = config("true", "token-mean", 40)
        cfg.actor.ppo_mini_batch_size = GROUPS // 2
        actor = Actor(tiny_lm(), cfg, 1, torch.device("cpu"))
        steps = []
        apply = actor.apply_gradients
        actor.apply_gradients = lambda: (steps.append(1), apply())[1]
        actor.update(rank_share(global_samples(), rank, world))
        state = {k.removeprefix("model."): v for k, v in full_state_dict(actor.scorer).items()}
        if rank == 0:
            torch.save({"state": state, "steps": len(steps)}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_mini_batch_counts_groups_over_all_ranks(tmp_path):
    """``actor.ppo_mini_batch_size`` is global, as in verl: with 4 groups on 2 ranks and mini-batches of 2
    there are 2 optimizer steps, each over one group of each rank, the same update as one process taking
    those groups in that order."""
    cfg = config("true", "token-mean", 40)
    cfg.actor.ppo_mini_batch_size = GROUPS // 2
    model = tiny_lm()
    reference = Actor(model, cfg, 1, torch.device("cpu"))
    reference.update(reorder_groups(global_samples(), [0, 2, 1, 3]))  # rank 0 owns groups 0-1, rank 1 groups 2-3
    out = tmp_path / "rank0.pt"
    spawn_ranks(_minis_worker, 2, free_port(), str(out))
    result = torch.load(out)
    assert result["steps"] == 2
    for name, value in model.state_dict().items():
        gap = (result["state"][name] - value).abs().max().item()
        assert gap <= 1e-7, (name, gap)


@pytest.mark.slow
def test_one_process_offloads_its_training_state_and_resumes_like_the_plain_run(run_inputs, tmp_path):
    """``actor.cpu_offload=true`` in a single process shards the model in a process group of its own (the
    shards, gradients and AdamW step in host memory; the engine keeps its own copy), then trains, saves and
    resumes as the plain run does."""
    from longqa.config import load_config
    from longqa.distributed.env import leave_group
    from longqa.train.trainer import Trainer

    trainer = Trainer(load_config(None, run_args(run_inputs, tmp_path / "inspect", **{"actor.cpu_offload": "true"})))
    try:
        assert type(next(trainer.actor.scorer.parameters())).__name__ == "DTensor"
        assert trainer.engine.model is not trainer.model
    finally:
        leave_group()
    plain = launch(run_inputs, tmp_path / "plain", 1, **{"trainer.max_steps": 3})
    out = tmp_path / "offload"
    launch(run_inputs, out, 1, **{"actor.cpu_offload": "true", "trainer.save_freq": 1})
    resumed = launch(run_inputs, out, 1, **{"actor.cpu_offload": "true", "trainer.max_steps": 3})
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(plain, resumed):
        assert_same_records(a, b)


def test_offloaded_shards_need_an_engine_with_its_own_weights():
    from longqa.config import ConfigError
    from longqa.config.checks import check_offload

    with pytest.raises(ConfigError, match="actor.cpu_offload=true needs rollout.engine=fast or vllm"):
        check_offload(load_config(None, ["actor.cpu_offload=true", "rollout.engine=hf"]))
    check_offload(load_config(None, ["actor.cpu_offload=true"]))  # the fast engine keeps a copy


def test_a_rank_s_device_is_its_local_gpu_and_a_device_the_machine_lacks_is_refused(monkeypatch):
    """Under torchrun each rank trains on its local rank's GPU; a device name that is none, or one this machine
    lacks, is refused as in one process (ranks fell back to the CPU for any name not starting with "cuda")."""
    from longqa.distributed.env import DistEnv
    from longqa.model.load import ModelError

    rank = DistEnv(3, 4, 1)
    assert rank.device("cpu") == torch.device("cpu")
    for name in ("gpu", "mps" if not torch.backends.mps.is_available() else "meta"):
        with pytest.raises(ModelError, match=f"trainer.device={name} "):
            rank.device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank.device("cuda") == rank.device("auto") == rank.device("cuda:0") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="trainer.device=cuda but no CUDA device is available"):
        rank.device("cuda")
    assert rank.device("auto") == torch.device("cpu")


@pytest.mark.parametrize("device,local_rank,gpu", [("cuda", 1, 1), ("cuda:0", 1, 0)])
def test_a_group_on_a_bare_cuda_device_joins_on_the_local_rank_s_gpu(monkeypatch, device, local_rank, gpu):
    """`--device cuda` names no GPU, and torch.cuda.set_device refuses such a device: every one-process sharded
    run on a GPU (FSDP2 offload, DeepSpeed) stopped there. A bare "cuda" is the process's own GPU, its local
    rank's; an explicit index stays."""
    import torch.distributed as dist

    from longqa.distributed.env import DistEnv

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: chosen.append(backend))
    assert DistEnv(0, 1, local_rank).init(torch.device(device), alone=True)
    assert chosen == [gpu, "nccl"]


@pytest.mark.slow
def test_sampler_ranks_of_their_own_sample_what_the_training_ranks_would(run_inputs, tmp_path):
    """rollout.sampler_ranks=1 under torchrun with three ranks: two train (FSDP2 over a group of their own) and one
    samples for both, its weights broadcast after each update. Sampling just before each update
    (max_staleness=0) it logs the synchronous single-process run, validation included; one_step_off logs the
    single-process one_step_off run (the sampler checks that each request names the weights it holds: one update
    old); resumed from its checkpoint after step 2 by one training rank and one sampler, it ends where it did.
    Every update moves the weights enough that a sampler which did not load them would draw other samples."""
    apart, common = {"rollout.sampler_ranks": 1}, {**moving(tmp_path), "trainer.max_steps": 3}
    sync = launch(run_inputs, tmp_path / "sync", 1, **common)
    assert all(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in sync[1:])
    fresh = launch(
        run_inputs,
        tmp_path / "fresh",
        3,
        **common,
        **apart,
        **{"rollout.mode": "one_step_off", "rollout.max_staleness": 0},
    )
    assert [r["step"] for r in fresh] == [0, 1, 2, 3] and "val/accuracy" in fresh[-1]
    for a, b in zip(sync, fresh):
        assert_same_records(a, b, skip=("rollout/staleness",))
    # (drawn response lengths travel with the requests too)
    off = {**common, "rollout.mode": "one_step_off", "trainer.test_freq": 0, "rollout.response_lengths": "lognormal"}
    one = launch(run_inputs, tmp_path / "one", 1, **off)
    split = launch(run_inputs, tmp_path / "split", 3, **off, **apart, **{"trainer.save_freq": 1})
    assert [r["rollout/staleness"] for r in split] == [0, 1, 1]
    assert len(split) == len(one)
    for a, b in zip(one, split):
        assert_same_records(a, b)
    middle = tmp_path / "split" / "checkpoints" / "step_00000002"
    resumed = launch(run_inputs, tmp_path / "resumed", 2, **off, **apart, **{"trainer.resume": middle})
    assert [r["step"] for r in resumed] == [3]
    assert_same_records(one[-1], resumed[-1])


@pytest.mark.slow
def test_a_sampler_rank_s_error_ends_the_job_as_it_would_in_one_process(run_inputs, tmp_path):
    """A KV budget too small for one group, on the sampler rank: the training rank reports the engine's own error in
    one line (what to change), as a single process does, and tells the sampler, which ends without a traceback."""
    import os
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "longqa.cli",
        "train",
        *run_args(
            run_inputs,
            tmp_path / "run",
            **{"rollout.sampler_ranks": 1, "rollout.kv_cache_bytes": 1000, "trainer.val_before_train": "false"},
        ),
    ]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    assert done.returncode != 0
    assert "longqa: error: one group (n=2" in done.stdout and "raise rollout.kv_cache_bytes" in done.stdout, (
        done.stdout[-3000:]
    )
    assert "[rank1]: Traceback" not in done.stdout  # the sampler ends quietly when told its training rank failed
