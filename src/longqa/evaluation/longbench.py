r"""LongBench v1's multi-hop QA sets (HotpotQA, 2WikiMultiHopQA, MuSiQue), answered by a longqa model and
scored exactly as LongBench scores them, so that its numbers stand next to published ones.

Both of LongBench's file formats are kept as they are. Its data files (``<dataset>.jsonl``: ``input`` the
question, ``context`` the passages, ``answers``, ``length`` in words) are read unchanged, and the
predictions are written as LongBench's ``pred.py`` writes them (``<dataset>.jsonl`` lines of ``pred``,
``answers``, ``all_classes``, ``length``), so LongBench's own ``eval.py`` can check our numbers and ours
can score files any other system wrote. The scoring follows LongBench's ``eval.py`` and ``metrics.py``
rule by rule, down to which float operations round the result; each rule names its origin.

The prompt is longqa's, not LongBench's: a LongBench row becomes a longqa row (the recipe's system
prompt, the passages, the question), because a longqa model was trained on that shape, and its answer
is read from ``\boxed{}`` as in training. Models that do not box are scored on their whole output.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from longqa import reward
from longqa.data.io import DataFileError
from longqa.data.schema import make_row, qa_user_message, with_system_prompt

DATASETS = ("hotpotqa", "2wikimqa", "musique")
RESULT_FILE = "result.json"
# As LongBench's eval.py (scorer_e): LongBench-E's three length ranges, by the row's word count.
LENGTH_BUCKETS = (("0-4k", 4000), ("4-8k", 8000), ("8k+", None))


# --- reading LongBench's files --------------------------------------------------------------------


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; anything else stops the read at that line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFileError(f"{path}, line {number}: not JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise DataFileError(f"{path}, line {number}: expected a JSON object, got {type(item).__name__}")
            yield number, item


def _check_answers(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise DataFileError(f"{where}: 'answers' must be a list of strings")
    return value


def _check_length(value, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataFileError(f"{where}: 'length' must be a number (the context's words)")
    return value


def read_dataset(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """The rows of one LongBench data file (the first ``limit`` of them), checked for the fields used here."""
    path = Path(path)
    rows = []
    for number, row in _json_lines(path):
        if limit is not None and len(rows) >= limit:
            break
        where = f"{path}, line {number}"
        for key in ("input", "context"):
            if not isinstance(row.get(key), str):
                raise DataFileError(f"{where}: {key!r} must be a string")
        _check_answers(row.get("answers"), where)
        _check_length(row.get("length"), where)
        rows.append(row)
    return rows


def read_longbench(data_dir: str | os.PathLike, limit: int | None = None) -> dict[str, list[dict]]:
    """Each multi-hop QA set found in ``data_dir`` (LongBench's ``data/`` folder, or any folder holding
    some of its files), in LongBench's order."""
    folder = Path(os.path.expanduser(str(data_dir)))
    expected = ", ".join(f"{name}.jsonl" for name in DATASETS)
    if not folder.is_dir():
        raise DataFileError(f"{folder}: no such folder (expected LongBench's data files {expected})")
    found = {name: folder / f"{name}.jsonl" for name in DATASETS if (folder / f"{name}.jsonl").is_file()}
    if not found:
        raise DataFileError(f"{folder} holds none of LongBench's multi-hop QA files: expected {expected}")
    examples = {name: read_dataset(path, limit) for name, path in found.items()}
    for name, rows in examples.items():
        if not rows:
            raise DataFileError(f"{found[name]}: no rows")
    return examples


# --- prompts and answers ----------------------------------------------------------------------------


def to_row(dataset: str, example: dict) -> dict:
    """A LongBench row as a longqa row. LongBench's contexts already list "Passage N:" blocks, the way the
    recipe's rows do, so they go in unchanged."""
    messages = with_system_prompt([{"role": "user", "content": qa_user_message(example["context"], example["input"])}])
    return make_row(
        f"longbench_{dataset}",
        messages,
        example["answers"],
        extra_info={"_id": example.get("_id"), "length": example["length"]},
    )


def middle_truncated(ids: list[int], max_length: int) -> list[int]:
    """As LongBench's pred.py: an overlong prompt loses its middle, keeping ``max_length // 2`` tokens at
    each end, where the instructions and the question are (here: the system prompt, and the question
    with the generation prompt)."""
    if len(ids) <= max_length:
        return ids
    half = max_length // 2
    return ids[:half] + ids[len(ids) - half :]


def prompt_ids(rows: list[dict], tokenizer, max_length: int) -> tuple[list[list[int]], int]:
    """Token ids of each row's chat-templated prompt, as ``prepare_prompts`` makes them (the template as
    text, then ids without added special tokens: the template has them), and how many were truncated."""
    texts = tokenizer.apply_chat_template([row["prompt"] for row in rows], tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = [middle_truncated(list(e), max_length) for e in encoded]
    return ids, sum(len(i) < len(e) for i, e in zip(ids, encoded))


def prediction(response: str) -> str:
    """What is scored: the last ``\\boxed{}`` after the reasoning, read as the reward reads it; without
    one, the whole response, so that models that answer in plain text are scored too."""
    boxed = reward.extract_answer(response)
    return boxed if boxed is not None else response.strip()


def write_predictions(out_dir: str | os.PathLike, dataset: str, examples: list[dict], predictions: list[str]) -> Path:
    """``<dataset>.jsonl`` with the keys LongBench's pred.py writes and its eval.py reads."""
    path = Path(os.path.expanduser(str(out_dir))) / f"{dataset}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for example, pred in zip(examples, predictions, strict=True):
            line = {
                "pred": pred,
                "answers": example["answers"],
                "all_classes": example.get("all_classes"),
                "length": example["length"],
            }
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path


def predict(
    model,
    tokenizer,
    examples: dict[str, list[dict]],
    out_dir: str | os.PathLike,
    max_new_tokens: int,
    max_prompt_length: int,
    batch_size: int = 64,
    samples_path: str | os.PathLike | None = None,
    engine=None,
) -> dict:
    """Greedy answers to every example, written as LongBench prediction files (one per dataset), and
    optionally every full response as JSONL (with its ``finish_reason``); returns rows, prompts truncated,
    responses cut by ``max_new_tokens`` and seconds. ``engine``: a rollout engine that answers instead of
    ``model``'s ``generate`` (``evaluate.answer_engine``)."""
    from longqa.evaluation.evaluate import engine_greedy_responses, greedy_responses

    start = time.perf_counter()
    order = [(dataset, example) for dataset, rows in examples.items() for example in rows]
    ids, truncated = prompt_ids([to_row(d, e) for d, e in order], tokenizer, max_prompt_length)
    # All sets in one call: batches group similar lengths across sets, which pads less.
    responses = (
        engine_greedy_responses(engine, tokenizer, ids, max_new_tokens)
        if engine is not None
        else greedy_responses(model, tokenizer, ids, max_new_tokens, batch_size)
    )
    start_of = 0
    for dataset, rows in examples.items():
        answers = [prediction(r.text) for r in responses[start_of : start_of + len(rows)]]
        write_predictions(out_dir, dataset, rows, answers)
        start_of += len(rows)
    if samples_path is not None:
        Path(samples_path).parent.mkdir(parents=True, exist_ok=True)
        with open(samples_path, "w", encoding="utf-8") as f:
            for (dataset, example), response in zip(order, responses):
                f.write(
                    json.dumps(
                        {
                            "dataset": dataset,
                            "_id": example.get("_id"),
                            "pred": prediction(response.text),
                            "answers": example["answers"],
                            "response": response.text,
                            "finish_reason": response.finish_reason,
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
    return {
        "rows": len(order),
        "prompts_truncated": truncated,
        "responses_cut": sum(1 for r in responses if r.finish_reason == "length"),
        "seconds": time.perf_counter() - start,
    }


# --- LongBench's scoring ------------------------------------------------------------------------------


# As LongBench's metrics.py (normalize_answer), which is SQuAD's and HotpotQA's: the reward module holds it.
normalize_answer = reward.normalize_answer


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """As LongBench's metrics.py (qa_f1_score, f1_score): F1 of the normalised tokens, overlap counted as
    a multiset. No token in common scores 0, which covers an empty prediction or an empty answer."""
    return reward.overlap_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def best_score(prediction: str, answers: list[str]) -> float:
    """As LongBench's eval.py (scorer): the best F1 over the answers, starting from 0 (no answers: 0).
    ``pred`` is used whole: eval.py keeps only the first line for trec, triviaqa, samsum and lsht, not
    for these sets."""
    score = 0.0
    for answer in answers:
        score = max(score, qa_f1_score(prediction, answer))
    return score


def length_bucket(length: int | float) -> str:
    """As LongBench's eval.py (scorer_e): under 4000 words, under 8000, the rest."""
    for name, below in LENGTH_BUCKETS:
        if below is None or length < below:
            return name
    raise AssertionError("the last bucket has no bound")


def read_predictions(path: str | os.PathLike) -> list[dict]:
    """The lines of one prediction file, checked for what the scoring reads."""
    path = Path(path)
    lines = []
    for number, line in _json_lines(path):
        where = f"{path}, line {number}"
        if not isinstance(line.get("pred"), str):
            raise DataFileError(f"{where}: 'pred' must be a string")
        _check_answers(line.get("answers"), where)
        if "length" in line:
            _check_length(line["length"], where)
        lines.append(line)
    if not lines:
        raise DataFileError(f"{path}: no predictions to score")
    return lines


def score_lines(lines: list[dict], where: str = "predictions") -> dict:
    """One set's scores: ``score`` over all lines and, when every line has a ``length``, ``by_length``.

    Kept to LongBench's arithmetic because its rounding to 2 decimals shows the last bit: the overall
    score sums in order and rounds a Python float (eval.py's scorer); the length buckets take numpy's
    mean and round a numpy float (scorer_e), which can round a half the other way. An empty bucket is
    NaN in LongBench and None (null) here.
    """
    scores = [best_score(line["pred"], line["answers"]) for line in lines]
    total = 0.0
    for score in scores:
        total += score
    result = {"n": len(scores), "score": round(100 * total / len(scores), 2)}
    missing = [i for i, line in enumerate(lines) if "length" not in line]
    if len(missing) == len(lines):
        return result
    if missing:
        raise DataFileError(f"{where}: prediction {missing[0] + 1} has no 'length', though others have one")
    buckets: dict[str, list[float]] = {name: [] for name, _ in LENGTH_BUCKETS}
    for line, score in zip(lines, scores):
        buckets[length_bucket(line["length"])].append(score)
    result["by_length"] = {name: float(round(100 * np.mean(b), 2)) if b else None for name, b in buckets.items()}
    result["by_length_n"] = {name: len(b) for name, b in buckets.items()}
    return result


def score_folder(pred_dir: str | os.PathLike, datasets: tuple[str, ...] | list[str] | None = None) -> dict:
    """Scores of the prediction files ``<dataset>.jsonl`` in ``pred_dir`` for the multi-hop QA sets
    (all found, or exactly ``datasets``), keyed by set as in LongBench's result.json."""
    folder = Path(os.path.expanduser(str(pred_dir)))
    expected = ", ".join(f"{name}.jsonl" for name in DATASETS)
    if not folder.is_dir():
        raise DataFileError(f"{folder}: no such folder (expected prediction files {expected})")
    names = [n for n in DATASETS if (folder / f"{n}.jsonl").is_file()] if datasets is None else list(datasets)
    if not names:
        raise DataFileError(f"{folder} holds no prediction file to score: expected {expected}")
    return {
        name: score_lines(read_predictions(folder / f"{name}.jsonl"), str(folder / f"{name}.jsonl")) for name in names
    }


def save_result(pred_dir: str | os.PathLike, result: dict) -> Path:
    """``result.json`` beside the prediction files, where LongBench's eval.py puts its own."""
    path = Path(os.path.expanduser(str(pred_dir))) / RESULT_FILE
    path.write_text(json.dumps(result, ensure_ascii=False, indent=4) + "\n", encoding="utf-8")
    return path


def format_scores(result: dict) -> str:
    """A table: per set the rows, LongBench's F1 score (x100) and the length buckets' scores."""
    names = [name for name, _ in LENGTH_BUCKETS]
    lines = [f"{'dataset':12s} {'n':>6s} {'f1':>7s}" + "".join(f" {name:>7s}" for name in names)]
    for dataset, r in result.items():
        by_length = r.get("by_length", {})
        cells = "".join(f" {by_length[n]:7.2f}" if by_length.get(n) is not None else f" {'-':>7s}" for n in names)
        lines.append(f"{dataset:12s} {r['n']:6d} {r['score']:7.2f}{cells}")
    return "\n".join(lines)
