"""The policy being trained: its optimizer and schedule, log-probs of samples, and the PPO-clip update.

Two layouts give the same log-probs. ``actor.shared_prompt=true`` (default) packs each prompt once
with its responses (``model/packing.py``): a group of n costs one prompt, not n. The naive padded
layout (one right-padded row per sample, the prompt repeated n times) is kept as the reference.
Either way a micro-batch yields ``[rows, width]`` log-probs with a mask of response tokens, so
the loss code does not know which layout ran. Gradient accumulation divides every micro-batch by
the whole mini-batch's token/sequence counts, so the accumulated gradient equals the one-big-batch
gradient for every loss aggregation mode.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from longqa.config import Config
from longqa.config.checks import float32_masters
from longqa.distributed import deepspeed
from longqa.distributed.env import all_reduce, world_size
from longqa.distributed.fsdp import shard_model
from longqa.distributed.ulysses import data_parallel_size, sequence_shard, sum_over_shards
from longqa.model.attention import PADDED_BACKENDS, length_step, resolve_backend, use_longqa_attention
from longqa.model.logprobs import packed_logprobs, token_logprobs
from longqa.model.packing import build_packed_batch, plan_packs
from longqa.planning.planner import AUTO, ModelSizes, resolve_auto
from longqa.rollout.base import bump_weights_version
from longqa.train import algo
from longqa.train.batching import budget_batches, collate_right


class TrainingError(RuntimeError):
    """Training cannot go on (for example, too many non-finite steps in a row)."""


@dataclass
class Samples:
    """One step's samples, group-contiguous: ``n`` responses of prompt 0, then prompt 1, ..."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: torch.Tensor  # [N], float32
    group_size: int
    # Each response's log-probs under the policy that sampled it, when that is not the one being updated (one-step-off
    # sampling): the PPO ratio's denominator. None: the update's own weights sampled them.
    old_logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def length(self, i: int) -> int:
        return len(self.prompt_ids[i]) + len(self.response_ids[i])

    @classmethod
    def from_padded(cls, prompts, prompt_mask, responses, response_mask, advantages, group_size: int) -> "Samples":
        """From verl's tensors: left-padded prompts ``[N, P]`` and right-padded responses ``[N, R]``
        with their 0/1 masks; padding is dropped."""
        keep = lambda ids, mask: [int(t) for t, m in zip(ids.tolist(), mask.tolist()) if m]  # noqa: E731
        return cls(
            [keep(p, m) for p, m in zip(prompts, prompt_mask)],
            [keep(r, m) for r, m in zip(responses, response_mask)],
            advantages,
            group_size,
        )


@dataclass
class MicroBatch:
    """Samples ``index`` (in row order) and the layout's inputs for one forward/backward."""

    index: list[int]
    inputs: object  # (ids, attention, response) for the padded layout, a PackedBatch for the shared one


def lr_lambda(cfg: Config, total_updates: int):
    """The learning rate of update ``u`` (from 0) as a fraction of ``actor.lr``: a linear warm-up over
    ``warmup_ratio`` of the schedule's updates (``actor.schedule_updates``, or the run's ``total_updates``), then
    constant, or a cosine to ``min_lr_ratio`` at the schedule's end.

    The warm-up is longqa's own, update u at (u + 1) / W for u < W, except under ``actor.strategy=deepspeed``:
    there it is the recipe's ZeRO-3 path's (``warmup_ramp``), so that the run DeepSpeed trains is the recipe's
    update for update."""
    a = cfg.actor
    horizon = a.schedule_updates or total_updates
    warmup, ramp_ends, ramp = warmup_ramp(a.warmup_ratio, horizon, deepspeed=a.strategy == "deepspeed")
    floor = a.min_lr_ratio

    def factor(update: int) -> float:
        if update < ramp_ends:
            return ramp(update)
        if a.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, horizon - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def warmup_ramp(ratio: float, horizon: int, deepspeed: bool):
    """``(W, end, ramp)``: the warm-up's length W in updates, the first update past it and the fraction of the
    learning rate each update before that takes.

    longqa's own: W = int(ratio * horizon), update u at (u + 1) / W, the full rate from update W on. The recipe's
    ZeRO-3 path (Arctic's client, arctic_platform/common/deepspeed_worker.py and integrations/verl/adapter.py)
    hands DeepSpeed ``WarmupLR`` (``WarmupCosineLR`` for a cosine) with ``warmup_min_lr`` 0, linear, over
    round(ratio * horizon) updates, none when that is 0. DeepSpeed raises W below 2 to 2, sets the rate of
    iteration -1 (the minimum, 0) when it is built and steps once after each update, so update u takes iteration
    u - 1's rate: 0 for updates 0 and 1, (u - 1) / W up to update W, the full rate (or the cosine, which then
    reads (u - W) / (horizon - W) as longqa's does) from update W + 1 on."""
    if not deepspeed:
        warmup = int(ratio * horizon)
        return warmup, warmup, lambda u: (u + 1) / warmup
    warmup = round(ratio * horizon)
    if not warmup:
        return 0, 0, None
    warmup = max(2, warmup)
    return warmup, warmup + 1, lambda u: max(u - 1, 0) / warmup


def _response_mask(micro: MicroBatch) -> torch.Tensor:
    return micro.inputs[2] if isinstance(micro.inputs, tuple) else micro.inputs.response_mask()


class PolicyScorer(torch.nn.Module):
    """Response-token log-probs of a micro-batch, as one module call.

    The log-probs need the decoder (``base_model``) and the LM head's weight but not the model's own
    forward (which would compute logits everywhere). Wrapping that in a module gives FSDP2 a root to
    shard: its hooks gather and reduce the embedding, final norm and LM head around this call, as
    each decoder layer's hooks do around the layer.
    """

    def __init__(self, model, temperature: float):
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(inputs, tuple):
            ids, attention, response = inputs
            logp, entropy = token_logprobs(self.model, ids, attention, response, self.temperature)
            return logp, entropy, response
        return packed_logprobs(self.model, inputs, self.temperature)


class Actor:
    """Owns the policy's training: its scorer (sharded with FSDP2 when the process group has several
    ranks, or inside a DeepSpeed ZeRO-3 engine under ``actor.strategy=deepspeed``), optimizer and
    schedule, the old-log-prob pass and the PPO-clip update."""

    def __init__(self, model, cfg: Config, total_steps: int, device: torch.device, pad_token_id: int = 0):
        if cfg.actor.max_tokens_per_micro_batch == AUTO:  # (the trainer fills it before loading; an actor alone, here)
            gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
            cfg, _ = resolve_auto(cfg, world_size(), gpu_bytes, ModelSizes.from_config(model.config))
        self.model, self.cfg, self.device, self.pad = model, cfg, device, pad_token_id
        a = cfg.actor
        temperature = cfg.rollout.temperature or 1.0
        self.backend = None
        # Ulysses sequence parallelism: this rank's shard of every packed row (None: whole rows)
        self.shard = sequence_shard(a.sequence_parallel_size)
        # Parameters become shards over several ranks, or in a process group of one to offload them to the CPU or
        # to keep float32 masters of a 16-bit model (`longqa train` makes no group for one process otherwise).
        sharded = world_size() > 1 or ((a.cpu_offload or float32_masters(cfg)) and torch.distributed.is_initialized())
        masters = next(model.parameters()).dtype != torch.float32  # FSDP2's mixed precision keeps float32 shards
        if a.shared_prompt:
            # Sharded by FSDP2 on a GPU, the layers compute in bfloat16 whatever the shards' dtype (shard_model).
            compute = (
                torch.bfloat16
                if sharded and a.strategy == "fsdp2" and device.type == "cuda"
                else next(model.parameters()).dtype
            )
            self.backend = resolve_backend(a.attention_backend, device, use_longqa_attention(model), compute)
        # A frozen copy of the starting weights, only when a KL penalty asks for one (the recipe has none).
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference = PolicyScorer(copy.deepcopy(model).eval().requires_grad_(False), temperature)
        self.scorer = PolicyScorer(model, temperature)
        self.engine = None  # the DeepSpeed engine under actor.strategy=deepspeed (then also the scorer)
        if a.strategy == "deepspeed":  # ZeRO-3 partitions the weights, even in a group of one rank
            self.engine, self.optimizer = deepspeed.wrap(self.scorer, cfg, device)
            self.scorer = self.engine
        else:
            if sharded:  # (the optimizer must be built on the shards, after)
                for scorer in (self.scorer, self.reference):
                    if scorer is not None:  # (the frozen reference takes no step: it keeps the loaded dtype)
                        shard_model(
                            scorer,
                            scorer.model.base_model.layers,
                            device,
                            a.cpu_offload,
                            mixed_precision=device.type == "cuda" or masters,
                            master_weights=a.master_weights if scorer is self.scorer else "model",
                        )
            self.optimizer = torch.optim.AdamW(
                self.scorer.parameters(), lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay
            )
        self.updates_per_step = a.ppo_epochs * math.ceil(cfg.data.train_batch_size / a.ppo_mini_batch_size)
        self.lr_factor = lr_lambda(cfg, max(1, total_steps * self.updates_per_step))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.bad_steps = 0  # consecutive non-finite updates

    def follow_config(self) -> None:
        """After a checkpoint is restored: the optimizer's settings and the learning-rate schedule of this run's
        config, continued at the restored update. A restored optimizer and scheduler carry the learning rate,
        betas and weight decay of the run that saved them; a resumed run that changes them (or the schedule, or
        the number of steps it is laid over) means its own from here on. Unchanged, the rate is the one the
        saving run would have used next, to the bit."""
        a = self.cfg.actor
        for group in self.optimizer.param_groups:
            group.update(initial_lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay)
        # (a scheduler built at the restored update takes each group's initial_lr as its base)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, self.lr_factor, last_epoch=self.scheduler.last_epoch - 1
        )

    def micro_batches(self, samples: Samples, indices: list[int]) -> list[MicroBatch]:
        """``indices`` (whole groups, group-contiguous) cut to ``actor.max_tokens_per_micro_batch``."""
        budget = self.cfg.actor.max_tokens_per_micro_batch
        if self.backend is None:
            lengths = [samples.length(i) for i in range(len(samples))]
            out = []
            for index in budget_batches(lengths, indices, budget):
                sequences = [list(samples.prompt_ids[i]) + list(samples.response_ids[i]) for i in index]
                tensors = collate_right(sequences, [len(samples.prompt_ids[i]) for i in index], self.pad)
                out.append(MicroBatch(index, tuple(t.to(self.device) for t in tensors)))
            return out
        # Rows padded to a few lengths per budget, so compiled kernels keep static shapes (length_step).
        pad_to = length_step(self.cfg.actor.max_tokens_per_micro_batch) if self.backend in PADDED_BACKENDS else 1
        if self.shard is not None:  # and split evenly over the sequence-parallel ranks
            pad_to = math.lcm(pad_to, self.shard.size)
        out = []
        for packs in self._plan(samples, indices):
            pack = build_packed_batch(packs, samples.response_ids, pad_to=pad_to)
            pack.backend, pack.shard = self.backend, self.shard
            out.append(MicroBatch(pack.samples, pack.to(self.device)))
        return out

    def compile_length_buckets(self) -> int:
        """Run the update's passes once at every packed length the flex and split backends pad rows to (multiples of
        ``length_step`` up to the token budget), so that compiled decoder layers build each length's graphs
        here, before the first step, rather than in whichever step first meets that length (8 s at
        Qwen3-1.7B). The gradient pass runs in training mode, the update's: Dynamo guards on the mode, and a
        loaded model comes in evaluation mode, in which every length would be compiled again mid-run. Gradients
        are dropped afterwards and the model left in the mode it came in; returns how many lengths."""
        if self.backend not in PADDED_BACKENDS:
            return 0
        was_training = self.model.training
        self.model.train()
        budget = self.cfg.actor.max_tokens_per_micro_batch
        step = length_step(budget)
        lengths = range(step, -(-budget // step) * step + 1, step)
        a = self.cfg.actor
        off_policy = a.ppo_epochs > 1 or self.cfg.data.train_batch_size > a.ppo_mini_batch_size
        for length in lengths:  # one pack of exactly `length` tokens: a prompt and a two-token response (a
            # single target would compile the LM-head chunk for size 1 only: sizes 0 and 1 are specialised)
            samples = Samples([[self.pad] * (length - 2)], [[self.pad] * 2], torch.zeros(1), 1)
            logp, _, _ = self.forward(self.scorer, self.micro_batches(samples, [0])[0])
            self._backward(logp.sum() * 0, boundary=False)
            if off_policy:  # the old log-prob pass: evaluation mode, no gradient
                self.logprobs(samples)
        self._zero_grad()
        self.model.train(was_training)
        return len(lengths)

    def forward(self, scorer: PolicyScorer, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logp, entropy, mask)``, ``[len(micro.index), width]``, rows in ``micro.index`` order."""
        return scorer(micro.inputs)

    @torch.no_grad()
    def logprobs(self, samples: Samples) -> list[torch.Tensor]:
        """Each sample's response-token log-probs under the current weights (the "old" policy)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor] = [None] * len(samples)
        micros = self.micro_batches(samples, list(range(len(samples))))
        rounds = int(all_reduce([len(micros)], "max", self.device)[0])  # every sharded forward is a collective
        for k in range(rounds):
            micro = micros[min(k, len(micros) - 1)]
            logp, _, _ = self.forward(self.scorer, micro)
            if k >= len(micros):
                continue
            logp, mask = sum_over_shards(logp, self.shard), _response_mask(micro).to(logp.device)  # whole rows
            for row, i in enumerate(micro.index):
                out[i] = logp[row][mask[row]].cpu()
        self.model.train(was_training)
        return out

    def update(self, samples: Samples) -> dict:
        """PPO-clip updates over mini-batches of whole groups; returns averaged metrics.

        ``actor.ppo_mini_batch_size`` counts groups over all ranks, as verl's does: each rank's mini-batch
        is its share, so every optimizer step covers that many groups whatever the number of ranks."""
        cfg = self.cfg
        groups = len(samples) // samples.group_size
        per_mini = cfg.actor.ppo_mini_batch_size // data_parallel_size(cfg.actor.sequence_parallel_size)
        minis = [
            list(range(g * samples.group_size, min(groups, g + per_mini) * samples.group_size))
            for g in range(0, groups, per_mini)
        ]
        on_policy = cfg.actor.ppo_epochs == 1 and len(minis) == 1
        if samples.old_logprobs is not None:  # sampled by older weights: their log-probs, not a recompute
            old = [torch.tensor(lp, dtype=torch.float32) for lp in samples.old_logprobs]
        else:
            old = None if on_policy else self.logprobs(samples)
        self.model.train()
        totals: dict[str, float] = {}
        for _ in range(cfg.actor.ppo_epochs):
            for mini in minis:
                for key, value in self._update_mini(samples, mini, old).items():
                    totals[key] = totals.get(key, 0.0) + value
        updates = cfg.actor.ppo_epochs * len(minis)
        stats = {k: (v if k == "skipped_updates" else v / updates) for k, v in totals.items()}
        stats["perf/tokens_saved"] = self.tokens_saved(samples)
        return stats

    def tokens_saved(self, samples: Samples) -> float:
        """Fraction of the naive layout's tokens that the update did not compute (0 for the naive layout),
        over all ranks."""
        if self.backend is None:
            return 0.0
        packs = self._plan(samples, list(range(len(samples))))
        naive = sum(samples.length(i) for i in range(len(samples)))
        packed = sum(len(p) for micro in packs for p in micro)
        naive, packed = all_reduce([naive, packed], "sum", self.device)
        return 1.0 - packed / naive if naive else 0.0

    def _plan(self, samples: Samples, indices: list[int]):
        """Packs of ``indices`` (whole groups, group-contiguous) in micro-batches of the token budget."""
        size = samples.group_size
        groups = [indices[g : g + size] for g in range(0, len(indices), size)]
        return plan_packs(samples.prompt_ids, samples.response_ids, groups, self.cfg.actor.max_tokens_per_micro_batch)

    def _update_mini(self, samples: Samples, mini: list[int], old: list[torch.Tensor] | None) -> dict:
        stats = self.accumulate_gradients(samples, mini, old)
        stats.update(self.apply_gradients())
        return stats

    def accumulate_gradients(self, samples: Samples, mini: list[int], old: list[torch.Tensor] | None) -> dict:
        """Backward over the mini-batch's micro-batches; the summed gradient is the whole mini-batch's.

        Under data parallelism (FSDP2) each rank passes its own groups: the token/sequence counts are
        summed over the ranks so every loss is divided by the global mini-batch's, each loss is scaled
        by the world size (FSDP averages gradients over ranks), and ranks with fewer micro-batches
        repeat their last one at weight 0, since every backward is a collective. Under sequence parallelism the
        ranks of a group pass the same groups and each computes the loss of its own tokens: the counts are each
        group's once, and a row's whole length divides its tokens' losses (``seq-mean-token-mean``)."""
        cfg = self.cfg
        micros = self.micro_batches(samples, mini)
        denominators = algo.global_denominators([_response_mask(m) for m in micros], cfg.data.max_response_length)
        world, rounds, copies = world_size(), len(micros), cfg.actor.sequence_parallel_size
        if world > 1:
            tokens, seqs = all_reduce([denominators["num_tokens"], denominators["num_seqs"]], "sum", self.device)
            denominators.update(num_tokens=int(tokens) // copies, num_seqs=int(seqs) // copies)
            rounds = int(all_reduce([len(micros)], "max", self.device)[0])
        stats: dict[str, float] = {}
        for k in range(rounds):
            micro, weight = (micros[k], float(world)) if k < len(micros) else (micros[-1], 0.0)
            index = micro.index
            logp, entropy, response = self.forward(self.scorer, micro)
            whole = _response_mask(micro).to(self.device)  # (``response``: this rank's tokens of it)
            if old is None:
                old_logp = logp.detach()
            else:
                old_logp = torch.zeros_like(logp)
                for row, i in enumerate(index):
                    old_logp[row][whole[row]] = old[i].to(self.device)
            advantages = samples.advantages[index].to(self.device)
            token_losses, pg_stats = algo.policy_loss(
                logp,
                old_logp,
                advantages,
                response,
                cfg.algo.clip_ratio,
                cfg.algo.clip_ratio_high,
                cfg.algo.dual_clip_c,
            )
            kl = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp, _, _ = self.forward(self.reference, micro)
                kl = algo.kl_penalty(logp, ref_logp, cfg.algo.kl_type) * response
            loss, loss_stats = algo.total_loss(
                token_losses,
                response,
                cfg.algo.loss_agg_mode,
                entropy=entropy,
                entropy_coeff=cfg.algo.entropy_coeff,
                kl=kl,
                kl_coef=cfg.algo.kl_coef,
                lengths=None if self.shard is None else whole.sum(-1),
                **denominators,
            )
            self._backward(loss * weight, boundary=k == rounds - 1)
            if weight == 0:
                continue
            # Summed on the device and read once at the end: reading a value here would make the host wait for
            # this micro-batch's backward before it could queue the next forward, leaving the device idle.
            share = response.sum() / max(1, denominators["num_tokens"])  # token-weighted averages
            for key, value in {**pg_stats, **loss_stats}.items():
                summed = key in loss_stats  # already divided by the mini-batch denominators
                stats[key] = stats.get(key, 0.0) + (value if summed else value * share)
        keys = sorted(stats)
        values = torch.stack([stats[k].float() for k in keys]).tolist() if keys else []
        if world > 1:  # each rank holds its share of every average: the sum is the global value
            values = all_reduce(values, "sum", self.device)
        return dict(zip(keys, values))

    def _backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Add ``loss``'s gradient; ``boundary``: the last micro-batch of the mini-batch."""
        if self.engine is None:
            loss.backward()
        else:
            deepspeed.backward(self.engine, loss, boundary)

    def _zero_grad(self) -> None:
        if self.engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            deepspeed.zero_grad(self.engine)

    def apply_gradients(self) -> dict:
        """Clip and step, or skip (and count) an update whose gradient is not finite. DeepSpeed takes the norm,
        clips and steps in one call (the same clipping rule), skipping a non-finite step itself."""
        cfg = self.cfg
        lr = self.scheduler.get_last_lr()[0]
        if self.engine is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.scorer.parameters(), cfg.actor.grad_clip))
        else:
            grad_norm = deepspeed.step(self.engine)
        stats = {"grad_norm": grad_norm, "lr": lr, "skipped_updates": 0.0}
        if not math.isfinite(grad_norm):
            self._zero_grad()
            self.bad_steps += 1
            stats.update(grad_norm=0.0, skipped_updates=1.0)
            if self.bad_steps >= cfg.actor.max_bad_steps:
                raise TrainingError(
                    f"{self.bad_steps} updates in a row had a non-finite loss or gradient; "
                    f"stopping (lower actor.lr, check the data, or raise actor.max_bad_steps)"
                )
            return stats
        self.bad_steps = 0
        if self.engine is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        bump_weights_version(self.model)
        self.scheduler.step()
        return stats
