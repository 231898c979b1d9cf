"""``longqa sft``: supervised warm-up on reference responses, and how the embedded default is made.

GRPO learns only from rewards it sometimes earns, so a model must already answer some questions
before RL can help. No downloadable small model can read our contexts (see the model card), so longqa
builds one: a byte-level BPE tokenizer trained on the data, a small Qwen3 built from its config, and
cross-entropy on the response tokens only (``<think> facts </think> \\boxed{answer}``, written by
``longqa data synth``). The reasoning spells out each supporting fact, which turns every hop of a
multi-hop question into one copy from the context: the thing a small transformer can learn.
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from longqa.config import ConfigError
from longqa.config.sft_options import SFTOptions
from longqa.data.io import DataFileError, iter_rows
from longqa.data.prompts import PromptOptions, PromptSet, prepare_prompts
from longqa.evaluation.evaluate import answer_engine, describe_prompt_losses, evaluate, format_table, prompt_counts
from longqa.model.load import (
    DTYPES,
    answer_dtype,
    load_model,
    load_model_config,
    load_model_tokenizer,
    pick_device,
    qwen3_config,
    raise_position_limit,
    set_max_positions,
)
from longqa.model.logprobs import token_logprobs
from longqa.model.tokenizer import train_tokenizer
from longqa.outputs.layout import EXPORT_FILES, MODEL_CARD, SFT_SUMMARY
from longqa.outputs.paths import SFT_MODEL, check_output_folder
from longqa.planning.planner import ModelSizes, check_sft
from longqa.train.batching import budget_batches, collate_right
from longqa.train.checkpoint import follow_umask

END_OF_TURN = "<|im_end|>"
# What `longqa sft` writes in its folder: a model folder's files, its model card and its summary.
SFT_FILES = (*EXPORT_FILES, MODEL_CARD, SFT_SUMMARY)


THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
EVAL_BATCH = 256  # held-out prompts answered at once


def without_thinking(response: str) -> str:
    """The same answer with an empty reasoning block, the way Qwen3 answers in non-thinking mode."""
    return THINK_BLOCK.sub("<think> </think>", response, count=1)


def _responses(rows_meta: list[dict], key: str, no_think_fraction: float = 0.0, seed: int = 0) -> list[str]:
    """Training targets; a seeded share of them without reasoning.

    A model trained on both styles (a hybrid thinking model, as Qwen3 is) chooses at its first
    token whether to reason. Reasoning answers multi-hop questions far better, so GRPO has a
    choice to learn that pays off on every question, not one memorised answer at a time.
    """
    rng = random.Random(seed)
    out = []
    for m in rows_meta:
        text = (m.get("extra_info") or {}).get(key)
        if not isinstance(text, str) or not text:
            raise DataFileError(f"row {m['row']} of file {m['file']} has no extra_info.{key} to train on")
        if rng.random() < no_think_fraction:
            text = without_thinking(text)
        out.append(text + END_OF_TURN)
    return out


def _tokenizer_for(options: SFTOptions):
    """A new tokenizer trained on the first 20,000 rows' prompts and responses."""
    sample = []
    for path in options.train_files:
        for i, row in enumerate(iter_rows(path)):
            if i >= 20_000:
                break
            sample.extend(m["content"] for m in row["prompt"])
            sample.append((row.get("extra_info") or {}).get(options.response_key, ""))
    return train_tokenizer(sample, vocab_size=options.vocab_size)


def _examples(prompts: PromptSet, tokenizer, options: SFTOptions) -> tuple[list[np.ndarray], np.ndarray]:
    """Each example's ids (prompt then response) and where its response starts."""
    responses = _responses(prompts.meta, options.response_key, options.no_think_fraction, options.seed)
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(responses, add_special_tokens=False)
    ids, starts = [], []
    for i, enc in enumerate(encodings):
        prompt = prompts.ids(i)
        ids.append(np.concatenate([prompt, np.asarray(enc.ids, dtype=np.int32)]))
        starts.append(len(prompt))
    return ids, np.asarray(starts)


class PositionLimitError(ConfigError):
    """A training example is longer than the model's position limit: the limit (``--max-positions``) or the
    prompts' (``--max-prompt-length``) is what to change. A ``ConfigError``, reported in one line."""


def check_positions(longest: int, limit: int) -> None:
    """Refuse examples longer than the model's position limit before training on them: a RoPE model would
    train on the extra positions without complaint, and a model whose declared limit is too short would
    then be refused, or cut, by the tools that trust the limit (vLLM, for one)."""
    if longest > limit:
        raise PositionLimitError(
            f"the longest training example has {longest} tokens, more than the model's "
            f"{limit} positions: raise --max-positions or lower --max-prompt-length"
        )


def _batches(lengths: np.ndarray, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Length-sorted buckets cut to a padded-token budget, in random order: little padding, no bias."""
    order = np.argsort(lengths + np.asarray([rng.random() for _ in range(len(lengths))]), kind="stable")
    batches = budget_batches(lengths, order, batch_tokens)
    rng.shuffle(batches)
    return batches


def _collate(examples: list[np.ndarray], starts: np.ndarray, index: list[int], pad: int, device):
    ids, mask, response = collate_right([examples[i] for i in index], [int(starts[i]) for i in index], pad)
    labels = ids.masked_fill(~response, -100)  # the loss is on response tokens only
    return ids.to(device), mask.to(device), labels.to(device)


def sft_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the response tokens (``labels`` other than -100), through the GRPO update's chunked
    LM head (``model/logprobs.py``): logits exist one chunk of tokens at a time. The model's own loss would make
    them for the whole batch at once: 131,072 tokens of a 49,152-entry vocabulary are 25.8 GB in float32, and
    its softmax and gradient as much again each.

    No attention mask: rows are right-padded, so causal attention already keeps every real token from the
    padding after it, and the log-probs of real tokens are those a masked forward gives. With a padding mask SDPA
    would keep an additive ``[rows, L, L]`` copy of it in every layer for the backward pass (32 GiB for a
    131,072-token batch of 4,400-token rows in SmolLM2-135M's 30 layers) and could not run its flash kernels."""
    targets = labels != -100
    logp, _ = token_logprobs(model, ids, None, targets)
    return -logp.sum() / targets[:, 1:].sum().clamp(min=1)


def sft_autocast(device: torch.device, enabled: bool | None = None):
    """The precision ``longqa sft`` computes in: float32 weights, bfloat16 matmuls and attention on a GPU."""
    enabled = device.type == "cuda" if enabled is None else enabled
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _model_config(options: SFTOptions):
    """``(config, tokenizer)`` of the model to train, before any weight exists: ``--init``'s (with the position
    limit ``--max-positions`` raises), or a new Qwen3's on a tokenizer trained on the data."""
    if options.init:
        config, tokenizer = load_model_config(options.init), load_model_tokenizer(options.init)
        if options.max_positions is not None:
            raise_position_limit(config, options.max_positions)
        return config, tokenizer
    tokenizer = _tokenizer_for(options)
    positions = options.max_positions
    if positions is None:
        positions = max(4096, 2 * options.max_prompt_length)
    config = qwen3_config(
        len(tokenizer),
        options.hidden_size,
        options.num_layers,
        options.num_heads,
        options.num_kv_heads,
        max_positions=positions,
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        pad_token_id=tokenizer.pad_token_id,
    )
    return config, tokenizer


def _model(options: SFTOptions, config, tokenizer, device: torch.device):
    """The model ``_model_config`` described, on ``device``: ``--init``'s weights, or new random ones."""
    if options.init:
        model, _ = load_model(options.init, device=device, tokenizer=tokenizer)
        if options.max_positions is not None:
            set_max_positions(model, options.max_positions)
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)


def _lr_at(step: int, options: SFTOptions, time_fraction: float) -> float:
    """Warmup, then cosine over whichever budget runs out first: steps or minutes."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    progress = min(
        1.0, max(time_fraction, (step - options.warmup_steps) / max(1, options.max_steps - options.warmup_steps))
    )
    floor = options.lr * options.min_lr_ratio
    return floor + (options.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def check_output(options: SFTOptions) -> None:
    """Refuse, before any work, an output folder that holds what sft reads, or that another command made: an
    export or another model it would overwrite, a data or run folder it would fill with model files."""
    reads = {"--train-files": options.train_files, "--eval-files": options.eval_files, "--init": [options.init]}
    check_output_folder(
        options.output_dir, "--output-dir", reads, makes=SFT_MODEL, files=SFT_FILES, writer="longqa sft"
    )


def run_sft(options: SFTOptions, command: str = "") -> dict:
    """Train, evaluate every ``eval_every`` steps, save the model folder and its card; return the summary."""
    check_output(options)
    torch.manual_seed(options.seed)
    rng = random.Random(options.seed)
    device = pick_device(options.device, "--device")
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    config, tokenizer = _model_config(options)
    prompt_options = PromptOptions(options.max_prompt_length)
    train = prepare_prompts(
        options.train_files, tokenizer, prompt_options, length_setting="--max-prompt-length", skip_setting=None
    )
    print("\n".join(describe_prompt_losses(train, prompt_options, "train")), flush=True)
    examples, starts = _examples(train, tokenizer, options)
    lengths = np.asarray([len(e) for e in examples])
    check_positions(int(lengths.max()), config.max_position_embeddings)
    memory = {}
    if device.type == "cuda":  # refuse a batch budget that cannot fit before any weight is read
        gpu = torch.cuda.get_device_properties(device).total_memory
        need = check_sft(
            ModelSizes.from_config(config), gpu_bytes=gpu, batch_tokens=options.batch_tokens, longest=int(lengths.max())
        )
        memory = {"planned_gib": round(need / 2**30, 1), "gpu_gib": round(gpu / 2**30, 1)}
    model = _model(options, config, tokenizer, device)
    held_out = None
    if options.eval_files:
        held_out = prepare_prompts(
            options.eval_files, tokenizer, prompt_options, length_setting="--max-prompt-length", skip_setting=None
        )
        print("\n".join(describe_prompt_losses(held_out, prompt_options, "held-out")), flush=True)
        keep = min(options.eval_rows, len(held_out))
        held_out = PromptSet(held_out.token_ids, held_out.offsets[: keep + 1], held_out.meta[:keep], held_out.stats)
    max_new = int(max(len(e) - s for e, s in zip(examples, starts))) + 16
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "examples": len(examples),
                "tokens": int(lengths.sum()),
                "params": params,
                "vocab": len(tokenizer),
                **memory,
                "prep_s": round(time.perf_counter() - start, 1),
            }
        ),
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    budget_s = 60 * options.max_minutes
    log, step, epoch, tokens_seen = [], 0, 0, 0
    train_start = time.perf_counter()

    def run_eval() -> dict:
        # On a GPU the answers come from the fast engine, as in `longqa eval`, and in the type it answers in there
        # (bfloat16, the type the weights are saved in): generate's padded batches of long prompts outgrow the
        # memory training leaves. The engine (its copy, its KV cache) lives for this evaluation only: the memory
        # check planned training without it.
        engine = answer_engine(model, tokenizer, "auto", EVAL_BATCH, DTYPES[answer_dtype("auto", device)])
        result = evaluate(model, tokenizer, held_out, max_new_tokens=max_new, batch_size=EVAL_BATCH, engine=engine)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        entry = {"step": step, "minutes": round((time.perf_counter() - train_start) / 60, 2), **result["all"]}
        log.append(entry)
        print(json.dumps(entry), flush=True)
        return result

    model.train()
    done = False
    while not done:
        for batch in _batches(lengths, options.batch_tokens, rng):
            ids, mask, labels = _collate(examples, starts, batch, tokenizer.pad_token_id, device)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, options, (time.perf_counter() - train_start) / budget_s)
            with sft_autocast(device):
                loss = sft_loss(model, ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += int(mask.sum())
            if step % 50 == 0:
                print(
                    json.dumps(
                        {
                            "step": step,
                            "epoch": epoch,
                            "loss": round(loss.item(), 4),
                            "tokens_per_s": round(tokens_seen / (time.perf_counter() - train_start)),
                        }
                    ),
                    flush=True,
                )
            if held_out is not None and step % options.eval_every == 0:
                run_eval()
            if step >= options.max_steps or time.perf_counter() - train_start > budget_s:
                done = True
                break
        epoch += 1

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    follow_umask(out.glob("*.safetensors"))
    model.float()
    summary = {
        "steps": step,
        "epochs_started": epoch,
        "train_minutes": round((time.perf_counter() - train_start) / 60, 2),
        "params": params,
        "architecture": type(model).__name__,
        "shape": {
            k: getattr(model.config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
            )
        },
        "examples": len(examples),
        "train_prompts": prompt_counts(train),
        "tokens_seen": tokens_seen,
        "device": str(device),
        "options": asdict(options),
        "commit": _git_commit(),
        "command": command,
        "evals": log,
    }
    if held_out is not None:
        final = run_eval()
        log[-1]["saved_weights"] = True  # after rounding to the bfloat16 that is stored
        summary["final"] = final
        print(format_table(final), flush=True)
    (out / SFT_SUMMARY).write_text(json.dumps(summary, indent=1))
    write_model_card(out, summary)
    return summary


def write_model_card(out: Path, summary: dict) -> None:
    """How the model was made, so anyone can rebuild it and knows what to expect of it."""
    o, shape = summary["options"], summary["shape"]
    origin = f"continued from `{o['init']}`" if o.get("init") else "trained from scratch"
    lines = [
        f"# {out.name}",
        "",
        f"A {summary['architecture']} {origin} by `longqa sft` on synthetic long-context multi-hop QA (`longqa "
        "data synth`): it reads the passages, writes the supporting facts inside `<think>` and the answer inside "
        "`\\boxed{}`" + ("." if o.get("init") else "; it knows nothing beyond that synthetic world."),
        "",
        f"- parameters: {summary['params']:,} (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, vocabulary "
        f"{shape['vocab_size']}, {shape['max_position_embeddings']:,} positions), stored in bfloat16",
        f"- training: {summary['steps']} steps, {summary['tokens_seen']:,} tokens, {summary['train_minutes']} min on "
        f"{summary['device']}, lr {o['lr']} (cosine to {o['min_lr_ratio']}x), {o['batch_tokens']} tokens per batch, "
        f"seed {o['seed']}",
        f"- longqa commit: {summary['commit']}",
        "",
        "## Command",
        "",
        "```bash",
        summary["command"] or "(called from Python)",
        "```",
        "",
    ]
    if "final" in summary:
        a = summary["final"]["all"]
        lines += [
            "## Held-out accuracy (greedy, hardened reward)",
            "",
            f"- accuracy {a['accuracy']:.3f} (EM {a['em']:.3f}, F1 {a['f1']:.3f}) on {a['n']} questions",
            f"- guessing baseline: {a.get('guess_baseline', float('nan')):.3f} (pick at random an entity of "
            f"the asked type named in the context)",
            "",
        ]
        lines += ["| step | minutes | accuracy |", "| ---: | ---: | ---: |"]
        lines += [
            f"| {e['step']}{' (saved bf16 weights)' if e.get('saved_weights') else ''} | {e['minutes']} | "
            f"{e['accuracy']:.3f} |"
            for e in summary["evals"]
        ]
    (out / MODEL_CARD).write_text("\n".join(lines) + "\n")
