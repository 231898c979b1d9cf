"""Ulysses sequence parallelism (actor.sequence_parallel_size) over gloo on the CPU: under FSDP2 (eager, recomputed
and compiled layers; the dense, split and flex backends) and DeepSpeed ZeRO-3, the log-probs, the loss and every
gradient of degrees 2 and 4 are the single process's, on packed groups with shared prompts and responses of
different lengths; and `longqa train` on 2 ranks at degree 2 logs the single-process run's metrics."""

import pytest
import torch
from test_deepspeed import needs_deepspeed
from test_distributed import (  # noqa: F401
    GROUPS,
    N,
    assert_same_records,
    free_port,
    global_samples,
    launch,
    moving,
    rank_share,
    run_inputs,
    spawn_ranks,
    step,
)
from tiny_models import tiny_lm

from longqa.config import load_config
from longqa.distributed.ulysses import SequenceLayoutError, sequence_shard
from longqa.model.sequence_parallel import SequenceShard, kv_repeats
from longqa.train.actor import Actor

BUDGET = 60  # several micro-batches of whole groups


def config(degree: int, backend: str = "dense", mode: str = "token-mean"):
    return load_config(
        None,
        [
            "actor.shared_prompt=true",
            f"algo.loss_agg_mode={mode}",
            "actor.lr=1e-6",
            f"actor.max_tokens_per_micro_batch={BUDGET}",
            f"data.train_batch_size={GROUPS}",
            f"actor.ppo_mini_batch_size={GROUPS}",
            f"rollout.n={N}",
            "data.max_response_length=9",
            f"actor.attention_backend={backend}",
            "algo.entropy_coeff=0.01",
            f"actor.sequence_parallel_size={degree}",
        ],
    )


# Each case: (ranks, degree, attention backend, loss aggregation, decoder layers: eager, recomputed in the backward
# pass (gradient checkpointing) or compiled as the trainer compiles them on a GPU, with Dynamo's eager backend here).
# The cases of one number of ranks run in one launch of its processes.
CASES = [
    (2, 2, "dense", "token-mean", "eager"),
    (2, 2, "dense", "seq-mean-token-sum", "recomputed"),  # recomputed layers run their exchanges again
    (2, 2, "dense", "token-mean", "compiled"),
    (2, 2, "split", "token-mean", "eager"),
    (2, 2, "flex", "token-mean", "eager"),
    (4, 4, "dense", "token-mean", "eager"),
    (4, 2, "dense", "seq-mean-token-mean", "eager"),  # 2 data-parallel x 2 sequence-parallel ranks
    (4, 4, "split", "seq-mean-token-sum-norm", "eager"),
    (4, 4, "flex", "token-mean", "eager"),
]


def _worker(rank, world, port, cases, out):
    import os

    import torch.distributed as dist

    from longqa.model.load import arrange_layer_memory, compile_decoder_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = []
        for _, degree, backend, mode, layers in cases:
            model = tiny_lm()
            if layers == "recomputed":
                arrange_layer_memory(model, checkpoint_fraction=1.0)
            actor = Actor(model, config(degree, backend, mode), 1, torch.device("cpu"))
            if layers == "compiled":
                compile_decoder_layers(actor.model, backend="eager")
            assert actor.shard.size == degree and type(next(actor.scorer.parameters())).__name__ == "DTensor"
            samples = rank_share(global_samples(), rank // degree, world // degree)  # a group's ranks: its groups
            result = {"logprobs": actor.logprobs(samples)}
            if backend != "flex":  # (flex_attention has no backward pass on the CPU)
                result["stats"], result["grads"] = step(actor, samples, lambda t: t.full_tensor())
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            results.append(gathered)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(backend: str, mode: str) -> dict:
    """The single process's update of the whole batch, whole rows."""
    actor = Actor(tiny_lm(), config(1, backend, mode), 1, torch.device("cpu"))
    result = {"logprobs": actor.logprobs(global_samples())}
    if backend != "flex":
        result["stats"], result["grads"] = step(actor, global_samples())
    return result


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every case's ranks' results, by case."""
    results = {}
    for world in sorted({case[0] for case in CASES}):
        cases = [case for case in CASES if case[0] == world]
        out = tmp_path_factory.mktemp(f"sp{world}") / "ranks.pt"
        spawn_ranks(_worker, world, free_port(), cases, str(out), nprocs=world)
        results.update(zip(cases, torch.load(out)))
    return results


def assert_single_process(expected: dict, ranks: list[dict], world: int, degree: int) -> None:
    """Every rank's log-probs are its groups' whole rows; the loss, its statistics and every gradient are the
    single process's (gradients to 1e-6 of each tensor's largest entry, float32 rounding of sums in another
    order)."""
    per = GROUPS // (world // degree) * N
    for r, got in enumerate(ranks):
        share = expected["logprobs"][r // degree * per : (r // degree + 1) * per]
        assert len(got["logprobs"]) == len(share)
        for a, b in zip(got["logprobs"], share):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=0), (a, b)
    if "grads" not in expected:
        return
    for got in ranks:
        for key in ("pg_loss", "grad_norm", "entropy"):
            assert got["stats"][key] == pytest.approx(expected["stats"][key], rel=1e-6, abs=1e-9), key
        for name, grad in expected["grads"].items():
            rel = ((got["grads"][name] - grad).abs().max() / grad.abs().max()).item()
            assert rel <= 1e-6, (name, rel)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sequence_parallel_update_is_the_single_process_update(launched, case):
    world, degree, backend, mode, _ = case
    assert_single_process(reference(backend, mode), launched[case], world, degree)


def test_shards_split_a_row_evenly_and_repeat_too_few_kv_heads():
    assert [SequenceShard(r, 4).bounds(12) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="does not split into 4"):
        SequenceShard(0, 4).bounds(10)
    assert (kv_repeats(2, 4), kv_repeats(8, 4), kv_repeats(2, 2), kv_repeats(3, 2)) == (2, 1, 1, 2)
    assert sequence_shard(1) is None
    with pytest.raises(SequenceLayoutError, match=r"^actor.sequence_parallel_size=2 must divide the 1 training ranks"):
        sequence_shard(2)  # (one process)


def _deepspeed_worker(rank, world, degree, port, mode, out):
    import os

    import torch.distributed as dist
    from test_deepspeed import one_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = config(degree, "dense", mode)
        cfg.actor.strategy = "deepspeed"
        actor = Actor(tiny_lm(), cfg, 1, torch.device("cpu"))
        assert actor.engine is not None and actor.shard.size == degree
        result = one_step(actor, rank_share(global_samples(), rank // degree, world // degree))
        if rank == 0:
            torch.save(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world,degree,mode", [(2, 2, "token-mean"), (4, 4, "seq-mean-token-mean")])
def test_sequence_parallel_under_deepspeed_is_the_single_process_update(tmp_path, world, degree, mode):
    """ZeRO-3 partitions over every rank, as FSDP2 shards: the loss, every gradient and the weights after the step
    are the single process's."""
    from test_deepspeed import assert_the_single_process_step, one_step

    reference = one_step(Actor(tiny_lm(), config(1, "dense", mode), 1, torch.device("cpu")), global_samples())
    out = tmp_path / "rank0.pt"
    spawn_ranks(_deepspeed_worker, world, degree, free_port(), mode, str(out), nprocs=world)
    assert_the_single_process_step(reference, torch.load(out))


@pytest.mark.slow
def test_torchrun_two_ranks_at_degree_two_log_the_single_process_run(run_inputs, tmp_path):
    """`longqa train` on 2 ranks that split every packed row between them: each samples half the prompts, both update
    on all the groups, and the run logs the single process's rewards, losses and gradient norms."""
    extra = moving(tmp_path)
    one = launch(run_inputs, tmp_path / "one", 1, **extra)
    two = launch(run_inputs, tmp_path / "two", 2, **extra, **{"actor.sequence_parallel_size": 2})
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    assert all(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in one[1:])
    for a, b in zip(one, two):
        assert_same_records(a, b)
