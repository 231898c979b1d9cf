"""GRPO-family math as pure tensor functions: advantages, the clipped policy loss, loss aggregation, KL.

Names and definitions follow verl (``verl/trainer/ppo/core_algos.py``). Nothing here knows about models or
engines, so every function can be checked against numbers worked out by hand.

Shapes: ``N`` samples laid out group-contiguous (prompt 0's ``group_size`` samples, then prompt 1's, ...);
token tensors are ``[B, T]`` over response tokens with a 0/1 (or bool) ``mask``. Masked positions must hold
finite values: they are multiplied by 0, as in verl, and ``inf * 0`` is NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "drgrpo", "rloo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[N]`` -> ``[num_groups, group_size]`` floats, refusing a batch that does not split into whole groups."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return (rewards if rewards.is_floating_point() else rewards.float()).view(-1, group_size)


def _constant(groups: Tensor) -> Tensor:
    """Groups whose rewards are all equal: they carry no learning signal under a group baseline."""
    return (groups == groups[:, :1]).all(dim=1)


def group_advantages(
    rewards: Tensor, group_size: int, estimator: str = "grpo", norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, int]:
    """One advantage per sample from its group's rewards; also the number of all-equal (zero-signal) groups.

    - ``grpo``: ``(r - mean) / (std + eps)`` with Bessel's std (verl's ``torch.std``); ``r - mean`` without
      ``norm_by_std``.
    - ``drgrpo``: ``r - mean``, never divided (Dr. GRPO: the std scaling favours too easy / too hard prompts).
    - ``rloo``: ``r_i`` minus the mean of the other ``n - 1`` rewards, i.e. ``n / (n - 1) * (r_i - mean)``.

    A group of one has no baseline: as in verl, its mean is 0 and its std 1, so grpo/drgrpo pass the reward
    through (REINFORCE without baseline); rloo refuses it. All-equal groups of two or more get exactly 0: in
    float32 the mean of eight rewards of 2/3 is off by an ulp and the std is ~1e-8, so the verl formula
    would hand them a spurious advantage of about 0.06.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    groups = _groups(rewards, group_size)
    constant = _constant(groups)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2: each sample's baseline is the mean of the others")
        adv = (groups - groups.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))
    elif group_size == 1:
        adv = groups / (1 + eps) if estimator == "grpo" and norm_by_std else groups.clone()
    else:
        adv = groups - groups.mean(dim=1, keepdim=True)
        if estimator == "grpo" and norm_by_std:
            adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    if group_size > 1:
        adv = adv.masked_fill(constant[:, None], 0.0)
    return adv.reshape(-1), int(constant.sum())


def keep_informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Dynamic sampling (DAPO): ``[num_groups]`` bool, True where rewards differ, i.e. the group has a gradient."""
    return ~_constant(_groups(rewards, group_size))


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio: float,
    clip_ratio_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, ``[B, T]``, plus detached masked-mean stats.

    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio, 1 + clip_ratio_high))``; a separate upper bound
    is DAPO's clip-higher. With ``dual_clip_c`` (> 1), tokens with ``A < 0`` are capped at ``-A * c`` so a
    huge ratio on a bad token cannot dominate (verl's dual-clip). ``advantages`` is ``[B]`` or ``[B, T]``.
    Stats: ``clip_fraction`` (the clipped branch won), ``dual_clip_fraction``, ``approx_kl`` (verl's
    ``ppo_kl``, mean of ``old_logp - logp``) and ``ratio_mean``.
    """
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # as verl: keeps exp() finite on wild tokens
    ratio = log_ratio.exp()
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + high)
    losses = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(losses, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (losses > cap)
        losses = torch.where(dual, cap, losses)
    with torch.no_grad():
        stats = {
            "clip_fraction": _masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "dual_clip_fraction": _masked_mean(dual.to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return losses, stats


def _denominator(given: int | float | None, counted: Tensor) -> Tensor | int | float:
    """The caller's whole-batch count, else this batch's own; at least 1 so an empty batch gives 0, not NaN."""
    return counted.clamp(min=1) if given is None else max(given, 1)


def aggregate(
    token_losses: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_response_length: int | None = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Reduce ``[B, T]`` token losses to a scalar the way verl's ``agg_loss`` does.

    - ``token-mean``: sum over valid tokens / ``num_tokens`` (long answers weigh more, per token).
    - ``seq-mean-token-sum``: sum of per-sequence sums / ``num_seqs``.
    - ``seq-mean-token-mean``: sum of per-sequence token means / ``num_seqs`` (each answer weighs the same).
    - ``seq-mean-token-sum-norm``: sum of per-sequence sums / ``max_response_length`` (Dr. GRPO's constant
      normaliser; as in verl it is not divided by the number of sequences).

    The keyword denominators default to this batch's own (``num_seqs`` counts only rows with a valid token,
    as verl now does; ``max_response_length`` defaults to ``T``). For gradient accumulation pass the whole
    mini-batch's values (``global_denominators``): then every term is linear in its rows, and the micro-batch
    losses, and their gradients, sum exactly to the mini-batch's. Where ``mask`` holds only some of each row's
    tokens (a sequence-parallel rank's share), ``lengths`` gives the rows' whole token counts, by which
    ``seq-mean-token-mean`` divides, so the shares' losses sum to the whole rows' loss.
    """
    mask = mask.to(token_losses.dtype)
    seq_sums = (token_losses * mask).sum(dim=-1)
    seq_lens = mask.sum(dim=-1) if lengths is None else lengths.to(token_losses.dtype)
    if mode == "token-mean":
        return seq_sums.sum() / _denominator(num_tokens, seq_lens.sum())
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / _denominator(num_seqs, (seq_lens > 0).sum())
    if mode == "seq-mean-token-mean":
        return (seq_sums / seq_lens.clamp(min=1)).sum() / _denominator(num_seqs, (seq_lens > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / (token_losses.shape[-1] if max_response_length is None else max_response_length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")


def global_denominators(masks: list[Tensor], max_response_length: int | None = None) -> dict[str, int]:
    """``aggregate``'s keyword denominators for a mini-batch given as its micro-batches' masks.

    ``max_response_length`` should be the configured response budget; by default it is the widest mask, so
    micro-batches padded to different widths still share one constant. Under data parallelism, all-reduce
    ``num_tokens`` and ``num_seqs`` over ranks and scale the loss by the world size (gradients are averaged).
    """
    if max_response_length is None:
        max_response_length = max(m.shape[-1] for m in masks)
    return {
        "num_tokens": sum(int(m.sum()) for m in masks),
        "num_seqs": sum(int((m.sum(dim=-1) > 0).sum()) for m in masks),
        "max_response_length": max_response_length,
    }


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    ``kl`` (k1): ``logp - ref``; ``abs``; ``mse`` (k2): ``0.5 * (logp - ref)^2``; ``low_var_kl`` (k3):
    ``exp(ref - logp) - (ref - logp) - 1``, non-negative and low variance, its log-ratio clamped to
    [-20, 20] and its value to [-10, 10] as in verl. verl's aliases k1/k2/k3 are accepted.
    """
    diff = logp - ref_logp
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (-diff).clamp(-20.0, 20.0)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")


def total_loss(
    token_losses: Tensor,
    mask: Tensor,
    mode: str,
    entropy: Tensor | None = None,
    entropy_coeff: float = 0.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    **denominators,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``agg(pg) - entropy_coeff * agg(entropy) + kl_coef * agg(kl)``, one aggregation and set of denominators.

    Sharing them keeps the three terms on the same scale and keeps the micro-batch sum exact. The stats
    (``pg_loss``, ``entropy``, ``kl_loss``; detached) are this batch's share: with global denominators they
    sum over micro-batches to the mini-batch's values.
    """
    pg = aggregate(token_losses, mask, mode, **denominators)
    loss, stats = pg, {"pg_loss": pg.detach()}
    if entropy is not None:
        ent = aggregate(entropy, mask, mode, **denominators)
        loss = loss - entropy_coeff * ent
        stats["entropy"] = ent.detach()
    if kl is not None:
        kl_loss = aggregate(kl, mask, mode, **denominators)
        loss = loss + kl_coef * kl_loss
        stats["kl_loss"] = kl_loss.detach()
    return loss, stats
