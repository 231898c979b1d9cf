"""The rules that tie settings to one another: one ordered list (``CHECKS``), run by ``check_settings``.

Each key's own type and range is checked as it is read (``config/schema.py``); what no single key can say (an
engine that cannot sample what another setting asks of it, a batch that does not split over the ranks) is a
rule here. ``longqa train`` (the trainer, and the Ray driver before its workers start), ``longqa config show``
and ``longqa plan`` all run this list, through ``planning.planner.check_run``, so that none of them passes a
config that another refuses, and each rule is said in one line naming the settings to change.

A check takes the config and what it needs of the run, named by its parameters: ``ranks``, the job's ranks
(sampler ranks included: torchrun's WORLD_SIZE, the Ray workers, ``longqa plan --gpus``), or
``training_ranks``, those of them that train. What a machine can run of a config (its packages, its devices)
is not a rule between settings: ``config/support.py`` checks it. A rule that needs what a run reads (the
prompts, the model's position limit) is here too, below the list, and is called where that is known.
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal

from longqa.config.schema import Config, ConfigError

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


# ------------------------------------------------------------------------ what the rules derive from settings


def float32_masters(cfg: Config) -> bool:
    """Whether FSDP2 keeps float32 master weights of a model loaded in 16 bits (``actor.master_weights=float32``,
    the default), as it does on any number of ranks: one process shards in a group of its own for them, since an
    update of the recipe's lr 1e-6 rounds away on most bf16 weights."""
    return cfg.actor.strategy == "fsdp2" and cfg.model.dtype != "float32" and cfg.actor.master_weights == "float32"


def logprobs_mode_for(temperature: float, top_k: int, top_p: float) -> LogprobsMode | None:
    """The vLLM ``logprobs_mode`` whose sampled-token log-probs are exactly ours: ``log softmax(logits / T)``
    with no top-k/top-p renormalisation (T=1 when greedy), or None where no mode gives that.

    vLLM's ``raw_logprobs`` is ``log softmax(logits)``: right at T=1 (and greedy) whatever the filters.
    ``processed_logprobs`` is taken after temperature *and* top-k/top-p masking, so it is renormalised
    over the kept tokens: right for any temperature when the filters are off. Tempered *and* filtered
    sampling has no exact mode (the trainer recomputes its log-probs anyway and does not ask for them).
    """
    filtered = top_k != -1 or top_p < 1
    if not filtered:
        return "processed_logprobs"
    if temperature in (0, 1):
        return "raw_logprobs"
    return None


# -------------------------------------------------------------------------------------------------- ranks


def check_sampler_ranks(cfg: Config, ranks: int) -> None:
    """What sampler ranks of their own (``rollout.sampler_ranks``) need of a job of ``ranks`` ranks: checked on
    every rank before any process group is made."""
    r, samplers = cfg.rollout, cfg.rollout.sampler_ranks
    if not samplers:
        return
    needs = {
        "rollout.engine": (r.engine == "fast", f"fast (got {r.engine})"),
        "actor.strategy": (
            cfg.actor.strategy == "fsdp2",
            f"fsdp2 (got {cfg.actor.strategy}: DeepSpeed partitions over every rank of the job)",
        ),
        "trainer.launcher": (cfg.trainer.launcher == "local", f"local, under torchrun (got {cfg.trainer.launcher})"),
    }
    for key, (ok, what) in needs.items():
        if not ok:
            raise ConfigError(f"rollout.sampler_ranks={samplers} needs {key}={what}")
    if ranks <= samplers:
        raise ConfigError(
            f"rollout.sampler_ranks={samplers} sets that many ranks apart to sample, but the job has "
            f"{ranks}: launch more ranks (torchrun --nproc_per_node) so that some train"
        )


def check_batch_shares(cfg: Config, training_ranks: int) -> None:
    """The one rule of ``data.train_batch_size`` and ``actor.ppo_mini_batch_size``, on one rank as on several:
    each rank owns whole groups of the batch and of every mini-batch, and the mini-batches split the batch
    evenly. A mini-batch size that does not divide the batch leaves a last, smaller mini-batch, whose optimizer
    step takes the full learning rate on a few groups' noisier gradient (and on several ranks gives some rank no
    group of it)."""
    world = training_ranks
    batch, mini = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if batch % world:
        raise ConfigError(
            f"data.train_batch_size={batch} must be a multiple of the {world} ranks: each rank owns whole groups"
        )
    if mini > batch:
        raise ConfigError(f"actor.ppo_mini_batch_size={mini} is larger than data.train_batch_size={batch}")
    if batch % mini or mini % world:
        sizes = [size for size in range(world, batch + 1, world) if batch % size == 0]  # (world is one)
        fits = max((size for size in sizes if size <= mini), default=world)
        ranks = f" and be a multiple of the {world} ranks" if world > 1 else ""
        raise ConfigError(
            f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={batch}{ranks}: "
            f"each optimizer step takes a mini-batch of that many groups, and every mini-batch must "
            f"be alike; use {fits} (or another such size)"
        )


def check_parallel_support(cfg: Config, training_ranks: int) -> None:
    """What several training ranks do not run yet."""
    if training_ranks == 1:
        return
    r = cfg.rollout
    unsupported = {
        "rollout.engine=hf": r.engine == "hf",
        "algo.dynamic_sampling=true": cfg.algo.dynamic_sampling,
    }
    for what, present in unsupported.items():
        if present:
            raise ConfigError(f"{what} is not supported with {training_ranks} ranks yet")
    tp = r.tensor_model_parallel_size
    if r.engine == "vllm" and training_ranks % tp:
        fits = [d for d in range(1, training_ranks + 1) if training_ranks % d == 0]
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tp} must divide the {training_ranks} ranks: each group of that "
            f"many ranks shares one vLLM engine; use one of {fits}"
        )


def check_sequence_parallel(cfg: Config, training_ranks: int) -> None:
    """Ulysses sequence parallelism splits the packed rows of the shared-prompt update over groups of
    ``actor.sequence_parallel_size`` training ranks, which the training ranks must fill."""
    a = cfg.actor
    degree = a.sequence_parallel_size
    if degree == 1:
        return
    if not a.shared_prompt:
        raise ConfigError(
            f"actor.sequence_parallel_size={degree} splits the packed rows of the shared-prompt update: it needs "
            f"actor.shared_prompt=true"
        )
    if training_ranks % degree:
        fits = [d for d in range(1, training_ranks + 1) if training_ranks % d == 0]
        raise ConfigError(
            f"actor.sequence_parallel_size={degree} must divide the {training_ranks} training ranks, which form "
            f"groups of that many: use one of {fits}"
        )


def check_data_parallel(cfg: Config, world: int) -> None:
    """What ``world`` training ranks (one included) need of the batch and of the other settings: the three rank
    rules of the list, for ``longqa plan --split``, which checks each split's training ranks with them."""
    check_batch_shares(cfg, world)
    check_parallel_support(cfg, world)
    check_sequence_parallel(cfg, world)


# ------------------------------------------------------------------------------------------------ sampling


def check_groups(cfg: Config) -> None:
    """Every advantage estimator here compares the samples of one prompt: a group of one, or of greedy samples
    (temperature 0: n copies of one response), has nothing to compare with, every advantage is 0 and the run
    would train nothing, silently."""
    r, estimator = cfg.rollout, cfg.algo.adv_estimator
    if r.n < 2:
        raise ConfigError(
            f"rollout.n={r.n}: algo.adv_estimator={estimator} compares the samples of each prompt, and "
            f"one sample gives every advantage 0; set rollout.n to 2 or more"
        )
    if r.temperature == 0:
        raise ConfigError(
            f"rollout.temperature=0: algo.adv_estimator={estimator} compares the samples of each "
            f"prompt, and greedy sampling makes the rollout.n={r.n} samples one response, which gives "
            f"every advantage 0; set rollout.temperature above 0 (1.0 samples the model as it is)"
        )


def check_response_lengths(cfg: Config) -> None:
    """Drawn response lengths need an engine that can end a sample at a given length."""
    r = cfg.rollout
    if r.response_lengths != "model" and r.engine != "fast":
        raise ConfigError(
            f"rollout.response_lengths={r.response_lengths} needs rollout.engine=fast (got "
            f"rollout.engine={r.engine}): only the fast engine ends a sample at a drawn length"
        )


def check_speculative(cfg: Config) -> None:
    """Speculative decoding is the fast engine's, and its match lengths must leave a range."""
    r = cfg.rollout
    if r.speculative != "off" and r.engine != "fast":
        raise ConfigError(
            f"rollout.speculative={r.speculative} needs rollout.engine=fast (got rollout.engine={r.engine})"
        )
    if r.prompt_lookup_min > r.prompt_lookup_max:
        raise ConfigError(
            f"rollout.prompt_lookup_min={r.prompt_lookup_min} must not exceed "
            f"rollout.prompt_lookup_max={r.prompt_lookup_max}"
        )


def check_one_step_off(cfg: Config) -> None:
    """One-step-off sampling takes the PPO ratio against the log-probs the engine returns with each sample: vLLM
    has none that are exactly the trainer's under a tempered *and* top-k/top-p-filtered distribution. Overlapped
    sampling needs a step sampled ahead to overlap, and the fast engine, whose copy of the weights it samples from
    while the update changes the model's."""
    r = cfg.rollout
    if r.overlap and (r.mode != "one_step_off" or not r.max_staleness):
        raise ConfigError(
            f"rollout.overlap=true samples the next step during this step's update: it needs "
            f"rollout.mode=one_step_off with rollout.max_staleness=1 (got rollout.mode={r.mode}, "
            f"rollout.max_staleness={r.max_staleness})"
        )
    if r.overlap and r.engine != "fast":
        raise ConfigError(
            f"rollout.overlap=true needs rollout.engine=fast (got rollout.engine={r.engine}): the "
            f"sampling beside the update runs in the trainer's process, from the fast engine's copy "
            f"of the weights"
        )
    if (
        r.mode == "one_step_off"
        and r.max_staleness
        and r.engine == "vllm"
        and not logprobs_mode_for(r.temperature, r.top_k, r.top_p)
    ):
        raise ConfigError(
            f"rollout.mode=one_step_off takes the PPO ratio against the sampling log-probs, which vLLM "
            f"cannot return for rollout.temperature={r.temperature} with top_k={r.top_k} / "
            f"top_p={r.top_p}: use rollout.engine=fast, a temperature of 1, or no top-k/top-p"
        )


def check_vllm_model(cfg: Config) -> None:
    """vLLM loads a model folder of its own (config.json and safetensors); it reads no GGUF file."""
    if cfg.rollout.engine == "vllm" and (cfg.model.gguf_file or (cfg.model.path or "").endswith(".gguf")):
        raise ConfigError(
            "rollout.engine=vllm needs a model folder (config.json and safetensors), not a GGUF file: "
            "export the model first or use rollout.engine=fast"
        )


# ------------------------------------------------------------------------------------- weights and memory


def check_offload(cfg: Config) -> None:
    """Shards (offloaded, or float32 masters in one process) need an engine with weights of its own, and a
    partial offload of the optimizer is DeepSpeed's."""
    if cfg.actor.cpu_offload and cfg.rollout.engine == "hf":
        raise ConfigError(
            "actor.cpu_offload=true needs rollout.engine=fast or vllm: the hf engine generates with the "
            "training model itself, whose weights are then shards in host memory"
        )
    if float32_masters(cfg) and cfg.rollout.engine == "hf":
        raise ConfigError(
            f"model.dtype={cfg.model.dtype} steps float32 master weights (actor.master_weights=float32), "
            f"sharded in a process group of their own, which rollout.engine=hf cannot sample from (it "
            f"generates with the training model itself): use rollout.engine=fast or vllm, or "
            f"actor.master_weights=model"
        )
    a = cfg.actor
    if a.cpu_offload_ratio != 1 and (a.strategy != "deepspeed" or not a.cpu_offload):
        raise ConfigError(
            f"actor.cpu_offload_ratio={a.cpu_offload_ratio:g} needs actor.strategy=deepspeed and "
            f"actor.cpu_offload=true: only DeepSpeed offloads part of the optimizer (got "
            f"actor.strategy={a.strategy}, actor.cpu_offload={str(a.cpu_offload).lower()})"
        )


def check_deepspeed_engine(cfg: Config) -> None:
    """ZeRO-3 partitions even one rank's weights, so sampling needs an engine with weights of its own."""
    if cfg.actor.strategy == "deepspeed" and cfg.rollout.engine == "hf":
        raise ConfigError(
            "actor.strategy=deepspeed needs rollout.engine=fast or vllm: the hf engine generates with "
            "the training model itself, whose ZeRO-3 weights are partitioned"
        )


def check_layer_memory(cfg: Config) -> None:
    """Offloaded and recomputed layers are disjoint: together they are at most all the layers."""
    m = cfg.model
    if m.gradient_checkpointing and m.activation_offload + m.checkpoint_fraction > 1:
        raise ConfigError(
            f"model.activation_offload={m.activation_offload} and model.checkpoint_fraction="
            f"{m.checkpoint_fraction} add up to more than all the layers"
        )


# The rules, in the order they are checked: the first one a config breaks is the one said.
CHECKS = (
    check_sampler_ranks,
    check_batch_shares,
    check_parallel_support,
    check_sequence_parallel,
    check_groups,
    check_response_lengths,
    check_speculative,
    check_one_step_off,
    check_vllm_model,
    check_offload,
    check_deepspeed_engine,
    check_layer_memory,
)


@functools.cache
def needs(check) -> tuple[str, ...]:
    """What ``check`` takes of the run besides the config: its parameters after the first."""
    return tuple(inspect.signature(check).parameters)[1:]


def check_settings(cfg: Config, ranks: int = 1, checks=CHECKS) -> None:
    """Refuse, in one ConfigError, the first rule of ``checks`` (the whole list unless told) that ``cfg`` breaks
    on a job of ``ranks`` ranks. Each check is given what its parameters name (``needs``)."""
    run = {"ranks": ranks, "training_ranks": ranks - cfg.rollout.sampler_ranks}
    for check in checks:
        check(cfg, *(run[name] for name in needs(check)))


# ------------------------------------------------------------------------------ rules on what a run reads


def check_prompt_count(cfg: Config, prompts: int) -> None:
    """A step takes ``data.train_batch_size`` prompts: the training set left after filtering must hold one."""
    if cfg.data.train_batch_size > prompts:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {prompts} training "
            f"prompts left after filtering"
        )


def check_positions(cfg: Config, longest_prompt: int, positions: int) -> None:
    """vLLM's ``max_model_len`` stops at the model's position limit (``positions``), so with
    ``rollout.engine=vllm`` prompts and responses that reach past it are refused, not sampled short."""
    need = longest_prompt + cfg.data.max_response_length
    if cfg.rollout.engine == "vllm" and need > positions:
        raise ConfigError(
            f"prompts of up to {longest_prompt} tokens and responses of up to "
            f"{cfg.data.max_response_length} need {need} positions, past the model's {positions}, and "
            f"rollout.engine=vllm samples none past them: lower data.max_prompt_length or "
            f"data.max_response_length, or sample with rollout.engine=fast"
        )


def check_sequence_heads(cfg: Config, heads: int) -> None:
    """Each rank of a sequence-parallel group attends with an equal share of the model's ``heads`` query heads (its
    key/value heads are repeated where fewer), so the degree must divide them."""
    degree = cfg.actor.sequence_parallel_size
    if heads % degree:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"actor.sequence_parallel_size={degree} must divide the model's {heads} attention heads, which the "
            f"ranks of a sequence-parallel group share: use one of {fits}"
        )


def check_engine(cfg: Config, engine) -> None:
    """What the settings ask of the engine built (a ``rollout.base.RolloutEngine``), read from what it declares: the
    checks in the list name the engines of ``rollout.engine``, and an engine of one's own
    (``Trainer(cfg, build_engine=...)``) is held to the same."""
    r = cfg.rollout
    if r.response_lengths != "model" and not engine.ends_at_given_lengths:
        raise ConfigError(
            f"rollout.response_lengths={r.response_lengths} needs an engine that ends a sample at a "
            f"drawn length (ends_at_given_lengths), which the engine built does not"
        )
    if r.overlap and not engine.holds_own_weights:
        raise ConfigError(
            "rollout.overlap=true samples while the update changes the training model's weights: it "
            "needs an engine with weights of its own (holds_own_weights), which the engine built does "
            "not hold"
        )
