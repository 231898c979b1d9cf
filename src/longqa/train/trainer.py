"""The GRPO loop: sample, score, compute advantages, update; validate, checkpoint, log, report.

The loop talks to interfaces only (a rollout engine, a reward function, the actor), so faster engines
and packed training slot in without touching it. Every source of randomness is either restored from
the checkpoint or derived from (seed, step), so a run killed and resumed logs the same numbers as an
uninterrupted one. SIGTERM or SIGINT stops the loop at a safe point with a checkpoint of the last
finished step (``preemption``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import resource
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from longqa import reward
from longqa.config import Config, ConfigError, to_dict
from longqa.config.checks import (
    check_engine,
    check_positions,
    check_prompt_count,
    check_sequence_heads,
    check_settings,
    float32_masters,
    logprobs_mode_for,
)
from longqa.config.support import check_imports, check_machine, run_ranks
from longqa.data.prompts import (
    GROUPS,
    PromptOptions,
    PromptSet,
    describe_losses,
    prepare_prompts,
    readable_files,
    tally,
)
from longqa.distributed.deepspeed import check_deepspeed
from longqa.distributed.env import DistEnv, Split, all_reduce, gather_objects, leave_group
from longqa.distributed.ulysses import gather_in_group
from longqa.evaluation.evaluate import evaluate, stop_token_ids
from longqa.model.compile_cache import load_run_cache, save_run_cache, use_user_cache
from longqa.model.compile_watch import CompileWatch
from longqa.model.load import (
    compile_decoder_layers,
    compiled_graphs,
    config_tokenizer,
    load_model,
    load_model_config,
    pick_device,
    position_limit_warning,
)
from longqa.outputs.layout import METRICS_FILE, checkpoints_dir
from longqa.outputs.lock import hold_run_folder
from longqa.outputs.paths import check_config_outputs
from longqa.planning.flops import counts_flops, group_flops
from longqa.planning.planner import check_fit, check_run, describe_training
from longqa.rollout.base import RolloutEngine, SamplingParams, bump_weights_version, weights_version
from longqa.rollout.build import EngineBuilder, build_engine
from longqa.rollout.lengths import draw_response_lengths
from longqa.rollout.remote import serve, stop_sampler
from longqa.train import algo
from longqa.train.actor import Actor, Samples, TrainingError
from longqa.train.checkpoint import (
    later_checkpoints,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from longqa.train.checkpoint_space import check_checkpoint_space, count_parameters
from longqa.train.preemption import StopRequest, preempted_message
from longqa.train.report import LENGTH_ACCURACY, MetricsLogger, read_metrics, write_report
from longqa.train.resume import CHANGES_KEY, DATA_KEY, change_history, check_resume, data_fingerprint, describe_changes
from longqa.train.sampled import SampledAhead, SampledGroup

AHEAD_KEY = "sampled_ahead"  # in trainer_state.json: rollout.mode=one_step_off's groups for the next step


class RewardFunctionError(ConfigError):
    """``reward.path`` / ``reward.name`` name no function that can be loaded (a missing file, a file that fails to
    import, no such function): found before any sampling."""


class RunFolderTaken(ConfigError):
    """``trainer.resume=none`` starts afresh in a run folder that holds another run's checkpoints or metrics, which
    it would replace."""


def reward_function(cfg: Config):
    """``(data_source, text, ground_truth, extra_info) -> RewardResult``: a user's function or ours."""
    if cfg.reward.path:
        try:
            return reward.load_reward_function(cfg.reward.path, cfg.reward.name)
        except ValueError as e:  # missing file or function: a config problem, found before any sampling
            raise RewardFunctionError(f"reward.path / reward.name: {e}") from None
    return functools.partial(reward.score_detailed, mode=cfg.reward.mode)


def check_reward_calls(cfg: Config, calls: int, errors: int, last_error: str | None, where: str) -> None:
    """Stop when every reward call of a step (or a validation) failed: every advantage is then 0, so the run
    would learn nothing and still finish with status 0. A function that fails on a few answers only costs
    those (``reward_errors`` in the metrics and on the console line)."""
    if not calls or errors < calls:
        return
    r = cfg.reward
    scorer = f"reward.path={r.path} ({r.name})" if r.path else f"reward.mode={r.mode}"
    raise TrainingError(
        f"every one of the {calls} reward calls of {where} failed"
        + (f", the last with {last_error}" if last_error else "")
        + f": fix {scorer}"
    )


def load_prompts(cfg: Config, tokenizer, say=print) -> tuple[PromptSet, PromptSet | None]:
    """The training and validation prompts; what preparing them dropped or cut is said (``say``) first."""
    d = cfg.data
    options = PromptOptions.from_config(d)
    train = prepare_prompts(d.train_files, tokenizer, options, cache_dir=d.cache_dir)
    val = prepare_prompts(d.val_files, tokenizer, options, cache_dir=d.cache_dir) if d.val_files else None
    for name, prompts in (("training prompts", train), ("validation prompts", val)):
        if prompts is not None:
            for line in describe_losses(prompts, name, options):
                say(line)
    if val is not None and (suffixes := lost_row_suffixes(val)):
        names = [validation_metric(group, key, suffix) for (group, key), suffix in suffixes.items()]
        say(
            f"  validation logs a source or length that dropped some rows under a name saying how many it scores: "
            f"{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
        )
    check_prompt_count(cfg, len(train))
    return train, val


def lost_row_suffixes(val: PromptSet) -> dict[tuple[str, object], str]:
    """``(group, key) -> suffix`` for each data_source and context length (``target_tokens``) of the validation
    set that lost rows (dropped as overlong or bad) but not all of them.

    Validation is compared across steps and runs by metric name: ``val/musique/accuracy`` or
    ``val/accuracy@2048`` computed on the questions that happened to fit would sit beside the same names from a
    run that scored them all, and a length whose long questions were dropped looks easier than it is. So a
    bucket that dropped rows logs under a name that says how many of its rows it scores
    (``val/accuracy@2048_whole_4_of_9``); a bucket that lost every row logs nothing ("none left" at the start).
    A prompt cut to the length limit (``data.truncation``) is kept and scored, so it is no loss here (the start
    of the run says how many were cut)."""
    return {
        (group, key): f"_whole_{t.rows - t.dropped}_of_{t.rows}"
        for group in GROUPS
        for key, t in tally(val, group).items()
        if 0 < t.dropped < t.rows
    }


def validation_metric(group: str, key, suffix: str) -> str:
    """The name validation logs a bucket's accuracy under (``lost_row_suffixes`` gives the suffix)."""
    return f"val/{key}/accuracy{suffix}" if group == "data_source" else f"{LENGTH_ACCURACY}{key}{suffix}"


def run_folder_contents(run_dir: Path) -> tuple[list[str], int]:
    """The checkpoint folders (``step_*``, finished or not) and the number of metrics.jsonl records that an earlier
    run left in ``run_dir``."""
    folder = checkpoints_dir(run_dir)
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) if folder.is_dir() else []
    metrics = run_dir / METRICS_FILE
    records = len(read_metrics(metrics)) if metrics.is_file() else 0
    return steps, records


def _describe_contents(steps: list[str], records: int) -> str:
    parts = []
    if steps:
        shown = ", ".join(steps[:3]) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
        parts.append(f"checkpoint{'s' if len(steps) > 1 else ''} {shown}")
    if records:
        parts.append(f"{METRICS_FILE} with {records} record{'s' if records > 1 else ''}")
    return " and ".join(parts)


def check_fresh_folder(cfg: Config, resume_from: Path | None, say=print) -> None:
    """A fresh start replaces what its run folder holds: metrics.jsonl and the report are rewritten, and its first
    checkpoint removes every later one (one timeline per folder). So ``trainer.resume=none`` in a folder holding
    another run's checkpoints or metrics is refused, before anything loads; nothing is deleted that the user did
    not ask to delete (verl's ``resume_mode=disable`` only overwrites the same steps, which here would mix two
    runs in one folder). ``trainer.resume=auto`` finding metrics but no complete checkpoint (a run that stopped
    before its first save) starts again and says that those records are replaced."""
    if resume_from is not None:
        return
    t = cfg.trainer
    steps, records = run_folder_contents(Path(t.output_dir).expanduser())
    if not steps and not records:
        return
    held = _describe_contents(steps, records)
    if t.resume == "none":
        raise RunFolderTaken(
            f"trainer.resume=none starts a fresh run, but trainer.output_dir={t.output_dir} holds "
            f"another run's {held}, which it would replace: pick another trainer.output_dir, remove "
            f"the folder, or resume it with trainer.resume=auto"
        )
    say(
        f"note: trainer.output_dir={t.output_dir} holds {held} but no complete checkpoint to resume: this run "
        f"starts at step 0 and replaces them"
    )


def check_data_files(cfg: Config) -> None:
    """The data files exist and can be read, as ``prepare_prompts`` checks them later on each rank."""
    readable_files(cfg.data.train_files)
    if cfg.data.val_files:
        readable_files(cfg.data.val_files)


def check_before_workers(cfg: Config) -> None:
    """What the trainer checks of the config, the data files and the run folder before anything loads, run where
    ``trainer.launcher=ray`` is driven, before Ray starts: a mistake found on the workers comes back through Ray
    after its own start, once per worker (and once per restart)."""
    check_run(cfg, run_ranks(cfg))  # (this machine's part is the driver's: Ray itself)
    reward_function(cfg)
    check_data_files(cfg)
    run_dir = Path(cfg.trainer.output_dir).expanduser()
    quiet = lambda line: None  # noqa: E731 (the workers say it, as a local run does)
    check_fresh_folder(cfg, resolve_resume(run_dir, cfg.trainer.resume, say=quiet), say=quiet)


def describe_epochs(cfg: Config, prompts: int) -> list[str]:
    """What the epochs leave out, said at the start: a step takes data.train_batch_size prompts of the epoch's order
    in turn, so the last ``prompts % batch`` of each epoch's order are never trained on (the same ones each epoch
    without data.shuffle), and trainer.total_epochs bounds trainer.max_steps."""
    d, t = cfg.data, cfg.trainer
    batch = d.train_batch_size
    per_epoch, left = divmod(prompts, batch)
    lines = []
    if t.max_steps and t.max_steps > t.total_epochs * per_epoch:
        lines.append(
            f"note: trainer.max_steps={t.max_steps} is capped at {t.total_epochs * per_epoch} by "
            f"trainer.total_epochs={t.total_epochs} ({prompts} prompts, {batch} a step): raise "
            f"trainer.total_epochs to go on"
        )
    if left:
        which = (
            f"the last {left} of the file order"
            if not d.shuffle
            else "the last of each epoch's shuffled order, other ones each epoch"
        )
        lines.append(
            f"note: {left} of {prompts} prompts ({which}) are left out of every epoch: {prompts} is not a "
            f"multiple of data.train_batch_size={batch}"
        )
    return lines


def rounding_warning(cfg: Config) -> str | None:
    """The weights the optimizer steps in bf16/fp16 keep 8 (11) significant bits, so an AdamW update, about the
    learning rate, is rounded away wherever it is under a 256th (2048th) of the weight. FSDP2 steps float32
    masters of a 16-bit model on any number of ranks (one process in a group of its own) and DeepSpeed's bf16
    mode keeps float32 masters; ``actor.master_weights=model`` steps the 16-bit weights themselves."""
    bits = {"bfloat16": 8, "float16": 11}.get(cfg.model.dtype)
    if bits is None or cfg.actor.strategy == "deepspeed" or cfg.actor.master_weights == "float32":
        return None
    return (
        f"warning: model.dtype={cfg.model.dtype} with actor.master_weights=model trains the {cfg.model.dtype} "
        f"weights themselves: an update of about actor.lr={cfg.actor.lr:g} is rounded away on any weight above "
        f"{cfg.actor.lr * 2**bits:.2g}. actor.master_weights=float32 keeps float32 master weights"
    )


# Memory per step in GiB, the most of any rank: the process's peak resident host memory since it started, and on
# CUDA the GPU's peak allocated and reserved bytes during the step (verl's names).
HOST_MEMORY, GPU_MEMORY = "perf/host_memory_peak_gb", ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")


def memory_peaks(device: torch.device) -> dict[str, float]:
    """This process's memory peaks, by their names in ``HOST_MEMORY`` and, on CUDA, ``GPU_MEMORY``."""
    gib = 2**30
    peaks = {HOST_MEMORY: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}  # (KB on Linux)
    if device.type == "cuda":
        peaks.update(
            zip(
                GPU_MEMORY,
                (torch.cuda.max_memory_allocated(device) / gib, torch.cuda.max_memory_reserved(device) / gib),
            )
        )
    return peaks


class Trainer:
    def __init__(
        self,
        cfg: Config,
        stop_file: str | Path | None = None,
        split: Split | None = None,
        *,
        build_engine: EngineBuilder = build_engine,
    ):
        """``stop_file``: where the driver of Ray Train workers asks for a stop (see ``preemption``); ``split``: the
        job's ranks when some of them only sample (``rollout.sampler_ranks``; this is a training rank);
        ``build_engine``: what builds the rollout engine (``rollout/build.py``'s for the engine ``rollout.engine``
        names; another engine needs only a function of its own, the trainer using it through ``RolloutEngine``)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.output_dir).expanduser()  # (a folder named ~ here is never meant)
        self.stop_request = StopRequest(stop_file)
        self.stopping = False  # every rank agreed to stop after the step in flight (or before it)
        self.saved: tuple[int, Path] | None = None  # the last checkpoint on disk of this timeline, by step
        self.seconds = {"update": None, "validate": None, "save": None}  # this process's last ones, for the grace
        # rollout.mode=one_step_off: the groups of step ``ahead.step``, sampled before the previous update
        self.ahead: SampledAhead | None = None
        self.over_budget_said = False  # a sample past actor.max_tokens_per_micro_batch was said (once a run)
        self.no_gradient_since: int | None = None  # the first step of the current run of steps without a gradient
        # The next step sampled beside the update: rollout.overlap, or one_step_off on sampler ranks of their own.
        # The thread (and on a GPU the CUDA stream) that samples, or waits for the sampler ranks, meanwhile.
        r = cfg.rollout
        self.beside = r.overlap or bool(split and r.mode == "one_step_off" and r.max_staleness)
        self.sampling_thread = ThreadPoolExecutor(1, "longqa-sampling") if self.beside else None
        self.sampling_stream = None
        self.env = DistEnv.from_environment() if split is None else split.training_env()
        deepspeed = cfg.actor.strategy == "deepspeed"
        if self.env.distributed:
            self.device = self.env.device(cfg.trainer.device)
        else:
            self.device = pick_device(cfg.trainer.device)
        # The settings and this machine checked, as config show and plan check them, and the micro-batch budget
        # filled where it is auto; then a plan that cannot fit refused, before anything loads (and before the
        # resume compares the config with the checkpoint's, which records the budget that ran).
        gpu_bytes = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        checked = check_run(
            cfg,
            split.job.world_size if split else self.env.world_size,
            device_type=self.device.type,
            gpu_bytes=gpu_bytes,
        )
        self.cfg = cfg = checked.config
        if checked.note:
            self._say(checked.note)
        check_imports(cfg)
        check_deepspeed(cfg, self.device)
        if gpu_bytes is not None:
            check_fit(cfg, self.env.world_size, gpu_bytes, checked.sizes)
        # The checkpoint to resume from, and what differs from the config it was written with: refused now, before
        # anything loads, where the difference changes what the run computes.
        self.resume_from = resolve_resume(self.run_dir, cfg.trainer.resume, say=self._say)
        check_fresh_folder(cfg, self.resume_from, say=self._say)
        self.data_fingerprint = data_fingerprint(cfg)  # the data files' contents, which the config does not show
        self.resume_changes = [] if self.resume_from is None else self._check_resume(self.resume_from)
        self.changes_on_resume: list[dict] = []  # this timeline's record of them, saved in every checkpoint
        # One process still shards in a group of its own when something must leave the device: ZeRO-3
        # partitions even one rank's weights, and FSDP2's CPU offload moves the shards to host memory.
        sharded_alone = deepspeed or cfg.actor.cpu_offload or float32_masters(cfg)
        self.owns_group = self.env.init(self.device, alone=sharded_alone)
        if (warning := rounding_warning(cfg)) and self.env.is_main:
            print(warning, flush=True)  # said before the weights load, not after
        if split is not None and not self.beside:
            why = "rollout.mode=sync" if r.mode == "sync" else "rollout.max_staleness=0"
            self._say(
                f"warning: rollout.sampler_ranks={r.sampler_ranks} with {why}: the sampler ranks wait while the "
                f"training ranks update, and the other way round; rollout.mode=one_step_off with "
                f"rollout.max_staleness=1 runs the two at once"
            )
        seed = cfg.trainer.seed
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        m = cfg.model
        self.score = reward_function(cfg)  # bad input fails first, before the weights are read
        self.tokenizer = config_tokenizer(m)
        self.train_set, self.val_set = load_prompts(cfg, self.tokenizer, say=self._say)
        self.val_suffixes = lost_row_suffixes(self.val_set) if self.val_set is not None else {}  # (fixed for the run)
        self.longest_prompt = longest = max(
            int(p.lengths.max(initial=0)) for p in (self.train_set, self.val_set) if p is not None
        )
        model_config = load_model_config(m.path, m.gguf_file)
        check_sequence_heads(cfg, model_config.num_attention_heads)
        if warning := position_limit_warning(
            model_config, longest, cfg.data.max_response_length, "data.max_prompt_length", "data.max_response_length"
        ):
            check_positions(cfg, longest, model_config.max_position_embeddings)
            self._say(warning)
        self.steps_per_epoch = len(self.train_set) // cfg.data.train_batch_size
        total = cfg.trainer.total_epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.trainer.max_steps or total)
        for line in describe_epochs(cfg, len(self.train_set)):
            self._say(line)
        if not cfg.trainer.save_freq:
            self._say(
                "note: trainer.save_freq=0 (never; verl's -1 is the same): this run writes no checkpoint but on a "
                "stop by SIGTERM/SIGINT, so a crash loses it and longqa export finds nothing to export"
            )
        partial_offload = deepspeed and cfg.actor.cpu_offload and cfg.actor.cpu_offload_ratio < 1
        if self.env.is_main and (cfg.trainer.save_freq or partial_offload):  # (the other ranks stop with it)
            params = count_parameters(model_config)
            start = 0 if self.resume_from is None else read_trainer_state(self.resume_from)["step"]
            if warning := check_checkpoint_space(
                cfg, self.run_dir, params, self.env.world_size, start, self.total_steps
            ):
                self._say(warning)
            if partial_offload:  # the share offloaded, in whole sub-groups
                self._say(describe_training(cfg, params, self.env.world_size))
        self.model, _ = load_model(
            m.path,
            gguf_file=m.gguf_file,
            dtype=m.dtype,
            attn_implementation=m.attn_implementation,
            gradient_checkpointing=m.gradient_checkpointing,
            checkpoint_fraction=m.checkpoint_fraction,
            activation_offload=m.activation_offload,
            mlp_tile_tokens=m.mlp_tile_tokens,
            device=self.device,
            tokenizer=self.tokenizer,
        )
        # Compiled graphs from earlier starts (this machine's cache, or the run folder's copy) before any compiling.
        use_user_cache()
        load_run_cache(self.run_dir)
        self.compiled_when_cached = compiled_graphs()
        # Built before the actor shards the model: under data parallelism (or a group of one, above) the fast
        # engine keeps an unsharded copy, and vLLM loads the unsharded weights (later syncs gather them); with
        # sampler ranks of their own, they hold the engine (and their own copy of the weights).
        self.engine: RolloutEngine = build_engine(
            cfg,
            self.model,
            self.tokenizer,
            split=split,
            prompt_tokens=self.longest_prompt,
            own_copy=self.env.distributed or sharded_alone or r.overlap,
        )
        check_engine(cfg, self.engine)
        self.actor = Actor(self.model, cfg, self.total_steps, self.device, self.tokenizer.pad_token_id)
        if cfg.actor.compile_layers and self.device.type == "cuda" and self._compilable():
            compile_decoder_layers(self.model, with_hooks=not deepspeed)  # DeepSpeed's hooks cannot be traced
            start = time.perf_counter()
            if (count := self.actor.compile_length_buckets()) and self.env.is_main:
                print(
                    f"compiled the update for {count} packed lengths in {time.perf_counter() - start:.0f} s", flush=True
                )
        # What a step compiles or captures once the process is warm, and why (said after its first step).
        self.compile_watch, self.warm, self.validated_since_step = CompileWatch(self.engine), False, False
        self.stops = tuple(stop_token_ids(self.tokenizer))
        logprobs_mode = logprobs_mode_for(r.temperature, r.top_k, r.top_p)
        # The trainer recomputes the old policy's log-probs itself; vLLM returns exact sample log-probs except
        # for tempered *and* top-k/top-p-filtered sampling, where it is not asked for them.
        self.params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=cfg.data.max_response_length,
            stop_token_ids=self.stops,
            stop_strings=tuple(r.stop),
            return_logprobs=r.engine != "vllm" or logprobs_mode is not None,
        )

    def _check_resume(self, checkpoint: Path) -> list:
        """What resuming from ``checkpoint`` changes (settings, and data files with other contents under the same
        names), each change that alters what the run computes refused unless allowed."""
        state = read_trainer_state(checkpoint)
        return check_resume(checkpoint, state["config"], self.cfg, state.get(DATA_KEY), self.data_fingerprint)

    def _compilable(self) -> bool:
        """Whether the update's decoder layers are compiled: where the engine says so (``compiled_update_layers``:
        the Llama-family layers the fast engine's fused decode runs, wherever that engine is)."""
        return self.engine.compiled_update_layers

    # ------------------------------------------------------------------------------------------ data

    def epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.train_set)
        if not self.cfg.data.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.cfg.trainer.seed, epoch]).permutation(n)

    def step_prompts(self, step: int) -> list[int]:
        """This rank's prompts of the step: a contiguous share of the global batch."""
        epoch, position = divmod(step, self.steps_per_epoch)
        b = self.cfg.data.train_batch_size
        share = b // self.env.world_size
        start = position * b + self.env.rank * share
        return self.epoch_order(epoch)[start : start + share].tolist()

    # ------------------------------------------------------------------------------------------ one step

    def _generator(self, step: int, round_: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(self.cfg.trainer.seed * 1_000_003 + step * 101 + round_)

    def _sample_groups(
        self, indices: list[int], step: int, round_: int, times: dict, at_version: int | None = None
    ) -> list[SampledGroup]:
        """Sample and score n responses for each prompt. Adds to ``times``. ``at_version``: the weights version
        sampled while an update runs beside (``RolloutEngine.generate``)."""
        t0 = time.perf_counter()
        prompts = [self.train_set.ids(i).tolist() for i in indices]
        generator = seeds = None
        if self.engine.seeded:  # samples depend on (seed, step, prompt)
            base = self.cfg.trainer.seed * 1_000_003 + step * 101 + round_
            seeds = [(base * 2_147_483_659 + i) % 2**63 for i in indices]  # an int64 for any trainer.seed
        else:  # on (seed, step) and the order of the prompts
            generator = self._generator(step, round_)
        outputs = self.engine.generate(
            prompts,
            self.params,
            generator,
            seeds=seeds,
            stop_at=self._drawn_lengths(indices, step, round_),
            at_version=at_version,
        )
        t1 = time.perf_counter()
        groups = []
        for i, prompt, samples in zip(indices, prompts, outputs):
            meta = self.train_set.meta[i]
            texts = self.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
            results = [self.score(meta["data_source"], t, meta["ground_truth"], meta.get("extra_info")) for t in texts]
            groups.append(SampledGroup(i, prompt, samples, results))
        times["rollout_s"] = times.get("rollout_s", 0.0) + t1 - t0
        times["reward_s"] = times.get("reward_s", 0.0) + time.perf_counter() - t1
        return groups

    def _drawn_lengths(self, indices: list[int], step: int, round_: int) -> list[list[int]] | None:
        """``stop_at`` under ``rollout.response_lengths=lognormal`` (None otherwise): each prompt's n lengths, a
        function of (seed, step, prompt, round) alone, so a resumed run draws the same ones."""
        kind = self.cfg.rollout.response_lengths
        if kind == "model":
            return None
        top, n, seed = self.params.max_new_tokens, self.params.n, self.cfg.trainer.seed
        return [draw_response_lengths(kind, n, top, (seed, step, i, round_)) for i in indices]

    def _informative(self, groups: list[SampledGroup]) -> list[SampledGroup]:
        rewards = torch.tensor([r.score for g in groups for r in g.results])
        keep = algo.keep_informative_groups(rewards, self.cfg.rollout.n).tolist()
        return [g for g, k in zip(groups, keep) if k]

    def _collect(self, step: int, at_version: int | None = None) -> tuple[list[SampledGroup], dict]:
        """The step's groups; with dynamic sampling, only groups whose rewards differ, topped up from
        more prompts (drawn from a stream seeded by the step) for at most ``max_sampling_rounds`` rounds."""
        cfg, stats = self.cfg, {}
        groups = self._sample_groups(self.step_prompts(step), step, 0, stats, at_version)
        if not cfg.algo.dynamic_sampling:
            return groups, stats
        kept = self._informative(groups)
        stats.update(dropped_groups=len(groups) - len(kept), sampling_rounds=1)
        rng = np.random.default_rng([cfg.trainer.seed, step, 7])
        for round_ in range(1, cfg.algo.max_sampling_rounds + 1):
            if len(kept) >= cfg.data.train_batch_size:
                break
            more = rng.choice(len(self.train_set), cfg.data.train_batch_size, replace=False).tolist()
            extra = self._sample_groups(more, step, round_, stats, at_version)
            good = self._informative(extra)
            stats["dropped_groups"] += len(extra) - len(good)
            stats["sampling_rounds"] += 1
            kept += good
        return (kept[: cfg.data.train_batch_size] or groups), stats

    def _step_groups(self, step: int) -> tuple[list[SampledGroup], dict, int]:
        """The step's groups, their sampling statistics, and the step whose weights sampled them (the weights
        after that many steps): sampled ahead, during the previous step, or now."""
        ahead = self.ahead  # kept until the update: a step dropped before it resumes from these very groups
        if ahead is not None and ahead.step == step:
            stats = {**ahead.stats, "rollout_s": 0.0, "reward_s": 0.0}  # the time went to the previous step
            return ahead.groups, stats, ahead.sampled_with
        groups, stats = self._collect(step)
        return groups, stats, step

    def _sample_ahead(self, step: int, stats: dict, at_version: int | None = None) -> SampledAhead | None:
        """rollout.mode=one_step_off: the next step's groups, sampled now with the weights this step updates, its
        sampling time counted in this step's ``stats``; None when the run is synchronous or this is its last step."""
        r = self.cfg.rollout
        if r.mode != "one_step_off" or not r.max_staleness or step + 1 >= self.total_steps:
            return None
        before = {key: stats.get(key, 0.0) for key in ("rollout_s", "reward_s")}
        groups, ahead_stats = self._collect(step + 1, at_version)
        for key, seconds in before.items():
            stats[key] = seconds + ahead_stats.pop(key, 0.0)
        return SampledAhead(step + 1, groups, ahead_stats, sampled_with=step)

    def _sample_ahead_beside(self, step: int, stats: dict) -> Future:
        """rollout.overlap: ``_sample_ahead`` started in a thread of its own (on a GPU, on a CUDA stream of its own)
        to run while this step's update does: the engine samples from its copy of the weights, which the update
        leaves alone until ``sync_weights``. The version sampled is pinned now, before the update's optimizer step
        moves the model's on. The future gives the groups; their sampling times go into ``stats``, which this
        thread alone touches until the future is done."""
        version = weights_version(self.model)
        stream = None
        if self.device.type == "cuda":
            stream = self.sampling_stream = self.sampling_stream or torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # (the copy refreshed after the last update)

        def sample() -> SampledAhead | None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return self._sample_ahead(step, stats, at_version=version)

        return self.sampling_thread.submit(sample)

    def _join_sampling(self, pending: Future) -> SampledAhead | None:
        """The groups sampled beside the update; on a GPU the default stream then waits for the sampling stream, so
        the engine's copy is refreshed only after its last read."""
        ahead = pending.result()
        if self.sampling_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.sampling_stream)
        return ahead

    def _update_batch(self, groups: list[SampledGroup], advantages: torch.Tensor, stale: bool) -> Samples:
        """What this rank updates on: its groups, or under sequence parallelism (``actor.sequence_parallel_size``)
        the groups of every rank of its sequence-parallel group, in rank order, which each of them computes a
        shard of. Each rank samples and scores a share of the step's prompts either way, and its metrics are
        those of its own groups."""
        n = self.cfg.rollout.n
        parts = gather_in_group((groups, advantages), self.actor.shard)
        groups = [g for part, _ in parts for g in part]
        samples = [s for g in groups for s in g.samples]
        return Samples(
            prompt_ids=[g.prompt for g in groups for _ in range(n)],
            response_ids=[s.token_ids for s in samples],
            advantages=torch.cat([a for _, a in parts]),
            group_size=n,
            old_logprobs=[s.logprobs for s in samples] if stale else None,
        )

    def train_step(self, step: int) -> dict | None:
        """The step's metrics; None when a stop request dropped it before its update (nothing changed)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        start = time.perf_counter()
        compiled, captured = compiled_graphs(), self.engine.graph_captures
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the step's own peaks, logged below
        groups, stats, sampled_with = self._step_groups(step)
        overlap = self.beside
        ahead = None if overlap else self._sample_ahead(step, stats)
        if self._drop_before_update(step):
            return None
        results = [r for g in groups for r in g.results]
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
        advantages, zero_var = algo.group_advantages(rewards, n, cfg.algo.adv_estimator, cfg.algo.norm_adv_by_std)
        stale = sampled_with < step  # sampled before an earlier update: the ratio's denominator is the sampler's
        batch = self._update_batch(groups, advantages, stale)
        self._say_over_budget(step, max(batch.length(i) for i in range(len(batch))))
        t_update = time.perf_counter()
        pending = self._sample_ahead_beside(step, stats) if overlap else None  # the next step, beside the update
        if pending is None:
            self.engine.sleep()  # a colocated engine frees its memory for the update ...
        try:
            update = self.actor.update(batch)
            update_s = time.perf_counter() - t_update
        finally:  # (an update that fails still waits for the sampling to let go of the engine)
            if pending is not None:
                wait([pending])
        if pending is not None:
            ahead = self._join_sampling(pending)
        self.engine.sync_weights()  # ... and gets it back with the new weights
        self.ahead = ahead
        end = time.perf_counter()
        self.seconds["update"] = end - t_update
        local = {
            "rewards": rewards.tolist(),
            "lengths": [len(s.token_ids) for s in samples],
            "truncated": [s.finish_reason == "length" for s in samples],
            "reasons": [r.reason for r in results if r.reason],
            "zero_var": zero_var,
            "groups": len(groups),
            "tokens": sum(len(g.prompt) + len(s.token_ids) for g in groups for s in g.samples),
            "flops": self._update_flops(groups),
            "reward_error": getattr(self.score, "last_error", None),
        }
        every = gather_objects(local)  # one entry per rank
        rewards = torch.tensor([x for part in every for x in part["rewards"]])
        lengths = np.array([x for part in every for x in part["lengths"]])
        truncated = [x for part in every for x in part["truncated"]]
        reasons = Counter(x for part in every for x in part["reasons"])
        reward_errors = sum(v for k, v in reasons.items() if k.startswith("error"))
        check_reward_calls(
            cfg,
            len(rewards),
            reward_errors,
            next((p["reward_error"] for p in every if p["reward_error"]), None),
            f"step {step + 1}",
        )
        zero_var, tokens = sum(p["zero_var"] for p in every), sum(p["tokens"] for p in every)
        flops = None if None in (p["flops"] for p in every) else sum(p["flops"] for p in every)
        if zero_var == sum(p["groups"] for p in every):
            self._say_no_gradient(step, zero_var, rewards, reasons, sum(truncated))
        else:
            self.no_gradient_since = None
        # Each phase's time and the compilations and graph captures (0 once warm): the most of any rank.
        compiled, captured = compiled_graphs() - compiled, self.engine.graph_captures - captured
        memory = memory_peaks(self.device)
        most = dict(
            zip(
                ("rollout_s", "reward_s", "update_s", "recompiles", "graph_captures", *memory),
                all_reduce(
                    [
                        stats["rollout_s"],
                        stats["reward_s"],
                        update_s if overlap else end - t_update,
                        compiled,
                        captured,
                        *memory.values(),
                    ],
                    "max",
                    self.device,
                ),
            )
        )
        metrics = {
            "epoch": step // self.steps_per_epoch,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/full_fraction": float((rewards >= 1.0).float().mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": int(lengths.max()),
            "response/truncated": float(np.mean(truncated)),
            "zero_variance_groups": zero_var,
            "reward_errors": reward_errors,
            **{f"reward_reason/{k}": v for k, v in sorted(reasons.items())},
            "time/rollout_s": most["rollout_s"],
            "time/reward_s": most["reward_s"],
            "time/update_s": most["update_s"],
            "perf/tokens_per_s": tokens / (end - start),
            "perf/recompiles": int(most["recompiles"]),
            "perf/graph_captures": int(most["graph_captures"]),
            **{key: round(most[key], 3) for key in memory},
            **update,
        }
        if flops is not None:  # the update's model FLOPs per second per training rank (recompute not counted)
            metrics["perf/update_tflops_per_gpu"] = flops / most["update_s"] / self.env.world_size / 1e12
        self._say_built_again(step)
        if cfg.rollout.mode == "one_step_off":
            metrics["rollout/staleness"] = step - sampled_with
        if cfg.algo.dynamic_sampling:
            metrics.update(
                {
                    "dynamic/dropped_groups": stats["dropped_groups"],
                    "dynamic/rounds": stats["sampling_rounds"],
                    "dynamic/groups": len(groups),
                }
            )
        return metrics

    def _update_flops(self, groups: list[SampledGroup]) -> float | None:
        """The model FLOPs of this rank's update of ``groups`` (forward and backward, each prompt once per group
        under actor.shared_prompt), where the model is a dense decoder whose FLOPs are counted."""
        config = self.model.config
        if not counts_flops(config):
            return None
        return sum(
            group_flops(
                config, len(g.prompt), [len(s.token_ids) for s in g.samples], self.cfg.actor.shared_prompt
            ).flops
            for g in groups
        )

    def _say_over_budget(self, step: int, longest: int) -> None:
        """Say once when a sample (a prompt and one response) is longer than actor.max_tokens_per_micro_batch: it
        cannot be cut, so it goes into a micro-batch of its own larger than the budget, and the budget is how a
        user bounds the update's memory."""
        budget = self.cfg.actor.max_tokens_per_micro_batch
        if self.over_budget_said or not isinstance(budget, int) or longest <= budget:
            return
        self.over_budget_said = True
        self._say(
            f"warning: step {step + 1} updates on a prompt and response of {longest} tokens, past "
            f"actor.max_tokens_per_micro_batch={budget}: it goes in a micro-batch of its own, larger than the "
            f"budget that bounds the update's memory; raise the budget to {longest} or more, or lower "
            f"data.max_prompt_length / data.max_response_length (said once)"
        )

    def _say_built_again(self, step: int) -> None:
        """After this process's first step (which compiles and captures what the run needs), say what a step
        compiled or captured again and why: ``perf/recompiles`` counts it, this says what changed shape."""
        # A validation asks the engine for one answer per prompt, so it re-sizes the KV stores (dropping captured
        # graphs) and the next step's sampling re-sizes them back: by design, not a warm step building again.
        news = self.compile_watch.news(engine_events=not self.validated_since_step)
        self.validated_since_step = False
        if news and self.env.is_main:
            shown = "; ".join(news[:4]) + (f"; and {len(news) - 4} more" if len(news) > 4 else "")
            if self.warm:
                print(
                    f"note: step {step + 1} (or a validation before it) compiled or captured again, which a warm "
                    f"step should not: {shown}",
                    flush=True,
                )
            else:  # the first step: what the rest of the run replays (and what it cost)
                print(f"the first step {shown}", flush=True)
        self.warm = True

    def _say_no_gradient(self, step: int, groups: int, rewards: torch.Tensor, reasons: Counter, cut: int) -> None:
        """Say it when a step's groups all scored alike, so that its update changed nothing: once at the first
        such step of a run of them, and again at every tenth. A run that logs a flat reward for an hour has
        learnt nothing, and the reasons say why: most responses ``cut`` at data.max_response_length before the
        answer at their end, or an untouched instruct model that never writes ``\\boxed{}``."""
        if self.no_gradient_since is None:
            self.no_gradient_since = step
        streak = step - self.no_gradient_since + 1
        if streak != 1 and streak % 10:
            return
        mean = float(rewards.mean())
        why = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common(3))
        why = f"; reasons: {why} of {len(rewards)} samples" if why else ""
        line = (
            f"warning: step {step + 1}: no gradient{f' for {streak} steps in a row' if streak > 1 else ''}: "
            f"all {groups} groups scored alike (mean reward {mean:.3f}{why})"
        )
        if mean <= 0 and 2 * cut > len(rewards):  # no reward, and most responses never reached their end
            line += (
                f": {cut} of {len(rewards)} samples were cut at data.max_response_length="
                f"{self.cfg.data.max_response_length} tokens before they ended, so the answer a response ends "
                f"with was never written; raise data.max_response_length"
            )
        elif mean == 0 and reasons and reasons.most_common(1)[0][0] == "no_boxed":
            line += (
                ": the model writes no \\boxed{} answer for the reward to read. A short `longqa sft` teaches "
                "the format (or an instruction in the prompts may ask for it)"
            )
        elif mean > 0 and bool((rewards == rewards[0]).all()):
            line += ": every sample earned the same reward; harder questions give GRPO something to learn"
        self._say(line)

    def validate(self) -> dict:
        if self.val_set is None:
            return {}
        # Greedy answers come from the rollout engine where it answers validation: it holds the whole current
        # model on every rank (the fast engine's copy, or vLLM, when the trainer is sharded) and is much faster
        # than transformers' generate; the reference engine's runs use generate on the model itself. Ranks
        # share the questions out and gather the answers.
        engine = self.engine if self.engine.answers_validation else None
        shard = (self.env.rank, self.env.world_size, gather_objects) if self.env.distributed else None
        # Compiled decoder layers would recompile for generation's shapes: run them eagerly where they
        # are called (generate, or an engine that runs the model's modules).
        eager = engine is None or engine.calls_model_layers
        with torch.compiler.set_stance("force_eager" if eager else "default"):
            result = evaluate(
                self.model,
                self.tokenizer,
                self.val_set,
                self.cfg.data.max_response_length,
                reward_fn=self.score,
                engine=engine,
                shard=shard,
            )
        check_reward_calls(
            self.cfg,
            result["all"]["n"],
            result["reward_errors"],
            getattr(self.score, "last_error", None),
            "the validation",
        )
        out = {
            "val/accuracy": result["all"]["accuracy"],
            "val/f1": result["all"]["f1"],
            "val/seconds": result["seconds"],
        }
        if result["reward_errors"]:  # a reward function failing on some answers, not scoring them 0
            out["val/reward_errors"] = result["reward_errors"]
        if dropped := self.val_set.stats.overlong_filtered + self.val_set.stats.bad_rows:  # (cut ones are scored)
            out["val/lost_prompts"] = dropped

        def name(group: str, key) -> str:
            return validation_metric(group, key, self.val_suffixes.get((group, key), ""))

        out.update(
            {
                name("data_source", source): r["accuracy"]
                for source, r in result.items()
                if isinstance(r, dict) and source != "all"
            }
        )
        # A validation set of one set of questions at several lengths (synth --context-lengths) gives the
        # accuracy at each: what longer contexts cost, and whether training closes the gap.
        out.update({name("target_tokens", g["target_tokens"]): g["accuracy"] for g in result.get("by_length", ())})
        return out

    # ------------------------------------------------------------------------------------------ the run

    def run(self) -> dict:
        """Train to the last step, or until SIGTERM/SIGINT asks for a stop: then the result's ``preempted``
        names the step and checkpoint, and no report is written (the resumed run writes it)."""
        finished = False
        try:
            result = self._run()
            finished = True
            return result
        finally:
            if self.sampling_thread is not None:
                self.sampling_thread.shutdown()
            self.engine.close(finished)

    def _already_done(self) -> dict | None:
        """When the checkpoint to resume is at or past the run's last step: the line saying there is nothing to
        train (nothing loaded, no change applied), and the result at the checkpoint's step; None otherwise."""
        if self.resume_from is None:
            return None
        step = read_trainer_state(self.resume_from)["step"]
        if step < self.total_steps:
            return None
        t = self.cfg.trainer
        limit = (
            f"trainer.max_steps={t.max_steps}"
            if t.max_steps and t.max_steps == self.total_steps
            else f"the {self.total_steps} steps of trainer.total_epochs={t.total_epochs}"
        )
        self._say(
            f"checkpoint {self.resume_from} is already at step {step} >= {limit}: nothing to train; raise "
            f"trainer.max_steps (or trainer.total_epochs) to go on"
        )
        return {"steps": step, "trained": 0, "report": None, "preempted": None}

    def _run(self) -> dict:
        if (result := self._already_done()) is not None:
            return result
        with self.stop_request:
            start_step, resumed = self._resume()
            self.saved = (start_step, resumed) if resumed is not None else None
            with self._logger(start_step, resumed) as logger:
                t = self.cfg.trainer
                if start_step == 0 and t.test_freq and t.val_before_train and self.val_set is not None:
                    logger.log(0, self._validate_timed())
                done = self._train(start_step, logger)
            if self.stopping and done < self.total_steps:
                return self._preempted(done)
            result = {"steps": done, "trained": done - start_step, "report": None, "preempted": None}
            if self.env.is_main and "jsonl" in self.cfg.trainer.logger:  # the report is drawn from the jsonl
                result["report"] = str(write_report(self.run_dir))
            return result

    def _resume(self) -> tuple[int, Path | None]:
        """The step to start from and the checkpoint it was restored from (None: a fresh start). The settings
        that changed since the checkpoint (``resume``) take effect here and are said."""
        resume = self.resume_from
        if resume is None:
            return 0, None
        state = load_checkpoint(
            resume,
            model=self.model,
            optimizer=self.actor.optimizer,
            scheduler=self.actor.scheduler,
            engine=self.actor.engine,
            say=self._say,
        )
        self.actor.follow_config()  # this run's learning rate, optimizer settings and schedule, at the restored step
        self.actor.bad_steps = state["bad_steps"]
        bump_weights_version(self.model)  # new weights: an engine holding a copy must load them
        self.engine.sync_weights()
        step = state["step"]
        self.ahead = self._restored_ahead(state.get(AHEAD_KEY))
        self.changes_on_resume = change_history(state, step, self.resume_changes)
        for line in [
            f"resumed from {resume} at step {step}",
            *describe_changes(self.resume_changes, step),
            *self._abandoned(step),
        ]:
            self._say(line)
        return step, resume

    def _abandoned(self, step: int) -> list[str]:
        """The line saying what a resume from an earlier checkpoint of this run gives up: its later checkpoints,
        which the first save discards, and the metrics logged after ``step``, which this run's replace."""
        later = later_checkpoints(self.run_dir, step)
        if not later:
            return []
        return [
            f"{self.run_dir} holds later checkpoints ({', '.join(p.name for p in later)}): this run goes on from "
            f"step {step} instead, discards them at its first save, and its metrics from step {step + 1} on "
            f"replace theirs"
        ]

    def _ahead_state(self) -> dict | None:
        """The groups sampled ahead (rollout.mode=one_step_off) for a checkpoint: what a resume needs to update on
        the very samples the uninterrupted run would, since the weights that drew them are gone by then. Every
        rank's groups, in rank order (a collective)."""
        mine = None if self.ahead is None else [g.state() for g in self.ahead.groups]
        every = gather_objects(mine)
        if self.ahead is None:
            return None
        return self.ahead.state([g for part in every for g in part])

    def _restored_ahead(self, saved: dict | None) -> SampledAhead | None:
        """``_ahead_state``'s groups back, this rank's contiguous share of them."""
        if saved is None:
            return None
        share = len(saved["groups"]) // self.env.world_size
        mine = saved["groups"][self.env.rank * share : (self.env.rank + 1) * share]
        return SampledAhead.from_state(
            saved, [SampledGroup.from_state(g, self.train_set.ids(g["index"]).tolist()) for g in mine]
        )

    def _say(self, line: str) -> None:
        """A line for the user, from one rank (the others would say the same)."""
        if self.env.is_main:
            print(line, flush=True)

    def _logger(self, start_step: int, resumed: Path | None):
        if not self.env.is_main:  # the other ranks compute the same (reduced) metrics; rank 0 writes them
            return _Silent()
        t = self.cfg.trainer
        return MetricsLogger(
            self.run_dir,
            t.logger,
            self.total_steps,
            to_dict(self.cfg),
            resume_step=start_step if resumed is not None else None,
            project=t.project_name,
            name=t.experiment_name or self.run_dir.name,
        )

    def _train(self, start_step: int, logger) -> int:
        """The steps from ``start_step`` until the last or an agreed stop; returns the last finished step."""
        done = start_step
        for step in range(start_step, self.total_steps):
            if self._stop_before_step():
                break
            random_state = rng_state()
            metrics = self.train_step(step)
            if metrics is None:  # dropped before its update: as if it had never begun
                set_rng_state(random_state)
                break
            done = step + 1
            if self._validates(done):
                metrics.update(self._validate_timed())
            logger.log(done, metrics)
            self._keep_compiled()
            if self.cfg.trainer.save_freq and (done % self.cfg.trainer.save_freq == 0 or done == self.total_steps):
                self._save(done)
            if self.stopping:
                break
        return done

    def _keep_compiled(self) -> None:
        """Copy what this process has compiled into the run folder (``compile_cache.bin``) after a step that
        compiled something new: the first, then only a recompilation. Kept apart from the checkpoints, so that a
        start with the run folder on a machine whose caches are empty is warm also before the first checkpoint
        and for a run whose checkpoints do not fit its disk."""
        if self.env.is_main and compiled_graphs() > self.compiled_when_cached:
            save_run_cache(self.run_dir)
            self.compiled_when_cached = compiled_graphs()

    def _validates(self, done: int) -> bool:
        test_freq = self.cfg.trainer.test_freq
        return bool(test_freq) and (done % test_freq == 0 or done == self.total_steps)

    def _validate_timed(self) -> dict:
        start = time.perf_counter()
        metrics = self.validate()
        self.seconds["validate"] = time.perf_counter() - start
        self.validated_since_step = True
        return metrics

    def _save(self, done: int) -> Path:
        start = time.perf_counter()
        cfg = self.cfg
        path = save_checkpoint(
            self.run_dir,
            done,
            model=self.model,
            optimizer=self.actor.optimizer,
            scheduler=self.actor.scheduler,
            engine=self.actor.engine,
            keep_last=cfg.trainer.keep_last,
            trainer_state={
                "step": done,
                "bad_steps": self.actor.bad_steps,
                "config": to_dict(cfg),
                CHANGES_KEY: self.changes_on_resume,
                AHEAD_KEY: self._ahead_state(),
                DATA_KEY: self.data_fingerprint,
            },
        )
        self.seconds["save"] = time.perf_counter() - start
        self.saved = (done, path)
        return path

    # ------------------------------------------------------------------------------------------ preemption

    def _stop_before_step(self) -> bool:
        """At a step's start: whether a stop was asked for on any rank (one collective under several ranks)."""
        asked, _, _ = self.stop_request.poll(0.0, self.device)
        self.stopping = asked
        return asked

    def _drop_before_update(self, step: int) -> bool:
        """With the step's samples drawn and no weight moved: on a stop request, whether to drop the step
        (it would not finish within the grace period) rather than finish it. One collective, as above."""
        asked, waited, finish = self.stop_request.poll(self._seconds_to_finish(step + 1), self.device)
        if not asked:
            return False
        self.stopping = True
        return waited + finish > self.cfg.trainer.preemption_grace_s

    def _seconds_to_finish(self, done: int) -> float:
        """The update, validation and checkpoint still ahead of step ``done``, timed on their last run in
        this process; infinite before any update ran (the first one may compile, and its time is unknown)."""
        update, validate, save = self.seconds["update"], self.seconds["validate"], self.seconds["save"]
        if update is None:
            return math.inf
        return update + ((validate or 0.0) if self._validates(done) else 0.0) + (save or 0.0)

    def _preempted(self, done: int) -> dict:
        """Checkpoint the last finished step unless it is on disk, and say how to go on."""
        if self.saved is not None and self.saved[0] == done:
            checkpoint = self.saved[1]
        else:
            checkpoint = self._save(done) if done > 0 else None
        saved = str(checkpoint) if checkpoint is not None else None
        if self.env.is_main:
            print(preempted_message(done, saved), flush=True)
            self.stop_request.answer(done, saved)
        return {"steps": done, "report": None, "preempted": {"step": done, "checkpoint": saved}}


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    def log(self, step: int, metrics: dict) -> None:
        pass


def train(cfg: Config, stop_file: str | None = None, run_lock: str | None = None) -> dict:
    """Train in this process (one rank of several under torchrun or Ray) or on Ray Train workers, holding the run
    folder for this run alone while it runs (``run_lock``).

    ``preempted`` in the result is set when SIGTERM/SIGINT stopped the run early (``preemption``);
    ``stop_file`` is where a Ray driver asks its workers for that stop, and ``run_lock`` the token of the run
    folder's lock that it holds for them.
    """
    check_config_outputs(cfg)  # before anything is written: the run folder and the cache are no one else's
    job = DistEnv.from_environment()
    check_settings(cfg, run_ranks(cfg))  # on every rank before any process group: a sampler rank builds no Trainer
    with hold_run_folder(Path(cfg.trainer.output_dir).expanduser(), holder=job.rank == 0, job=run_lock) as token:
        if cfg.trainer.launcher == "ray":
            from longqa.train.ray_launcher import run_with_ray

            check_before_workers(cfg)

            return run_with_ray(cfg, functools.partial(train, run_lock=token))
        return _train_here(cfg, stop_file, job)


def _train_here(cfg: Config, stop_file: str | None, job: DistEnv) -> dict:
    """``train`` in this process, one rank of the job."""
    split = None
    if cfg.rollout.sampler_ranks:
        split = job.init_split(job.device(cfg.trainer.device), cfg.rollout.sampler_ranks)
        if split.is_sampler:
            if run_sampler(cfg, split):  # (after a training rank's error it leaves no group: that rank is gone)
                leave_group()
            return {"steps": None, "report": None, "preempted": None}
    try:
        trainer = Trainer(cfg, stop_file, split)
    except BaseException:
        if split is not None:  # (its sampler waits for this rank's first message)
            stop_sampler(split, finished=False)
        raise
    result = trainer.run()
    if trainer.owns_group or split is not None:
        leave_group()
    return result


def run_sampler(cfg: Config, split: Split) -> bool:
    """A sampler rank's part of the job: the model in ``model.dtype`` on this rank's device and the fast engine on
    it, serving the training ranks (``rollout/remote.py``); whether they finished without an error."""
    m = cfg.model
    device = split.job.device(cfg.trainer.device)
    check_machine(cfg, device.type)
    random.seed(cfg.trainer.seed), np.random.seed(cfg.trainer.seed), torch.manual_seed(cfg.trainer.seed)
    tokenizer = config_tokenizer(m)
    model, _ = load_model(
        m.path,
        gguf_file=m.gguf_file,
        dtype=m.dtype,
        attn_implementation=m.attn_implementation,
        device=device,
        tokenizer=tokenizer,
    )
    model.requires_grad_(False)
    return serve(build_engine(cfg, model, tokenizer, split=split), split)


__all__ = ["Trainer", "train", "reward_function", "load_prompts"]
