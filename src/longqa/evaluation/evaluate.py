"""Greedy evaluation: answers for held-out prompts, scored per data source (hardened reward, EM, F1).

The answers come from one of two engines (``answer_engine``). On a GPU, the fast rollout engine the trainer
samples with: its KV stores are sized from a memory budget and its prefill runs in chunks, so prompts of 8K or
16K tokens are answered in the memory the model needs anyway, many at once. Elsewhere (or for a model it
cannot hold), batched greedy decoding through transformers' ``generate`` with left padding: evaluation has
one sample per prompt, so batching many prompts is what makes it fast on a CPU; batches of long prompts are
cut to fewer rows so that generate's rows x length x length attention mask stays within 2 GiB.

Rows whose ``extra_info`` names their target context length or hop count (``longqa data synth
--context-lengths`` writes both) are also scored per length and per hop count, beside the per-source
scores: on a set that asks the same questions at several lengths, accuracy against length alone.
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from longqa import reward
from longqa.config import ConfigError
from longqa.outputs.layout import RUN_REWARD
from longqa.outputs.paths import CHECKPOINT, RUN, folder_kind

# A reward function: (data_source, response, ground_truth, extra_info) -> reward.RewardResult, as the trainer
# scores its samples with (reward.mode's scorer, or the function of reward.path).
RewardFn = Callable[..., reward.RewardResult]


class EngineChoiceError(ConfigError):
    """The engine asked for (``--engine fast``) cannot answer with the model given; another engine can. A
    ``ConfigError``, reported in one line."""


class ModelFolderError(ConfigError):
    """A folder given as the model to answer with holds none: a training run, a checkpoint (which ``longqa export``
    turns into a model folder) or a folder without a model's config. A ``ConfigError``, reported in one line."""


def mode_reward(mode: str = "hardened") -> RewardFn:
    """longqa's own reward in ``mode`` (see ``longqa.reward``)."""
    return functools.partial(reward.score_detailed, mode=mode)


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus the chat end-of-turn token, which is where a chat model's answer ends."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return sorted(i for i in ids if i is not None)


@dataclass(frozen=True)
class Response:
    """One greedy response and why it ended: ``stop`` at a stop token, ``length`` when the token limit cut it
    (its answer, if any, is scored as it stands: most often there is none yet)."""

    text: str
    finish_reason: str


# transformers' generate on a left-padded batch builds a float attention mask of rows x length x length: 256 MiB a
# row at 8K tokens, 1 GiB at 16K. A batch holds at most this much of it (and at least one row).
GENERATE_MASK_BYTES = 2 << 30


@torch.inference_mode()
def greedy_responses(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 64,
    mask_bytes: int = GENERATE_MASK_BYTES,
) -> list[Response]:
    """Greedy responses in prompt order, batched by similar lengths (less padding), at most ``batch_size``
    prompts a batch and fewer where their attention mask would pass ``mask_bytes``. A response without a stop
    token ran to ``max_new_tokens`` (generate stops a batch early only when every row has stopped)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    responses: list[Response | None] = [None] * len(prompts)
    start = 0
    while start < len(order):
        end = start + 1  # the batch grows while its prefill's mask (rows x width x width floats) fits
        while (
            end < min(start + batch_size, len(order))
            and 4 * (end + 1 - start) * len(prompts[order[end]]) ** 2 <= mask_bytes
        ):
            end += 1
        chunk, start = order[start:end], end
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            p = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=stops,
            pad_token_id=pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        stopped = torch.isin(out[:, width:], torch.as_tensor(stops, device=out.device)).any(dim=1).tolist()
        for row, i in enumerate(chunk):
            responses[i] = Response(
                tokenizer.decode(out[row, width:], skip_special_tokens=True), "stop" if stopped[row] else "length"
            )
    model.train(was_training)
    return responses


def engine_greedy_responses(engine, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Response]:
    """Greedy responses from a rollout engine (the trainer's validation: the engine holds the whole current
    model even when training shards it); equal to ``greedy_responses`` up to float ties."""
    from longqa.rollout.base import SamplingParams

    params = SamplingParams(
        n=1,
        temperature=0,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_token_ids(tokenizer)),
        return_logprobs=False,
    )
    # Greedy needs no randomness, but a seeded engine draws seeds that are not given: fixed ones leave the global
    # generator (the training run's) untouched.
    seeds = [0] * len(prompts) if engine.seeded else None
    groups = engine.generate([list(p) for p in prompts], params, seeds=seeds)
    return [
        Response(tokenizer.decode(group[0].token_ids, skip_special_tokens=True), group[0].finish_reason)
        for group in groups
    ]


def answer_engine(model, tokenizer, choice: str = "auto", batch_size: int = 64, dtype: torch.dtype | None = None):
    """The fast engine that answers for ``model`` (at most ``batch_size`` prompts at once), or ``None`` where
    transformers' ``generate`` on the model itself does. ``choice``: ``fast``, ``hf``, or ``auto``: the fast
    engine on a GPU where it can hold the model, ``generate`` on a CPU (quicker there: 37 s against 49 s for the
    embedded model's answers to 60 questions of 512-1,024 tokens) and for a model the engine cannot hold.
    ``dtype``, when it differs from the model's, gives the engine a copy of its own in that type."""
    from longqa.model.attention_spec import UnsupportedModelError
    from longqa.rollout.fast import FastRolloutEngine

    if choice not in ("auto", "fast", "hf"):
        raise ValueError(f"engine must be auto, fast or hf, got {choice!r}")
    if choice == "hf" or (choice == "auto" and next(model.parameters()).device.type != "cuda"):
        return None
    try:
        return FastRolloutEngine(model, tokenizer, max_groups=batch_size, dtype=dtype)
    except UnsupportedModelError as e:
        if choice == "fast":
            raise EngineChoiceError(f"--engine fast cannot answer with this model ({e}); --engine hf can") from None
        return None


def guess_baseline(extra_info: dict) -> float | None:
    """Chance of naming the answer by picking an entity of the asked type from the context at random."""
    n = (extra_info or {}).get("num_candidates")
    return 1.0 / n if isinstance(n, int) and n > 0 else None


@dataclass(frozen=True)
class Scored:
    """One answer scored: the reward function's result, and SQuAD's EM and F1 of the answer it holds."""

    reward: reward.RewardResult
    em: float
    f1: float


def score_answers(meta: Sequence[dict], responses: Sequence[str], reward_fn: RewardFn | None = None) -> list[Scored]:
    """Each response scored once by ``reward_fn`` (the hardened reward by default), with EM and F1."""
    reward_fn = reward_fn or mode_reward()
    scored = []
    for m, text in zip(meta, responses):
        truth = m["ground_truth"]
        answer = reward.extract_answer(text)
        scored.append(
            Scored(
                reward_fn(m["data_source"], text, truth, m.get("extra_info")),
                reward.exact_match(answer, truth),
                reward.token_f1(answer, truth),
            )
        )
    return scored


def summarize(meta: Sequence[dict], scored: Sequence[Scored]) -> dict:
    """Accuracy (the mean reward), EM and F1 overall and per data_source, plus the guessing baseline."""
    groups: dict[str, list[Scored]] = defaultdict(list)
    guesses = []
    for m, row in zip(meta, scored):
        groups[m["data_source"]].append(row)
        groups["all"].append(row)
        if (g := guess_baseline(m.get("extra_info"))) is not None:
            guesses.append(g)
    result = {}
    for source, rows in sorted(groups.items()):
        n = len(rows)
        result[source] = {
            "n": n,
            "accuracy": sum(r.reward.score for r in rows) / n,
            "em": sum(r.em for r in rows) / n,
            "f1": sum(r.f1 for r in rows) / n,
        }
    if guesses:
        result["all"]["guess_baseline"] = sum(guesses) / len(guesses)
    return result


def score(meta: Sequence[dict], responses: Sequence[str], reward_fn: RewardFn | None = None) -> dict:
    """``summarize`` of ``score_answers``."""
    return summarize(meta, score_answers(meta, responses, reward_fn))


# Groupings beside the per-source scores: result key -> the extra_info key whose integer values make the groups.
GROUPINGS = {"by_length": "target_tokens", "by_hops": "hops"}


def summarize_by(meta: Sequence[dict], scored: Sequence[Scored], key: str) -> list[dict]:
    """``summarize``'s overall numbers for each integer value of ``extra_info[key]``, ascending, as
    ``{key: value, "n": ..., "accuracy": ...}``; rows without one are left out."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(meta):
        value = (m.get("extra_info") or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            groups[value].append(i)
    return [
        {key: value, **summarize([meta[i] for i in rows], [scored[i] for i in rows])["all"]}
        for value, rows in sorted(groups.items())
    ]


def summarize_groups(meta: Sequence[dict], scored: Sequence[Scored]) -> dict[str, list[dict]]:
    """``summarize_by`` for every grouping of ``GROUPINGS`` that some row has. Lists, not mappings, so that
    whatever reads the per-source entries of a result (the ones that are mappings) reads only those."""
    return {name: groups for name, key in GROUPINGS.items() if (groups := summarize_by(meta, scored, key))}


# What a row of ``--samples`` carries from the row's extra_info beside its answer: which question it is (the same
# question_id at every context length) and the groups ``summarize_groups`` makes.
SAMPLE_KEYS = ("index", "question_id", *GROUPINGS.values())


def sample_record(meta: dict, response: Response, scored: Scored, files: Sequence[str] = ()) -> dict:
    """One row of ``--samples``: where the question comes from (its file, named from ``files`` where given, its
    row, data_source and ``SAMPLE_KEYS``), its ground truth, the answer read from the response, its scores, the
    response and why it ended (``finish_reason``: ``length`` when the token limit cut it)."""
    extra = meta.get("extra_info") or {}
    file = meta.get("file")
    return {
        "data_source": meta["data_source"],
        "file": str(files[file]) if file is not None and files else file,
        "row": meta.get("row"),
        **{key: extra[key] for key in SAMPLE_KEYS if key in extra},
        "ground_truth": meta["ground_truth"],
        "answer": reward.extract_answer(response.text),
        "score": scored.reward.score,
        "reason": scored.reward.reason,
        "em": scored.em,
        "f1": scored.f1,
        "response": response.text,
        "finish_reason": response.finish_reason,
    }


def evaluate(
    model,
    tokenizer,
    prompts,
    max_new_tokens: int,
    batch_size: int = 64,
    samples_path: Path | None = None,
    reward_fn: RewardFn | None = None,
    engine=None,
    shard=None,
    files: Sequence[str] = (),
) -> dict:
    """Greedy answers for a PromptSet, scored by ``reward_fn`` (the hardened reward by default) with EM and F1;
    optionally every answer written as JSONL for inspection (``files``: the prompts' files, to name them). With
    ``engine`` (a rollout engine holding its own weights) the answers come from it instead of ``model``.
    ``shard`` ``(rank, world, gather)`` splits the engine's work over data-parallel ranks: each answers
    every ``world``-th question from ``rank`` (an engine answers each prompt on its own: the split changes
    no answer beyond float ties) and ``gather`` (every rank's list, in rank order) brings the rest.
    ``result["reward_errors"]`` counts the answers whose scoring failed (a reason starting with ``error``),
    ``result["responses_cut"]`` the responses that ``max_new_tokens`` cut before they ended."""
    start = time.perf_counter()
    ids = [prompts.ids(i) for i in range(len(prompts))]
    if engine is not None:
        rank, world, gather = shard or (0, 1, lambda answers: [answers])
        parts = gather(engine_greedy_responses(engine, tokenizer, ids[rank::world], max_new_tokens))
        responses = [parts[i % world][i // world] for i in range(len(ids))]
    else:
        responses = greedy_responses(model, tokenizer, ids, max_new_tokens, batch_size)
    scored = score_answers(prompts.meta, [r.text for r in responses], reward_fn)
    result = summarize(prompts.meta, scored)
    result.update(summarize_groups(prompts.meta, scored))
    result["reward_errors"] = sum(1 for s in scored if (s.reward.reason or "").startswith("error"))
    result["responses_cut"] = sum(1 for r in responses if r.finish_reason == "length")
    result["seconds"] = time.perf_counter() - start
    if samples_path is not None:
        samples_path.parent.mkdir(parents=True, exist_ok=True)
        with open(samples_path, "w") as f:
            for m, response, row in zip(prompts.meta, responses, scored):
                f.write(json.dumps(sample_record(m, response, row, files)) + "\n")
    return result


def check_model_folder(path: str | None, flag: str = "--model") -> None:
    """Refuse, in one line, a folder that holds no model to answer with: a training run or checkpoint folder
    (its weights are a training state that ``longqa export`` turns into a model folder) or a folder without a
    model's config. Without this, transformers' tokenizer loader fails there with an unrelated complaint about
    missing tokenizer packages."""
    folder = Path(path).expanduser() if path else None
    if folder is None or not folder.is_dir():
        return  # the embedded model, a hub id, a GGUF file, or a path the model loader reports
    export = f"run `longqa export {path} OUT` first and give {flag} OUT"
    kind = folder_kind(folder)
    if kind == CHECKPOINT:
        raise ModelFolderError(f"{flag} {path} is {CHECKPOINT}, not a model folder: {export}")
    if kind == RUN:
        raise ModelFolderError(
            f"{flag} {path} is {RUN}, not a model folder: {export} (it exports the run's latest complete checkpoint)"
        )
    if not (folder / "config.json").is_file() and not any(folder.glob("*.gguf")):
        why = "it is empty" if not any(folder.iterdir()) else "no config.json"
        raise ModelFolderError(f"{flag} {path} holds no model ({why}): give a model folder, hub id or GGUF file")


def run_reward(model: str | None) -> dict | None:
    """The reward section of the config the run behind ``model`` trained with, which ``longqa export`` writes beside
    the model (``RUN_REWARD``); None for any other model (a hub id, a base model, an sft folder)."""
    path = Path(model).expanduser() / RUN_REWARD if model else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))["reward"]


def run_reward_note(run: dict | None, mode: str) -> str | None:
    """What the scores in ``mode`` are beside the reward of the run that made the model (``run_reward``): its
    validation's accuracy is another number where it scored otherwise, which is said rather than left to be
    compared. None where no run is known."""
    if run is None:
        return None
    if run.get("path"):
        return (
            f"the run that made this model scored with {run['name']} of reward.path={run['path']}, which eval "
            f"does not run: these scores are not its validation's"
        )
    if run["mode"] != mode:
        return (
            f"the run that made this model validated with reward.mode={run['mode']}, not {mode}: "
            f"--mode {run['mode']} scores as it did"
        )
    return "the mode the run that made this model validated with"


def describe_prompt_losses(prompts, options, name: str = "prompts") -> list[str]:
    """What preparing ``prompts`` dropped or cut, per reason, data_source and context length, in the words
    `longqa train` uses but naming the flags: a source that vanished would otherwise only be missed in the
    table."""
    from longqa.data.prompts import describe_losses

    return describe_losses(prompts, name, options, length_setting="--max-prompt-length", skip_setting="--skip-bad-rows")


def prompt_counts(prompts) -> dict:
    """The counts behind ``describe_prompt_losses``, for a JSON record: rows read, prompts kept, dropped as
    overlong or bad and truncated (``prompts_truncated``: cut to the prompt length limit, unlike the responses
    that ``evaluate`` counts as ``responses_cut``), and per data_source that lost any (a list, so that a
    result's only mappings stay its per-source scores)."""
    from longqa.data.prompts import tally

    stats = prompts.stats
    return {
        "rows_read": stats.rows_read,
        "kept": stats.kept,
        "dropped_overlong": stats.overlong_filtered,
        "bad_rows_skipped": stats.bad_rows,
        "prompts_truncated": stats.truncated,
        "lost_by_source": [
            {"data_source": source, "rows": t.rows, "dropped": t.dropped, "truncated": t.truncated}
            for source, t in tally(prompts, "data_source").items()
            if t.lost
        ],
    }


def describe_cut_responses(cut: int, n: int, max_new_tokens: int, setting: str = "--max-new-tokens") -> str:
    """How many responses the token limit cut, said every time: a cut response is scored as it stands, most often
    without the answer it had not reached, and nothing in the accuracy alone tells that apart from a wrong one."""
    if not cut:
        return f"responses: none cut at {setting}={max_new_tokens}"
    return (
        f"responses: {cut} of {n} cut at {setting}={max_new_tokens} before they ended, scored as they stand "
        f"(most often without an answer): raise {setting} to let them finish"
    )


def format_table(result: dict) -> str:
    """The per-source scores; with ``result["reward_mode"]``, a first line that says which mode made ``acc`` (and,
    with ``result["run_reward_note"]``, how it stands to the reward of the run that made the model)."""
    lines = []
    if result.get("reward_mode"):
        said = f"acc: reward mode {result['reward_mode']}"
        said += f" ({result['reward_mode_from']})" if result.get("reward_mode_from") else ""
        lines.append(said + (f"; {result['run_reward_note']}" if result.get("run_reward_note") else ""))
    lines.append(f"{'data_source':32s} {'n':>6s} {'acc':>7s} {'em':>7s} {'f1':>7s}")
    for source, r in result.items():
        if isinstance(r, dict):
            lines.append(f"{source:32s} {r['n']:6d} {r['accuracy']:7.3f} {r['em']:7.3f} {r['f1']:7.3f}")
    if "guess_baseline" in result.get("all", {}):
        lines.append(
            f"guessing baseline (1 / entities of the asked type in the context): {result['all']['guess_baseline']:.3f}"
        )
    return "\n".join(lines)


def format_groups(result: dict) -> str:
    """The tables of ``score_groups``' groupings in ``result``, each after a blank line (nothing without any),
    to print after ``format_table``."""
    tables = []
    for name, key in GROUPINGS.items():
        lines = [f"{key:32s} {'n':>6s} {'acc':>7s} {'em':>7s} {'f1':>7s}"]
        lines += [
            f"{g[key]:<32d} {g['n']:6d} {g['accuracy']:7.3f} {g['em']:7.3f} {g['f1']:7.3f}"
            for g in result.get(name, ())
        ]
        if len(lines) > 1:
            tables.append("\n".join(lines))
    return "".join(f"\n\n{table}" for table in tables)
