"""The activation count the memory checks use (planning/activations.py) against peaks measured on the CPU,
sft's check and loss, and the trainer's refusal of a micro-batch budget too large for its GPU."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from longqa.bench.memory import grpo_case, peak_bytes, sft_case
from longqa.planning.activations import Compute, eager_layer_bytes
from longqa.planning.planner import GIB, ModelSizes, PlanError, check_sft, sft_bytes

# SmolLM2-135M-Instruct's config.json, sized without its weights
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
H200 = 141 * 10**9  # bytes, as the GPU's datasheet counts them


def test_the_cpu_peak_is_the_allocator_s_largest_total_above_the_start():
    """Tensors alive before the measured function and the bytes of kernels' own scratch space are what it must
    leave out and keep in."""
    before = torch.ones(1 << 20)  # 4 MiB that exist at the start: not counted, nor their freeing

    def work():
        nonlocal before
        a = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB
        b = torch.empty(2 << 20, dtype=torch.uint8)  # 3 MiB alive
        del a
        before = None  # frees 4 MiB allocated earlier, which must not lower the count
        c = torch.empty(3 << 20, dtype=torch.uint8)  # 5 MiB alive: the peak
        del b, c

    assert peak_bytes(work, torch.device("cpu")) == 5 << 20


def _tiny(family: str, dtype=torch.float32):
    """One decoder layer whose widths differ (hidden 48, queries 72, keys 24, MLP 80), so a miscount shows."""
    common = dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=128,
    )
    config = (Qwen3Config if family == "qwen3" else LlamaConfig)(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).train()


def _saved_per_token(model, tokens: int, autocast: bool) -> float:
    """Bytes per token of the tensors one decoder layer hands autograd for its backward pass, each storage once:
    its input's included, the rotary tables (made once for all layers) and the weights left out."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    skip = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved = {}

    def keep(t):
        storage = t.untyped_storage()
        if tokens in t.shape and storage.data_ptr() not in skip:  # (no weight has a dimension of 97)
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.model.layers[0](x, position_ids=positions, position_embeddings=(cos, sin))
    return sum(saved.values()) / tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_eager_layer_count_bounds_what_one_layer_saves(family, dtype, autocast):
    """Counted from the modeling code, checked against what autograd is handed: float32, bfloat16, and float32
    weights under bf16 autocast (longqa sft on a GPU); with and without Qwen3's per-head norms."""
    model = _tiny(family, dtype)
    sizes = ModelSizes.from_config(model.config)
    assert sizes.qk_norm == (family == "qwen3") and sizes.heads == 6
    counted = eager_layer_bytes(
        sizes, Compute(dtype_bytes=2 if autocast else dtype.itemsize, param_bytes=dtype.itemsize, autocast=autocast)
    )
    saved = _saved_per_token(model, 97, autocast)
    assert saved <= counted <= 1.1 * saved


TINY, SMOL = dict(shape="qwen3-tiny"), dict(shape="smollm2-135m", layers=2)  # hidden 64 and 576
GRPO = {  # name: micro-batches of the packed update on the CPU (dense attention)
    "small vocab": dict(**TINY, prompt=256, response=64, n=4, vocab=1024),
    "logits dominate": dict(**TINY, prompt=256, response=64, n=4, vocab=32768),
    "longer packs": dict(**TINY, prompt=1024, response=128, n=8, vocab=1024),
    "all recomputed": dict(**TINY, prompt=1024, response=128, n=8, vocab=1024, recomputed=1.0),
    "half recomputed, big vocab": dict(**TINY, prompt=512, response=64, n=8, vocab=32768, recomputed=0.5),
    "bfloat16": dict(**TINY, prompt=256, response=64, n=4, vocab=4096, dtype="bfloat16"),
    "a group over the budget": dict(**TINY, prompt=256, response=64, n=8, vocab=1024, budget=512),
    "three groups": dict(**TINY, prompt=128, response=32, n=4, groups=3, vocab=1024),
    "wider layers": dict(**SMOL, prompt=256, response=32, n=4, vocab=1024),
}


@pytest.mark.parametrize("name", list(GRPO))
def test_the_count_bounds_a_measured_update_micro_batch(name):
    """Through the actor's own code (micro-batch, forward, PPO-clip loss, backward): never under the peak, and
    not far over it."""
    case = grpo_case(**GRPO[name])
    assert case.measured <= case.predicted.total <= 1.5 * case.measured, case.row()


@pytest.mark.parametrize(
    "model,vocab,autocast,tokens",
    [(TINY, 1024, False, 2048), (TINY, 1024, True, 2048), (TINY, 32768, False, 2048), (SMOL, 1024, False, 1024)],
)
def test_the_count_bounds_a_measured_sft_step(model, vocab, autocast, tokens):
    """sft's loss and backward on padded rows, in float32 (the CPU) and under the bf16 autocast of a GPU."""
    case = sft_case(**model, batch_tokens=tokens, longest=tokens // 4, vocab=vocab, autocast=autocast)
    assert case.measured <= case.predicted.total <= 1.5 * case.measured, case.row()


def test_sft_loss_is_the_model_s_own_loss_without_its_logits():
    """The chunked loss, with no attention mask on right-padded rows, against transformers' loss of the masked
    batch: the same value and the same gradient."""
    from longqa.train.batching import collate_right
    from longqa.train.sft import sft_loss

    model = _tiny("qwen3")
    sequences = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    ids, mask, response = collate_right(sequences, [3, 1, 2], 0)
    labels = ids.masked_fill(~response, -100)
    ours = sft_loss(model, ids, labels)
    (grad,) = torch.autograd.grad(ours, model.model.embed_tokens.weight)
    theirs = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    (reference,) = torch.autograd.grad(theirs, model.model.embed_tokens.weight)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad, reference)


def test_sft_refuses_a_batch_budget_over_the_gpu_naming_the_largest_that_fits():
    sizes = ModelSizes.from_config(LlamaConfig(**SMOLLM2))
    # With the chunked head and no padding mask, the default budget fits SmolLM2-135M's 49K vocabulary on an H200
    # at 4,400-token examples; its own loss's float32 logits alone would be 25.8 GB
    assert sft_bytes(sizes, 131072, 4400) < H200
    gpu = 64 * GIB
    with pytest.raises(PlanError) as refused:
        check_sft(sizes, gpu_bytes=gpu, batch_tokens=131072, longest=4400)
    message = str(refused.value)
    assert "\n" not in message
    fits = int(re.search(r"use --batch-tokens (\d+) or lower, the largest that fits", message).group(1))
    assert sft_bytes(sizes, fits, 4400) <= gpu < sft_bytes(sizes, fits + 1, 4400)
    check_sft(sizes, gpu_bytes=gpu, batch_tokens=fits, longest=4400)
    with pytest.raises(PlanError, match="even a batch of the longest example alone"):
        check_sft(sizes, gpu_bytes=8 * GIB, batch_tokens=131072, longest=4400)


def test_the_trainer_check_names_the_largest_micro_batch_budget_that_fits(tmp_path):
    """configs/gpu-long.yaml with SmolLM2-135M's shape, 64 x 8, responses of up to 384: float32 eager layers on the
    dense backend, whose grouped heads leave SDPA its math kernel (scores kept in every layer). At 8K prompts not
    even one sample fits an H200 (the check says to use flex); at 2K it names the largest budget that fits."""
    from longqa.config import load_config
    from longqa.planning.planner import check_fit, plan_config

    LlamaConfig(**SMOLLM2).save_pretrained(tmp_path)  # config.json alone: the check reads no weight
    sizes = ModelSizes.from_config(LlamaConfig(**SMOLLM2))
    for prompt in (8192, 2048):
        overrides = [
            f"model.path={tmp_path}",
            f"data.max_prompt_length={prompt}",
            "data.max_response_length=384",
            "data.train_batch_size=64",
        ]
        cfg = load_config("configs/gpu-long.yaml", overrides)
        with pytest.raises(PlanError) as refused:
            check_fit(cfg, 1, H200, sizes)
        message = str(refused.value)
        assert "use actor.attention_backend=flex" in message and "\n" not in message
        offered = re.search(r"set actor.max_tokens_per_micro_batch=(\d+), the largest that fits \(now 65536\)", message)
        if prompt == 8192:
            assert offered is None  # one sample, prompt and response, is already over
            assert plan_config(cfg, sizes, 1, H200, micro_batch_tokens=prompt + 384).total > H200
            continue
        fits = int(offered.group(1))
        assert plan_config(cfg, sizes, 1, H200, micro_batch_tokens=fits).total <= H200
        assert plan_config(cfg, sizes, 1, H200, micro_batch_tokens=fits + 1).total > H200
        check_fit(
            load_config("configs/gpu-long.yaml", [*overrides, f"actor.max_tokens_per_micro_batch={fits}"]),
            1,
            H200,
            sizes,
        )


@pytest.mark.parametrize(
    "config, prompt, mini_batch",
    [
        ("configs/gpu-long.yaml", 2048, 64),  # float32 dense: masks and scores bound it far below a mini-batch
        ("configs/gpu-long.yaml", 4352, 64),
        ("configs/gpu-long.yaml", 8192, 64),  # not even one sample: refused as a number would be
        ("configs/demo.yaml", 1024, 16),  # a small float32 run: the whole mini-batch share fits
        ("configs/loongrl-qwen3-8b.yaml", 16384, None),  # the recipe's shape, its own model (Qwen3's config)
    ],
)
@pytest.mark.parametrize("gpu_gib", [24, 80, 141])
def test_auto_micro_batch_budget_is_the_largest_that_fits_in_steps(tmp_path, config, prompt, mini_batch, gpu_gib):
    """actor.max_tokens_per_micro_batch=auto on a GPU: a multiple of the step whose plan fits where one step
    more does not, or the whole mini-batch share when that fits (more saves nothing), or one sample's when not
    even that fits, which the check then refuses; what it chose is said, and a number given is left alone."""
    from longqa.config import load_config
    from longqa.planning.planner import (
        BUDGET_STEP,
        GIB,
        check_fit,
        check_run,
        mini_batch_share_tokens,
        one_sample_tokens,
        plan_config,
    )

    gpu_bytes = gpu_gib * GIB
    overrides = ["actor.max_tokens_per_micro_batch=auto", f"data.max_prompt_length={prompt}"]
    if config != "configs/loongrl-qwen3-8b.yaml":
        LlamaConfig(**SMOLLM2).save_pretrained(tmp_path)
        overrides += [
            f"model.path={tmp_path}",
            f"actor.ppo_mini_batch_size={mini_batch}",
            f"data.train_batch_size={mini_batch}",
        ]
    else:
        from transformers import Qwen3Config

        from longqa.model.shapes import SHAPES

        Qwen3Config(**SHAPES["qwen3-8b"]).save_pretrained(tmp_path)
        overrides.append(f"model.path={tmp_path}")
    cfg = load_config(config, overrides)
    checked = check_run(cfg, 1, machine=False, gpu_bytes=gpu_bytes)
    said = [checked.note]
    try:
        check_fit(checked.config, 1, gpu_bytes, checked.sizes)
        refused = None
    except PlanError as e:
        refused = str(e)
    chosen = checked.config.actor.max_tokens_per_micro_batch
    assert cfg.actor.max_tokens_per_micro_batch == "auto"  # (the config checked is left as it was)
    assert isinstance(chosen, int) and len(said) == 1 and f"auto: {chosen:,} tokens" in said[0] or "not even" in said[0]
    sizes = model_sizes_of(cfg)

    def fits(tokens):
        plan = plan_config(cfg, sizes, 1, gpu_bytes, micro_batch_tokens=tokens)
        return plan.total <= gpu_bytes and plan.loading <= gpu_bytes

    ceiling = mini_batch_share_tokens(cfg, 1)
    if not fits(one_sample_tokens(cfg)):
        assert chosen == one_sample_tokens(cfg) and refused is not None and "not even one sample" in said[0]
    elif chosen == ceiling:
        assert fits(ceiling) and refused is None and "a whole mini-batch share" in said[0]
    else:
        assert refused is None and fits(chosen) and not fits((chosen // BUDGET_STEP + 1) * BUDGET_STEP)
        assert chosen % BUDGET_STEP == 0 or chosen == one_sample_tokens(cfg)  # (a step below one sample saves nothing)
        assert chosen < ceiling and f"the largest the memory plan fits in {gpu_gib} GiB" in said[0]
    numbered = load_config(config, [*overrides, "actor.max_tokens_per_micro_batch=4096"])
    checked = check_run(numbered, 1, machine=False, gpu_bytes=gpu_bytes)
    assert checked.config.actor.max_tokens_per_micro_batch == 4096 and checked.note is None


def model_sizes_of(cfg) -> ModelSizes:
    from longqa.planning.planner import model_sizes

    return model_sizes(cfg)


def test_longqa_sft_refuses_on_a_gpu_before_building_the_model(tmp_path, monkeypatch, capsys):
    """The command's own path on a (pretended) GPU too small for its default batch budget: one line on stderr,
    status 2, naming the largest --batch-tokens that fits, and no model built or written."""
    import types

    import longqa.train.sft
    from longqa.cli import main
    from longqa.data.synth import generate

    generate(tmp_path / "data", rows_per_task=2, context_tokens=256, max_hops=2, test_ratio=0.5, seed=5)
    monkeypatch.setattr(longqa.train.sft, "pick_device", lambda *args: torch.device("cuda"))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=6 * GIB + 50 * 2**20)
    )  # the margin and 50 MiB
    monkeypatch.setattr(longqa.train.sft, "_model", lambda *args: pytest.fail("the model was built"))
    assert (
        main(
            [
                "sft",
                "--train-files",
                str(tmp_path / "data/merged/train.parquet"),
                "--output-dir",
                str(tmp_path / "model"),
                "--vocab-size",
                "400",
                "--hidden-size",
                "32",
                "--num-layers",
                "2",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"longqa: error: longqa sft needs about [\d.]+ GiB at --batch-tokens 131072 but the GPU has "
        r"6\.0 GiB: use --batch-tokens \d+ or lower, the largest that fits",
        error,
    )
    assert not (tmp_path / "model" / "config.json").exists()


def test_the_benchmark_s_gpu_grid_is_well_formed():
    """The GPU grid runs only on a GPU: here, every row must at least name settings its case takes, and the
    count must size each to fit one H200."""
    import importlib.util
    import inspect
    from pathlib import Path

    file = Path(__file__).resolve().parent.parent / "benchmarks" / "memory_check.py"
    spec = importlib.util.spec_from_file_location("memory_check", file)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    grid = script.gpu_grid()
    assert {path for path, _ in grid} == {"grpo", "sft"}
    assert {settings.get("vocab", 49152) for _, settings in grid} >= {1024, 49152, 151936}
    for path, settings in grid:
        takes = inspect.signature(grpo_case if path == "grpo" else sft_case).parameters
        assert set(settings) <= set(takes) - {"device"}, settings
        assert 0 < script.predicted_need(path, settings) < 139 * GIB, settings
