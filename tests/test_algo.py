"""Tests for longqa.train.algo: every function against numbers worked out by hand, and gradient accumulation with
global denominators reproducing the full mini-batch gradient exactly."""

from __future__ import annotations

import math

import pytest
import torch

from longqa.model.logprobs import entropy_from_logits
from longqa.train.algo import (
    AGG_MODES,
    aggregate,
    global_denominators,
    group_advantages,
    keep_informative_groups,
    kl_penalty,
    policy_loss,
    total_loss,
)

D = torch.float64


def t(values, dtype=D):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- advantages

REWARDS = t([1, 0, 0, 1, 1, 1, 1, 1])  # group 0 mixed, group 1 all correct


def test_grpo_by_hand():
    # mean 0.5, Bessel std sqrt((4 * 0.25) / 3) = 0.57735, so +-0.5 / 0.57735 = +-0.866025
    adv, zero = group_advantages(REWARDS, 4, "grpo")
    assert torch.allclose(adv, t([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0]), atol=1e-5)
    assert zero == 1


def test_grpo_without_std_and_drgrpo_are_centred_only():
    expected = t([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    assert torch.equal(group_advantages(REWARDS, 4, "grpo", norm_by_std=False)[0], expected)
    assert torch.equal(group_advantages(REWARDS, 4, "drgrpo")[0], expected)
    assert torch.equal(group_advantages(REWARDS, 4, "drgrpo", norm_by_std=True)[0], expected)  # never divided


def test_rloo_by_hand():
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; an all-ones group gives 1 - 1 = 0
    adv, zero = group_advantages(REWARDS, 4, "rloo")
    assert torch.allclose(adv, t([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert zero == 1
    # n = 2 with rewards 3, 1: 3 - 1 = 2 and 1 - 3 = -2
    assert torch.allclose(group_advantages(t([3, 1]), 2, "rloo")[0], t([2, -2]))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_advantage_properties(estimator):
    rewards = torch.rand(6 * 5, dtype=D, generator=torch.Generator().manual_seed(0))
    rewards[10:15] = 0.25  # group 2 has no signal
    adv, zero = group_advantages(rewards, 5, estimator)
    groups = adv.view(6, 5)
    assert torch.allclose(groups.sum(dim=1), torch.zeros(6, dtype=D), atol=1e-12)
    assert torch.equal(groups[2], torch.zeros(5, dtype=D))
    assert zero == 1
    if estimator == "grpo":  # the unit-variance normalisation (eps aside)
        assert torch.allclose(groups[[0, 1, 3, 4, 5]].std(dim=1), torch.ones(5, dtype=D), atol=1e-4)


def test_equal_float32_rewards_get_exactly_zero():
    # the float32 mean of eight 2/3 is off by an ulp; (r - mean) / (std + eps) would give about 0.06
    adv, zero = group_advantages(torch.full((8,), 2 / 3), 8, "grpo")
    assert torch.equal(adv, torch.zeros(8)) and zero == 1


def test_group_of_one_follows_verl():
    # verl: mean 0, std 1 for a lone sample, so the reward passes through (divided by 1 + eps)
    adv, zero = group_advantages(t([0.5, 1.0]), 1, "grpo")
    assert torch.allclose(adv, t([0.5 / (1 + 1e-6), 1.0 / (1 + 1e-6)]), rtol=0, atol=1e-12)
    assert zero == 2
    assert torch.equal(group_advantages(t([0.5, 1.0]), 1, "drgrpo")[0], t([0.5, 1.0]))
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        group_advantages(t([0.5, 1.0]), 1, "rloo")


def test_advantage_input_checks():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(REWARDS, 4, "ppo")
    adv, _ = group_advantages(torch.tensor([1, 0, 1, 1]), 2, "drgrpo")  # integer rewards are fine
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_keep_informative_groups():
    rewards = t([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25])
    assert keep_informative_groups(rewards, 4).tolist() == [True, False, False, True]


# ---------------------------------------------------------------- policy loss

# old_logp = 0, so ratio = exp(logp). Row 0 has A = +1, row 1 has A = -1. clip 0.2 low, 0.28 high.
RATIOS = [[1.1, 1.5, 0.5], [0.7, 1.2, 4.0]]
ADV = t([1.0, -1.0])
MASK = t([[1, 1, 0], [1, 1, 1]])


def _policy(**kwargs):
    logp = t(RATIOS).log().requires_grad_()
    losses, stats = policy_loss(logp, torch.zeros(2, 3, dtype=D), ADV, MASK, 0.2, **kwargs)
    return logp, losses, stats


def test_policy_loss_clip_higher_and_dual_clip_by_hand():
    logp, losses, stats = _policy(clip_ratio_high=0.28, dual_clip_c=3.0)
    # (0,0) inside: -1.1; (0,1) 1.5 > 1.28 with A > 0: clipped to -1.28; (0,2) 0.5 < 0.8 with A > 0: the
    # unclipped -0.5 is the max; (1,0) 0.7 < 0.8 with A < 0: clipped to 0.8; (1,1) inside: 1.2;
    # (1,2) 4.0 > 1.28 with A < 0: max(4.0, 1.28) = 4.0, then dual-clip caps it at 3.0
    assert torch.allclose(losses, t([[-1.1, -1.28, -0.5], [0.8, 1.2, 3.0]]))
    # clipped tokens carry no gradient; the others have d(-A * exp(logp)) / dlogp = -A * ratio
    losses.sum().backward()
    assert torch.allclose(logp.grad, t([[-1.1, 0, -0.5], [0, 1.2, 0]]))
    # stats over the 5 unmasked tokens: clipped at (0,1) and (1,0); dual-clipped at (1,2)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 5)
    assert stats["ratio_mean"].item() == pytest.approx((1.1 + 1.5 + 0.7 + 1.2 + 4.0) / 5)
    kl = -(math.log(1.1) + math.log(1.5) + math.log(0.7) + math.log(1.2) + math.log(4.0)) / 5
    assert stats["approx_kl"].item() == pytest.approx(kl)
    assert not any(v.requires_grad for v in stats.values())


def test_policy_loss_symmetric_without_dual_clip():
    _, losses, stats = _policy()
    # clip_high defaults to 0.2: (0,1) becomes -1.2; without dual-clip (1,2) keeps 4.0
    assert torch.allclose(losses, t([[-1.1, -1.2, -0.5], [0.8, 1.2, 4.0]]))
    assert stats["dual_clip_fraction"].item() == 0.0


def test_policy_loss_per_token_advantages_and_checks():
    _, per_seq, _ = _policy(clip_ratio_high=0.28)
    logp = t(RATIOS).log()
    per_token, _ = policy_loss(logp, torch.zeros(2, 3, dtype=D), ADV[:, None].expand(2, 3), MASK, 0.2, 0.28)
    assert torch.equal(per_seq, per_token)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(logp, logp, ADV, MASK, 0.2, dual_clip_c=1.0)


# ---------------------------------------------------------------- aggregation

LOSSES = t([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
RAGGED = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])  # lengths 3, 2, 0: sums 6 and 11, 5 tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 17 / 5),
        ("seq-mean-token-sum", (6 + 11) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", (6 / 3 + 11 / 2) / 2),
        ("seq-mean-token-sum-norm", 17 / 4),  # divided by T = 4, not by the number of sequences
    ],
)
def test_aggregate_by_hand(mode, expected):
    assert aggregate(LOSSES, RAGGED, mode).item() == pytest.approx(expected)
    assert aggregate(LOSSES, RAGGED.bool(), mode).item() == pytest.approx(expected)


def test_aggregate_explicit_denominators():
    assert aggregate(LOSSES, RAGGED, "token-mean", num_tokens=10).item() == pytest.approx(1.7)
    assert aggregate(LOSSES, RAGGED, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(4.25)
    assert aggregate(LOSSES, RAGGED, "seq-mean-token-mean", num_seqs=5).item() == pytest.approx(1.5)
    assert aggregate(LOSSES, RAGGED, "seq-mean-token-sum-norm", max_response_length=10).item() == pytest.approx(1.7)


def test_aggregate_empty_batch_is_zero_and_bad_mode_raises():
    empty = torch.zeros(2, 4, dtype=D)
    for mode in AGG_MODES:
        assert aggregate(LOSSES[:2], empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate(LOSSES, RAGGED, "sum")


def test_global_denominators():
    masks = [RAGGED, t([[1, 1, 1, 1, 1]])]
    assert global_denominators(masks) == {"num_tokens": 10, "num_seqs": 3, "max_response_length": 5}
    assert global_denominators(masks, max_response_length=64)["max_response_length"] == 64


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_gradients_sum_to_full_batch_gradient(mode):
    g = torch.Generator().manual_seed(1)
    B, T = 8, 12
    lengths = torch.tensor([12, 3, 0, 7, 1, 12, 5, 9])  # ragged, one empty row
    mask = (torch.arange(T) < lengths[:, None]).to(D)
    logp = (-torch.rand(B, T, dtype=D, generator=g) * 2).requires_grad_()
    old_logp = logp.detach() + 0.3 * torch.randn(B, T, dtype=D, generator=g)  # some tokens get clipped
    ref_logp = logp.detach() + 0.3 * torch.randn(B, T, dtype=D, generator=g)
    adv = torch.randn(B, dtype=D, generator=g)

    def loss_of(rows, **denominators):
        pg, _ = policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], 0.2, 0.28, 3.0)
        entropy = -logp[rows] * logp[rows].exp()  # any differentiable per-token term
        kl = kl_penalty(logp[rows], ref_logp[rows], "low_var_kl")
        return total_loss(pg, mask[rows], mode, entropy, 0.01, kl, 0.1, **denominators)[0]

    full = torch.autograd.grad(loss_of(slice(0, B)), logp)[0]
    splits = [slice(0, 3), slice(3, 5), slice(5, 8)]
    denominators = global_denominators([mask[s] for s in splits])
    micro = sum(torch.autograd.grad(loss_of(s, **denominators), logp)[0] for s in splits)
    assert full.abs().sum() > 0
    assert torch.allclose(full, micro, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- entropy, KL, total loss


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(2, 4, dtype=D)).tolist() == pytest.approx([math.log(4)] * 2)
    assert entropy_from_logits(t([[1000.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-12)  # no NaN
    logits = torch.randn(3, 5, 7, dtype=D, generator=torch.Generator().manual_seed(2))
    p = logits.softmax(dim=-1)
    assert torch.allclose(entropy_from_logits(logits), -(p * p.log()).sum(dim=-1))
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_kl_kinds_by_formula():
    logp, ref = t([-1.0, -2.0, -0.5]), t([-1.5, -1.0, -0.5])  # logp - ref = 0.5, -1, 0
    assert torch.allclose(kl_penalty(logp, ref, "kl"), t([0.5, -1.0, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), t([0.5, 1.0, 0.0]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), t([0.125, 0.5, 0.0]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]  # exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), t(k3))
    assert torch.equal(kl_penalty(logp, ref, "k3"), kl_penalty(logp, ref, "low_var_kl"))
    assert kl_penalty(t([-20.0]), t([-5.0]), "low_var_kl").item() == 10.0  # exp(15) - 16, clamped
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty(logp, ref, "full")


def test_total_loss_combines_terms_with_one_aggregation():
    entropy = torch.full((3, 4), 2.0, dtype=D)
    kl = torch.full((3, 4), 0.5, dtype=D)
    loss, stats = total_loss(LOSSES, RAGGED, "token-mean", entropy, 0.1, kl, 0.2)
    assert loss.item() == pytest.approx(3.4 - 0.1 * 2.0 + 0.2 * 0.5)
    assert {k: v.item() for k, v in stats.items()} == pytest.approx({"pg_loss": 3.4, "entropy": 2.0, "kl_loss": 0.5})
    loss, stats = total_loss(LOSSES, RAGGED, "seq-mean-token-sum", num_seqs=4)
    assert loss.item() == pytest.approx(17 / 4) and set(stats) == {"pg_loss"}
