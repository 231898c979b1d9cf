"""The ``longqa`` command. Each subcommand parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
from pathlib import Path

from longqa import __version__
from longqa.config import Config, ConfigError, key_help, load_config, to_dict, to_yaml

DESCRIPTION = """\
longqa trains language models with GRPO to answer multi-hop questions over long documents.

Command groups:
  train    GRPO training (no arguments: the embedded default demo, on the CPU)
  eval     greedy evaluation of a model: accuracy, EM and F1 per data source; LongBench's multi-hop QA F1
  export   a checkpoint as a Hugging Face folder
  data     make training data: the LoongRL seed recipe's files, offline synthetic files, tokenized prompts
  sft      supervised warm-up on reference responses (how the embedded default model is made)
  bench    speed of the training layouts on random-weight models of real shapes
  cluster  start or stop a Ray cluster over ssh from an MPI-style hostfile
  plan     GPU and host memory and step time of a run, refused with what to change when it cannot fit
  config   show the resolved config and every key it accepts
"""


class _DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless the text says it in its own words (``default``)
    or there is none to say: a switch (off unless given) or an unset default, whose meaning the text gives."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text
        value = action.default
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class _Parser(argparse.ArgumentParser):
    """Every command's parser: each option's help says its default (``_DefaultsShown``). The commands' parsers
    are made by ``add_parser``, which makes them of their parent's class."""

    def __init__(self, *args, formatter_class: type = _DefaultsShown, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


class _RootFormatter(argparse.RawDescriptionHelpFormatter, _DefaultsShown):
    """``longqa --help``: the command list as written in ``DESCRIPTION``."""


def _within(low: int | float, high: int | float = math.inf, kind: type = int):
    """An argparse type: a finite ``kind`` number from ``low`` to ``high``, so that a count of 0, a negative size
    or a port past 65535 is refused with the flag's name before any work (it failed deep inside, with a
    traceback, or not at all)."""

    def parse(text: str):
        value = kind(text)  # a ValueError here: argparse's "invalid int value: 'x'"
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


DEVICE_HELP = "auto (the GPU when there is one), cpu or cuda[:i]"


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # nan too
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text}")
    return value


_fraction.__name__ = "float"
COUNT = _within(1)
SEED = _within(0, 2**32 - 1)  # numpy's generators take no negative seed
PORT = _within(1, 65535)


def _writable(path: str, setting: str, folder: bool = False) -> Path:
    """``path``, the output of the work ahead, checked before that work: it is not a file where a folder goes (or
    a folder where a file goes), and its nearest existing folder can be written to. So the work is not lost at
    its end; the missing folders are made then."""
    target = Path(path).expanduser()
    if target.exists():
        if target.is_dir() != folder:
            raise ConfigError(
                f"{setting} {path} is {'a file' if folder else 'a folder'}: give "
                f"{'a folder' if folder else 'a file'} to write"
            )
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{setting} {path} cannot be written to")
        return target
    existing = target.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{setting} {path}: {existing} is a file, so nothing can be made below it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting} {path}: {existing} cannot be written to")
    return target


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (default: the embedded demo's, configs/demo.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. data.max_prompt_length=16384 rollout.n=8 (default: none)",
    )


def _add_layout_args(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The options every command writing the recipe's folder layout shares."""
    p.add_argument("--output-dir", required=True, help="where the parquet files go")
    p.add_argument("--test-ratio", type=float, default=0.05, help="test fraction per task (default 0.05)")
    p.add_argument("--seed", type=SEED, default=42, help=f"{seed_help} (default 42)")


def _split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional containing '=' is an override, not a config file."""
    if args.config is not None and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def run_config(args: argparse.Namespace) -> Config:
    """The config ``longqa train`` runs for these arguments, which ``config show``, ``plan`` and ``data prepare``
    read as well: CONFIG with the overrides; without CONFIG, the embedded demo adjusted by them, unless they are
    a verl launch line (a whole run of its own, on longqa's defaults with verl's where results differ). What the
    verl keys without a counterpart are is said on stderr."""
    from longqa.config import read_config_file
    from longqa.config.verl_keys import VERL_DEFAULTS, file_notes, is_verl_line, verl_notes
    from longqa.data.demo import DEMO_CONFIG

    path, overrides = _split_config_args(args)
    if path is None and is_verl_line(overrides):  # a whole run of its own, from verl's defaults
        cfg = load_config(None, overrides, base=VERL_DEFAULTS)
        notes = [_verl_start(), *verl_notes(overrides)]
    else:
        cfg, notes = load_config(path or DEMO_CONFIG, overrides), verl_notes(overrides)
        if path is not None:  # a config file's verl keys are said as the command line's are
            notes = [*file_notes(read_config_file(path)), *notes]
    if os.environ.get("RANK", "0") == "0":  # once under torchrun; on stderr, so config show's YAML stays clean
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    return cfg


def _verl_start() -> str:
    """What a verl line without a config file starts from, with every value of that start that differs from the
    embedded demo's (what a plain `longqa train` runs), so that nobody expects the demo's data or batch."""
    from longqa.config.verl_keys import VERL_DEFAULTS, verl_start_note
    from longqa.data.demo import DEMO_CONFIG

    def flat(cfg: Config) -> dict:
        return {f"{section}.{key}": value for section, values in to_dict(cfg).items() for key, value in values.items()}

    start, demo = flat(load_config(None, base=VERL_DEFAULTS)), flat(load_config(DEMO_CONFIG))
    changed = ", ".join(f"{key}={value}" for key, value in start.items() if value != demo[key])
    return f"{verl_start_note()}; unlike the demo: {changed}"


def cmd_config_show(args: argparse.Namespace) -> None:
    """The config as given (``auto`` left as it is: each run fills it for its own machine), once ``train``'s checks
    before any work pass: for this environment's ranks and device, as ``train`` would run it here."""
    from longqa.config.support import run_device_type, run_ranks
    from longqa.planning.planner import check_run

    cfg = run_config(args)
    check_run(cfg, run_ranks(cfg), device_type=run_device_type(cfg))
    if cfg.actor.sequence_parallel_size > 1:  # the ranks of a sequence-parallel group share the model's heads
        from longqa.config.checks import check_sequence_heads
        from longqa.model.load import load_model_config

        check_sequence_heads(cfg, load_model_config(cfg.model.path, cfg.model.gguf_file).num_attention_heads)
    print(to_yaml(cfg), end="")


def cmd_config_keys(args: argparse.Namespace) -> None:
    if args.verl:
        from longqa.config.verl_keys import verl_key_table

        for key, becomes in verl_key_table():
            print(f"{key:56s} {becomes}")
        return
    for key, text, default in key_help():
        print(f"{key:32s} {text} [default: {default!r}]")


def _data_output(output_dir: str, reads: dict) -> None:
    """``--output-dir`` of the data commands, checked before any work: it can be written, and it is neither what the
    command reads nor a folder another command made (a data folder's files are written anew)."""
    from longqa.outputs.paths import DATA, check_output_folder

    _writable(output_dir, "--output-dir", folder=True)
    check_output_folder(output_dir, "--output-dir", reads, makes=DATA)


def cmd_data_loongrl(args: argparse.Namespace) -> None:
    from longqa.data.loongrl import prepare_loongrl

    _data_output(args.output_dir, {"--source": [args.source]})
    counts = prepare_loongrl(args.output_dir, source=args.source, test_ratio=args.test_ratio, seed=args.seed)
    _print_counts(args.output_dir, counts)


def cmd_data_synth(args: argparse.Namespace) -> None:
    from longqa.data.synth import generate

    _data_output(args.output_dir, {"--tokenizer": [args.tokenizer]})
    counts = generate(
        args.output_dir,
        rows_per_task=args.rows_per_task,
        context_tokens=args.context_tokens,
        tasks=tuple(args.tasks),
        min_hops=args.min_hops,
        max_hops=args.max_hops,
        keychain=args.keychain,
        test_ratio=args.test_ratio,
        seed=args.seed,
        tokenizer=args.tokenizer,
        workers=args.workers,
        context_lengths=args.context_lengths or (),
        near_misses=args.near_misses,
    )
    _print_counts(args.output_dir, counts)


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from longqa.data.prompts import PromptOptions, describe_losses, prepare_prompts
    from longqa.model.load import config_tokenizer
    from longqa.outputs.paths import check_config_outputs

    cfg = run_config(args)
    check_config_outputs(cfg, run=False)
    options = PromptOptions.from_config(cfg.data)
    tokenizer = config_tokenizer(cfg.model)  # as train reads it: model.path unset is the embedded model
    for name, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        if files:
            prompts = prepare_prompts(files, tokenizer, options, cache_dir=cfg.data.cache_dir)
            print(f"{name}: {prompts.stats.summary()}\n  cache: {prompts.stats.cache_path}")
            for line in describe_losses(prompts, name, options)[1:]:  # what it lost, per source and length
                print(line)


def cmd_train(args: argparse.Namespace) -> int:
    """0 when the run finished; ``EXIT_PREEMPTED`` when SIGTERM/SIGINT stopped it with a checkpoint to resume."""
    from longqa.data.demo import ensure_demo_data, uses_demo_data
    from longqa.train.preemption import EXIT_PREEMPTED
    from longqa.train.trainer import train

    cfg = run_config(args)
    _check_verl_data(args, cfg)
    _writable(cfg.trainer.output_dir, "trainer.output_dir", folder=True)
    if uses_demo_data(cfg):  # the demo's own files, whichever config names them: made on first use
        ensure_demo_data(cfg)
    result = train(cfg)
    if result["preempted"]:
        return EXIT_PREEMPTED
    if result["report"]:  # rank 0 (or the only process)
        print(f"done: {_steps_done(result)}; report: {result['report']}")
    elif result.get("trained") and os.environ.get("RANK", "0") == "0":  # (the report is drawn from the jsonl)
        print(
            f"done: {_steps_done(result)}; no report: trainer.logger=[{','.join(cfg.trainer.logger)}] writes no "
            f"jsonl to draw it from"
        )
    return 0


def _check_verl_data(args: argparse.Namespace, cfg: Config) -> None:
    """A verl line without a config file has no data files unless it names them: say why, not only that."""
    from longqa.config.verl_keys import is_verl_line, verl_start_note

    path, overrides = _split_config_args(args)
    if not cfg.data.train_files and path is None and is_verl_line(overrides):
        raise ConfigError(f"no data files given: {verl_start_note()}")


def _steps_done(result: dict) -> str:
    """The step the run is at, and how many of its steps this process trained when it resumed (a resume that
    had nothing to train says so itself and writes no report)."""
    steps, trained = result["steps"], result.get("trained")
    if trained is None or trained == steps:
        return f"{steps} steps"
    return f"at step {steps}, {trained} of them trained in this run"


# Options that an input of `longqa eval` has no use for, and why: given with it, they would do nothing.
EVAL_UNUSED_OPTIONS = {
    "longbench": (("mode", "skip_bad_rows"), "LongBench's prediction files are scored with its own F1"),
    "longbench_scores": (
        (
            "model",
            "max_new_tokens",
            "max_prompt_length",
            "batch_size",
            "engine",
            "mode",
            "device",
            "dtype",
            "output",
            "samples",
            "limit",
            "skip_bad_rows",
        ),
        "it scores the prediction files as they are and writes PRED_DIR/result.json",
    ),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def cmd_eval(args: argparse.Namespace) -> None:
    from longqa.config import environment_reward_mode

    for source, (options, why) in EVAL_UNUSED_OPTIONS.items():
        given = [_flag(o) for o in options if getattr(args, o) != args.eval_defaults[o]]
        if getattr(args, source) and given:
            raise ConfigError(f"{_flag(source)} takes no {', '.join(given)}: {why}")
    environment_mode = environment_reward_mode()  # the environment's checked even when unused
    mode = args.mode or environment_mode or "hardened"
    mode_from = "--mode" if args.mode else "REWARD_CALC_TYPE" if environment_mode else "the default"
    if args.longbench or args.longbench_scores:
        return _eval_longbench(args)
    import json

    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.evaluation.evaluate import (
        answer_engine,
        check_model_folder,
        describe_cut_responses,
        describe_prompt_losses,
        evaluate,
        format_groups,
        format_table,
        mode_reward,
        prompt_counts,
        run_reward,
        run_reward_note,
    )
    from longqa.model.load import answer_dtype, load_model, load_model_tokenizer, pick_device, position_limit_warning

    output, samples = _eval_outputs(args, {"--data": args.data, "--model": [args.model]})
    device = pick_device(args.device, "--device")
    check_model_folder(args.model)
    run = run_reward(args.model)  # the reward of the run an exported model comes from, to say beside the scores
    tokenizer = load_model_tokenizer(args.model)  # the data before the weights: a bad file fails fast
    options = PromptOptions(args.max_prompt_length, skip_bad_rows=args.skip_bad_rows)
    prompts = prepare_prompts(
        args.data, tokenizer, options, length_setting="--max-prompt-length", skip_setting="--skip-bad-rows"
    )
    print("\n".join(describe_prompt_losses(prompts, options)))
    if args.limit is not None:
        prompts = prompts.first_of_each_file(args.limit)
    dtype = answer_dtype(args.dtype, device)
    model, tokenizer = load_model(args.model, device=device, tokenizer=tokenizer, dtype=dtype)
    if warning := position_limit_warning(
        model.config,
        int(prompts.lengths.max(initial=0)),
        args.max_new_tokens,
        "--max-prompt-length",
        "--max-new-tokens",
    ):
        print(warning, file=sys.stderr)
    result = evaluate(
        model,
        tokenizer,
        prompts,
        args.max_new_tokens,
        args.batch_size,
        samples,
        mode_reward(mode),
        engine=answer_engine(model, tokenizer, args.engine, args.batch_size),
        files=args.data,
    )
    result.update(
        dtype=dtype,
        reward_mode=mode,
        reward_mode_from=mode_from,
        run_reward_mode=run["mode"] if run and not run.get("path") else None,
        run_reward_note=run_reward_note(run, mode),
        max_new_tokens=args.max_new_tokens,
        **prompt_counts(prompts),
    )
    print(format_table(result) + format_groups(result))
    print(describe_cut_responses(result["responses_cut"], result["all"]["n"], args.max_new_tokens))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1))


def _eval_outputs(args: argparse.Namespace, reads: dict, folder: bool = False) -> tuple[Path | None, Path | None]:
    """``--output`` (with ``folder``: a folder) and ``--samples``, when given, checked before any work: each can be
    written, neither is what the command reads or another command's, and they are not one file."""
    from longqa.outputs.paths import check_output_file, check_output_folder

    output = _writable(args.output, "--output", folder=folder) if args.output else None
    samples = _writable(args.samples, "--samples") if args.samples else None
    if output is not None:
        (check_output_folder if folder else check_output_file)(output, "--output", reads)
    if samples is not None:
        check_output_file(samples, "--samples", reads)
        if output is not None and samples.resolve() == output.resolve():
            raise ConfigError(f"--samples {args.samples} is also --output: give each a file of its own")
    return output, samples


def _eval_longbench(args: argparse.Namespace) -> None:
    """``eval --longbench`` (answer, then score the files written) and ``--longbench-scores`` (score alone)."""
    from longqa.evaluation import longbench

    folder, datasets = args.longbench_scores, None
    if args.longbench:
        if not args.output:
            raise ConfigError("--longbench needs --output: the folder for the prediction files and result.json")
        if args.max_prompt_length < 2:
            raise ConfigError(f"--max-prompt-length must be at least 2, got {args.max_prompt_length}")
        from longqa.evaluation.evaluate import answer_engine, describe_cut_responses
        from longqa.model.load import answer_dtype, load_model, pick_device

        _eval_outputs(args, {"--longbench": [args.longbench], "--model": [args.model]}, folder=True)
        device = pick_device(args.device, "--device")
        examples = longbench.read_longbench(args.longbench, args.limit)  # before the weights: bad files fail fast
        model, tokenizer = load_model(args.model, device=device, dtype=answer_dtype(args.dtype, device))
        done = longbench.predict(
            model,
            tokenizer,
            examples,
            args.output,
            args.max_new_tokens,
            args.max_prompt_length,
            args.batch_size,
            args.samples,
            answer_engine(model, tokenizer, args.engine, args.batch_size),
        )
        print(
            f"{done['rows']} rows answered in {done['seconds']:.1f}s; {done['prompts_truncated']} prompts over "
            f"--max-prompt-length={args.max_prompt_length} lost their middle\n"
            + describe_cut_responses(done["responses_cut"], done["rows"], args.max_new_tokens)
        )
        folder, datasets = args.output, list(examples)  # only what was just answered, not older files there
    result = longbench.score_folder(folder, datasets)
    path = longbench.save_result(folder, result)
    print(f"{longbench.format_scores(result)}\nwrote {path}")


def cmd_export(args: argparse.Namespace) -> None:
    from longqa.config import load_config_dict
    from longqa.model.load import config_tokenizer, load_model
    from longqa.outputs.layout import EXPORT_FILES
    from longqa.outputs.paths import MODEL, check_output_folder
    from longqa.train.checkpoint import (
        CheckpointError,
        check_export_folder,
        export_hf,
        is_complete,
        latest_of_folder,
        read_trainer_state,
        write_run_reward,
    )

    _writable(args.output, "the output folder", folder=True)  # transformers only logs that it cannot write a file
    check_output_folder(
        args.output,
        "the output folder",
        {"the checkpoint": [args.checkpoint]},
        makes=MODEL,
        files=EXPORT_FILES,
        writer="export",
    )
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "trainer_state.json").is_file():  # a run folder (or its checkpoints/): its latest
        latest = latest_of_folder(checkpoint)
        if latest is None:
            raise CheckpointError(
                f"{checkpoint} is neither a checkpoint (no trainer_state.json) nor a run folder "
                f"with a complete one: give runs/NAME/checkpoints/step_XXXXXXXX or runs/NAME"
            )
        print(f"exporting {latest}, the run's latest complete checkpoint")
        checkpoint = latest
    elif not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is incomplete (its writing was interrupted): export an earlier step")
    check_export_folder(args.output, checkpoint)
    cfg = load_config_dict(read_trainer_state(checkpoint)["config"])
    model, tokenizer = load_model(
        cfg.model.path, gguf_file=cfg.model.gguf_file, dtype=cfg.model.dtype, tokenizer=config_tokenizer(cfg.model)
    )
    out = export_hf(checkpoint, tokenizer, args.output, model=model, say=print)
    write_run_reward(out, checkpoint, to_dict(cfg)["reward"])
    print(f"wrote {out}")


def cmd_sft(args: argparse.Namespace) -> None:
    import dataclasses

    from longqa.train.sft import SFTOptions, run_sft

    options = SFTOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SFTOptions)})
    shape = [_flag(name) for name in SFT_NEW_MODEL_OPTIONS if getattr(args, name) != args.sft_defaults[name]]
    if options.init and shape:
        raise ConfigError(f"--init takes no {', '.join(shape)}: the model it names has its shape and vocabulary")
    _writable(options.output_dir, "--output-dir", folder=True)
    summary = run_sft(options, command="longqa " + shlex.join(args.argv))
    print(f"wrote {options.output_dir} ({summary['steps']} steps, {summary['train_minutes']} min)")


# The options that shape the new model `longqa sft` builds: --init, continuing from a model, takes none of them.
SFT_NEW_MODEL_OPTIONS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads")


def _save_results(args: argparse.Namespace, results: list[dict]) -> None:
    if args.json:
        import json

        path = Path(args.json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))


def _check_bench(args: argparse.Namespace, backend: str = "auto") -> None:
    """What a bench is asked for and cannot do, refused before it builds its model: a device this machine
    lacks, a kernel or attention backend the device cannot run, a --json that cannot be written."""
    from longqa.config.support import attention_backend_problem, decode_kernel_problem
    from longqa.model.load import pick_device

    device = pick_device(args.device, "--device").type
    kernel = getattr(args, "decode_kernel", None) or "auto"  # the benches that sample choose one
    problems = [
        f"{flag} {value}: {problem}"
        for flag, value, problem in (
            ("--backend", backend, attention_backend_problem(backend, device)),
            ("--decode-kernel", kernel, decode_kernel_problem(kernel, device)),
        )
        if problem
    ]
    if problems:
        raise ConfigError("; ".join(problems))
    if args.json:
        from longqa.outputs.paths import check_output_file

        check_output_file(_writable(args.json, "--json"), "--json")


def cmd_bench_train(args: argparse.Namespace) -> None:
    from longqa.bench.speed import bench_train

    _check_bench(args, args.backend)
    _save_results(
        args,
        bench_train(
            args.shape,
            args.prompt,
            args.response,
            args.n,
            tuple(args.layouts),
            args.repeat,
            args.device,
            0.0 if args.no_gradient_checkpointing else args.checkpoint_fraction,
            args.budget,
            args.backend,
            args.compile,
            activation_offload=args.activation_offload,
        ),
    )


def cmd_bench_rollout(args: argparse.Namespace) -> None:
    from longqa.bench.speed import bench_rollout

    _check_bench(args)
    _save_results(
        args,
        bench_rollout(
            args.shape,
            args.prompt,
            args.new_tokens,
            args.n,
            tuple(args.groups),
            args.hf_new_tokens,
            args.device,
            not args.no_cuda_graphs,
            _engine_options(args),
            args.lengths,
        ),
    )


def _engine_options(args: argparse.Namespace) -> dict:
    """The fast engine's decode-step choices a bench was asked for (the defaults are left out)."""
    return {
        **({"decode_kernel": args.decode_kernel} if args.decode_kernel else {}),
        **({"fused_decode": False} if args.no_fused_decode else {}),
        **(
            {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
            if args.speculative
            else {}
        ),
    }


def cmd_bench_step(args: argparse.Namespace) -> None:
    from longqa.bench.speed import bench_grpo_step

    _check_bench(args, args.backend)
    if args.overlap and args.profile:
        raise ConfigError(
            "--profile times a step's phases one after the other; --overlap runs them at once: choose one"
        )
    _save_results(
        args,
        bench_grpo_step(
            args.shape,
            args.prompt,
            args.response,
            args.n,
            args.prompts,
            args.steps,
            args.device,
            _engine_options(args),
            args.gradient_checkpointing,
            args.lengths,
            args.strategy,
            args.cpu_offload,
            args.budget,
            args.backend,
            args.profile,
            args.overlap,
        ),
    )


def cmd_cluster(args: argparse.Namespace) -> None:
    from longqa.distributed import cluster

    hosts = cluster.parse_hostfile(args.hostfile)
    if args.command == "up":
        cluster.run_steps(cluster.up_commands(hosts, args.port, args.ray), args.dry_run)
        print(cluster.reach_message(hosts, args.hostfile, args.port, args.dry_run))
    elif args.command == "down":
        cluster.run_steps(cluster.down_commands(hosts, args.ray), args.dry_run)
    else:
        cluster.run_steps(cluster.status_command(hosts, args.port, args.ray), args.dry_run)


def cmd_plan(args: argparse.Namespace) -> None:
    from longqa.config.checks import check_settings
    from longqa.planning.fit import Machine, check_run_plan, largest_shape, plan_run, shape_sizes
    from longqa.planning.host_memory import HOST_GIB_PER_GPU
    from longqa.planning.planner import GIB, check_run, describe_training, model_sizes, resolve_auto
    from longqa.planning.step_time import planned_lengths, step_time_config

    if args.largest and args.shape:
        raise ConfigError("--largest tries every known shape, --shape sizes one: give either")
    cfg = run_config(args)
    _check_plan_flags(args, cfg)
    gpu_bytes = int(args.gpu_memory_gib * GIB)
    read_sizes = (lambda _: shape_sizes(args.shape)) if args.shape else model_sizes
    if args.split:  # the rank rules are each split's own (plan_splits checks them per split); the others here
        check_settings(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sampler_ranks=0)))
        sizes = read_sizes(cfg)
        cfg, note = resolve_auto(cfg, args.gpus, gpu_bytes, sizes)
    elif args.largest:  # as the trainer checks it, one rank per GPU (each shape fills its own budget)
        check_run(cfg, args.gpus, machine=False)
    else:  # as the trainer checks it, one rank per GPU
        checked = check_run(cfg, args.gpus, machine=False, gpu_bytes=gpu_bytes, read_sizes=read_sizes)
        cfg, note, sizes = checked.config, checked.note, checked.sizes
    samplers = 0 if args.split else cfg.rollout.sampler_ranks
    args.gpus -= samplers  # the job's last ranks only sample: the plan is a training rank's, over the others
    per_node = args.gpus_per_node or min(args.gpus, 8)
    _check_sequence_parallel_node(cfg, per_node)
    used = min(args.gpus, per_node)  # the run's GPUs on a node: the default host memory is theirs
    host_gib = args.host_memory_gib or HOST_GIB_PER_GPU * used
    machine = Machine(args.gpus, gpu_bytes, per_node, int(host_gib * GIB))
    nodes_of = f" (nodes of {per_node}: the host memory is the share of the GPUs used)" if per_node > used else ""
    where = (
        f"{args.gpus} GPU(s) of {args.gpu_memory_gib:g} GiB, {used} per node{nodes_of} with {host_gib:g} GiB "
        f"of host memory"
    )
    if samplers:
        where += f" (the training ranks; {samplers} more GPU(s) only sample, rollout.sampler_ranks={samplers})"
    if args.largest:
        print(f"the largest Qwen3 shape on {where}, {describe_training(cfg)}:")
        for attempt in largest_shape(cfg, machine):
            ratio = f" actor.cpu_offload_ratio={attempt.offload_ratio:g}" if attempt.offload_ratio < 1 else ""
            print(
                f"  {attempt.shape}, actor.cpu_offload={str(attempt.cpu_offload).lower()}{ratio}: "
                + (
                    attempt.error
                    or f"fits (GPU {attempt.gpu.total / GIB:.1f} GiB, host {attempt.host.peak / GIB:.1f} GiB per node)"
                )
            )
        _print_longest_prompts(cfg, machine)
        return
    if note:
        print(note)
    if args.split:
        _plan_split(cfg, sizes, machine, args.response_length, f"{_count(sizes.params)} parameters on {where}")
        return
    gpu, host = plan_run(cfg, sizes, machine)
    step = step_time_config(cfg, sizes, gpu, per_node, args.response_length)
    lengths = planned_lengths(cfg, args.gpus, args.response_length)
    if isinstance(lengths, int):
        responses = f"responses of {lengths} tokens"
    else:
        flat = [length for group in lengths for length in group]
        responses = (
            f"responses of drawn lengths, mean {sum(flat) / len(flat):.0f} and longest {max(flat)} of "
            f"{cfg.data.max_response_length} tokens (rollout.response_lengths={cfg.rollout.response_lengths})"
        )
    print(
        f"{_count(sizes.params)} parameters on {where}, {describe_training(cfg, sizes.params, args.gpus)}:\n"
        f"GPU memory per GPU:\n{gpu.table()}\nhost memory per node:\n{host.table()}\n"
        f"step time per GRPO step ({cfg.data.train_batch_size} prompts x {cfg.rollout.n}, {responses}; H200s, the "
        f"fast engine):\n{step.table()}"
    )
    print(_kv_line(cfg, sizes, gpu))
    check_run_plan(cfg, gpu, host, sizes, per_node)
    print("fits")


def _kv_line(cfg, sizes, gpu) -> str:
    """The rollout's KV of one group beside the longest prompt one GPU's fast engine can hold a group of."""
    from longqa.planning.planner import DTYPE_BYTES, GIB, longest_kv_prompt

    limit = longest_kv_prompt(
        sizes, gpu.gpu_bytes, cfg.data.max_response_length, cfg.rollout.n, DTYPE_BYTES[cfg.model.dtype]
    )
    return (
        f"rollout KV of one group ({cfg.data.max_prompt_length:,}-token prompt once, {cfg.rollout.n} x "
        f"{cfg.data.max_response_length:,}-token responses): {gpu.kv_group / GIB:.1f} GiB on one GPU (the fast "
        f"engine has no tensor parallelism for the prompt's KV); a GPU that only samples holds it up to "
        f"{limit:,}-token prompts"
    )


def _print_longest_prompts(cfg, machine) -> None:
    """``longqa plan --largest``'s second answer: the longest prompt each shape trains on the machine."""
    from longqa.planning.fit import LONGEST_PROMPT, longest_prompts

    def length(tokens: int | None) -> str:  # (the search stops at LONGEST_PROMPT)
        return "none" if not tokens else f"{tokens:,}" + ("+" if tokens >= LONGEST_PROMPT else "")

    print(
        f"the longest prompt each shape trains (data.max_prompt_length, in steps of 1,024, with "
        f"{cfg.rollout.n} x {cfg.data.max_response_length:,}-token responses at one sample a micro-batch; "
        f"sequence parallelism within a node of {machine.gpus_per_node}):"
    )
    print(f"  {'shape':<14} {'cpu_offload':<12} {'sp=1':>10} {'with sp':>10} {'sp':>3} {'KV on one GPU':>14}")
    for row in longest_prompts(cfg, machine):
        print(
            f"  {row.shape:<14} {str(row.cpu_offload).lower():<12} {length(row.plain):>10} "
            f"{length(row.parallel):>10} {row.degree:>3} {row.kv_limit:>14,}"
        )
    print(
        "  (cpu_offload: actor.cpu_offload, as the config asks or true where that trains longer; KV on one GPU: "
        "the longest prompt whose group's KV the fast engine holds on one GPU beside its weights alone, on GPUs "
        "that only sample: it has no tensor parallelism for the prompt's KV)"
    )


def _check_plan_flags(args: argparse.Namespace, cfg: Config) -> None:
    """The flags of `longqa plan` that a run can have, ``--gpus`` set to its default (the config's Ray workers, else
    1): GPUs spanning nodes in whole nodes (the host memory and the links are planned per node), as many as the
    config's Ray workers, a mean response no longer than the longest one a step samples, and one question at a
    time (--largest or --split)."""
    workers = cfg.trainer.ray_workers if cfg.trainer.launcher == "ray" else None
    if args.gpus and workers and args.gpus != workers:
        raise ConfigError(
            f"--gpus {args.gpus}, but the config runs trainer.ray_workers={workers} Ray workers, one per "
            f"GPU: plan for --gpus {workers}, or set trainer.ray_workers={args.gpus}"
        )
    args.gpus = args.gpus or workers or 1
    gpus, per_node = args.gpus, args.gpus_per_node or min(args.gpus, 8)
    if gpus > per_node and gpus % per_node:  # (fewer than a node: the share of one)
        fewer, more = gpus // per_node * per_node, (gpus // per_node + 1) * per_node
        raise ConfigError(
            f"--gpus {gpus} spans nodes of --gpus-per-node {per_node}"
            f"{'' if args.gpus_per_node else ' (the default)'} but is not a whole number of them: "
            f"plan --gpus {fewer} or {more}, or give the nodes' own --gpus-per-node"
        )
    limit = cfg.data.max_response_length
    if args.response_length and args.response_length > limit:
        raise ConfigError(
            f"--response-length {args.response_length} is longer than data.max_response_length={limit}, "
            f"the longest response a step samples: give at most {limit}, or raise "
            f"data.max_response_length"
        )
    if args.largest and args.split:
        raise ConfigError("--largest tries every known shape, --split splits the GPUs of one: give either")


def _check_sequence_parallel_node(cfg: Config, per_node: int) -> None:
    """A sequence-parallel group within one node, where the all-to-alls around every attention use its links (the
    plan times them there)."""
    degree = cfg.actor.sequence_parallel_size
    if degree > per_node:
        raise ConfigError(
            f"actor.sequence_parallel_size={degree} spans nodes of --gpus-per-node {per_node}: the all-to-alls "
            f"around every layer's attention would cross the network; use at most {per_node}"
        )


def _plan_split(cfg, sizes, machine, response_length: int | None, what: str) -> None:
    """``longqa plan --split``: every split of the GPUs between sampler and training ranks, and the proposal."""
    from longqa.planning.planner import PlanError, describe_training
    from longqa.planning.split_plan import best_split, plan_splits, splits_table
    from longqa.planning.step_time import seconds

    colocated, splits = plan_splits(cfg, sizes, machine, response_length)
    print(
        f"{what}, {describe_training(cfg)}; rollout.mode=one_step_off with sampler ranks of their own "
        f"(rollout.sampler_ranks), each step's time per split (H200s, the fast engine):\n"
        f"{splits_table(colocated, splits)}"
    )
    best, together = best_split(splits), colocated.step.total
    if best is None and colocated.error is not None:
        raise PlanError("no layout of these GPUs fits, split or not: see each one's reason above")
    if best is None or (colocated.error is None and best.step_s >= together):
        why = (
            "no split fits"
            if best is None
            else f"the fastest split, rollout.sampler_ranks={best.samplers}, "
            f"would take {seconds(best.step_s)} s a step against {seconds(together)} s"
        )
        print(f"proposed: every GPU samples and trains (rollout.sampler_ranks=0): {why}")
        return
    speed = (
        f"{together / best.step_s:.2f}x the synchronous step's speed"
        if colocated.error is None
        else "every GPU sampling then training does not fit"
    )
    print(
        f"proposed: rollout.sampler_ranks={best.samplers} rollout.mode=one_step_off, {best.trainers} training "
        f"rank(s): {seconds(best.step_s)} s a step, {speed}"
    )


def _count(n: int) -> str:
    """A parameter count in the unit that shows it: 8.19B, 2.47M, 120,000."""
    for unit, size in (("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,}"


def _add_dataclass_args(p: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field of an options dataclass, typed by its annotation (``int | None``: an int or unset),
    its help the field's ``help`` metadata, else its default."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = _flag(f.name)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            p.add_argument(flag, dest=f.name, required=True, nargs="+" if "list" in str(f.type) else None)
        elif f.default_factory is not dataclasses.MISSING:
            p.add_argument(
                flag,
                dest=f.name,
                nargs="+",
                default=f.default_factory(),
                help=f"default {' '.join(map(str, f.default_factory())) or 'none'}",
            )
        else:
            kind = next(t for t in (*typing.get_args(hints[f.name]), hints[f.name]) if t is not type(None))
            p.add_argument(
                flag, dest=f.name, type=kind, default=f.default, help=f.metadata.get("help", f"default {f.default}")
            )


def _print_counts(output_dir: str, counts: dict[str, dict[str, int]]) -> None:
    print(f"wrote {output_dir}")
    for task, splits in counts.items():
        for split, n in splits.items():
            print(f"  {task}/{split}.parquet  {n} rows")


# --- the parser, one function per command group ----------------------------------------------------------
# `build_parser` composes them in the order `longqa --help` lists the commands.


def _add_data_commands(groups: argparse._SubParsersAction) -> None:
    """``longqa data loongrl|synth|prepare``: the files training reads."""
    data = groups.add_parser(
        "data",
        help="make training data",
        description="Make training data in verl's "
        "parquet schema and the recipe's folder layout (<task>/{train,test}.parquet, merged/).",
    )
    data_cmds = data.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = data_cmds.add_parser(
        "loongrl",
        help="the seed recipe's LoongRL-Train-Data, prepared as the recipe does",
        description="Download (or read locally) the six LoongRL-Train-Data subsets, concatenate "
        "each task's pair, keep verl's columns, prepend the <think>/\\boxed{} system prompt and "
        "split train/test per task with the recipe's seeded split.",
    )
    _add_layout_args(p, seed_help="split seed")
    p.add_argument(
        "--source",
        default="OldKingMeister/LoongRL-Train-Data",
        help="Hub dataset id, or a local folder holding the subsets as parquet/jsonl",
    )
    p.set_defaults(func=cmd_data_loongrl)

    p = data_cmds.add_parser(
        "synth",
        help="offline long-context multi-hop QA (no network needed)",
        description="Generate fictional multi-hop questions in the styles of HotpotQA, "
        "2WikiMultiHopQA and MuSiQue over long contexts of supporting and distractor documents, "
        "optionally with LoongRL's KeyChain. The same seed gives byte-identical files.",
    )
    _add_layout_args(p, seed_help="generation and split seed")
    p.add_argument("--rows-per-task", type=COUNT, default=400, help="rows per task before the split (default 400)")
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--context-tokens",
        type=int,
        default=1024,
        help="target context length in tokens (default 1024): contexts end within 10%% of it, "
        "and how many did not (a short target cannot hold the passages some questions need) is "
        "said",
    )
    length.add_argument(
        "--context-lengths",
        type=int,
        nargs="+",
        metavar="TOKENS",
        help="the same questions at each of these context lengths, longer contexts adding only "
        "distractor passages: ctx<TOKENS>/ holds each length's files, merged/ every length's "
        "(longqa eval and validation then score accuracy per length; default: one length, "
        "--context-tokens)",
    )
    p.add_argument("--tasks", nargs="+", default=["hotpotqa", "musique", "2wikimqa"], help="tasks to generate")
    p.add_argument("--min-hops", type=int, default=2, help="fewest hops of MuSiQue-style chains (default 2)")
    p.add_argument("--max-hops", type=int, default=4, help="most hops of MuSiQue-style chains (default 4)")
    p.add_argument("--keychain", action="store_true", help="insert LoongRL-style UUID KeyChains")
    p.add_argument(
        "--near-misses",
        action="store_true",
        help="distractors that are near misses of the answer chain: at each of its links, an entity "
        "of the same kind with a look-alike name whose same relations lead, fact by fact, to a wrong "
        "answer of the answer's type (chain questions; their passages are the first distractors added)",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer folder, tokenizer.json or a model's .gguf file that measures "
        "context length (default: a built-in approximate count)",
    )
    p.add_argument("--workers", type=COUNT, default=1, help="processes generating rows (default 1)")
    p.set_defaults(func=cmd_data_synth)

    p = data_cmds.add_parser(
        "prepare",
        help="tokenize data.train_files / data.val_files into the prompt cache",
        description="Validate rows, apply the tokenizer's chat template, filter or truncate "
        "overlong prompts and cache the token ids; prints what was kept and dropped.",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_data_prepare)


def _add_model_commands(groups: argparse._SubParsersAction) -> None:
    """``longqa train``, ``eval`` and ``export``: a policy trained, scored, and written out."""
    from longqa.reward import REWARD_MODES

    p = groups.add_parser(
        "train",
        help="GRPO training (no arguments: the embedded default demo on the CPU)",
        description="GRPO training from a YAML config plus key=value overrides. With no config it "
        "runs the embedded default: the committed small model on synthetic data generated on "
        "first use (configs/demo.yaml), and prints where the report is. On SIGTERM or SIGINT it "
        "saves the last finished step and exits with status 75: rerun the same command to "
        "resume.",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = groups.add_parser(
        "eval",
        help="greedy evaluation: accuracy, EM and F1 per data source",
        description="Greedy answers of a model on verl-schema files, scored per data_source with "
        "the hardened reward, exact match and token F1; a table, optional JSON and samples. "
        "With --longbench: greedy answers to LongBench v1's HotpotQA, 2WikiMultiHopQA and "
        "MuSiQue files (longqa's prompt, the \\boxed{} answer), written as LongBench prediction "
        "files and scored with LongBench's F1, overall and per length (0-4k, 4-8k, 8k+ words). "
        "With --longbench-scores: the same scores of prediction files any system wrote.",
    )
    p.add_argument("--model", default=None, help="model folder, hub id or GGUF file (default: the embedded model)")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--data", nargs="+", help="parquet/jsonl files in verl's schema")
    inputs.add_argument(
        "--longbench",
        metavar="DATA_DIR",
        help="a folder with LongBench's hotpotqa.jsonl, 2wikimqa.jsonl and/or musique.jsonl",
    )
    inputs.add_argument(
        "--longbench-scores",
        metavar="PRED_DIR",
        help="score the LongBench prediction files <dataset>.jsonl in PRED_DIR (no model); writes PRED_DIR/result.json",
    )
    p.add_argument(
        "--max-new-tokens",
        type=COUNT,
        default=256,
        help="most tokens of each response: the responses it cuts are counted and said",
    )
    p.add_argument(
        "--max-prompt-length",
        type=COUNT,
        default=16384,
        help="most prompt tokens: a longer prompt is left out with --data, and loses its middle "
        "with --longbench (as in LongBench)",
    )
    p.add_argument("--batch-size", type=COUNT, default=64, help="most prompts answered at once")
    p.add_argument(
        "--engine",
        choices=("auto", "fast", "hf"),
        default="auto",
        help="what answers: the fast rollout engine (its KV cache sized from free GPU memory, prefill "
        "in chunks: long prompts in bounded memory), transformers' generate on padded batches (hf), "
        "or auto: fast on a GPU where it can hold the model, else hf",
    )
    p.add_argument(
        "--mode",
        choices=REWARD_MODES,
        help="reward mode that decides accuracy (default: the environment's REWARD_CALC_TYPE when set, else "
        "hardened); for a model `longqa export` wrote, the output says whether its run validated with the same",
    )
    p.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip and count rows that break verl's schema instead of stopping at the first",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the weights' and activations' type while answering; auto: bfloat16 on a GPU (as training "
        "there computes), float32 on the CPU",
    )
    p.add_argument(
        "--output",
        help="write the scores as JSON here (with --longbench: the folder for the "
        "prediction files and result.json; default: not written)",
    )
    p.add_argument("--samples", help="write every answer as JSONL here, with why it ended (default: not written)")
    p.add_argument(
        "--limit",
        type=COUNT,
        help="answer the first N rows of each --data file or LongBench set (quick runs; default: every row)",
    )
    p.set_defaults(
        func=cmd_eval,
        eval_defaults={dest: p.get_default(dest) for options, _ in EVAL_UNUSED_OPTIONS.values() for dest in options},
    )

    p = groups.add_parser(
        "export",
        help="a checkpoint as a Hugging Face folder (safetensors + tokenizer)",
        description="Write checkpoint CHECKPOINT (or a run's latest complete one) as a folder "
        "that transformers (and vLLM) load. The output folder must be new, empty, or a previous "
        "export (only the files an export writes: config, safetensors weights, tokenizer), which "
        "is replaced; a folder inside the run's checkpoints folder is refused, since training "
        "deletes old checkpoints there, and so is a folder another command made (a longqa sft "
        "model, a run or data folder).",
    )
    p.add_argument("checkpoint", help="runs/NAME/checkpoints/step_XXXXXXXX, or a run folder runs/NAME")
    p.add_argument("output", help="output folder: new, empty, or a previous export to replace")
    p.set_defaults(func=cmd_export)


def _add_sft_command(groups: argparse._SubParsersAction) -> None:
    """``longqa sft``: its flags are the fields of ``SFTOptions``, so the two cannot drift apart."""
    from longqa.config.sft_options import SFTOptions

    p = groups.add_parser(
        "sft",
        help="supervised warm-up on reference responses (builds the embedded default)",
        description="Train a model on the reference responses of verl-schema rows "
        "(extra_info.reference_response, written by `longqa data synth`): a new small Qwen3 with a "
        "tokenizer trained on the data, or --init MODEL to continue from one. Evaluates greedy "
        "held-out accuracy as it goes and writes the model folder with a model card. The output "
        "folder must be new, empty, or a previous longqa sft folder, which is replaced: an export "
        "or any other model folder, a run or data folder is refused.",
    )
    _add_dataclass_args(p, SFTOptions)
    p.set_defaults(func=cmd_sft, sft_defaults={name: p.get_default(name) for name in SFT_NEW_MODEL_OPTIONS})


def _add_bench_args(p: argparse.ArgumentParser, func) -> None:
    """The arguments every bench takes: model shape, prompt, n, device, JSON output."""
    from longqa.model.shapes import SHAPES

    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b", help="the model's shape")
    p.add_argument("--prompt", type=COUNT, default=8192, help="prompt tokens (default 8192)")
    p.add_argument("-n", type=COUNT, default=8, help="samples per prompt (default 8)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--json", help="also write the results here (default: not written)")
    p.set_defaults(func=func)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The fast engine's decode-step choices, and the responses' lengths, for the benches that sample."""
    from typing import get_args, get_type_hints

    from longqa.config.schema import RolloutConfig
    from longqa.rollout.lengths import LENGTH_KINDS

    # rollout.speculative's methods, read from the schema: the engine's module would load torch for --help
    methods = [m for m in get_args(get_type_hints(RolloutConfig)["speculative"]) if m != "off"]

    p.add_argument(
        "--decode-kernel",
        choices=["bmm", "triton"],
        help="fast engine decode attention (default: the engine's choice, triton on a GPU with Triton)",
    )
    p.add_argument("--no-fused-decode", action="store_true", help="decode through the model's own modules")
    p.add_argument(
        "--speculative",
        choices=methods,
        help="fast engine speculative decoding (drafts from each sample's own text, verified in the "
        "step; random prompts and weights give no right drafts, so a step then measures the cost of "
        "verifying k+1 tokens per sample; default: off)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=COUNT,
        default=4,
        metavar="K",
        help="with --speculative: most drafted tokens per sample and step (default 4)",
    )
    p.add_argument(
        "--lengths",
        choices=LENGTH_KINDS,
        default="lognormal",
        help="each response's length (a random-weight model never samples EOS): drawn from a log-normal "
        "clipped to the maximum, mean about 40%% of it (default), or the maximum for all",
    )


def _add_bench_commands(groups: argparse._SubParsersAction) -> None:
    """``longqa bench train|rollout|step``: speed on random-weight models of real shapes."""
    bench = groups.add_parser(
        "bench",
        help="speed of the training layouts on random-weight models",
        description="Benchmarks on random-weight models of real shapes (no download).",
    )
    bench_cmds = bench.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = bench_cmds.add_parser(
        "train",
        help="forward+backward of one group: naive padded vs shared-prompt packed",
        description="Seconds per group of N samples of one prompt through the actor's code "
        "path, tokens/s, speed-up, MFU (model FLOPs, recompute excluded, over the H200 bf16 "
        "peak) and peak memory. bf16 on CUDA, float32 on the CPU.",
    )
    _add_bench_args(p, cmd_bench_train)
    p.add_argument("--response", type=COUNT, default=1024, help="tokens of each response (default 1024)")
    p.add_argument(
        "--layouts", nargs="+", choices=["naive", "packed"], default=["naive", "packed"], help="the layouts to time"
    )
    p.add_argument("--repeat", type=COUNT, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument(
        "--backend", choices=["auto", "dense", "flex", "split"], default="auto", help="packed attention backend"
    )
    p.add_argument("--budget", type=COUNT, help="micro-batch token budget (default: one packed group)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument(
        "--checkpoint-fraction",
        type=_fraction,
        default=1.0,
        help="fraction of decoder layers recomputed in the backward pass (default 1: all)",
    )
    p.add_argument(
        "--activation-offload",
        type=_fraction,
        default=0.0,
        help="fraction of decoder layers (the first, before the recomputed ones) whose activations wait "
        "in host memory (default 0)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")

    p = bench_cmds.add_parser(
        "rollout",
        help="sampling speed: transformers generate vs the fast engine",
        description="New tokens/s for n samples of random prompts (temperature 1, each "
        "response ending at its --lengths length): transformers' generate for one group, the "
        "fast engine for each --groups count, the fast engine's decode time against its "
        "HBM-bandwidth floor for those lengths (an H200's: null on a CPU) and how full it kept "
        "its slots.",
    )
    _add_bench_args(p, cmd_bench_rollout)
    p.add_argument("--new-tokens", type=COUNT, default=1024, help="most new tokens per sample (default 1024)")
    p.add_argument("--groups", type=COUNT, nargs="+", default=[1, 16], help="prompts per run (default 1 16)")
    p.add_argument(
        "--hf-new-tokens", type=_within(0), help="most new tokens for transformers (default --new-tokens; 0 skips)"
    )
    p.add_argument("--no-cuda-graphs", action="store_true")
    _add_engine_args(p)

    p = bench_cmds.add_parser(
        "step",
        help="a whole GRPO step: fast-engine rollout + packed update, per phase",
        description="Seconds per phase of GRPO steps on a random-weight model: rollout with "
        "the fast engine, rewards (random: such a model cannot answer) and advantages, one "
        "packed shared-prompt update, and each phase against an H200's floor (null on a "
        "CPU). The first step includes warm-up.",
    )
    _add_bench_args(p, cmd_bench_step)
    p.add_argument("--response", type=COUNT, default=1024, help="most new tokens per sample (default 1024)")
    p.add_argument("--prompts", type=COUNT, default=16, help="prompts per step (default 16)")
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (off, as in longqa train)",
    )
    p.add_argument("--steps", type=COUNT, default=2, help="GRPO steps to time")
    p.add_argument(
        "--budget",
        type=COUNT,
        help="micro-batch token budget of the update (default: one group of --prompt + n x --response tokens)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "dense", "flex", "split"],
        default="auto",
        help="the update's packed attention, as actor.attention_backend (default auto)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the last step: per phase, the device's busy time and its costliest kernels",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="sample each next step while this step's update runs, from weights one update old, as "
        "rollout.mode=one_step_off rollout.overlap=true (not with --profile)",
    )
    p.add_argument(
        "--strategy",
        choices=["fsdp2", "deepspeed"],
        default="fsdp2",
        help="as actor.strategy; deepspeed: ZeRO-3 in a process group of one (default fsdp2: unsharded "
        "unless --cpu-offload)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="as actor.cpu_offload: the optimizer on the host (FSDP2 with torch's AdamW, or ZeRO-3 with "
        "DeepSpeed's CPU Adam)",
    )
    _add_engine_args(p)


def _add_scale_out_commands(groups: argparse._SubParsersAction) -> None:
    """``longqa cluster up|down|status`` and ``longqa plan``: the machines, and whether a run fits them."""
    from longqa.model.shapes import SHAPES

    cluster_p = groups.add_parser(
        "cluster",
        help="a Ray cluster over ssh from a hostfile",
        description="Start, stop or inspect a Ray cluster on the hosts of an MPI-style "
        "hostfile ('IP slots=N' per line; # comments and blank lines allowed). The first host "
        "runs the head; every command is printed before it runs.",
    )
    cluster_cmds = cluster_p.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, text in (
        ("up", "stop any Ray on the hosts, start the head on the first and workers on the rest"),
        ("down", "stop Ray on every host"),
        ("status", "print the cluster's resources"),
    ):
        p = cluster_cmds.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("--hostfile", required=True, help="one 'IP slots=N' per line")
        if name != "down":  # stopping Ray needs no port
            p.add_argument("--port", type=PORT, default=6379, help="the head's port (default 6379)")
        p.add_argument("--ray", default="ray", help="the ray executable on the hosts (default: ray)")
        p.add_argument("--dry-run", action="store_true", help="print the commands without running them")
        p.set_defaults(func=cmd_cluster)

    p = groups.add_parser(
        "plan",
        help="GPU and host memory and step time of a run; refused with what to change when it cannot fit",
        description="Estimate per-GPU memory of CONFIG on --gpus GPUs (model sharded over them): "
        "training state, unsharded layers, activations of one micro-batch, the rollout engine's "
        "weights and KV cache; the host memory of a node (the model read on every rank, the "
        "offloaded state and activations); and the time of one GRPO step by phase. Exits 2 with "
        "the settings to change when either memory cannot hold it.",
    )
    _add_config_args(p)
    p.add_argument(
        "--gpus",
        type=COUNT,
        help="GPUs the model is sharded over (default: the config's "
        "trainer.ray_workers under trainer.launcher=ray, else 1)",
    )
    p.add_argument(
        "--gpu-memory-gib", type=_within(1, kind=float), default=141.0, help="memory of one GPU (default 141, an H200)"
    )
    p.add_argument(
        "--gpus-per-node",
        type=COUNT,
        help="GPUs of one node (default: --gpus, at most 8); --gpus past one node fills whole nodes",
    )
    p.add_argument(
        "--host-memory-gib",
        type=_within(1, kind=float),
        help="host memory of one node (default: 125 per GPU the run uses on the node, what the kernel "
        "counts on the measurement machines; an 8-GPU H200 server often has more)",
    )
    p.add_argument(
        "--response-length",
        type=COUNT,
        help="mean response length for the step time (default, and at most, data.max_response_length)",
    )
    p.add_argument(
        "--shape", choices=sorted(SHAPES), help="a known model shape to plan for (default: model.path's config)"
    )
    p.add_argument(
        "--largest",
        action="store_true",
        help="instead: the largest known shape that fits, as CONFIG asks or with actor.cpu_offload=true",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="instead: each split of the --gpus between sampler ranks and training ranks "
        "(rollout.sampler_ranks with rollout.mode=one_step_off), its step time next to the synchronous "
        "step on all of them, and the fastest split that fits",
    )
    p.set_defaults(func=cmd_plan)


def _add_config_commands(groups: argparse._SubParsersAction) -> None:
    """``longqa config show|keys``: the config tree a run would use, and every key it accepts."""
    config = groups.add_parser(
        "config",
        help="show the config",
        description="The typed config tree: YAML plus dotted key=value overrides, checked before any work starts.",
    )
    config_cmds = config.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    p = config_cmds.add_parser(
        "show",
        help="print the resolved config",
        description="Print the config after applying CONFIG and the overrides.",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_config_show)
    p = config_cmds.add_parser("keys", help="list every key with its help and default")
    p.add_argument(
        "--verl",
        action="store_true",
        help="list instead the verl launch keys longqa takes and the longqa setting each becomes",
    )
    p.set_defaults(func=cmd_config_keys)


def build_parser() -> argparse.ArgumentParser:
    # The version the package states itself (pyproject.toml reads the same attribute), not the installed metadata,
    # which a source checkout run as `PYTHONPATH=src python -m longqa.cli` does not have.
    parser = _Parser(prog="longqa", description=DESCRIPTION, formatter_class=_RootFormatter)
    parser.add_argument("--version", action="version", version=f"longqa {__version__}")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    _add_data_commands(groups)
    _add_model_commands(groups)
    _add_sft_command(groups)
    _add_bench_commands(groups)
    _add_scale_out_commands(groups)
    _add_config_commands(groups)
    return parser


def _reported_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line (a bad input, not a bug). Imported only when something
    fails, so that parsing, --help and the light commands do not load torch."""
    from longqa.data.io import DataFileError
    from longqa.data.loongrl import SourceError
    from longqa.distributed.cluster import HostfileError
    from longqa.model.load import ModelError
    from longqa.model.tokenizer import TokenizerError
    from longqa.planning.planner import PlanError
    from longqa.rollout.fast import KVBudgetError
    from longqa.train.actor import TrainingError
    from longqa.train.checkpoint import CheckpointError

    return (
        ConfigError,
        DataFileError,
        SourceError,
        TokenizerError,
        ModelError,
        CheckpointError,
        TrainingError,
        KVBudgetError,
        HostfileError,
        PlanError,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with ``key=value`` overrides also after options (``longqa plan CONFIG --gpus 8
    rollout.n=16``): argparse alone takes positionals only before an option that follows them."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    late = [arg for arg in extra if "=" in arg and not arg.startswith("-")]
    if late != extra or (late and not hasattr(args, "overrides")):
        parser.parse_args(argv)  # says what it does not recognise, and exits
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv  # the command as typed, for records such as the model card
    try:
        code = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before training installs its own handler (loading, building): no traceback
        print("longqa: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # a path that cannot be read or written (an output folder on a read-only disk, say) is the user's to fix
        if not isinstance(e, _reported_errors()) and not (isinstance(e, OSError) and e.filename):
            raise
        print(f"longqa: error: {e}", file=sys.stderr)
        return 2
    return code or 0  # a command returns a status only when it has one to tell


if __name__ == "__main__":
    sys.exit(main())
