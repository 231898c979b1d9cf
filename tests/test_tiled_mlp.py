"""Tiled MLP (model.mlp_tile_tokens): the MLPs computed over tiles of the row give the untiled outputs and input
gradients to the bit in float32 and its parameters' gradients to float rounding, for several decoder families, a
row that is no multiple of the tile, beside recomputed and offloaded layers, under FSDP2 and ZeRO-3; they keep none
of the MLP's intermediates, as the planner counts; and rows of one tile, forwards without grad and compiled layers
run the MLP untiled."""

import copy
import importlib.util

import pytest
import torch
from model_zoo import ZooError, tiny_model
from test_offload import LAYERS, PROMPT, RESPONSES, device_saved_activations, gradients, model
from tiny_models import VOCAB, tiny_lm

from longqa.config import load_config
from longqa.model import tiled_mlp
from longqa.model.load import arrange_layer_memory, compile_decoder_layers
from longqa.model.tiled_mlp import TiledMLPError, mlp_tile, tile_mlps, untile_mlps
from longqa.planning.activations import Compute, activation_bytes, mlp_bytes
from longqa.planning.planner import ModelSizes, update_compute

ROW = 45  # tokens per row: no multiple of TILE
TILE = 7


def is_mlp_weight(name: str) -> bool:
    return ".mlp." in name


def forward_backward(m, rows: int = 2):
    """Logits, the input embeddings' gradient and every parameter's gradient of one fixed weighted sum of the
    logits over ``rows`` rows of ``ROW`` tokens."""
    m.train().zero_grad()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (rows, ROW), generator=g)
    embeds = m.get_input_embeddings()(ids).detach().requires_grad_()
    logits = m(inputs_embeds=embeds).logits
    (logits * torch.randn(logits.shape, generator=g)).sum().backward()
    grads = {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
    return logits.detach(), embeds.grad, grads


def assert_same_as_untiled(reference, got, exact: bool = True) -> None:
    """Outputs and input gradients to the bit; parameters outside the MLPs to the bit too (the gradient reaching
    them is the same), the MLPs' as sums over tiles, to float32 rounding. Not ``exact``: everything to float32
    rounding (a mixture of experts multiplies each expert's share of a tile, a matrix of other rows than the
    row's share, whose products round otherwise)."""
    (logits, embeds_grad, grads), (tiled_logits, tiled_embeds_grad, tiled_grads) = reference, got

    def close(a, b) -> bool:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        return True

    same = torch.equal if exact else close
    assert same(tiled_logits, logits)
    assert same(tiled_embeds_grad, embeds_grad)
    assert tiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        if is_mlp_weight(name) or not exact:
            close(tiled_grads[name], grad)
        else:
            assert torch.equal(tiled_grads[name], grad), name


def counting_tiles(monkeypatch) -> list:
    """The calls of the tiled computation, recorded as they happen."""
    calls = []
    apply = tiled_mlp._TiledMLP.apply

    def counted(*args):
        calls.append(args[2])
        return apply(*args)

    monkeypatch.setattr(tiled_mlp._TiledMLP, "apply", counted)
    return calls


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_tiled_mlps_give_the_untiled_outputs_and_gradients(family, monkeypatch):
    reference = forward_backward(tiny_lm(family))
    m = tiny_lm(family)
    assert tile_mlps(m, TILE) == m.config.num_hidden_layers
    calls = counting_tiles(monkeypatch)
    assert_same_as_untiled(reference, forward_backward(m))
    assert calls == [TILE] * m.config.num_hidden_layers  # every layer's MLP ran in tiles


@pytest.mark.parametrize("family", ["gemma", "phi3", "mixtral"])
def test_other_families_mlps_tile_the_same(family, monkeypatch):
    """A GELU MLP (Gemma), a fused gate-and-up projection (Phi-3) and a mixture of experts (Mixtral), whose
    router, like every MLP here, computes each token on its own."""
    try:
        reference = forward_backward(tiny_model(family))
        m = tiny_model(family)
    except ZooError as e:
        pytest.skip(str(e))
    tile_mlps(m, TILE)
    calls = counting_tiles(monkeypatch)
    assert_same_as_untiled(reference, forward_backward(m), exact=family != "mixtral")
    assert len(calls) == m.config.num_hidden_layers


def test_tiled_mlps_beside_recomputed_and_offloaded_layers_keep_no_intermediates(monkeypatch):
    """Two layers offloaded, two recomputed, two kept, every MLP tiled: the packed update's loss to the bit, the
    gradients of the model whose layers keep everything untiled, and the kept layers each hold the MLP's four
    intermediates fewer than untiled, per token of the packed row, as the planner counts them."""
    reference_loss, reference = gradients(model())
    untiled = model()
    _, _, untiled_saved = device_saved_activations(untiled)
    m = model()
    offload = arrange_layer_memory(m, 1 / 3, 1 / 3, mlp_tile_tokens=16)
    offload.min_bytes = 0
    calls = counting_tiles(monkeypatch)
    loss, got, saved = device_saved_activations(m)
    assert loss == reference_loss
    for name, grad in reference.items():
        if is_mlp_weight(name):
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
        else:
            assert torch.equal(got[name], grad), name
    assert len(calls) >= LAYERS  # (recomputed layers run their tiled forward again)
    tokens = PROMPT + sum(RESPONSES)
    sizes = ModelSizes.from_config(m.config)
    fewer = tokens * mlp_bytes(sizes, Compute(dtype_bytes=4, param_bytes=4)) // 4  # elements, float32
    # (the count is per save: untiled, the gate and the up projection each save the norm's output, one tensor
    # counted twice; tiled, the tiled MLP saves it once)
    fewer += tokens * m.config.hidden_size
    assert [a - b for a, b in zip(untiled_saved[4:], saved[4:])] == [fewer, fewer]
    assert offload.late_loads == 0 and offload.pending == {}


def test_rows_of_one_tile_and_forwards_without_grad_run_untiled(monkeypatch):
    m = tiny_lm()
    tile_mlps(m, ROW)
    calls = counting_tiles(monkeypatch)
    forward_backward(m, rows=1)  # one row of exactly one tile
    with torch.no_grad():
        m(input_ids=torch.ones(2, ROW, dtype=torch.long))
    assert calls == []
    forward_backward(m, rows=2)  # two rows are one sequence of 2 x ROW tokens: tiled
    assert len(calls) == m.config.num_hidden_layers


def test_compiled_layers_untile_and_a_copy_tiles_its_own_modules():
    m = tiny_lm()
    tile_mlps(m, TILE)
    copied = copy.deepcopy(m)  # (the reference policy and the fast engine's own copy are deep copies)
    for layer, own in zip(copied.model.layers, m.model.layers):
        assert layer.mlp.forward.args[0] is layer.mlp and layer.mlp is not own.mlp
    assert mlp_tile(copied) == TILE
    compile_decoder_layers(m, backend="eager")
    assert mlp_tile(m) == 0 and "forward" not in vars(m.model.layers[0].mlp)
    assert untile_mlps(m) == 0
    tile_mlps(copied, 0)
    assert mlp_tile(copied) == 0


def test_an_mlp_that_returns_more_than_a_tensor_is_refused():
    m = tiny_lm()
    tile_mlps(m, TILE)
    for layer in m.model.layers:
        own = getattr(layer.mlp, tiled_mlp.OWN_FORWARD)
        setattr(layer.mlp, tiled_mlp.OWN_FORWARD, lambda x, own=own: (own(x), None))
    with pytest.raises(TiledMLPError, match="model.mlp_tile_tokens=0"):
        forward_backward(m)


def test_the_planner_counts_a_tiled_mlp_for_eager_layers_only():
    """The setting reaches the plan's count; a row of at most one tile and compiled layers count as untiled."""
    cfg = load_config(None, ["model.mlp_tile_tokens=1024"])
    sizes = ModelSizes.from_config(tiny_lm().config)
    compute = update_compute(cfg, sizes, 1)
    assert compute.mlp_tile == 1024
    eager = Compute(dtype_bytes=2, param_bytes=2, compiled=False)
    tiled = Compute(dtype_bytes=2, param_bytes=2, compiled=False, mlp_tile=1024)
    tokens = 65536
    full, less = activation_bytes(sizes, eager, tokens), activation_bytes(sizes, tiled, tokens)
    assert full.layers - less.layers == sizes.layers * tokens * mlp_bytes(sizes, eager)
    assert activation_bytes(sizes, tiled, 1024) == activation_bytes(sizes, eager, 1024)
    compiled = Compute(dtype_bytes=2, param_bytes=2, compiled=True)
    assert activation_bytes(sizes, compiled, tokens) == activation_bytes(
        sizes, Compute(dtype_bytes=2, param_bytes=2, compiled=True, mlp_tile=1024), tokens
    )


# --- FSDP2 and ZeRO-3 ----------------------------------------------------------------------------------------

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")


def _sharded_worker(rank, world, port, out, tile):
    """One update of the tiled model under FSDP2 and under ZeRO-3 (each decoder layer gathered whole around its
    forward and backward, the tiles computed inside), how many tiled MLP calls each made, and how many gradients
    ZeRO-3 queued for reduction, tiled and untiled."""
    import os

    import torch.distributed as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Zero3
    from test_deepspeed import one_step
    from test_distributed import config, global_samples, rank_share

    from longqa.train.actor import Actor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls, queued = [], []
    apply, queue = tiled_mlp._TiledMLP.apply, Zero3._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket
    tiled_mlp._TiledMLP.apply = lambda *args: calls.append(1) or apply(*args)
    Zero3._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket = lambda *args: queued.append(1) or queue(*args)
    try:
        results = {}
        for strategy, strategy_tile in (("fsdp2", tile), ("deepspeed", tile), ("deepspeed-untiled", 0)):
            cfg = config("true", "token-mean", 40)
            cfg.actor.strategy = strategy.split("-")[0]
            m = tiny_lm()
            tile_mlps(m, strategy_tile)
            calls.clear(), queued.clear()
            results[strategy] = one_step(
                Actor(m, cfg, 1, torch.device("cpu")), rank_share(global_samples(), rank, world)
            )
            results[strategy].update(tiled_calls=len(calls), queued=len(queued))
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@needs_deepspeed
@pytest.mark.slow
def test_fsdp2_and_zero3_take_the_single_process_step_with_tiled_mlps(tmp_path):
    from test_deepspeed import assert_the_single_process_step, one_step
    from test_distributed import config, free_port, global_samples, spawn_ranks

    from longqa.train.actor import Actor

    reference = one_step(Actor(tiny_lm(), config("true", "token-mean", 40), 1, torch.device("cpu")), global_samples())
    spawn_ranks(_sharded_worker, 2, free_port(), str(tmp_path / "rank0.pt"), 8)
    results = torch.load(tmp_path / "rank0.pt")
    for strategy in ("fsdp2", "deepspeed"):
        assert results[strategy]["tiled_calls"] > 0, strategy
        assert_the_single_process_step(reference, results[strategy])
    # ZeRO-3 reduces each gradient once, after the last tile, as untiled (not once per tile)
    assert results["deepspeed"]["queued"] == results["deepspeed-untiled"]["queued"] > 0
