"""The policy being trained: its optimizer and schedule, log-probs of samples, and the PPO-clip update.

This is the naive padded path: every sample is its own row, prompt repeated for each of its n
responses. (A later issue packs each prompt once with its responses behind ``actor.shared_prompt``.)
Gradient accumulation divides every micro-batch by the whole mini-batch's token/sequence counts, so
the accumulated gradient equals the one-big-batch gradient for every loss aggregation mode.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from longqa import algo
from longqa.batching import budget_batches, collate_right
from longqa.config import Config
from longqa.model.logprobs import token_logprobs


class TrainingError(RuntimeError):
    """Training cannot go on (for example, too many non-finite steps in a row)."""


@dataclass
class Samples:
    """One step's samples, group-contiguous: ``n`` responses of prompt 0, then prompt 1, ..."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: torch.Tensor  # [N], float32
    group_size: int

    def __len__(self) -> int:
        return len(self.response_ids)

    def length(self, i: int) -> int:
        return len(self.prompt_ids[i]) + len(self.response_ids[i])


def lr_lambda(cfg: Config, total_updates: int):
    """Linear warmup over ``warmup_ratio`` of the updates, then constant or cosine to ``min_lr_ratio``."""
    warmup = int(cfg.actor.warmup_ratio * total_updates)
    floor = cfg.actor.min_lr_ratio

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if cfg.actor.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Actor:
    def __init__(self, model, cfg: Config, total_steps: int, device: torch.device, pad_token_id: int = 0):
        self.model, self.cfg, self.device, self.pad = model, cfg, device, pad_token_id
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=tuple(a.betas),
                                           weight_decay=a.weight_decay)
        self.updates_per_step = a.ppo_epochs * math.ceil(cfg.data.train_batch_size / a.ppo_mini_batch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg, max(1, total_steps * self.updates_per_step)))
        self.bad_steps = 0  # consecutive non-finite updates
        # A frozen copy of the starting weights, only when a KL penalty asks for one (the recipe has none).
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.kl_coef > 0 else None

    def _collate(self, samples: Samples, index: list[int]):
        """Right-padded rows of prompt+response, with the response-token mask."""
        sequences = [list(samples.prompt_ids[i]) + list(samples.response_ids[i]) for i in index]
        tensors = collate_right(sequences, [len(samples.prompt_ids[i]) for i in index], self.pad)
        return tuple(t.to(self.device) for t in tensors)

    def _micro(self, samples: Samples, indices: list[int]) -> list[list[int]]:
        lengths = [samples.length(i) for i in range(len(samples))]
        return budget_batches(lengths, indices, self.cfg.actor.max_tokens_per_micro_batch)

    @torch.no_grad()
    def logprobs(self, samples: Samples) -> list[torch.Tensor]:
        """Each sample's response-token log-probs under the current weights (the "old" policy)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor] = [None] * len(samples)
        for index in self._micro(samples, list(range(len(samples)))):
            ids, attention, response = self._collate(samples, index)
            logp, _ = token_logprobs(self.model, ids, attention, response, self.cfg.rollout.temperature or 1.0)
            for row, i in enumerate(index):
                out[i] = logp[row][response[row]].cpu()
        self.model.train(was_training)
        return out

    def update(self, samples: Samples) -> dict:
        """PPO-clip updates over mini-batches of whole groups; returns averaged metrics."""
        cfg = self.cfg
        groups = len(samples) // samples.group_size
        per_mini = cfg.actor.ppo_mini_batch_size
        minis = [list(range(g * samples.group_size, min(groups, g + per_mini) * samples.group_size))
                 for g in range(0, groups, per_mini)]
        on_policy = cfg.actor.ppo_epochs == 1 and len(minis) == 1
        old = None if on_policy else self.logprobs(samples)
        self.model.train()
        totals: dict[str, float] = {}
        for _ in range(cfg.actor.ppo_epochs):
            for mini in minis:
                for key, value in self._update_mini(samples, mini, old).items():
                    totals[key] = totals.get(key, 0.0) + value
        updates = cfg.actor.ppo_epochs * len(minis)
        return {k: (v if k == "skipped_updates" else v / updates) for k, v in totals.items()}

    def _update_mini(self, samples: Samples, mini: list[int], old: list[torch.Tensor] | None) -> dict:
        stats = self.accumulate_gradients(samples, mini, old)
        stats.update(self.apply_gradients())
        return stats

    def accumulate_gradients(self, samples: Samples, mini: list[int], old: list[torch.Tensor] | None) -> dict:
        """Backward over the mini-batch's micro-batches; the summed gradient is the whole mini-batch's."""
        cfg = self.cfg
        micros = self._micro(samples, mini)
        collated = [self._collate(samples, index) for index in micros]
        denominators = algo.global_denominators([c[2] for c in collated], cfg.data.max_response_length)
        temperature = cfg.rollout.temperature or 1.0
        stats: dict[str, float] = {}
        for index, (ids, attention, response) in zip(micros, collated):
            logp, entropy = token_logprobs(self.model, ids, attention, response, temperature)
            if old is None:
                old_logp = logp.detach()
            else:
                old_logp = torch.zeros_like(logp)
                for row, i in enumerate(index):
                    old_logp[row][response[row]] = old[i].to(self.device)
            advantages = samples.advantages[index].to(self.device)
            token_losses, pg_stats = algo.policy_loss(logp, old_logp, advantages, response, cfg.algo.clip_ratio,
                                                      cfg.algo.clip_ratio_high, cfg.algo.dual_clip_c)
            kl = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs(self.reference, ids, attention, response, temperature)
                kl = algo.kl_penalty(logp, ref_logp, cfg.algo.kl_type) * response
            loss, loss_stats = algo.total_loss(token_losses, response, cfg.algo.loss_agg_mode, entropy=entropy,
                                               entropy_coeff=cfg.algo.entropy_coeff, kl=kl,
                                               kl_coef=cfg.algo.kl_coef, **denominators)
            loss.backward()
            share = int(response.sum()) / max(1, denominators["num_tokens"])  # token-weighted averages
            for key, value in {**pg_stats, **loss_stats}.items():
                summed = key in loss_stats  # already divided by the mini-batch denominators
                stats[key] = stats.get(key, 0.0) + float(value) * (1.0 if summed else share)
        return stats

    def apply_gradients(self) -> dict:
        """Clip and step, or skip (and count) an update whose gradient is not finite."""
        cfg = self.cfg
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.actor.grad_clip))
        stats = {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "skipped_updates": 0.0}
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            stats.update(grad_norm=0.0, skipped_updates=1.0)
            if self.bad_steps >= cfg.actor.max_bad_steps:
                raise TrainingError(f"{self.bad_steps} updates in a row had a non-finite loss or gradient; "
                                    f"stopping (lower actor.lr, check the data, or raise actor.max_bad_steps)")
            return stats
        self.bad_steps = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats
