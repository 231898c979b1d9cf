"""verl's launch-line keys on longqa's command line.

A verl launch (``python -m verl.trainer.main_ppo data.train_files=... actor_rollout_ref.actor.optim.lr=1e-6
trainer.n_gpus_per_node=8 ...``) can be handed to ``longqa train`` as it is, so users coming from verl keep
their launch scripts. Each verl key is one of:

- renamed: it is a longqa setting under another name (``actor_rollout_ref.rollout.n`` is ``rollout.n``);
  the few values verl spells differently are converted (``rollout.name=vllm`` is ``rollout.engine=vllm``);
- fixed: longqa has one behaviour there, and the key is accepted at that value only
  (``actor_rollout_ref.model.use_remove_padding=True``: longqa never pads);
- grouped: read together with the keys it only makes sense with, with verl's defaults for those not given
  (``use_kl_loss`` and ``kl_loss_coef`` make ``algo.kl_coef``; ``trainer.n_gpus_per_node`` times
  ``trainer.nnodes`` Ray workers, as verl runs through Ray; the Arctic remote backend's ``remote_backend.*``
  keys, the reference recipe's, make ZeRO-3 with the optimizer offloaded, the packed shared-prompt update,
  the shared-prefix fast engine and its GPU count);
- noted: a setting of verl's machinery with no longqa counterpart whose value changes no result (a timeout,
  a worker implementation, a scheduler's or kernel's tuning): taken at any value, and ``verl_notes`` gives
  one line for each saying why, which the command prints.

Nothing is dropped quietly: every override that longqa cannot take, verl's or its own, is named in one
ConfigError, so a launch script is fixed in one pass rather than one key per run; and a setting given twice
under different names (a verl key and its longqa key, or two verl keys) must have one value. A verl launch
line run on its own (no longqa config file) starts from verl's defaults where they change results and
longqa's differ (``VERL_DEFAULTS``: sampling in bf16 beside float32 masters, the dual-clip bound of 3, AdamW's
betas (0.9, 0.999) and weight decay 0.01, no warmup, 30 epochs, no validation or checkpoints unless asked), so
that it trains as verl would.
Key names are those of verl's ``trainer/config/ppo_trainer.yaml``; hydra's ``+``/``++`` prefixes are
accepted.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from longqa.config.schema import ConfigError, all_keys, checked, is_key, parse_value, split_override, unknown_key

ACTOR, ROLLOUT, MODEL = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
# Top-level sections only verl has: a key under one of them is verl's, whatever its name.
VERL_SECTIONS = (
    "actor_rollout_ref",
    "algorithm",
    "critic",
    "reward_model",
    "custom_reward_function",
    "ray_kwargs",
    "ray_init",
    "global_profiler",
    "transfer_queue",
    "sandbox_fusion",
    "remote_backend",
)
REMOTE = "remote_backend."  # the Arctic remote backend of the reference recipe (Snowflake's verl)
SHARED_SECTIONS = ("data", "trainer", "reward")  # verl's and longqa's alike


class Unsupported(Exception):
    """A verl value or combination with no longqa counterpart; the text says what longqa does instead."""


def _spelled(values: dict, instead: str) -> Callable[[Any], Any]:
    """A converter for a key whose values longqa spells differently (or lacks: ``instead`` says what it has)."""

    def convert(value: Any) -> Any:
        try:
            return values[value]
        except (KeyError, TypeError):
            raise Unsupported(instead) from None

    return convert


def _auto_budget(value: Any) -> str:
    """A verl token budget (a positive integer, or auto) as longqa's: auto, see ppo_max_token_len_per_gpu."""
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise Unsupported("a token budget is an integer > 0 (or auto)")
    return "auto"


@dataclass(frozen=True)
class Renamed:
    key: str
    convert: Callable[[Any], Any] | None = None  # None: the value is read as the longqa key reads it


@dataclass(frozen=True)
class Fixed:
    values: tuple
    behaviour: str  # what longqa does, said when another value is asked for


@dataclass(frozen=True)
class Group:
    keys: tuple[str, ...]
    resolve: Callable[[dict[str, Any]], list[tuple[str, Any]]]  # the given keys' values -> longqa settings
    becomes: str


RENAMED: dict[str, Renamed] = {
    MODEL + "path": Renamed("model.path"),
    MODEL + "tokenizer_path": Renamed("model.tokenizer_path"),
    MODEL + "enable_gradient_checkpointing": Renamed("model.gradient_checkpointing"),
    # FlashAttention 3 is a kernel of the same attention: longqa's own kernels compute the update and the
    # rollout (actor.attention_backend), and transformers' SDPA the rest (said, VALUE_NOTES).
    MODEL + "override_config.attn_implementation": Renamed(
        "model.attn_implementation",
        _spelled(
            {
                "sdpa": "sdpa",
                "eager": "eager",
                "flex_attention": "flex_attention",
                "flash_attention_2": "flash_attention_2",
                "flash_attention_3": "sdpa",
            },
            "longqa's attention implementations are sdpa, eager, flex_attention, "
            "flash_attention_2 (and flash_attention_3, run as sdpa)",
        ),
    ),
    # verl compiles its actor's log-prob computation; longqa compiles the decoder layers of the update
    ACTOR + "use_torch_compile": Renamed("actor.compile_layers"),
    ACTOR + "data_loader_seed": Renamed("trainer.seed"),  # the shuffle's seed, which data.seed also sets
    ACTOR + "optim.lr": Renamed("actor.lr"),
    ACTOR + "optim.betas": Renamed("actor.betas"),
    ACTOR + "optim.weight_decay": Renamed("actor.weight_decay"),
    ACTOR + "optim.lr_warmup_steps_ratio": Renamed("actor.warmup_ratio"),
    ACTOR + "optim.lr_scheduler_type": Renamed("actor.lr_schedule"),
    ACTOR + "optim.min_lr_ratio": Renamed("actor.min_lr_ratio"),
    ACTOR + "optim.clip_grad": Renamed("actor.grad_clip"),
    ACTOR + "grad_clip": Renamed("actor.grad_clip"),
    # verl's FSDP engine is FSDP1 or FSDP2; longqa's is FSDP2, beside DeepSpeed ZeRO-3 (the reference recipe's).
    ACTOR + "strategy": Renamed(
        "actor.strategy",
        _spelled(
            {"fsdp": "fsdp2", "fsdp2": "fsdp2", "deepspeed": "deepspeed"},
            "longqa shards the actor with FSDP2 (fsdp, fsdp2) or DeepSpeed ZeRO-3 (deepspeed)",
        ),
    ),
    # verl loads the actor in fp32 by default and computes in bf16; longqa loads model.dtype and keeps the shards
    # the optimizer steps in float32 unless told otherwise.
    ACTOR + "fsdp_config.model_dtype": Renamed(
        "actor.master_weights",
        _spelled(
            {"fp32": "float32", "float32": "float32", "bf16": "model", "bfloat16": "model"},
            "longqa's FSDP2 shards are float32 (fp32) or model.dtype (bf16)",
        ),
    ),
    ACTOR + "ppo_mini_batch_size": Renamed("actor.ppo_mini_batch_size"),
    ACTOR + "ppo_epochs": Renamed("actor.ppo_epochs"),
    ACTOR + "ulysses_sequence_parallel_size": Renamed("actor.sequence_parallel_size"),
    # Both are token budgets of one forward/backward, for speed and memory alone, counted differently: verl's
    # counts each response's prompt (Arctic's its tiles), longqa packs a prompt once for its group. So a verl
    # budget becomes longqa's auto (the largest its memory plan fits), said (VALUE_NOTES).
    ACTOR + "ppo_max_token_len_per_gpu": Renamed("actor.max_tokens_per_micro_batch", _auto_budget),
    ACTOR + "clip_ratio": Renamed("algo.clip_ratio"),
    ACTOR + "clip_ratio_low": Renamed("algo.clip_ratio"),
    ACTOR + "clip_ratio_high": Renamed("algo.clip_ratio_high"),
    ACTOR + "clip_ratio_c": Renamed("algo.dual_clip_c"),
    ACTOR + "loss_agg_mode": Renamed("algo.loss_agg_mode"),
    ACTOR + "entropy_coeff": Renamed("algo.entropy_coeff"),
    ACTOR + "kl_loss_type": Renamed(
        "algo.kl_type",
        _spelled(
            {
                "low_var_kl": "low_var_kl",
                "k3": "low_var_kl",
                "kl": "kl",
                "k1": "kl",
                "abs": "abs",
                "mse": "mse",
                "k2": "mse",
            },
            "longqa's KL estimators are low_var_kl (k3), kl (k1), abs and mse (k2)",
        ),
    ),
    # Arctic's inference engine shares each prompt's KV among its samples and speculates: longqa's fast engine
    ROLLOUT + "name": Renamed(
        "rollout.engine",
        _spelled(
            {"vllm": "vllm", "hf": "hf", "arctic": "fast"},
            "longqa samples with rollout.engine=fast (its own engine; verl's arctic), hf or vllm",
        ),
    ),
    ROLLOUT + "n": Renamed("rollout.n"),
    ROLLOUT + "temperature": Renamed("rollout.temperature"),
    ROLLOUT + "top_p": Renamed("rollout.top_p"),
    ROLLOUT + "top_k": Renamed("rollout.top_k", lambda k: -1 if k == 0 else k),  # vLLM reads 0 and -1 as off
    ROLLOUT + "tensor_model_parallel_size": Renamed("rollout.tensor_model_parallel_size"),
    ROLLOUT + "gpu_memory_utilization": Renamed("rollout.gpu_memory_utilization"),
    ROLLOUT + "free_cache_engine": Renamed("rollout.free_cache_engine"),
    ROLLOUT + "enforce_eager": Renamed("rollout.enforce_eager"),
    ROLLOUT + "prompt_length": Renamed("data.max_prompt_length"),
    ROLLOUT + "response_length": Renamed("data.max_response_length"),
    "algorithm.adv_estimator": Renamed(
        "algo.adv_estimator",
        _spelled(
            {"grpo": "grpo", "grpo_vectorized": "grpo", "rloo": "rloo", "rloo_vectorized": "rloo"},
            "longqa's estimators are grpo (algorithm.norm_adv_by_std_in_grpo=False: Dr. GRPO's advantages) and rloo",
        ),
    ),
    "algorithm.norm_adv_by_std_in_grpo": Renamed("algo.norm_adv_by_std"),
    "data.seed": Renamed("trainer.seed"),
    "custom_reward_function.path": Renamed("reward.path"),
    "custom_reward_function.name": Renamed("reward.name"),
    "reward.custom_reward_function.path": Renamed("reward.path"),
    "reward.custom_reward_function.name": Renamed("reward.name"),
    "trainer.total_training_steps": Renamed("trainer.max_steps"),
    "trainer.default_local_dir": Renamed("trainer.output_dir"),
    "trainer.max_actor_ckpt_to_keep": Renamed("trainer.keep_last"),
}

_GREEDY_VALIDATION = "longqa validates with one greedy answer per question"
_NO_REWARD_MODEL = "longqa scores with a rule-based reward function (reward.mode, reward.path), not a reward model"
_ONE_RESPONSE_AT_A_TIME = "longqa scores each response on its own, as verl's naive reward manager does"
FIXED: dict[str, Fixed] = {
    ACTOR + "fsdp_config.strategy": Fixed(("fsdp", "fsdp2"), "longqa's FSDP is FSDP2 (actor.strategy=fsdp2)"),
    ACTOR + "use_dynamic_bsz": Fixed(
        (True,),
        "longqa fills each micro-batch up to a token budget (actor_rollout_ref."
        "actor.ppo_max_token_len_per_gpu, actor.max_tokens_per_micro_batch)",
    ),
    ACTOR + "optim.lr_warmup_steps": Fixed(
        (-1, None),
        "longqa warms up over a fraction of the steps "
        "(actor_rollout_ref.actor.optim.lr_warmup_steps_ratio, actor.warmup_ratio)",
    ),
    MODEL + "use_remove_padding": Fixed((True,), "longqa packs sequences without padding"),
    ROLLOUT + "do_sample": Fixed(
        (True,),
        "longqa always samples: greedy decoding makes a prompt's samples one "
        "response, which GRPO has nothing to compare in (rollout.temperature=0 is refused)",
    ),
    ROLLOUT + "val_kwargs.temperature": Fixed((0,), _GREEDY_VALIDATION),
    ROLLOUT + "val_kwargs.do_sample": Fixed((False,), _GREEDY_VALIDATION),
    ROLLOUT + "val_kwargs.n": Fixed((1,), _GREEDY_VALIDATION),
    ROLLOUT + "val_kwargs.top_p": Fixed((1,), _GREEDY_VALIDATION),
    ROLLOUT + "val_kwargs.top_k": Fixed((-1, 0), _GREEDY_VALIDATION),
    "actor_rollout_ref.hybrid_engine": Fixed((True,), "longqa's actor and rollout engine share the GPUs"),
    "data.prompt_key": Fixed(("prompt",), "longqa reads the prompt from the 'prompt' column of verl's schema"),
    "data.reward_fn_key": Fixed(("data_source",), "longqa hands the reward the 'data_source' column"),
    "reward_model.enable": Fixed((False,), _NO_REWARD_MODEL),
    "reward.reward_model.enable": Fixed((False,), _NO_REWARD_MODEL),
    "reward_model.reward_manager": Fixed(("naive",), _ONE_RESPONSE_AT_A_TIME),
    "reward.reward_manager.name": Fixed(("naive",), _ONE_RESPONSE_AT_A_TIME),
    "trainer.critic_warmup": Fixed((0,), "longqa trains no critic"),
    ROLLOUT + "calculate_log_probs": Fixed(
        (False,), "longqa recomputes the samples' log-probs with the training model before the update"
    ),
}

_TOKEN_BUDGET = (
    "with use_dynamic_bsz=True verl reads the token budget (ppo_max_token_len_per_gpu) instead, as "
    "longqa always does (actor.max_tokens_per_micro_batch)"
)
_WEIGHT_REFRESH = "how weights reach the sampler; longqa refreshes its engine's copy in place after each update"
NOTED: dict[str, str] = {
    "data.filter_overlong_prompts_workers": "longqa tokenizes each file once and caches the prompts "
    "(data.cache_dir): workers change no prompt",
    ACTOR + "ppo_micro_batch_size_per_gpu": _TOKEN_BUDGET,
    ACTOR + "ppo_micro_batch_size": _TOKEN_BUDGET,
    ROLLOUT + "log_prob_micro_batch_size_per_gpu": _TOKEN_BUDGET,
    ROLLOUT + "log_prob_micro_batch_size": _TOKEN_BUDGET,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _TOKEN_BUDGET,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": _TOKEN_BUDGET,
    "actor_rollout_ref.ref.fsdp_config.param_offload": "placement of the reference model, which exists only with "
    "a KL penalty (algo.kl_coef > 0); results are the same",
    MODEL + "use_liger": "Liger's fused kernels: longqa's LM head computes log-probs and entropy in chunks "
    "without keeping the logits, the same values",
    ACTOR + "fsdp_config.forward_prefetch": "FSDP's prefetch order: speed only",
    ROLLOUT + "checkpoint_engine.update_weights_bucket_megabytes": _WEIGHT_REFRESH,
    ROLLOUT + "agent.num_workers": "verl's agent loop workers; longqa samples single-turn answers",
    ROLLOUT + "max_num_seqs": "vLLM's scheduler limit: speed and memory only (the fast engine fits its batch to "
    "rollout.kv_cache_bytes)",
    ROLLOUT + "max_num_batched_tokens": "vLLM's scheduler limit: speed and memory only (the fast engine fits its "
    "batch to rollout.kv_cache_bytes)",
    "actor_rollout_ref.nccl_timeout": "a collective's timeout; longqa's are torch.distributed's defaults",
    "trainer.use_legacy_worker_impl": "which of verl's worker classes runs; longqa has one",
    "trainer.balance_batch": "verl reorders a step's samples over the ranks by length for speed; longqa's ranks "
    "each own whole prompt groups, and the gradient is the same",
    REMOTE + "sampling_tp_size": "the fast engine holds the whole model on each GPU (no tensor parallelism): "
    "speed and memory only, the samples are the same",
    REMOTE + "weight_sync.cuda_ipc": _WEIGHT_REFRESH,
    REMOTE + "weight_sync.low_memory": _WEIGHT_REFRESH,
    REMOTE + "train.logits.optimization": "longqa's LM head never keeps a whole batch's logits (chunked)",
    REMOTE + "train.zorro_train.max_rollouts": "longqa packs each prompt once with all its rollout.n responses",
}
# verl's own actor and rollout settings, which the Arctic remote backend replaces with its own (its keys say
# what runs): with a remote_backend key in the line they are taken and said, not applied.
SUPERSEDED_BY_REMOTE = (
    ACTOR + "strategy",
    ACTOR + "fsdp_config.param_offload",
    ACTOR + "fsdp_config.optimizer_offload",
    ROLLOUT + "tensor_model_parallel_size",
)
_SUPERSEDED = (
    "verl's own actor or rollout setting, replaced by the Arctic remote backend's (remote_backend.*), "
    "which says what runs"
)


# Renamed keys only rollout.engine=vllm reads: said when the line samples with another engine.
VLLM_ONLY = (ROLLOUT + "gpu_memory_utilization", ROLLOUT + "free_cache_engine", ROLLOUT + "enforce_eager")
_VLLM_ONLY = "vLLM's setting (rollout.engine=vllm); this line samples with another engine, which does not read it"


@dataclass(frozen=True)
class _Given:
    """One setting as the user gave it: a ``key=value`` override (its text kept, so that each key reads it as its
    type says) or a key of a YAML config file (its value already read by YAML)."""

    key: str  # hydra's "+"/"++" markers removed
    raw: str | None  # the override's value text; None for a config file's value
    parsed: Any
    given_as: str  # as typed, for messages

    def value(self, as_key: str | None = None) -> Any:
        """The value as ``as_key`` (default: its own key) reads it: a string key keeps an override's text."""
        return self.parsed if self.raw is None else parse_value(as_key or self.key, self.raw)


def _from_overrides(overrides: Sequence[str]) -> list[_Given]:
    given = []
    for text in overrides:
        key, raw = split_override(text)
        given.append(_Given(key.lstrip("+"), raw, None, f"{key}={raw}"))
    return given


def _from_file(flat: dict[str, Any]) -> list[_Given]:
    """A config file's keys (nested sections flattened to dotted keys), read as the same keys on the command line."""
    return [_Given(key.lstrip("+"), None, value, f"{key}: {value!r}") for key, value in flat.items()]


def _samples_with_vllm(given: Sequence[_Given]) -> bool:
    engines = {g.key: g.value() for g in given}
    return "vllm" in (engines.get(ROLLOUT + "name"), engines.get("rollout.engine"))


def _remote(given: Sequence[_Given]) -> bool:
    return any(
        g.key == "remote_backend" or g.key.startswith(REMOTE) or g.key == "trainer.remote_backend" for g in given
    )


def uses_remote_backend(overrides: Sequence[str]) -> bool:
    return _remote(_from_overrides(overrides))


# Values of renamed keys that run as another value, said the way NOTED keys are.
# ``ANY_VALUE``: said whatever the value.
ANY_VALUE = ...
VALUE_NOTES: dict[tuple[str, Any], str] = {
    (
        MODEL + "override_config.attn_implementation",
        "flash_attention_3",
    ): "runs as sdpa: the update and the rollout use longqa's own attention kernels (actor.attention_backend)",
    (
        ACTOR + "ppo_max_token_len_per_gpu",
        ANY_VALUE,
    ): "verl's budget counts each response's prompt; longqa packs a prompt once with its responses and takes the "
    "largest budget its memory plan fits (actor.max_tokens_per_micro_batch=auto; to choose one, give that key "
    "a number instead of this one): micro-batching changes no result",
}

# verl's defaults (trainer/config/ppo_trainer.yaml) where longqa's differ and results would: the base of a verl
# launch line run without a longqa config file.
VERL_DEFAULTS: dict[str, Any] = {
    # verl samples in the model's bf16 (vLLM) and trains bf16 compute on float32 masters (fsdp_config.model_dtype,
    # actor.master_weights): longqa's bf16 model with float32 masters
    "model.dtype": "bfloat16",
    "algo.dual_clip_c": 3.0,  # actor.clip_ratio_c
    "actor.weight_decay": 0.01,  # actor.optim.weight_decay
    "actor.betas": [0.9, 0.999],  # actor.optim.betas
    "actor.warmup_ratio": 0.0,  # actor.optim.lr_warmup_steps_ratio
    "trainer.total_epochs": 30,
    "trainer.test_freq": 0,  # -1: never
    "trainer.save_freq": 0,  # -1: never
}

# longqa keys verl shares, where verl has a value longqa spells differently: -1 is verl's "never".
SHARED_VALUES: dict[str, dict[Any, Any]] = {"trainer.save_freq": {-1: 0}, "trainer.test_freq": {-1: 0}}


def _flag(given: dict[str, Any], key: str, default: bool) -> bool:
    value = given.get(key, default)
    if not isinstance(value, bool):
        raise Unsupported(f"{key} must be true or false")
    return value


def _kl_loss(given: dict[str, Any]) -> list[tuple[str, Any]]:
    """verl adds ``kl_loss_coef`` times the KL to the loss only with ``use_kl_loss``; longqa whenever its
    ``algo.kl_coef`` is above 0 (and only then loads the reference model)."""
    use = _flag(given, ACTOR + "use_kl_loss", False)
    return [("algo.kl_coef", given.get(ACTOR + "kl_loss_coef", 0.001) if use else 0.0)]


def _kl_in_reward(given: dict[str, Any]) -> list[tuple[str, Any]]:
    """The controller and estimator keys shape only the in-reward penalty, which verl (and longqa) skip
    unless it is on: with it off they are read by no one, in verl as here."""
    if _flag(given, "algorithm.use_kl_in_reward", False):
        raise Unsupported(
            "longqa has no KL penalty in the reward; its KL term is in the loss "
            "(actor_rollout_ref.actor.use_kl_loss, algo.kl_coef)"
        )
    return []


def _offload(given: dict[str, Any]) -> list[tuple[str, Any]]:
    params = _flag(given, ACTOR + "fsdp_config.param_offload", False)
    optimizer = _flag(given, ACTOR + "fsdp_config.optimizer_offload", False)
    if params != optimizer:
        raise Unsupported(
            "longqa offloads the weight shards, their gradients and the optimizer step together "
            "(actor.cpu_offload): set both to the same value"
        )
    return [("actor.cpu_offload", params)]


def _count(given: dict[str, Any], key: str, default: int) -> int:
    value = given.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise Unsupported(f"{key} must be an integer >= 0")
    return value


def _workers(given: dict[str, Any]) -> list[tuple[str, Any]]:
    """verl starts its workers through Ray, n_gpus_per_node on each of nnodes nodes: longqa's Ray launcher.
    Under the Arctic remote backend those are verl's driver and the GPUs that train and sample are the
    backend's: colocated, as longqa's are, with the old log-probs recomputed by the training engine."""
    if any(key.startswith(REMOTE) for key in given):
        if not _flag(given, REMOTE + "colocate", True):
            raise Unsupported("longqa trains and samples on the same GPUs (remote_backend.colocate=True)")
        if _count(given, REMOTE + "log_prob_gpus", 0):
            raise Unsupported(
                "longqa recomputes the old log-probs with the training engine (remote_backend.log_prob_gpus=0)"
            )
        training = _count(given, REMOTE + "training_gpus", 0)
        sampling = _count(given, REMOTE + "sampling_gpus", training)
        if not training or sampling != training:
            raise Unsupported(
                "longqa trains and samples on the same GPUs: remote_backend.training_gpus and "
                "sampling_gpus must be the same count > 0"
            )
        return [("trainer.launcher", "ray"), ("trainer.ray_workers", training)]
    per_node, nodes = given.get("trainer.n_gpus_per_node", 8), given.get("trainer.nnodes", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (per_node, nodes)):
        raise Unsupported("trainer.n_gpus_per_node and trainer.nnodes must be integers > 0")
    return [("trainer.launcher", "ray"), ("trainer.ray_workers", per_node * nodes)]


_ZERO = REMOTE + "train.deepspeed.zero_optimization."


def _arctic(given: dict[str, Any]) -> list[tuple[str, Any]]:
    """The Arctic remote backend: DeepSpeed ZeRO-3 (the optimizer on the CPU, or not), Zorro's prompt
    de-duplication in training (longqa's packed shared-prompt update) and in inference (the fast engine's
    shared prompt KV), and speculative decoding (longqa's prompt lookup: the same samples, faster)."""
    for key in ("trainer.remote_backend", "remote_backend"):
        if given.get(key, "arctic") != "arctic":
            raise Unsupported(f"{key}: longqa takes the arctic remote backend's keys (its own engines run them)")
    if given.get(_ZERO + "stage", 3) != 3:
        raise Unsupported("longqa's DeepSpeed is ZeRO-3 (stage 3)")
    devices = {"cpu": True, "none": False, None: False}
    optimizer, params = given.get(_ZERO + "offload_optimizer.device"), given.get(_ZERO + "offload_param.device")
    if optimizer not in devices or params not in devices:
        raise Unsupported("offload devices are cpu or none")
    if devices[params]:
        raise Unsupported(
            "parameter offload: give actor.deepspeed_config a file with zero_optimization.offload_param.device: cpu"
        )
    settings = [
        ("actor.strategy", "deepspeed"),
        ("actor.cpu_offload", devices[optimizer]),
        ("actor.shared_prompt", _flag(given, REMOTE + "train.zorro_train.enable", True)),
    ]
    if _flag(given, REMOTE + "rollout.zorro_inference.enable", False):
        settings.append(("rollout.engine", "fast"))
    if given.get(REMOTE + "rollout.speculative_decoding.model"):
        settings.append(("rollout.speculative", "prompt_lookup"))
    return settings


def _resume(given: dict[str, Any]) -> list[tuple[str, Any]]:
    mode = given.get("trainer.resume_mode", "auto")
    if mode == "resume_path":
        if not given.get("trainer.resume_from_path"):
            raise Unsupported("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        return [("trainer.resume", str(given["trainer.resume_from_path"]))]
    modes = {"auto": "auto", "disable": "none"}
    if mode not in modes:
        raise Unsupported("verl's resume modes are auto, disable and resume_path")
    return [("trainer.resume", modes[mode])]  # without resume_path verl ignores resume_from_path too


GROUPS: tuple[Group, ...] = (
    Group(
        (ACTOR + "use_kl_loss", ACTOR + "kl_loss_coef"),
        _kl_loss,
        "algo.kl_coef: kl_loss_coef (verl's default 0.001) with use_kl_loss=True, else 0",
    ),
    Group(
        (
            "algorithm.use_kl_in_reward",
            "algorithm.kl_penalty",
            "algorithm.kl_ctrl.type",
            "algorithm.kl_ctrl.kl_coef",
            "algorithm.kl_ctrl.horizon",
            "algorithm.kl_ctrl.target_kl",
        ),
        _kl_in_reward,
        "use_kl_in_reward=False only; the kl_ctrl and kl_penalty keys are then read by neither",
    ),
    Group(
        (ACTOR + "fsdp_config.param_offload", ACTOR + "fsdp_config.optimizer_offload"),
        _offload,
        "actor.cpu_offload: both true or both false",
    ),
    Group(
        (
            "trainer.n_gpus_per_node",
            "trainer.nnodes",
            REMOTE + "training_gpus",
            REMOTE + "sampling_gpus",
            REMOTE + "colocate",
            REMOTE + "log_prob_gpus",
        ),
        _workers,
        "trainer.launcher=ray with n_gpus_per_node x nnodes trainer.ray_workers; under the Arctic remote backend "
        "remote_backend.training_gpus of them (colocated with sampling, log_prob_gpus 0)",
    ),
    Group(
        (
            "trainer.remote_backend",
            "remote_backend",
            _ZERO + "stage",
            _ZERO + "offload_optimizer.device",
            _ZERO + "offload_param.device",
            REMOTE + "train.zorro_train.enable",
            REMOTE + "rollout.zorro_inference.enable",
            REMOTE + "rollout.speculative_decoding.model",
        ),
        _arctic,
        "actor.strategy=deepspeed (stage 3), actor.cpu_offload (offload_optimizer cpu), actor.shared_prompt "
        "(zorro_train), rollout.engine=fast (zorro_inference), rollout.speculative=prompt_lookup (a "
        "speculative model)",
    ),
    Group(
        ("trainer.resume_mode", "trainer.resume_from_path"),
        _resume,
        "trainer.resume: auto, none (disable) or the resume_from_path of resume_path",
    ),
)
_GROUP_OF = {key: group for group in GROUPS for key in group.keys}
VALUE_NOTES_KEYS = {key for key, _ in VALUE_NOTES}


def _value_note(given: _Given) -> str | None:
    """What VALUE_NOTES says of the given setting, if anything."""
    if given.key not in VALUE_NOTES_KEYS:
        return None
    return VALUE_NOTES.get((given.key, ANY_VALUE)) or VALUE_NOTES.get((given.key, given.value()))


_TAKEN = {*RENAMED, *FIXED, *_GROUP_OF, *NOTED}


def verl_key_table() -> list[tuple[str, str]]:
    """(verl key, what longqa makes of it) for every verl key longqa takes, for ``longqa config keys --verl``."""
    rows = [(key, rename.key + (" (values converted)" if rename.convert else "")) for key, rename in RENAMED.items()]
    rows += [(key, f"only {' or '.join(map(repr, fixed.values))}: {fixed.behaviour}") for key, fixed in FIXED.items()]
    rows += [(key, group.becomes) for group in GROUPS for key in group.keys]
    rows += [(key, f"{key} (verl's -1 is 0, never)") for key in SHARED_VALUES]
    rows += [(key, f"any value, changes nothing: {why}") for key, why in NOTED.items()]
    return rows


def _said(given: Sequence[_Given]) -> list[tuple[_Given, str | None]]:
    """``(setting, why)`` for each setting given: ``why`` is what the command says of it (a key the remote backend
    supersedes, a vLLM setting another engine does not read, a NOTED key, a VALUE_NOTES value), else None."""
    remote, vllm, said = _remote(given), _samples_with_vllm(given), []
    for g in given:
        if remote and g.key in SUPERSEDED_BY_REMOTE:
            why = _SUPERSEDED
        elif g.key in VLLM_ONLY and not vllm:
            why = _VLLM_ONLY
        else:
            why = NOTED.get(g.key) or _value_note(g)
        said.append((g, why))
    return said


def launch_line_table(overrides: Sequence[str]) -> str:
    """A markdown table of a launch line: each argument and what longqa does with it (docs/verl-launch-line.md
    holds the reference recipe's)."""
    described = dict(verl_key_table())
    rows = ["| argument | in longqa |", "| --- | --- |"]
    for g, why in _said(_from_overrides(overrides)):
        text, key = g.given_as, g.key
        if why == _SUPERSEDED:
            does = f"taken, changes nothing: {why}"
        elif key in described:  # (a NOTED key's row says why already)
            does = described[key] if why is None or key in NOTED else f"{described[key]}; {why}"
        else:
            does = "the same longqa setting" if is_key(key) else "not taken: " + _not_taken(key)
        rows.append(f"| `{text}` | {does.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def verl_notes(overrides: Sequence[str]) -> list[str]:
    """One line for each verl override taken without a longqa counterpart, or run otherwise than it says
    (``_said``): what it is in verl and why, for the command to say."""
    return [f"{g.key}={g.raw}: {why}" for g, why in _said(_from_overrides(overrides)) if why]


def file_notes(flat: dict[str, Any]) -> list[str]:
    """``verl_notes`` for a config file's keys (flattened to dotted keys)."""
    return [f"{g.key}: {g.parsed!r}: {why}" for g, why in _said(_from_file(flat)) if why]


def verl_start_note() -> str:
    """What a verl line without a config file starts from, in one line: not the embedded demo, so no data files
    unless the line names them (verl's own default has none either)."""
    return (
        "verl keys and no config file: starting from longqa's defaults with verl's where results differ, not "
        "the embedded demo, so data.train_files is empty unless given (give a config file, or data.train_files)"
    )


def is_verl_line(overrides: Sequence[str]) -> bool:
    """Whether any override is in verl's vocabulary (not in longqa's): such a line describes a whole run."""

    def verl(text: str) -> bool:
        key = split_override(text)[0].lstrip("+")
        return not is_key(key) and (key in _TAKEN or key.split(".")[0] in VERL_SECTIONS)

    return any(verl(text) for text in overrides)


def _not_taken(key: str) -> str:
    """Why ``key`` is refused. Outside verl's sections and the three both share, it is longqa's unknown-key
    message; else a hint only for a near spelling of a sibling key, as verl's names are long and alike."""
    section = key.split(".")[0]
    if section not in VERL_SECTIONS and section not in SHARED_SECTIONS:
        return str(unknown_key(key))
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in (*all_keys(), *_TAKEN) if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.88)
    hint = f"; did you mean '{parent}.{close[0]}'?" if close else ""
    return f"'{key}': neither a longqa setting nor a verl setting longqa has{hint}"


@dataclass
class _Setting:
    key: str  # longqa's
    value: Any
    given_as: str  # the override(s) as typed, for messages
    from_verl: bool


def _conflicts(settings: list[_Setting]) -> list[str]:
    """One problem per longqa key given different values under different names (a verl key among them)."""
    by_key: dict[str, list[_Setting]] = {}
    for setting in settings:
        by_key.setdefault(setting.key, []).append(setting)
    problems = []
    for key, same in by_key.items():
        if any(s.from_verl for s in same) and any(s.value != same[0].value for s in same):
            problems.append(f"{key} is given different values: {', '.join(s.given_as for s in same)}")
    return problems


def _translate(given_settings: Sequence[_Given]) -> tuple[list[_Setting], list[str]]:
    """Every setting given as longqa settings (values not yet checked), and those longqa cannot take."""
    settings, problems, grouped = [], [], {}
    remote = _remote(given_settings)
    for g in given_settings:
        key, given_as = g.key, g.given_as
        if is_key(key):
            value = g.value()
            if key in SHARED_VALUES:
                value = SHARED_VALUES[key].get(value, value)
            settings.append(_Setting(key, value, given_as, False))
            continue
        value = g.value()  # YAML, as hydra reads it
        if key in NOTED or (remote and key in SUPERSEDED_BY_REMOTE):  # (verl_notes says why)
            continue
        if key in RENAMED:
            rename = RENAMED[key]
            try:
                value = rename.convert(value) if rename.convert else g.value(rename.key)
            except Unsupported as e:
                problems.append(f"{given_as}: {e}")
                continue
            settings.append(_Setting(rename.key, value, given_as, True))
        elif key in FIXED:
            if value not in FIXED[key].values:
                problems.append(f"{given_as}: {FIXED[key].behaviour}")
        elif key in _GROUP_OF:
            given = grouped.setdefault(_GROUP_OF[key], {})
            if key in given and given[key][1] != value:
                problems.append(f"{key} is given different values: {given[key][0]}, {given_as}")
            given[key] = (given_as, value)
        else:
            problems.append(_not_taken(key))
    for group, given in grouped.items():
        given_as = " ".join(text for text, _ in given.values())
        try:
            settings += [
                _Setting(key, value, given_as, True)
                for key, value in group.resolve({k: v for k, (_, v) in given.items()})
            ]
        except Unsupported as e:
            problems.append(f"{given_as}: {e}")
    return settings, problems


def resolve_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """``key=value`` overrides, longqa's or verl's, as (longqa key, checked value) in the order given.

    Raises one ConfigError naming every override that cannot be used: unknown keys, verl keys or values
    longqa has no counterpart for, bad values, and one setting given different values under two names.
    """
    return _resolve(_from_overrides(overrides), "overrides")


def resolve_file_keys(flat: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """A config file's keys (nested sections flattened to dotted keys), longqa's or verl's, as (longqa key,
    checked value): a file takes exactly the keys the command line takes, with the same messages."""
    return _resolve(_from_file(flat), f"keys of config file {path}")


def _resolve(given: Sequence[_Given], what: str) -> list[tuple[str, Any]]:
    """``resolve_overrides`` for settings given either way; ``what`` names them in a message of several."""
    settings, problems = _translate(given)
    for setting in settings:
        try:
            setting.value = checked(setting.key, setting.value)
        except ConfigError as e:
            problems.append(f"{e} (given as {setting.given_as})" if setting.from_verl else str(e))
    problems += _conflicts(settings)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            f"{len(problems)} {what} cannot be used (verl keys are taken where longqa has the "
            f"setting: `longqa config keys --verl`):\n  - " + "\n  - ".join(problems)
        )
    return [(setting.key, setting.value) for setting in settings]
