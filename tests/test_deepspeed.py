"""actor.strategy=deepspeed: DeepSpeed ZeRO-3 over gloo on the CPU takes the single-process (and FSDP2) step,
logs the single-process run's metrics, resumes exactly after a kill and exports its weights; its settings
fail with one clear message."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_distributed import (  # noqa: F401
    assert_same_records,
    config,
    free_port,
    global_samples,
    launch,
    rank_share,
    run_args,
    run_inputs,
    spawn_ranks,
)
from test_train import overrides, tiny_model_dir  # noqa: F401
from tiny_models import tiny_lm
from transformers import AutoModelForCausalLM

from longqa.config import ConfigError, load_config
from longqa.distributed import deepspeed as zero3
from longqa.train.actor import Actor
from longqa.train.checkpoint import CheckpointError, load_checkpoint, load_model_weights, save_checkpoint

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed: pip install 'longqa[deepspeed]'"
)
LR = 1e-6  # test_distributed.config's: the recipe's

# name: (strategy, actor.cpu_offload, model dtype, compiled layers). FSDP2; ZeRO-3 stepping torch's AdamW; ZeRO-3 in
# bf16 (the GPU setting) with fp32 master weights; ZeRO-3 with its decoder layers compiled, as the trainer does on a
# GPU, and FSDP2 with its layers' forwards compiled the same way (the graphs a compiled model needs without
# DeepSpeed): none of these compiles a DeepSpeed op. And the recipe's setting, ZeRO-3 stepping DeepSpeed's CPU Adam
# on the offloaded optimizer (compiled on first use), in a test of its own.
VARIANTS = {
    "fsdp2": ("fsdp2", False, torch.float32, False),
    "deepspeed": ("deepspeed", False, torch.float32, False),
    "deepspeed-bf16": ("deepspeed", False, torch.bfloat16, False),
    "deepspeed-compiled": ("deepspeed", False, torch.float32, True),
    "fsdp2-compiled": ("fsdp2", False, torch.float32, True),
    "deepspeed-offload": ("deepspeed", True, torch.float32, False),
}


def whole_grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole gradient, whichever sharding holds it (a collective when sharded)."""
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    return param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad


def whole_weights(actor: Actor) -> dict:
    from longqa.distributed.gather import full_tensor

    return {name: full_tensor(p).float() for name, p in actor.model.named_parameters()}


def one_step(actor: Actor, samples) -> dict:
    """Stats, whole gradients and whole weights after one update (old log-probs shifted to exercise clipping)."""
    old = [o - 0.05 * (i % 3) for i, o in enumerate(actor.logprobs(samples))]
    stats = actor.accumulate_gradients(samples, list(range(len(samples))), old)
    grads = {name: whole_grad(p).float().clone() for name, p in actor.model.named_parameters()}
    stats.update(actor.apply_gradients())
    return {"stats": stats, "grads": grads, "weights": whole_weights(actor)}


def make_actor(name: str) -> Actor:
    strategy, offload, dtype, _ = VARIANTS[name]
    cfg = config("true", "token-mean", 40, offload)  # several micro-batches, a different number per rank
    cfg.actor.strategy = strategy
    return Actor(tiny_lm().to(dtype), cfg, 1, torch.device("cpu"))


def _step_worker(rank, world, port, out, checkpoints, names, extensions):
    """One update of each named variant; an engine's checkpoint after it; and, under DeepSpeed, the update after
    that twice: by the engine that took the first, and by a fresh engine resumed from the checkpoint. Compiled
    ops, if any, are built in ``extensions`` (None: the shared cache)."""
    import torch.distributed as dist

    from longqa.model.load import compile_decoder_layers, compiled_graphs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    if extensions:
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    dist.init_process_group("gloo", rank=rank, world_size=world)
    linear = torch.nn.functional.linear
    try:
        results = {}
        samples = rank_share(global_samples(), rank, world)
        for name in names:
            actor = make_actor(name)
            if VARIANTS[name][3]:
                torch._dynamo.reset()  # (no graph of an earlier variant is reused: each counts all it needs)
            start = compiled_graphs()
            if VARIANTS[name][3]:
                compile_decoder_layers(actor.model, backend="eager", with_hooks=False)
            results[name] = one_step(actor, samples)
            results[name]["graphs"] = compiled_graphs() - start
            if actor.engine is None:
                continue
            saved = save_checkpoint(
                f"{checkpoints}/{name}",
                1,
                model=actor.model,
                optimizer=actor.optimizer,
                scheduler=actor.scheduler,
                engine=actor.engine,
                keep_last=1,
                trainer_state={"step": 1},
            )
            if not VARIANTS[name][3]:  # (the resumed engine is not compiled: compared with one that is not either)
                resumed = make_actor(name)
                load_checkpoint(
                    saved,
                    model=resumed.model,
                    optimizer=resumed.optimizer,
                    scheduler=resumed.scheduler,
                    engine=resumed.engine,
                )
                results[name]["second"] = [one_step(a, samples)["weights"] for a in (actor, resumed)]
        results["torch_s_linear"] = torch.nn.functional.linear is linear
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference_step():
    """The single-process update: its stats, gradients and weights."""
    return one_step(Actor(tiny_lm(), config("true", "token-mean", 40), 1, torch.device("cpu")), global_samples())


def two_rank_run(root, names: list[str], extensions=None) -> tuple[dict, object]:
    """The named variants' updates on 2 ranks (rank 0's results) and the folder of their checkpoints."""
    args = (2, free_port(), str(root / "rank0.pt"), str(root / "runs"), names, extensions and str(extensions))
    spawn_ranks(_step_worker, *args)
    return torch.load(root / "rank0.pt"), root / "runs"


@pytest.fixture(scope="module")
def two_rank_steps(reference_step, tmp_path_factory):
    """One update of each variant that needs no compiled op, on 2 ranks (building any op in a folder of its
    own), and the single-process update."""
    root = tmp_path_factory.mktemp("deepspeed-step")
    (root / "extensions").mkdir()
    results, runs = two_rank_run(
        root, ["fsdp2", "deepspeed", "deepspeed-bf16", "deepspeed-compiled", "fsdp2-compiled"], root / "extensions"
    )
    return reference_step, results, runs


def assert_the_single_process_step(reference: dict, got: dict) -> None:
    """Gradients to 1e-5 of each tensor's largest entry; weights after the step (clipped: the norm is above
    actor.grad_clip) to float32 rounding, 1e-8 at these weights of ~0.05. Adam's first step moves each weight by
    about lr * g / |g|, so where the gradient itself is float noise (below the gradient tolerance) its direction
    is noise too, and those weights agree to 2 lr."""
    assert reference["stats"]["grad_norm"] > 1.0  # clipping takes part
    for key in ("pg_loss", "grad_norm", "clip_fraction", "entropy", "lr"):
        assert got["stats"][key] == pytest.approx(reference["stats"][key], rel=1e-6, abs=1e-9), key
    for param, grad in reference["grads"].items():
        scale = grad.abs().max()
        assert ((got["grads"][param] - grad).abs().max() / scale).item() <= 1e-5, param
        gap = (got["weights"][param] - reference["weights"][param]).abs()
        defined = grad.abs() > 1e-5 * scale
        assert gap[defined].max().item() <= 1e-8, param
        assert gap.max().item() <= 2 * LR, param


def assert_resumed_exactly(got: dict) -> None:
    """The update after a checkpoint, taken by the engine that wrote it and by one resumed from it: the same."""
    kept, resumed = got["second"]
    assert all(torch.equal(kept[param], resumed[param]) for param in kept)
    assert any(not torch.equal(kept[param], got["weights"][param]) for param in kept)  # the update moved them


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "deepspeed", "deepspeed-compiled"])
def test_one_step_equals_the_single_process_step(two_rank_steps, name):
    """FSDP2, and ZeRO-3 with torch's AdamW (eager and compiled), take the single-process update; ZeRO-3 resumes
    it exactly from its checkpoint."""
    reference, results, _ = two_rank_steps
    assert_the_single_process_step(reference, results[name])
    if name == "deepspeed":
        assert_resumed_exactly(results[name])


@needs_deepspeed
@pytest.mark.slow
def test_cpu_adam_on_the_offloaded_optimizer_takes_the_single_process_step(reference_step, tmp_path):
    """The recipe's setting, `actor.strategy=deepspeed actor.cpu_offload=true`: ZeRO-3 on 2 ranks with the
    optimizer offloaded and stepped by DeepSpeed's CPU Adam (compiled here on first use) takes torch's AdamW
    step of one process, and resumes exactly from its checkpoint (CPU Adam's state included)."""
    results, _ = two_rank_run(tmp_path, ["deepspeed-offload"])
    assert_the_single_process_step(reference_step, results["deepspeed-offload"])
    assert_resumed_exactly(results["deepspeed-offload"])


def partly_offloaded_actor(ratio: float, sub_groups_file: str) -> Actor:
    """ZeRO-3 with CPU Adam stepping ``ratio`` of the optimizer's sub-groups and torch's AdamW the rest, the learning
    rate falling along a cosine over the 3 updates, from the full rate (so it changes every step and is never 0, as
    a DeepSpeed warm-up's first two updates are). On the CPU DeepSpeed's accelerator *is* the CPU,
    and it would give every sub-group to CPU Adam: the accelerator's share is renamed "cpu:0", a name for the same
    device that DeepSpeed does not take for its host, so those sub-groups take its accelerator path as on a GPU."""
    cfg = config("true", "token-mean", 40, True)
    cfg.actor.strategy, cfg.actor.cpu_offload_ratio, cfg.actor.deepspeed_config = "deepspeed", ratio, sub_groups_file
    cfg.actor.warmup_ratio, cfg.actor.lr_schedule = 0.0, "cosine"
    actor = Actor(tiny_lm(), cfg, 3, torch.device("cpu"))
    zero = actor.engine.optimizer
    for i in range(int((1 - ratio) * len(zero.subgroup_to_device))):
        zero.subgroup_to_device[i] = "cpu:0"
    return actor


def _partial_offload_worker(rank, world, port, out, folder):
    """Three updates with the whole optimizer offloaded and with half of it, a checkpoint of the second after
    its second update, and that third update again by an engine resumed from the checkpoint."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        samples, sub_groups = rank_share(global_samples(), rank, world), f"{folder}/sub_groups.json"
        results = {}
        for ratio in (1.0, 0.5):
            actor = partly_offloaded_actor(ratio, sub_groups)
            results[ratio] = {"devices": dict(actor.engine.optimizer.subgroup_to_device), "weights": []}
            for update in range(3):
                results[ratio]["weights"].append(one_step(actor, samples)["weights"])
                if update == 1 and ratio < 1:
                    saved = save_checkpoint(
                        f"{folder}/runs",
                        2,
                        model=actor.model,
                        optimizer=actor.optimizer,
                        scheduler=actor.scheduler,
                        engine=actor.engine,
                        keep_last=1,
                        trainer_state={"step": 2},
                    )
        resumed = partly_offloaded_actor(0.5, sub_groups)
        load_checkpoint(
            saved, model=resumed.model, optimizer=resumed.optimizer, scheduler=resumed.scheduler, engine=resumed.engine
        )
        results["resumed"] = one_step(resumed, samples)["weights"]
        try:
            load_checkpoint(
                saved,
                model=(whole := partly_offloaded_actor(1.0, sub_groups)).model,
                optimizer=whole.optimizer,
                scheduler=whole.scheduler,
                engine=whole.engine,
            )
        except ConfigError as e:
            results["refused"] = str(e)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@needs_deepspeed
@pytest.mark.slow
def test_a_partly_offloaded_optimizer_steps_as_the_offloaded_one_and_resumes_exactly(tmp_path):
    """`actor.cpu_offload_ratio=0.5` on 2 ranks: half of each rank's sub-groups stepped by torch's AdamW on the
    accelerator, the rest by CPU Adam on the host, take the fully offloaded run's updates under a changing
    learning rate (DeepSpeed builds that AdamW with the rate of its first step and never moves it), and resume
    exactly from a checkpoint (DeepSpeed saves the offloaded part's moments alone); a run that offloads all of it
    is refused that checkpoint, naming the setting."""
    (tmp_path / "sub_groups.json").write_text(json.dumps({"zero_optimization": {"sub_group_size": 2000}}))
    spawn_ranks(_partial_offload_worker, 2, free_port(), str(tmp_path / "rank0.pt"), str(tmp_path))
    results = torch.load(tmp_path / "rank0.pt")
    devices = list(results[0.5]["devices"].values())
    assert len(devices) >= 4 and devices.count("cpu") == len(devices) - len(devices) // 2
    assert set(results[1.0]["devices"].values()) == {"cpu"}
    whole, half = results[1.0]["weights"], results[0.5]["weights"]
    for update in range(3):  # CPU Adam and torch's AdamW round differently: 1e-8 is 1% of the first update
        assert max((half[update][p] - whole[update][p]).abs().max().item() for p in whole[update]) <= 1e-8, update
    assert all(torch.equal(results["resumed"][p], half[2][p]) for p in half[2])
    assert "actor.cpu_offload_ratio" in results["refused"]


def _host_with_a_gpu_worker(rank, world, port, out, extensions):
    """One rank of ZeRO-3 on the CPU where DeepSpeed's own choice of accelerator is CUDA's, as on a GPU host;
    compiled ops, if any, are built in ``extensions``."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), TORCH_EXTENSIONS_DIR=extensions
    )
    set_accelerator(CUDA_Accelerator())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        actor = make_actor("deepspeed")
        got = one_step(actor, global_samples())
        got["accelerator"] = get_accelerator().device_name()
        got["devices"] = {p.device.type for p in actor.model.parameters()}
        torch.save(got, out)
    finally:
        dist.destroy_process_group()


@needs_deepspeed
@pytest.mark.slow
def test_a_cpu_run_on_a_host_with_a_gpu_keeps_deepspeed_on_the_cpu(reference_step, tmp_path):
    """DeepSpeed chooses its accelerator from the host: on a host with a GPU it moved a CPU run's model to cuda:0
    and gave rank r GPU r (an invalid device past the GPU count). Here the host's choice is CUDA's, as on such a
    host, and a one-rank ZeRO-3 run on the CPU still takes the single-process step there, compiling no op (the
    CPU accelerator's inference all-reduce was built there when it was marked unavailable on CUDA's)."""
    out, extensions = tmp_path / "rank0.pt", tmp_path / "extensions"
    extensions.mkdir()
    spawn_ranks(_host_with_a_gpu_worker, 1, free_port(), str(out), str(extensions), nprocs=1)
    got = torch.load(out)
    assert got["accelerator"] == "cpu" and got["devices"] == {"cpu"}
    assert_the_single_process_step(reference_step, got)
    assert list(extensions.iterdir()) == []


def _refresh_worker(rank, world, port, out):
    """The engine refresh's gathers of a ZeRO-3 model, before any step and after one, counted."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from longqa.distributed.gather import full_parameters, full_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    original = deepspeed.zero.GatheredParameters
    try:
        actor = make_actor("deepspeed")
        model = actor.model
        results = []
        for when in ("before any step", "after a step"):
            if when == "after a step":
                one_step(actor, rank_share(global_samples(), rank, world))
            gathers = []
            deepspeed.zero.GatheredParameters = lambda params, *a, **k: (
                gathers.append(len(params)),
                original(params, *a, **k),
            )[1]
            gathered = [(name, tensor.clone()) for name, tensor in full_parameters(model)]
            deepspeed.zero.GatheredParameters = original
            one_by_one = [(name, full_tensor(p).clone()) for name, p in model.named_parameters()]
            results.append(
                {
                    "gathered": gathered,
                    "one_by_one": one_by_one,
                    "gathers": gathers,
                    "partitioned": all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()),
                }
            )
        if rank == 0:
            torch.save(
                {
                    "results": results,
                    "layers": len(model.base_model.layers),
                    "per_layer": len(list(model.base_model.layers[0].parameters())),
                    "parameters": len(list(model.parameters())),
                },
                out,
            )
        dist.barrier()
    finally:
        deepspeed.zero.GatheredParameters = original
        dist.destroy_process_group()


@needs_deepspeed
@pytest.mark.slow
def test_the_engine_refresh_gathers_a_zero3_layer_at_a_time(tmp_path):
    """ZeRO-3 weights come back whole, equal to gathering each tensor alone, with one gather per decoder layer
    (its dozen tensors together, as its forward pass gathers them) and every parameter partitioned again
    after."""
    out = tmp_path / "gathered.pt"
    spawn_ranks(_refresh_worker, 2, free_port(), str(out))
    saved = torch.load(out)
    others = saved["parameters"] - saved["layers"] * saved["per_layer"]  # embeddings, final norm, LM head
    for result in saved["results"]:
        assert sorted(name for name, _ in result["gathered"]) == sorted(name for name, _ in result["one_by_one"])
        one_by_one = dict(result["one_by_one"])
        for name, tensor in result["gathered"]:
            assert torch.equal(tensor, one_by_one[name]), name
        assert sorted(result["gathers"]) == sorted([saved["per_layer"]] * saved["layers"] + [1] * others)
        assert result["partitioned"]


@needs_deepspeed
@pytest.mark.slow
def test_zero3_with_torch_s_adamw_compiles_no_op(two_rank_steps):
    """Neither CPU Adam, nor the shared-memory all-reduce that DeepSpeed's CPU accelerator builds for inference:
    ZeRO-3 on the CPU needs a C++ compiler only for an offloaded optimizer."""
    _, _, runs = two_rank_steps
    assert list((runs.parent / "extensions").iterdir()) == []


@needs_deepspeed
@pytest.mark.slow
def test_compiled_layers_trace_no_deepspeed_hook(two_rank_steps):
    """Each decoder layer is gathered whole by one hook outside its compiled forward, so the compiled layers
    need the graphs they need without DeepSpeed: those of FSDP2's layers, whose hooks are outside their
    compiled forwards too, on the same micro-batches (with a hook per projection inside the compiled call,
    Dynamo recompiled each hook for every layer, dozens of graphs)."""
    _, results, _ = two_rank_steps
    assert results["deepspeed"]["graphs"] == 0
    assert 0 < results["deepspeed-compiled"]["graphs"] == results["fsdp2-compiled"]["graphs"]
    # ZeRO-3's memory-efficient linear replaces torch's for the whole process, and its backward reads each weight's
    # ZeRO id: on an H200 the compiled layers then recompiled for every weight (here the CPU's graphs hide it).
    assert results["torch_s_linear"]


@needs_deepspeed
@pytest.mark.slow
def test_bf16_keeps_the_step_to_bf16_precision(two_rank_steps):
    """The GPU setting on the CPU: a bf16 model, fp32 master weights, fp32 reduction and accumulation."""
    reference, results, _ = two_rank_steps
    got = results["deepspeed-bf16"]
    assert got["stats"]["grad_norm"] == pytest.approx(reference["stats"]["grad_norm"], rel=1e-2)
    for param, grad in reference["grads"].items():
        assert ((got["grads"][param] - grad).abs().max() / grad.abs().max()).item() <= 3e-2, param


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed", "deepspeed-bf16"])
def test_a_two_rank_checkpoint_exports_the_trained_weights(two_rank_steps, name):
    """The ranks' partitions put together in one process (what `longqa export` writes) are the weights the
    engine held after its step; in bf16, the fp32 master weights that the bf16 ones round."""
    _, results, runs = two_rank_steps
    checkpoint = runs / name / "checkpoints" / "step_00000001"
    model = tiny_lm()
    load_model_weights(checkpoint, model)
    for param, value in model.named_parameters():
        held = results[name]["weights"][param]
        assert torch.equal(value.detach().to(torch.bfloat16).float() if name.endswith("bf16") else value.detach(), held)
    with pytest.raises(
        CheckpointError, match="written under actor.strategy=deepspeed.*resume with actor.strategy=deepspeed"
    ):
        load_checkpoint(checkpoint, model=model, optimizer=torch.optim.AdamW(model.parameters()))


# ------------------------------------------------------------------------------------------ whole runs


# ZeRO-3 stepping torch's AdamW, which compiles nothing (DeepSpeed's CPU Adam, the recipe's optimizer, takes the
# same update: test_cpu_adam_on_the_offloaded_optimizer_takes_the_single_process_step).
DEEPSPEED_RUN = {"trainer.max_steps": 3, "trainer.save_freq": 1, "actor.strategy": "deepspeed"}


@pytest.fixture(scope="module")
def straight_runs(run_inputs, tmp_path_factory):
    """Three uninterrupted steps: one process, and 2 ranks under DeepSpeed (checkpointing every step)."""
    root = tmp_path_factory.mktemp("deepspeed-runs")
    one = launch(run_inputs, root / "one", 1, **{"trainer.max_steps": 3})
    two = launch(run_inputs, root / "two", 2, **DEEPSPEED_RUN)
    return one, two, root / "two"


@needs_deepspeed
@pytest.mark.slow
def test_two_ranks_under_deepspeed_log_the_single_process_run(straight_runs):
    """`longqa train actor.strategy=deepspeed` under torchrun: the same samples, rewards, validation and update
    statistics as one process on the same global batch (2 mini-batches a step, several micro-batches each)."""
    one, two, _ = straight_runs
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3]
    for a, b in zip(one, two):
        assert_same_records(a, b)


@needs_deepspeed
@pytest.mark.slow
def test_kill_and_resume_under_deepspeed_reproduces_the_uninterrupted_run(run_inputs, straight_runs, tmp_path):
    """2 ranks killed (SIGKILL, launcher and workers) once step 2's checkpoint is complete; rerun, they resume
    from DeepSpeed's partitions (weights and optimizer state) and log what the uninterrupted 2-rank
    run logged; both runs' last checkpoints export the same HF weights."""
    _, straight, straight_dir = straight_runs
    out = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "longqa.cli",
        "train",
        *run_args(run_inputs, out, **DEEPSPEED_RUN),
    ]
    proc = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = out / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert (marker.parent / "deepspeed").is_dir()
    resumed = launch(run_inputs, out, 2, **DEEPSPEED_RUN)  # trainer.resume=auto
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed):
        assert_same_records(a, b)

    from longqa.cli import main

    exported = []
    for run in (out, straight_dir):
        assert main(["export", str(run / "checkpoints" / "step_00000003"), str(run / "hf")]) == 0
        exported.append(AutoModelForCausalLM.from_pretrained(run / "hf").state_dict())
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])


# ------------------------------------------------------------------------------------------ warm-up


def recipe_zero3_rates(lr: float, ratio: float, horizon: int, schedule: str, floor: float, updates: int) -> list:
    """The learning rate of each update on the recipe's ZeRO-3 path, from DeepSpeed's own schedulers built as
    Arctic's client builds them (arctic_platform/common/deepspeed_worker.py, ds_training_config): WarmupLR over
    round(ratio * horizon) updates from 0, linear, none when that is 0; WarmupCosineLR for a cosine. The engine
    builds it before the first update and steps it after each (DeepSpeedEngine._take_model_step)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    warmup = round(ratio * horizon)
    if schedule == "cosine":
        scheduler = WarmupCosineLR(
            optimizer, horizon, warmup_min_ratio=0.0, warmup_num_steps=warmup, cos_min_ratio=floor, warmup_type="linear"
        )
    elif warmup > 0:
        scheduler = WarmupLR(optimizer, 0.0, lr, warmup, warmup_type="linear")
    else:
        scheduler = None
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        if scheduler is not None:
            scheduler.step()
    return rates


def longqa_rates(overrides: list[str], total_updates: int, updates: int, path: str | None = None) -> list:
    """The learning rate the actor's scheduler gives each update (the rate the engine's optimizer steps with) in a
    run of ``total_updates``."""
    from longqa.train.actor import lr_lambda

    cfg = load_config(path, overrides)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.actor.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # (no gradient: the weight stays; the scheduler then steps in torch's order)
        scheduler.step()
    return rates


@needs_deepspeed
@pytest.mark.parametrize(
    "ratio, horizon, schedule, floor",
    [
        (0.05, 1000, "constant", 0.0),  # the 8B Arctic launcher's: 50 updates
        (0.05, 148, "constant", 0.0),  # round(7.4): 7
        (0.05, 150, "constant", 0.0),  # round(7.5): 8 (int would say 7)
        (0.1, 10, "constant", 0.0),  # 1 update, which DeepSpeed raises to 2
        (0.0, 20, "constant", 0.0),  # no warm-up: no scheduler, the full rate from the first update
        (0.1, 40, "cosine", 0.1),  # 4 updates up, then a cosine to 10% (and past the end of the schedule)
    ],
)
def test_the_warm_up_under_deepspeed_is_deepspeed_s_own(ratio, horizon, schedule, floor):
    """Under `actor.strategy=deepspeed` the learning rate of every update is the one DeepSpeed's WarmupLR (or
    WarmupCosineLR) gives on the recipe's ZeRO-3 path, to the bit: 0 for the first two updates of a warm-up,
    where longqa's own ramp starts at 1/W."""
    lr, updates = 1e-6, horizon + 10
    expected = recipe_zero3_rates(lr, ratio, horizon, schedule, floor, updates)
    given = [f"actor.lr={lr}", f"actor.warmup_ratio={ratio}", f"actor.lr_schedule={schedule}"]
    given.append(f"actor.min_lr_ratio={floor}")
    assert longqa_rates([*given, "actor.strategy=deepspeed"], horizon, updates) == expected
    # laid over actor.schedule_updates instead of the run's own updates: the same rates, whatever the run's length
    assert longqa_rates([*given, "actor.strategy=deepspeed", f"actor.schedule_updates={horizon}"], 7, updates) == (
        expected
    )
    if ratio * horizon >= 1:  # FSDP2 keeps longqa's own ramp, which starts at 1/W
        assert longqa_rates(given, horizon, 1) == [lr / int(ratio * horizon)]


@needs_deepspeed
@pytest.mark.parametrize("run_updates", [7, 312, 5000])
def test_the_8b_config_steps_as_the_arctic_launcher(run_updates):
    """configs/loongrl-qwen3-8b.yaml under `actor.strategy=deepspeed`, as its launcher trains: one update a step
    (SkyRL's Arctic trainer takes one fwd_bwd and one optim_step over the step's whole batch), and the learning
    rate of each update the launcher's: WarmupLR over round(0.05 * 1000) updates, SkyRL laying the schedule over
    1,000 updates when not given trainer.total_training_steps (integrations/arctic_rl/config.py), however long
    the run."""
    cfg = load_config("configs/loongrl-qwen3-8b.yaml", ["actor.strategy=deepspeed"])
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs) == (16, 16, 1)
    expected = recipe_zero3_rates(1e-6, 0.05, 1000, "constant", 0.0, 120)
    assert expected[:3] == [0.0, 0.0, 1e-6 / 50] and expected[51] == 1e-6
    rates = longqa_rates(["actor.strategy=deepspeed"], run_updates, 120, "configs/loongrl-qwen3-8b.yaml")
    assert rates == expected


# ------------------------------------------------------------------------------------------ clear errors


def deepspeed_file(tmp_path, text: str, suffix: str = ".json"):
    path = tmp_path / f"ds{suffix}"
    path.write_text(text)
    return str(path)


def test_the_users_file_is_merged_over_the_generated_config(tmp_path):
    cfg = load_config(None, ["actor.strategy=deepspeed", "actor.cpu_offload=true", "actor.grad_clip=0.5"])
    generated = zero3.engine_config(cfg, torch.device("cpu"), torch.float32)
    assert generated["gradient_clipping"] == 0.5 and generated["bf16"] == {"enabled": False}
    assert zero3.optimizer_offloaded(generated)
    assert zero3.engine_config(cfg, torch.device("cuda"), torch.float32)["bf16"] == {"enabled": True}
    cfg.actor.deepspeed_config = deepspeed_file(
        tmp_path,
        (
            "zero_optimization:\n  offload_param: {device: cpu}\n  stage3_max_live_parameters: 1000\n"
            "train_micro_batch_size_per_gpu: auto\ngradient_clipping: auto\n"
        ),
        ".yaml",
    )
    merged = zero3.engine_config(cfg, torch.device("cpu"), torch.float32)
    assert merged["zero_optimization"] == {
        **generated["zero_optimization"],
        "offload_param": {"device": "cpu"},
        "stage3_max_live_parameters": 1000,
    }
    assert merged["train_micro_batch_size_per_gpu"] == 1 and merged["gradient_clipping"] == 0.5  # "auto": ours
    cfg.actor.deepspeed_config = deepspeed_file(
        tmp_path, '{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}'
    )
    cfg.actor.cpu_offload = False
    assert zero3.optimizer_offloaded(zero3.engine_config(cfg, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize(
    "text,message",
    [
        (
            '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "gradient_clipping": 2.0}',
            r"sets 'gradient_clipping' \(longqa sets it from actor.grad_clip\), 'optimizer' \(longqa sets it from "
            r"actor.lr",
        ),
        (
            '{"zero_optimization": {"stage": 2}}',
            "sets zero_optimization.stage=2: actor.strategy=deepspeed runs ZeRO stage 3",
        ),
        (
            '{"zero_optimization": {"memory_efficient_linear": true}}',
            "sets zero_optimization.memory_efficient_linear: it replaces torch.nn.functional.linear",
        ),
        ('{"zero_optimization": ', "cannot be read"),
        ("[1, 2]", "must hold a mapping"),
    ],
)
def test_a_users_file_that_cannot_work_is_refused(tmp_path, text, message):
    cfg = load_config(None, ["actor.strategy=deepspeed", f"actor.deepspeed_config={deepspeed_file(tmp_path, text)}"])
    with pytest.raises(ConfigError, match=message):
        zero3.engine_config(cfg, torch.device("cpu"), torch.float32)


def test_settings_that_cannot_work_are_refused_before_any_weight_loads(tmp_path, monkeypatch):
    from longqa.config.checks import check_settings
    from longqa.config.support import check_imports

    cfg = load_config(None, ["actor.strategy=deepspeed", f"actor.deepspeed_config={tmp_path / 'missing.json'}"])
    with pytest.raises(ConfigError, match="missing.json: no such file"):
        zero3.check_deepspeed(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs rollout.engine=fast or vllm"):
        check_settings(load_config(None, ["actor.strategy=deepspeed", "rollout.engine=hf"]))
    with pytest.raises(ConfigError, match="config key 'actor.strategy' must be one of"):
        load_config(None, ["actor.strategy=zero3"])
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(
        ConfigError,
        match=r"needs DeepSpeed, which cannot be imported .*pip install "
        r"'longqa\[deepspeed\]'",
    ):
        check_imports(load_config(None, ["actor.strategy=deepspeed"]))


@pytest.mark.parametrize(
    "settings,refused",
    [
        (["actor.cpu_offload=true"], True),
        (["actor.strategy=deepspeed"], True),
        (["actor.strategy=deepspeed", "actor.cpu_offload=true"], False),
    ],
)
def test_a_partial_offload_is_deepspeed_s_own_offload(settings, refused):
    from longqa.config.checks import check_offload

    cfg = load_config(None, [*settings, "actor.cpu_offload_ratio=0.4"])
    if refused:
        with pytest.raises(
            ConfigError, match="actor.cpu_offload_ratio=0.4 needs actor.strategy=deepspeed and actor.cpu_offload=true"
        ):
            check_offload(cfg)
        return
    check_offload(cfg)
    offload = zero3.generated_config(cfg, torch.device("cuda"), torch.bfloat16)["zero_optimization"][
        "offload_optimizer"
    ]
    assert offload == {"device": "cpu", "pin_memory": True, "ratio": 0.4}
    with pytest.raises(ConfigError, match=r"actor.cpu_offload_ratio' must be in \[0, 1\]"):
        load_config(None, ["actor.cpu_offload_ratio=1.5"])


@needs_deepspeed
def test_cpu_adam_without_a_compiler_is_refused_with_what_to_do(monkeypatch):
    import deepspeed.git_version_info as info

    monkeypatch.setitem(info.installed_ops, "cpu_adam", False)  # not prebuilt: it would compile on first use
    monkeypatch.setenv("CXX", "no-such-compiler")
    cfg = load_config(None, ["actor.strategy=deepspeed", "actor.cpu_offload=true"])
    with pytest.raises(
        ConfigError,
        match=r"no C\+\+ compiler \(no-such-compiler is not on PATH\).*DS_BUILD_CPU_ADAM=1"
        r".*actor.cpu_offload=false",
    ):
        zero3.check_deepspeed(cfg, torch.device("cpu"))
    zero3.check_deepspeed(load_config(None, ["actor.strategy=deepspeed"]), torch.device("cpu"))  # no CPU Adam needed


def test_checkpoints_of_the_other_strategy_are_refused(tmp_path):
    """A checkpoint resumes under the strategy that wrote it; the message says how to go on."""
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / "COMPLETE").write_text(json.dumps({"step": 1, "files": {}}))
    model = tiny_lm()
    with pytest.raises(
        CheckpointError, match="written under actor.strategy=fsdp2 and cannot resume under actor.strategy=deepspeed"
    ):
        load_checkpoint(folder, model=model, optimizer=None, engine=object())


@needs_deepspeed
def test_two_runs_in_one_process(tiny_model_dir, data_dir, tmp_path):
    """The trainer makes its process group for a run and destroys it after: a second `longqa train` in the same
    process (a notebook, a sweep) gets a ZeRO-3 engine over the new group, not over DeepSpeed's clone of the old."""
    from longqa.cli import main

    for name in ("first", "second"):
        settings = {
            "actor.strategy": "deepspeed",
            "trainer.max_steps": 1,
            "trainer.test_freq": 0,
            "trainer.save_freq": 0,
        }
        assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / name, **settings)]) == 0


@needs_deepspeed
def test_a_partial_offload_says_the_share_its_whole_sub_groups_make(tiny_model_dir, data_dir, tmp_path, capsys):
    """ZeRO-3 keeps int((1 - ratio) x sub-groups) whole sub-groups of the optimizer on the device: a small model is
    one sub-group, so any ratio offloads all of it, and `longqa train` says so rather than the ratio asked for."""
    from longqa.cli import main

    settings = {
        "actor.strategy": "deepspeed",
        "actor.cpu_offload": "true",
        "actor.cpu_offload_ratio": 0.5,
        "trainer.max_steps": 1,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
    }
    assert main(["train", *overrides(tiny_model_dir, data_dir, tmp_path / "run", **settings)]) == 0
    assert (
        "the whole optimizer offloaded: actor.cpu_offload_ratio=0.5 keeps int(0.5 x 1) = 0 of its 1 sub-groups"
        in capsys.readouterr().out
    )
