"""Shared-prompt packing is exact: the naive padded layout is the reference, in float32 on the CPU."""

import copy

import pytest
import torch
from tiny_models import VOCAB, tiny_lm

from longqa.config import load_config
from longqa.model.attention import BLOCK, block_mask, pack_mask, use_longqa_attention
from longqa.model.packing import Pack, build_packed_batch, plan_packs
from longqa.train.actor import Actor, Samples


def samples_for(prompts: list[list[int]], response_lengths: list[list[int]], seed: int = 0) -> Samples:
    """Group g has prompt ``prompts[g]`` and responses of ``response_lengths[g]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids = [], []
    for prompt, lengths in zip(prompts, response_lengths):
        for n in lengths:
            prompt_ids.append(prompt)
            response_ids.append(torch.randint(1, VOCAB, (n,), generator=g).tolist())
    n = len(response_lengths[0])
    return Samples(prompt_ids, response_ids, torch.randn(len(response_ids), generator=g), n)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def actor_for(model, shared: bool, budget: int = 100_000, extra=(), device="cpu") -> Actor:
    cfg = load_config(
        None,
        [
            f"actor.shared_prompt={str(shared).lower()}",
            f"actor.max_tokens_per_micro_batch={budget}",
            "data.max_response_length=16",
            "actor.attention_backend=dense",
            "data.train_batch_size=3",
            "actor.ppo_mini_batch_size=3",
            *extra,
        ],
    )
    return Actor(model, cfg, 1, torch.device(device))


def logprobs_and_grads(model, samples: Samples, shared: bool, budget: int = 100_000, extra=(), device="cpu"):
    model = copy.deepcopy(model).to(device)
    actor = actor_for(model, shared, budget, extra=extra, device=device)
    logp = actor.logprobs(samples)
    old = [o - 0.05 * (i % 3) for i, o in enumerate(logp)]  # ratios away from 1: clipping is exercised
    actor.accumulate_gradients(samples, list(range(len(samples))), old)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp, grads, actor


def assert_same(model, samples: Samples, budget: int = 100_000, extra=(), device="cpu"):
    ref_logp, ref_grads, _ = logprobs_and_grads(model, samples, shared=False, extra=extra, device=device)
    logp, grads, actor = logprobs_and_grads(model, samples, shared=True, budget=budget, extra=extra, device=device)
    for a, b in zip(ref_logp, logp):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        assert ((grads[name] - ref_grads[name]).abs().max() / scale) < 1e-4, name
    return actor


# Prompts of different lengths, responses of different lengths including 1, and the same prompt
# text in two groups (they must stay separate groups).
PROMPTS = [random_prompt(11, 1), random_prompt(5, 2), random_prompt(11, 1)]
LENGTHS = [[3, 1, 7, 2], [1, 1, 9, 4], [5, 6, 1, 2]]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_packed_logprobs_and_gradients_equal_the_naive_layout(family):
    assert_same(tiny_lm(family), samples_for(PROMPTS, LENGTHS))


def test_flex_backend_log_probs_equal_the_naive_layout():
    """The block-mask backend: eager flex_attention on the CPU, which has no backward there (the
    CUDA test below checks gradients through the compiled kernel)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model, samples = tiny_lm("qwen3"), samples_for(PROMPTS, LENGTHS)
    reference = actor_for(copy.deepcopy(model), shared=False).logprobs(samples)
    flex = actor_for(copy.deepcopy(model), shared=True, budget=40, extra=("actor.attention_backend=flex",))
    assert flex.backend == "flex"
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(reference, flex.logprobs(samples)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_on_cuda_equals_the_naive_layout():
    # compiled flex_attention needs head_dim >= 16
    assert_same(
        tiny_lm("qwen3", head_dim=16),
        samples_for(PROMPTS, LENGTHS),
        budget=40,
        extra=("actor.attention_backend=flex",),
        device="cuda",
    )


# Sliding windows (all layers: Mistral; alternating with full layers: Gemma3) and attention soft-capping
# (Gemma2, with windows too) with a window of 5, shorter than most of the test's sequences.
WINDOWED = ["mistral", "gemma2", "gemma3_text"]


def windowed_lm(family: str, head_dim: int = 8):
    from model_zoo import WINDOW, tiny_model

    model = tiny_model(family, head_dim=head_dim, hidden_size=4 * head_dim)
    spec = use_longqa_attention(copy.deepcopy(model))
    assert {layer.window for layer in spec.layers.values()} >= {WINDOW}
    assert (family == "gemma2") == any(layer.softcap for layer in spec.layers.values())
    return model


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_and_soft_capping_are_exact_in_the_packed_update(family):
    assert_same(windowed_lm(family), samples_for(PROMPTS, LENGTHS))


@pytest.mark.parametrize("family", WINDOWED)
def test_flex_block_masks_honour_sliding_windows_and_soft_capping(family):
    """Eager flex_attention on the CPU: the windowed block masks and the soft-capping score transform."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model, samples = windowed_lm(family), samples_for(PROMPTS, LENGTHS)
    reference = actor_for(copy.deepcopy(model), shared=False).logprobs(samples)
    flex = actor_for(copy.deepcopy(model), shared=True, budget=40, extra=("actor.attention_backend=flex",))
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(reference, flex.logprobs(samples)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", WINDOWED)
def test_compiled_flex_on_cuda_honours_windows_and_soft_capping(family):
    assert_same(
        windowed_lm(family, head_dim=16),
        samples_for(PROMPTS, LENGTHS),
        budget=40,
        extra=("actor.attention_backend=flex",),
        device="cuda",
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_aggregation_matches_with_entropy_and_kl(mode):
    extra = (f"algo.loss_agg_mode={mode}", "algo.entropy_coeff=0.01", "algo.kl_coef=0.1")
    assert_same(tiny_lm("qwen3"), samples_for(PROMPTS, LENGTHS), extra=extra)


def test_one_sample_per_group():
    assert_same(tiny_lm("qwen3"), samples_for([random_prompt(7, 3), random_prompt(2, 4)], [[5], [1]]))


def test_groups_split_when_alone_over_budget_and_many_micro_batches():
    samples = samples_for(PROMPTS, LENGTHS)
    actor = assert_same(tiny_lm("llama"), samples, budget=20)
    micros = actor.micro_batches(samples, list(range(len(samples))))
    # naive: 150 tokens; one pack per group: 69; split groups repeat their prompt, so less is saved
    assert 0 < actor.tokens_saved(samples) < 1 - 69 / 150
    assert actor_for(tiny_lm("qwen3"), True).tokens_saved(samples) == pytest.approx(1 - 69 / 150)
    assert len(micros) > len(PROMPTS)  # groups of 11 + 13 tokens of responses do not fit 20
    assert sorted(i for m in micros for i in m.index) == list(range(len(samples)))


def test_left_padded_inputs_are_unpadded_first():
    model = tiny_lm("qwen3")
    reference = samples_for(PROMPTS, LENGTHS)
    width_p = max(len(p) for p in reference.prompt_ids)
    width_r = max(len(r) for r in reference.response_ids)
    prompts = torch.zeros(len(reference), width_p, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    responses = torch.zeros(len(reference), width_r, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    for i, (p, r) in enumerate(zip(reference.prompt_ids, reference.response_ids)):
        prompts[i, width_p - len(p) :], prompt_mask[i, width_p - len(p) :] = torch.tensor(p), 1
        responses[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1
    padded = Samples.from_padded(prompts, prompt_mask, responses, response_mask, reference.advantages, 4)
    assert padded.prompt_ids == reference.prompt_ids and padded.response_ids == reference.response_ids
    ref_logp, _, _ = logprobs_and_grads(model, reference, shared=False)
    logp, _, _ = logprobs_and_grads(model, padded, shared=True)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(ref_logp, logp))


def test_plain_forwards_and_generation_still_work_after_switching():
    model = tiny_lm("qwen3")
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    before = model(input_ids=ids, attention_mask=mask).logits
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    use_longqa_attention(model)
    use_longqa_attention(model)  # idempotent
    assert model.config._attn_implementation == "longqa:sdpa"
    assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, before, atol=1e-6)
    assert torch.equal(
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0), greedy
    )


def test_plan_keeps_groups_whole_and_counts_saved_tokens():
    prompts, responses = [[1] * 10] * 4 + [[2] * 6] * 4, [[3] * 2] * 8
    micros = plan_packs(prompts, responses, [[0, 1, 2, 3], [4, 5, 6, 7]], budget=40)
    assert [[p.samples for p in m] for m in micros] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]  # 18 + 14 tokens
    micros = plan_packs(prompts, responses, [[0, 1, 2, 3], [4, 5, 6, 7]], budget=31)
    assert [[p.samples for p in m] for m in micros] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # never split to fill
    micros = plan_packs(prompts, responses, [[0, 1, 2, 3], [4, 5, 6, 7]], budget=12)  # alone over budget
    assert [[p.samples for p in m] for m in micros] == [[[0]], [[1]], [[2]], [[3]], [[4, 5, 6]], [[7]]]
    assert all(len(p.prompt) in (10, 6) for m in micros for p in m)  # every pack carries its prompt
    full = plan_packs(prompts, responses, [[0, 1, 2, 3], [4, 5, 6, 7]], budget=1000)
    assert len(full) == 1 and sum(len(p) for p in full[0]) == 32  # of 80 naive tokens


def test_layout_positions_and_prediction_sites():
    pack = build_packed_batch([Pack([5, 6, 7], [0, 1], [2, 1])], [[8, 9], [4]], pad_to=4)
    assert pack.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert pack.predict_at.tolist() == [2, 3, 2] and pack.targets.tolist() == [8, 9, 4]
    assert pack.response_mask().tolist() == [[True, True], [True, False]]
    mask = pack_mask(3, [2, 1])
    assert mask[5].tolist() == [True, True, True, False, False, True]  # 2nd response: prompt + itself
    assert mask[4].tolist() == [True, True, True, True, True, False]


def token_by_token(packs, responses, pad_to):
    """The layout written out one token at a time, as the module docstring states it."""
    rows = {"ids": [], "positions": [], "pack": [], "segment": [], "predict_at": [], "targets": []}
    for p, pack in enumerate(packs):
        start, plen = len(rows["ids"]), len(pack.prompt)
        for t, token in enumerate(pack.prompt):
            for key, value in zip(("ids", "positions", "pack", "segment"), (token, t, p, 0)):
                rows[key].append(value)
        for r, i in enumerate(pack.samples):
            for t, token in enumerate(responses[i]):
                rows["predict_at"].append(start + plen - 1 if t == 0 else len(rows["ids"]) - 1)
                rows["targets"].append(token)
                for key, value in zip(("ids", "positions", "pack", "segment"), (token, plen + t, p, r + 1)):
                    rows[key].append(value)
    for t in range((-len(rows["ids"])) % pad_to):
        for key, value in zip(("ids", "positions", "pack", "segment"), (0, t, len(packs), 0)):
            rows[key].append(value)
    return rows


def test_the_layout_equals_the_token_by_token_one():
    """Random packs (empty responses, one-token prompts, several packs, every padding) against the layout
    built token by token."""
    rng = torch.Generator().manual_seed(3)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=rng))]  # noqa: E731
    for _ in range(200):
        responses = [torch.randint(1, VOCAB, (pick([0, 1, 2, 5, 17]),), generator=rng).tolist() for _ in range(12)]
        packs, used = [], 0
        for _ in range(pick([1, 2, 4])):
            members = list(range(used, used + pick([1, 3])))
            used += len(members)
            prompt = torch.randint(1, VOCAB, (pick([1, 7, 20]),), generator=rng).tolist()
            packs.append(Pack(prompt, members, [len(responses[i]) for i in members]))
        pad_to = pick([1, 4, 128])
        pack, expected = build_packed_batch(packs, responses, pad_to=pad_to), token_by_token(packs, responses, pad_to)
        assert pack.input_ids[0].tolist() == expected["ids"] and pack.position_ids[0].tolist() == expected["positions"]
        assert pack.pack_id.tolist() == expected["pack"] and pack.segment_id.tolist() == expected["segment"]
        assert pack.predict_at.tolist() == expected["predict_at"] and pack.targets.tolist() == expected["targets"]
        assert pack.length % pad_to == 0


def test_block_mask_classifies_every_block_exactly():
    """Each (query block, key block) is skipped, full or partial exactly as the token mask says, and
    the mask_mod reproduces the token mask."""
    lengths = [(300, [40, 1, 130]), (5, [3]), (200, [128, 128])]
    packs, responses = [], []
    for prompt_length, rs in lengths:
        first = len(responses)
        responses += [[1] * n for n in rs]
        packs.append(Pack([1] * prompt_length, list(range(first, first + len(rs))), rs))
    pack = build_packed_batch(packs, responses, pad_to=BLOCK)
    dense = torch.zeros(pack.length, pack.length, dtype=torch.bool)
    for start, p, rs in pack.segments:
        end = start + p + sum(rs)
        dense[start:end, start:end] = pack_mask(p, rs)
    pad_start = sum(len(p) for p in packs)
    dense[pad_start:, pad_start:] = torch.ones(pack.length - pad_start, pack.length - pad_start).tril().bool()
    bm = block_mask(pack)
    blocks = pack.length // BLOCK
    tiles = dense.view(blocks, BLOCK, blocks, BLOCK).permute(0, 2, 1, 3).reshape(blocks, blocks, -1)
    full, partial = bm.full_kv_num_blocks[0, 0], bm.kv_num_blocks[0, 0]
    for q in range(blocks):
        full_set = set(bm.full_kv_indices[0, 0, q, : int(full[q])].tolist())
        partial_set = set(bm.kv_indices[0, 0, q, : int(partial[q])].tolist())
        for k in range(blocks):
            tile = tiles[q, k]
            expected = "full" if tile.all() else "partial" if tile.any() else "none"
            got = "full" if k in full_set else "partial" if k in partial_set else "none"
            assert got == expected, (q, k)
    q, k = torch.meshgrid(torch.arange(pack.length), torch.arange(pack.length), indexing="ij")
    assert torch.equal(bm.mask_mod(0, 0, q, k), dense)
