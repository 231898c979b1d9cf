"""The typed config tree: every key declared once, with its type, its allowed values, a line of help and what a
resumed run does with another value, and the check of one key's value against that declaration.

Key names follow the seed recipe (verl) where one exists, so a recipe's command line reads the same
here: ``data.train_files=... data.max_prompt_length=16384 rollout.n=8 algo.clip_ratio=0.2``.
A wrong key (with the closest one suggested), a wrong type or a bad value is refused with one message that
names the key, because a typo found after an hour of sampling is an hour lost. Loading files and overrides
(``longqa.config``) and reading verl's launch-line keys (``longqa.config.verl_keys``) both build on this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds a bad value."""


def opt(
    default: Any,
    help: str,
    check: typing.Callable[[Any], bool] | None = None,
    rule: str = "",
    *,
    path: bool = False,
    on_resume: Literal["apply", "refuse"],
) -> Any:
    """A config field: its default, one line of help, and an optional value check described by ``rule``.
    ``path``: the value is a file or folder path (or a list of them), whose ``~`` is expanded as it is read.
    ``on_resume``: what a resumed run given another value than its checkpoint's does (``train/resume.py``): apply
    it from the resumed step on (how long, how fast, what is logged: the numbers stay as they were), or refuse it
    (what the run computes). Every key says which, so that a new key is a decision, made where it is declared."""
    factory = (lambda: list(default)) if isinstance(default, list) else None
    meta = {"help": help, "check": check, "rule": rule, "path": path, "on_resume": on_resume}
    if factory:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


positive = (lambda v: v > 0, "> 0")
non_negative = (lambda v: v >= 0, ">= 0")
unit_open = (lambda v: 0 < v < 1, "in (0, 1)")
unit_closed = (lambda v: 0 <= v <= 1, "in [0, 1]")
# numpy's generators take no negative seed; the trainer derives each prompt's seed from it in 64-bit integers
seed_range = (lambda v: 0 <= v < 2**32, "in [0, 2**32)")
device_name = (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "auto, cpu, cuda or cuda:<index>")


@dataclass
class ModelConfig:
    path: Optional[str] = opt(
        None,
        "local Hugging Face model folder, hub id or GGUF file; none: the embedded default",
        path=True,
        on_resume="refuse",
    )
    tokenizer_path: Optional[str] = opt(
        None, "tokenizer folder when it differs from model.path", path=True, on_resume="refuse"
    )
    gguf_file: Optional[str] = opt(
        None, "GGUF file name inside model.path (transformers dequantizes it)", on_resume="refuse"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "parameter dtype for training and sampling", on_resume="refuse"
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = opt(
        "sdpa", "transformers attention backend", on_resume="apply"
    )
    gradient_checkpointing: bool = opt(
        False, "recompute activations in the backward pass to save memory", on_resume="apply"
    )
    checkpoint_fraction: float = opt(
        1.0,
        "with gradient_checkpointing: the fraction of decoder layers recomputed "
        "(the first ones); below 1 spends free memory to recompute less",
        lambda v: 0 < v <= 1,
        "in (0, 1]",
        on_resume="apply",
    )
    activation_offload: float = opt(
        0.0,
        "the fraction of decoder layers (the first ones, before any recomputed) "
        "whose activations wait in pinned host memory between forward and backward "
        "instead of on the GPU: memory freed like recomputing them, for copies that "
        "overlap compute instead of a second forward pass (CUDA only)",
        *unit_closed,
        on_resume="apply",
    )
    mlp_tile_tokens: int = opt(
        0,
        "compute each decoder layer's MLP over tiles of this many tokens in the update, so its intermediates "
        "(4 x intermediate_size per token) exist for one tile, not the whole row, for one more MLP forward "
        "pass in the backward (DeepSpeed's ALST calls it tiled_mlp; verl has no key for it); rows of at most "
        "one tile, and compiled decoder layers (actor.compile_layers on a GPU), run the MLP untiled; 0: off",
        *non_negative,
        on_resume="apply",
    )


@dataclass
class DataConfig:
    train_files: list[str] = opt(
        [], "parquet/jsonl files in verl's schema used for training", path=True, on_resume="refuse"
    )
    val_files: list[str] = opt([], "held-out files for validation", path=True, on_resume="refuse")
    max_prompt_length: int = opt(
        16384, "longest prompt in tokens, chat template included", *positive, on_resume="refuse"
    )
    max_response_length: int = opt(4096, "longest sampled response in tokens", *positive, on_resume="refuse")
    filter_overlong_prompts: bool = opt(True, "drop (and count) prompts over max_prompt_length", on_resume="refuse")
    truncation: Literal["error", "left", "right"] = opt(
        "left",
        "when not filtering: cut overlong prompts on the left or right, or stop with an error",
        on_resume="refuse",
    )
    skip_bad_rows: bool = opt(
        False, "skip and count rows that break the schema instead of stopping", on_resume="refuse"
    )
    train_batch_size: int = opt(256, "prompts per training step", *positive, on_resume="refuse")
    shuffle: bool = opt(True, "shuffle the training prompts every epoch", on_resume="refuse")
    cache_dir: str = opt(
        "~/.cache/longqa", "where tokenized prompts are cached between runs", path=True, on_resume="apply"
    )


@dataclass
class RolloutConfig:
    engine: Literal["fast", "hf", "vllm"] = opt(
        "fast",
        "sampling engine: fast (shared-prefix KV, CUDA graphs on a GPU), hf (the transformers reference) "
        "or vllm (an in-process vLLM engine per rank: pip install 'longqa[vllm]')",
        on_resume="refuse",
    )
    kv_cache_bytes: Optional[int] = opt(
        None,
        "fast and vllm engines: KV cache size in bytes (default: fast 40% of "
        "free GPU memory, 85% on sampler ranks of their own; vllm from "
        "gpu_memory_utilization; 2 GiB on a CPU)",
        *positive,
        on_resume="apply",
    )
    tensor_model_parallel_size: int = opt(
        1,
        "vllm engine: GPUs one vLLM engine spans (tensor parallel): under several ranks, each group of that many "
        "ranks shares one engine; one process on a CPU takes 1",
        *positive,
        on_resume="apply",
    )
    gpu_memory_utilization: float = opt(
        0.5,
        "vllm engine: fraction of the GPU's memory vLLM may take for its "
        "weights, activations and KV cache (when kv_cache_bytes is unset)",
        lambda v: 0 < v <= 1,
        "in (0, 1]",
        on_resume="apply",
    )
    free_cache_engine: bool = opt(
        True,
        "vllm engine: put vLLM to sleep during each update (frees its weights and "
        "KV cache for training) and wake it at the weight sync; skipped where the "
        "platform has no sleep mode (the CPU)",
        on_resume="apply",
    )
    enforce_eager: bool = opt(
        False,
        "vllm engine: run eagerly (no torch.compile, no CUDA graphs): faster startup, slower sampling",
        on_resume="apply",
    )
    cuda_graphs: bool = opt(True, "fast engine: replay the decode step as CUDA graphs on a GPU", on_resume="apply")
    speculative: Literal["off", "prompt_lookup"] = opt(
        "off",
        "fast engine: prompt_lookup drafts each sample's next tokens from its own text (the continuation "
        "of its latest tokens' earlier occurrence in the prompt or response) and verifies them in one decode "
        "step; the samples and log-probs are those without it, in fewer steps where drafts are right",
        on_resume="apply",
    )
    num_speculative_tokens: int = opt(
        4,
        "speculative: most drafted tokens per sample and decode step (k; each "
        "step then computes k + 1 tokens per sample)",
        *positive,
        on_resume="apply",
    )
    prompt_lookup_min: int = opt(
        2, "speculative=prompt_lookup: fewest latest tokens that must match to draft", *positive, on_resume="apply"
    )
    prompt_lookup_max: int = opt(
        8,
        "speculative=prompt_lookup: most latest tokens matched (the longest match up to this wins)",
        *positive,
        on_resume="apply",
    )
    mode: Literal["sync", "one_step_off"] = opt(
        "sync",
        "sync: each step samples with the weights it then updates; one_step_off: the next step's prompts "
        "are sampled before this step's update, with weights one update old (as verl's one-step-off-policy "
        "trainer), and the PPO ratio is taken against the sampling log-probs; sampling and training share the "
        "ranks, one after the other or, with rollout.overlap, at once, or run on ranks of their own at once "
        "(rollout.sampler_ranks)",
        on_resume="refuse",
    )
    max_staleness: int = opt(
        1,
        "one_step_off: most updates between the weights that sampled a step and the "
        "update that uses it; 0 samples each step just before its update (the sync run "
        "exactly); the pipeline holds one step, so above 1 is 1",
        *non_negative,
        on_resume="refuse",
    )
    overlap: bool = opt(
        False,
        "one_step_off with the fast engine: sample the next step's prompts while this step's "
        "update runs (on a GPU, on a CUDA stream of their own), from the engine's own copy of the "
        "weights, which costs one more copy of the model in memory; the samples are those sampled "
        "before the update, to the bit; false: sample them first, then update",
        on_resume="apply",
    )
    sampler_ranks: int = opt(
        0,
        "ranks set apart to sample only, the job's last ones (under torchrun; the fast "
        "engine, each holding the whole model): the others train, sharded among themselves, "
        "and send their prompts to them; new weights are broadcast to them after each update. "
        "With mode=one_step_off they sample the next step while the training ranks update; "
        "0: every rank samples and trains",
        *non_negative,
        on_resume="apply",
    )
    n: int = opt(8, "responses sampled per prompt (the GRPO group size)", *positive, on_resume="refuse")
    temperature: float = opt(
        1.0,
        "sampling temperature; 0 (greedy) is refused: every sample of a prompt would be "
        "the same response, with no advantage to learn from",
        *non_negative,
        on_resume="refuse",
    )
    top_p: float = opt(1.0, "nucleus sampling mass", lambda v: 0 < v <= 1, "in (0, 1]", on_resume="refuse")
    top_k: int = opt(
        -1,
        "sample from the k most likely tokens; -1 for all",
        lambda v: v == -1 or v > 0,
        "-1 or > 0",
        on_resume="refuse",
    )
    stop: list[str] = opt(
        [], "extra stop strings (EOS always stops)", lambda v: all(v), "a list of non-empty strings", on_resume="refuse"
    )
    # For benchmarking random-weight models, whose responses never stop on their own: without a drawn
    # length every response runs to data.max_response_length and a run measures only the worst case.
    response_lengths: Literal["model", "lognormal"] = opt(
        "model",
        "model: the model's own EOS ends each response; lognormal (fast engine only, for benchmarking "
        "random-weight models, which never sample EOS): each response also ends at a length drawn from a "
        "log-normal clipped to data.max_response_length (mean about 40% of it), seeded by (seed, step, prompt)",
        on_resume="refuse",
    )


@dataclass
class AlgoConfig:
    adv_estimator: Literal["grpo", "drgrpo", "rloo"] = opt(
        "grpo", "how advantages are formed within a prompt group", on_resume="refuse"
    )
    norm_adv_by_std: bool = opt(
        True, "GRPO: divide by the group's reward std (the recipe's setting)", on_resume="refuse"
    )
    clip_ratio: float = opt(0.2, "PPO clip range", *unit_open, on_resume="refuse")
    clip_ratio_high: Optional[float] = opt(
        None,
        "upper clip range (clip-higher): the ratio is clipped to at most 1 + clip_ratio_high; default clip_ratio",
        *positive,
        on_resume="refuse",
    )
    kl_coef: float = opt(
        0.0, "KL penalty to a frozen reference; 0 loads no reference model", *non_negative, on_resume="refuse"
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = opt(
        "token-mean", "how token losses are aggregated", on_resume="refuse"
    )
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient", *non_negative, on_resume="refuse")
    dual_clip_c: Optional[float] = opt(
        None,
        "dual-clip bound for negative advantages (e.g. 3.0); null: off",
        lambda v: v > 1,
        "> 1",
        on_resume="refuse",
    )
    kl_type: Literal["low_var_kl", "kl", "abs", "mse"] = opt(
        "low_var_kl", "KL estimator when kl_coef > 0", on_resume="refuse"
    )
    dynamic_sampling: bool = opt(
        False, "drop groups whose rewards are all equal and sample more to fill the batch", on_resume="refuse"
    )
    max_sampling_rounds: int = opt(3, "dynamic sampling: most extra rounds per step", *positive, on_resume="refuse")


@dataclass
class ActorConfig:
    lr: float = opt(1e-6, "AdamW learning rate", *positive, on_resume="apply")
    betas: list[float] = opt(
        [0.9, 0.95],
        "AdamW betas: the decay rates of the gradient's mean and square",
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "two numbers in [0, 1)",
        on_resume="apply",
    )
    weight_decay: float = opt(0.0, "AdamW weight decay", *non_negative, on_resume="apply")
    warmup_ratio: float = opt(
        0.05,
        "fraction of the schedule's updates (actor.schedule_updates) spent warming the learning rate up",
        *unit_closed,
        on_resume="apply",
    )
    schedule_updates: int = opt(
        0,
        "optimizer updates the warm-up ratio and the cosine are laid over; 0: all of the run's updates (SkyRL's "
        "Arctic backend lays them over 1000 unless told the run's length)",
        *non_negative,
        on_resume="apply",
    )
    lr_schedule: Literal["constant", "cosine"] = opt("constant", "learning rate after warmup", on_resume="apply")
    min_lr_ratio: float = opt(0.0, "cosine: final learning rate as a fraction of lr", *unit_closed, on_resume="apply")
    ppo_mini_batch_size: int = opt(
        64, "prompts per optimizer step, over all ranks (each rank takes its share)", *positive, on_resume="refuse"
    )
    ppo_epochs: int = opt(1, "passes over each step's samples", *positive, on_resume="refuse")
    max_tokens_per_micro_batch: int | Literal["auto"] = opt(
        "auto",
        "token budget of one forward/backward (packed tokens when shared_prompt); auto: on a GPU the "
        "largest the memory plan fits, up to a whole mini-batch share, on the CPU 16384",
        lambda v: v == "auto" or v > 0,
        "> 0 or auto",
        on_resume="apply",
    )
    strategy: Literal["fsdp2", "deepspeed"] = opt(
        "fsdp2",
        "how the model is sharded over the ranks: fsdp2 (PyTorch's FSDP2) or deepspeed (DeepSpeed ZeRO-3, "
        "any number of ranks; pip install 'longqa[deepspeed]')",
        on_resume="refuse",
    )
    cpu_offload: bool = opt(
        False,
        "fsdp2, with several ranks: keep the weight shards, their gradients and the AdamW "
        "step on the CPU; deepspeed: offload the optimizer and step it with DeepSpeed's CPU Adam "
        "(ZeRO-3 + CPU optimizer offload)",
        on_resume="apply",
    )
    cpu_offload_ratio: float = opt(
        1.0,
        "deepspeed with cpu_offload: the fraction of the optimizer (its float32 weights, gradients and AdamW "
        "moments, in whole sub-groups of zero_optimization.sub_group_size parameters) kept in host memory and stepped "
        "by CPU Adam; torch's AdamW steps the rest on the GPU (DeepSpeed's partial offload), for a model whose "
        "optimizer fits in neither memory alone",
        *unit_closed,
        on_resume="refuse",
    )
    master_weights: Literal["float32", "model"] = opt(
        "float32",
        "fsdp2 (several ranks, cpu_offload, or a 16-bit model.dtype in one process, sharded in a group of "
        "its own): the dtype of the weight shards the optimizer steps, computed in model.dtype's 16 bits either "
        "way. float32 (verl's default): an update of lr 1e-6 survives; model: model.dtype itself, half the "
        "training state's memory, but bfloat16 keeps 8 significant bits and rounds away any update under a 256th "
        "of its weight",
        on_resume="refuse",
    )
    deepspeed_config: Optional[str] = opt(
        None,
        "strategy=deepspeed: a DeepSpeed config file (JSON or YAML) merged "
        "over the one longqa generates (e.g. zero_optimization.offload_param)",
        path=True,
        on_resume="apply",
    )
    shared_prompt: bool = opt(
        True,
        "pack each prompt once with its n responses (false: the naive padded layout, one row per sample)",
        on_resume="apply",
    )
    attention_backend: Literal["auto", "dense", "flex", "split"] = opt(
        "auto",
        "shared-prompt attention: dense (SDPA per pack, the reference), flex (flex_attention block "
        "mask, any model), split (prompt and own halves as cuDNN attentions: plain causal models in bf16/fp16; "
        "each new shape costs a cuDNN plan), auto (flex on CUDA, dense otherwise)",
        on_resume="apply",
    )
    compile_layers: bool = opt(
        True,
        "on a GPU with the fast engine: torch.compile each decoder layer for "
        "training (norms, rotary and activations fuse; the engine never calls the layers)",
        on_resume="apply",
    )
    grad_clip: float = opt(1.0, "max gradient norm", *positive, on_resume="apply")
    max_bad_steps: int = opt(3, "stop after this many non-finite steps in a row", *positive, on_resume="apply")
    sequence_parallel_size: int = opt(
        1,
        "Ulysses sequence parallelism: each packed group's row is split over this many ranks, which trade sequence "
        "shards for head shards around attention (verl's ulysses_sequence_parallel_size)",
        *positive,
        on_resume="apply",
    )


@dataclass
class RewardConfig:
    mode: Literal["hardened", "pure_exact_match", "format_exact_match", "format_f1_score"] = opt(
        "hardened",
        "scoring mode of longqa.reward; the last three are the recipe's (gameable) modes. The recipe's "
        "environment variable REWARD_CALC_TYPE, when set, is the default, and a config naming another mode is "
        "refused (unless reward.path is set: its function scores, and reads the variable itself)",
        on_resume="refuse",
    )
    path: Optional[str] = opt(
        None,
        "Python file holding a custom reward function (training and validation score with it instead of reward.mode)",
        path=True,
        on_resume="refuse",
    )
    name: str = opt(
        "compute_score", "function name inside reward.path", str.isidentifier, "a Python identifier", on_resume="refuse"
    )


@dataclass
class TrainerConfig:
    total_epochs: int = opt(20, "passes over the training data", *positive, on_resume="apply")
    max_steps: Optional[int] = opt(
        None, "stop after this many steps (before total_epochs ends)", *positive, on_resume="apply"
    )
    test_freq: int = opt(10, "validate every this many steps (0: never)", *non_negative, on_resume="apply")
    val_before_train: bool = opt(
        True, "with test_freq > 0, also validate before the first step (the baseline)", on_resume="apply"
    )
    save_freq: int = opt(
        10,
        "checkpoint every this many steps (0, or verl's -1: never; a stop by SIGTERM/SIGINT still saves one)",
        lambda v: v >= 0,
        ">= 0 (0: never; verl's -1 is taken as 0)",
        on_resume="apply",
    )
    keep_last: int = opt(2, "checkpoints kept on disk", *positive, on_resume="apply")
    resume: str = opt(
        "auto", "auto (latest checkpoint in output_dir), none, or a checkpoint path", path=True, on_resume="apply"
    )
    resume_allow_changes: bool = opt(
        False,
        "resume even where settings that change what the run computes (model, "
        "data, batch, rollout.n, sampling, algo, reward, seed) differ from the "
        "checkpoint's; others (lr, schedule, steps, logging, memory) always apply",
        on_resume="apply",
    )
    output_dir: str = opt("runs/longqa", "run folder: checkpoints, metrics and report", path=True, on_resume="apply")
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = opt(
        ["console", "jsonl"],
        "metric sinks: console, jsonl, tensorboard (pip install tensorboard), wandb "
        "(pip install wandb); the report is drawn from jsonl's file",
        on_resume="apply",
    )
    project_name: str = opt(
        "longqa", "the W&B project the run logs to", lambda v: bool(v.strip()), "not empty", on_resume="apply"
    )
    experiment_name: Optional[str] = opt(
        None,
        "the run's name in W&B (default: the output folder's name)",
        lambda v: bool(v.strip()),
        "not empty",
        on_resume="apply",
    )
    device: str = opt("auto", "auto (cuda when present), cpu or cuda[:i]", *device_name, on_resume="apply")
    seed: int = opt(42, "seed for data order and sampling", *seed_range, on_resume="refuse")
    launcher: Literal["local", "ray"] = opt(
        "local",
        "local: this process, or one per rank under torchrun; ray: "
        "Ray Train workers on the cluster at RAY_ADDRESS (one per GPU slot)",
        on_resume="apply",
    )
    ray_workers: Optional[int] = opt(
        None, "launcher=ray: number of workers (default: the cluster's GPUs)", *positive, on_resume="apply"
    )
    max_failures: int = opt(
        0, "launcher=ray: restarts from the last checkpoint after a worker dies", *non_negative, on_resume="apply"
    )
    preemption_grace_s: float = opt(
        30.0,
        "seconds your cluster leaves between SIGTERM and SIGKILL: on SIGTERM or "
        "SIGINT the step in flight is finished if that fits in them, else dropped; the "
        "last finished step is saved and the run exits 75 (rerun to resume)",
        *non_negative,
        on_resume="apply",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@functools.cache
def declared_types(cls: type) -> dict[str, Any]:
    """A section's declared types (resolved once: every value checked looks them up)."""
    return typing.get_type_hints(cls)


def sections() -> dict[str, type]:
    """Each section's name and its dataclass (``rollout`` -> ``RolloutConfig``), in the order they are declared."""
    return declared_types(Config)


def all_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in sections().items() for f in dataclasses.fields(cls)]


def keys_on_resume(action: str) -> frozenset[str]:
    """The keys whose ``on_resume`` is ``action`` (apply or refuse)."""
    return frozenset(
        f"{section}.{f.name}"
        for section, cls in sections().items()
        for f in dataclasses.fields(cls)
        if f.metadata["on_resume"] == action
    )


APPLIED_ON_RESUME, REFUSED_ON_RESUME = keys_on_resume("apply"), keys_on_resume("refuse")


def unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; `longqa config keys` lists the {len(all_keys())} keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        return " or ".join([_describe(a) for a in args if a is not type(None)] + ["null"] * (type(None) in args))
    if origin is list:
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) is Literal:
            *first, last = (repr(c) for c in typing.get_args(item))
            return f"a list of {', '.join(first)} or {last}"
        return f"a list of {_describe(item).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[tp]


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the declared type, converting only where no information is lost."""
    bad = ConfigError(f"config key '{key}' must be {_describe(tp)}, got {value!r}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for alternative in (a for a in args if a is not type(None)):  # the first that takes the value
            try:
                return _coerce(key, alternative, value)
            except ConfigError:
                pass
        raise bad
    if origin is list:
        item = typing.get_args(tp)[0]
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single file is a list of one
        if not isinstance(value, (list, tuple)):
            raise bad
        try:
            return [_coerce(key, item, v) for v in value]
        except ConfigError:
            raise bad from None
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or int(value) != value
        ):  # int() of inf or nan raises rather than refuses
            raise bad
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        else:
            number = float(value)
        if not math.isfinite(number):  # nan passes every comparison a rule makes, and no setting means inf
            raise bad
        return number
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad
        return str(value)
    raise TypeError(f"unsupported config type {tp!r}")  # a programming error in this file


def is_key(key: str) -> bool:
    section, _, name = key.partition(".")
    cls = sections().get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


def checked(key: str, value: Any) -> Any:
    """``value`` as ``key`` declares it (type, then rule); a ConfigError naming the key when it cannot be."""
    if not is_key(key):
        raise unknown_key(key)
    section, _, name = key.partition(".")
    cls = sections()[section]
    value = _coerce(key, declared_types(cls)[name], value)
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    if meta.get("path") and value is not None:
        value = _expanded_path(key, value)
    if meta.get("check") is not None and value is not None and not meta["check"](value):
        raise ConfigError(f"config key '{key}' must be {meta['rule']}, got {value!r}")
    return value


def path_keys() -> list[str]:
    """The keys whose values are paths (``~`` expanded, empty refused)."""
    return [
        f"{section}.{f.name}"
        for section, cls in sections().items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("path")
    ]


def _expanded_path(key: str, value: str | list[str]) -> str | list[str]:
    """A path value with ``~`` expanded, as a shell would have (a key given as ``key=~/x`` or in a YAML file is
    not expanded by the shell); an empty one is refused, as it would name the working folder or ``.``."""
    paths = value if isinstance(value, list) else [value]
    if any(not p.strip() for p in paths):
        none = "; [] for none" if isinstance(value, list) else ""
        raise ConfigError(f"config key '{key}' is given an empty path: give a path{none}")
    expanded = [os.path.expanduser(p) for p in paths]
    return expanded if isinstance(value, list) else expanded[0]


def expand_paths(cfg: Config) -> None:
    """Expand ``~`` in every path key's value, defaults included (``data.cache_dir``'s is ``~/.cache/longqa``), so
    that a config reads the same whether a path came from a default, a file or the command line."""
    for key in path_keys():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            setattr(getattr(cfg, section), name, _expanded_path(key, value))


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set ``key`` of ``cfg`` to ``value`` once it is checked (``checked``)."""
    value = checked(key, value)  # first: an unknown section has no attribute to set
    section, _, name = key.partition(".")
    setattr(getattr(cfg, section), name, value)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A YAML tree as dotted keys, whatever the nesting (``rollout: {n: 4}``, ``rollout.n: 4`` and verl's
    ``actor_rollout_ref: {rollout: {n: 4}}`` alike). A section left empty or given a value is refused, since its
    keys, not a value, belong there."""
    if not isinstance(tree, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.')}' must be a mapping of keys, got {tree!r}")
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        elif key in sections():
            example = dataclasses.fields(sections()[key])[0].name
            raise ConfigError(
                f"config section '{key}' must be a mapping of its keys (such as {key}.{example}), got {v!r}"
            )
        else:
            flat[key] = v
    return flat


def split_override(text: str) -> tuple[str, str]:
    """``key=value`` as the key and the value's text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key=value, e.g. rollout.n=8")
    return key.strip(), raw


def parse_value(key: str, raw: str) -> Any:
    """An override's text read as YAML (numbers, booleans, lists), except for keys declared as strings."""
    section, _, name = key.partition(".")
    cls = sections().get(section)
    if cls is not None and declared_types(cls).get(name) in (str, Optional[str]) and raw not in ("null", "~"):
        return raw  # keep "001" or "1e5" a string where a string is declared
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value``; the value is read as YAML (numbers, booleans, lists), except for string keys."""
    key, raw = split_override(text)
    return key, parse_value(key, raw)
