"""Prompt preparation: verl-schema rows in, token ids of chat-templated prompts out, cached.

The recipe feeds ~14,000 prompts of 16K tokens (~230M tokens) to every run. Preparing them must cost
about what the tokenizer itself costs (rows are validated, templated and tokenized in batches that
the Rust tokenizer spreads over the cores, and ids go straight into one flat int32 file, never into
Python lists of the whole set), and a second run with the same files, tokenizer and options must
not pay it again: the result is cached under a key made of those three, and a hit is a memory map.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from longqa.data.io import DataFileError, check_data_file, iter_rows
from longqa.data.schema import row_problem
from longqa.model.tokenizer import tokenizer_fingerprint

CACHE_FORMAT = 2  # bump when the cache layout or the preparation rules change
BATCH_ROWS = 64


@dataclass(frozen=True)
class PromptOptions:
    """How overlong and malformed rows are handled (``data.*`` keys of the config)."""

    max_prompt_length: int
    filter_overlong_prompts: bool = True
    truncation: str = "left"  # "left" keeps the end of the prompt (the question and generation prompt)
    skip_bad_rows: bool = False

    @classmethod
    def from_config(cls, data) -> "PromptOptions":
        """From the ``data`` section of the config (``data.max_prompt_length`` and friends)."""
        return cls(data.max_prompt_length, data.filter_overlong_prompts, data.truncation, data.skip_bad_rows)

    def __post_init__(self):
        if self.truncation not in ("error", "left", "right"):
            raise ValueError(f"truncation must be error, left or right, got {self.truncation!r}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0, got {self.max_prompt_length}")


@dataclass
class PrepStats:
    files: int = 0
    rows_read: int = 0
    kept: int = 0
    bad_rows: int = 0
    overlong_filtered: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    max_prompt_tokens: int = 0
    cache_hit: bool = False
    seconds: float = 0.0
    cache_path: str = ""
    # One entry per row not kept whole (dropped as overlong or bad, or truncated), with what it belonged to:
    # {"file", "row", "data_source", "target_tokens", "tokens", "reason"} (``LOST_REASONS``).
    lost: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        mean = self.prompt_tokens / max(self.kept, 1)
        parts = [
            f"{self.kept} prompts from {self.rows_read} rows in {self.files} file(s)",
            f"{self.prompt_tokens:,} tokens (mean {mean:,.0f}, max {self.max_prompt_tokens:,})",
        ]
        if self.overlong_filtered:
            parts.append(f"{self.overlong_filtered} overlong filtered")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        if self.bad_rows:
            parts.append(f"{self.bad_rows} bad rows skipped")
        parts.append(f"{'cache hit' if self.cache_hit else 'prepared'} in {self.seconds:.1f}s")
        return ", ".join(parts)


OVERLONG, BAD_ROW, TRUNCATED = "overlong", "bad row", "truncated"
LOST_REASONS = (OVERLONG, BAD_ROW, TRUNCATED)  # the last one keeps the row, cut
NO_SOURCE = "(no data_source)"


def target_tokens(extra_info) -> int | None:
    """The context length a row was made for (``longqa data synth --context-lengths``), or None."""
    value = extra_info.get("target_tokens") if isinstance(extra_info, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lost_row(file_index: int, row_index: int, row, reason: str, tokens: int | None = None) -> dict:
    """What a row not kept whole belonged to; read defensively, since a bad row may lack any of it."""
    row = row if isinstance(row, dict) else {}
    source = row.get("data_source")
    return {
        "file": file_index,
        "row": row_index,
        "data_source": source if isinstance(source, str) and source else NO_SOURCE,
        "target_tokens": target_tokens(row.get("extra_info")),
        "tokens": tokens,
        "reason": reason,
    }


@dataclass
class PromptSet:
    """Token ids of every kept prompt as one flat array plus offsets, and each row's reward metadata."""

    token_ids: np.ndarray  # int32, all prompts back to back
    offsets: np.ndarray  # int64, len(self) + 1
    meta: list[dict]  # data_source, ground_truth, ability, extra_info, file, row
    stats: PrepStats = field(default_factory=PrepStats)

    def __len__(self) -> int:
        return len(self.meta)

    def ids(self, i: int) -> np.ndarray:
        return self.token_ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def first_of_each_file(self, n: int) -> PromptSet:
        """The first ``n`` kept prompts of each file, in order: a quick evaluation that still sees every file
        (one per context length, say) rather than the first file alone."""
        taken: dict[int, int] = {}
        keep = []
        for i, m in enumerate(self.meta):
            taken[m["file"]] = taken.get(m["file"], 0) + 1
            if taken[m["file"]] <= n:
                keep.append(i)
        offsets = np.concatenate([[0], np.cumsum(self.lengths[keep])]).astype(np.int64)
        token_ids = np.concatenate([self.ids(i) for i in keep]).astype(np.int32)
        return PromptSet(token_ids, offsets, [self.meta[i] for i in keep], self.stats)


@dataclass
class Tally:
    """The rows of one data_source or one context length: read, dropped (overlong or bad) and truncated."""

    rows: int = 0
    dropped: int = 0
    truncated: int = 0

    @property
    def lost(self) -> bool:
        return bool(self.dropped or self.truncated)

    def describe(self, key) -> str:
        """``key`` and what it lost, e.g. ``musique: 3 of 3 dropped, none left``."""
        parts = (
            [f"{self.dropped} of {self.rows} dropped" + (", none left" if self.dropped == self.rows else "")]
            if self.dropped
            else []
        )
        if self.truncated:
            parts.append(f"{self.truncated} of {self.rows} truncated")
        return f"{key}: {' and '.join(parts)}"


GROUPS = ("data_source", "target_tokens")  # what a row belongs to, in the accounting of what was lost


def tally(prompts: PromptSet, group: str) -> dict:
    """A ``Tally`` per value of ``group`` (``data_source``, or ``target_tokens`` where rows have one), sorted."""
    tallies: dict = {}

    def of(key) -> Tally:
        return tallies.setdefault(key, Tally())

    for m in prompts.meta:
        key = m["data_source"] if group == "data_source" else target_tokens(m.get("extra_info"))
        if key is not None:
            of(key).rows += 1
    for entry in prompts.stats.lost:
        if (key := entry[group]) is None:
            continue
        if entry["reason"] == TRUNCATED:  # (a kept row, counted above)
            of(key).truncated += 1
        else:
            of(key).rows += 1
            of(key).dropped += 1
    return dict(sorted(tallies.items()))


def describe_losses(
    prompts: PromptSet,
    name: str,
    options: PromptOptions,
    length_setting: str = "data.max_prompt_length",
    skip_setting: str = "data.skip_bad_rows=true",
) -> list[str]:
    """Lines saying what preparing ``prompts`` dropped or cut, by reason, then per data_source and per context
    length (``target_tokens``) that lost rows: a run says this before it starts, since a source or a length
    that is gone would otherwise only be missed in the metrics. ``length_setting`` and ``skip_setting`` name
    the settings behind the limit and the skipping, as for ``prepare_prompts`` (a command's flags, say)."""
    stats = prompts.stats
    if not stats.lost:
        return [f"{name}: all {stats.kept} kept whole"]
    reasons = Counter(entry["reason"] for entry in stats.lost)
    limit = f"{length_setting}={options.max_prompt_length}"
    said = {
        OVERLONG: f"{reasons[OVERLONG]} dropped over {limit}",
        BAD_ROW: f"{reasons[BAD_ROW]} bad rows dropped ({skip_setting})",
        TRUNCATED: f"{reasons[TRUNCATED]} truncated to {limit} (data.truncation={options.truncation})",
    }
    lines = [
        f"{name}: {stats.kept} of {stats.rows_read} kept; " + "; ".join(said[r] for r in LOST_REASONS if reasons[r])
    ]
    for group in GROUPS:
        lost = [t.describe(key) for key, t in tally(prompts, group).items() if t.lost]
        if lost:
            lines.append(f"  by {group}: " + "; ".join(lost))
    return lines


def file_digest(path: Path) -> str:
    """A digest of the file's bytes: what the cache keys by, and what a checkpoint records of its data."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()[:32]


def cache_key(files: Sequence[Path], fingerprint: str, options: PromptOptions) -> str:
    """Content of the files (not their names or times), the tokenizer and the options."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([CACHE_FORMAT, fingerprint, dataclasses.asdict(options)]).encode())
    for path in files:
        h.update(file_digest(path).encode())
    return h.hexdigest()


def _batched(items: Iterable, n: int):
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _fit(ids: list[int], options: PromptOptions, where: str) -> list[int] | None:
    """The ids to keep for one prompt: unchanged, truncated, or None when filtered."""
    limit = options.max_prompt_length
    if len(ids) <= limit:
        return ids
    if options.filter_overlong_prompts:
        return None
    if options.truncation == "error":
        raise DataFileError(
            f"{where}: prompt has {len(ids)} tokens, over data.max_prompt_length={limit} "
            f"(set data.filter_overlong_prompts=true or data.truncation=left|right)"
        )
    return ids[-limit:] if options.truncation == "left" else ids[:limit]


def _templated(files: Sequence[Path], tokenizer, options: PromptOptions, stats: PrepStats, skip_setting: str | None):
    """Valid rows with their chat-templated prompt texts, a batch at a time."""
    for file_index, path in enumerate(files):
        for batch in _batched(enumerate(iter_rows(path)), BATCH_ROWS):
            good = []
            for row_index, row in batch:
                stats.rows_read += 1
                if problem := row_problem(row):
                    if not options.skip_bad_rows:
                        raise DataFileError(
                            f"{path}, row {row_index}: {problem}"
                            + (f" ({skip_setting} skips and counts such rows)" if skip_setting else "")
                        )
                    stats.bad_rows += 1
                    stats.lost.append(_lost_row(file_index, row_index, row, BAD_ROW))
                    continue
                good.append((file_index, path, row_index, row))
            if good:
                yield (
                    good,
                    tokenizer.apply_chat_template(
                        [g[3]["prompt"] for g in good], tokenize=False, add_generation_prompt=True
                    ),
                )


def _encoded(batches, backend):
    """Each batch with its encodings. The tokenizer releases the GIL, so while one batch encodes in a
    worker thread the next one is read and templated here: the Python work hides behind the Rust work."""
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for rows, texts in batches:
            future = pool.submit(backend.encode_batch_fast, texts, add_special_tokens=False)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = rows, future
        if pending is not None:
            yield pending[0], pending[1].result()


def _tokenize(
    files: Sequence[Path], tokenizer, options: PromptOptions, out_dir: Path, skip_setting: str | None
) -> PrepStats:
    """Stream every file through validation, the chat template and the tokenizer into ``out_dir``."""
    stats = PrepStats(files=len(files))
    offsets, meta = [0], []
    with open(out_dir / "tokens.int32", "wb") as out:
        batches = _templated(files, tokenizer, options, stats, skip_setting)
        for rows, encodings in _encoded(batches, tokenizer.backend_tokenizer):
            for (file_index, path, row_index, row), enc in zip(rows, encodings):
                full = enc.ids  # a new Python list on every access: take it once
                ids = _fit(full, options, f"{path}, row {row_index}")
                if ids is None:
                    stats.overlong_filtered += 1
                    stats.lost.append(_lost_row(file_index, row_index, row, OVERLONG, len(full)))
                    continue
                if len(ids) < len(full):
                    stats.truncated += 1
                    stats.lost.append(_lost_row(file_index, row_index, row, TRUNCATED, len(full)))
                out.write(np.asarray(ids, dtype=np.int32).tobytes())
                offsets.append(offsets[-1] + len(ids))
                stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(ids))
                meta.append(
                    {
                        "data_source": row["data_source"],
                        "ground_truth": row["reward_model"]["ground_truth"],
                        "ability": row.get("ability"),
                        "extra_info": row.get("extra_info") or {},
                        "file": file_index,
                        "row": row_index,
                    }
                )
    stats.kept, stats.prompt_tokens = len(meta), offsets[-1]
    np.save(out_dir / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    (out_dir / "meta.json").write_text(json.dumps(meta, default=str))
    return stats


def _load_cached(entry: Path) -> PromptSet:
    offsets = np.load(entry / "offsets.npy")
    tokens = np.memmap(entry / "tokens.int32", dtype=np.int32, mode="r")
    meta = json.loads((entry / "meta.json").read_text())
    stats = PrepStats(**json.loads((entry / "stats.json").read_text()))
    return PromptSet(tokens, offsets, meta, stats)


def _commit(work: Path, entry: Path) -> None:
    """Move a finished ``work`` folder to ``entry`` in one rename. Several processes (the ranks of a run)
    may prepare the same entry at once: the first rename wins and the others drop their copy, never
    deleting an entry that a reader may already have open."""
    try:
        os.replace(work, entry)  # atomic; refused when entry is a non-empty folder
    except OSError:
        if not (entry / "stats.json").is_file():  # not a finished entry (a crash of older code): take its place
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(work, entry)
            return
        shutil.rmtree(work, ignore_errors=True)


def readable_files(files: Sequence[str | os.PathLike]) -> list[Path]:
    """``files`` as paths (``~`` expanded), each an existing readable file; at least one."""
    paths = [Path(os.path.expanduser(str(f))) for f in files]
    if not paths:
        raise DataFileError("no data files given (set data.train_files)")
    for path in paths:
        check_data_file(path)
        if not os.access(path, os.R_OK):
            raise DataFileError(f"{path}: not readable")
    return paths


def prepare_prompts(
    files: Sequence[str | os.PathLike],
    tokenizer,
    options: PromptOptions,
    cache_dir: str | os.PathLike | None = None,
    length_setting: str = "data.max_prompt_length",
    skip_setting: str | None = "data.skip_bad_rows=true",
) -> PromptSet:
    """Tokenized prompts of ``files``; with ``cache_dir``, reused when files, tokenizer and options match.
    ``length_setting`` names where ``options.max_prompt_length`` came from, for the error when none is left;
    ``skip_setting`` where ``options.skip_bad_rows`` comes from (None: nowhere), for the error on a bad row.

    A bad row stops the load naming file, row and reason (or is skipped and counted with
    ``skip_bad_rows``); overlong prompts are filtered and counted, or truncated, per ``options``.
    """
    start = time.perf_counter()
    paths = readable_files(files)
    entry = None
    if cache_dir is not None:
        root = Path(os.path.expanduser(str(cache_dir))) / "prompts"
        entry = root / cache_key(paths, tokenizer_fingerprint(tokenizer), options)
        if (entry / "stats.json").is_file():
            prompts = _load_cached(entry)
            prompts.stats.cache_hit, prompts.stats.seconds = True, time.perf_counter() - start
            return prompts
        work = root / f".{entry.name}.tmp-{os.getpid()}"
    else:
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="longqa-prompts-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        stats = _tokenize(paths, tokenizer, options, work, skip_setting)
        if stats.kept == 0:
            raise DataFileError(
                f"no prompt left: {stats.rows_read} rows read, {stats.overlong_filtered} over "
                f"{length_setting}={options.max_prompt_length}, {stats.bad_rows} bad"
            )
        stats.cache_path = str(entry or work)
        (work / "stats.json").write_text(json.dumps(dataclasses.asdict(stats)))
        if entry is not None:
            _commit(work, entry)
            work = entry
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    prompts = _load_cached(work)
    if entry is None:  # nothing to keep on disk: hold the ids in memory and drop the folder
        prompts.token_ids = np.array(prompts.token_ids)
        shutil.rmtree(work, ignore_errors=True)
    prompts.stats.seconds = time.perf_counter() - start
    return prompts
