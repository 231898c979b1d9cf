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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from longqa.data.io import DataFileError, iter_rows
from longqa.data.schema import row_problem
from longqa.model.tokenizer import tokenizer_fingerprint

CACHE_FORMAT = 1  # bump when the cache layout or the preparation rules change
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

    def summary(self) -> str:
        mean = self.prompt_tokens / max(self.kept, 1)
        parts = [f"{self.kept} prompts from {self.rows_read} rows in {self.files} file(s)",
                 f"{self.prompt_tokens:,} tokens (mean {mean:,.0f}, max {self.max_prompt_tokens:,})"]
        if self.overlong_filtered:
            parts.append(f"{self.overlong_filtered} overlong filtered")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        if self.bad_rows:
            parts.append(f"{self.bad_rows} bad rows skipped")
        parts.append(f"{'cache hit' if self.cache_hit else 'prepared'} in {self.seconds:.1f}s")
        return ", ".join(parts)


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
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

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


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()[:32]


def cache_key(files: Sequence[Path], fingerprint: str, options: PromptOptions) -> str:
    """Content of the files (not their names or times), the tokenizer and the options."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([CACHE_FORMAT, fingerprint, dataclasses.asdict(options)]).encode())
    for path in files:
        h.update(_file_digest(path).encode())
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
        raise DataFileError(f"{where}: prompt has {len(ids)} tokens, over data.max_prompt_length={limit} "
                            f"(set data.filter_overlong_prompts=true or data.truncation=left|right)")
    return ids[-limit:] if options.truncation == "left" else ids[:limit]


def _templated(files: Sequence[Path], tokenizer, options: PromptOptions, stats: PrepStats):
    """Valid rows with their chat-templated prompt texts, a batch at a time."""
    for file_index, path in enumerate(files):
        for batch in _batched(enumerate(iter_rows(path)), BATCH_ROWS):
            good = []
            for row_index, row in batch:
                stats.rows_read += 1
                if problem := row_problem(row):
                    if not options.skip_bad_rows:
                        raise DataFileError(f"{path}, row {row_index}: {problem} "
                                            f"(set data.skip_bad_rows=true to skip and count such rows)")
                    stats.bad_rows += 1
                    continue
                good.append((file_index, path, row_index, row))
            if good:
                yield good, tokenizer.apply_chat_template([g[3]["prompt"] for g in good], tokenize=False,
                                                          add_generation_prompt=True)


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


def _tokenize(files: Sequence[Path], tokenizer, options: PromptOptions, out_dir: Path) -> PrepStats:
    """Stream every file through validation, the chat template and the tokenizer into ``out_dir``."""
    stats = PrepStats(files=len(files))
    offsets, meta = [0], []
    with open(out_dir / "tokens.int32", "wb") as out:
        batches = _templated(files, tokenizer, options, stats)
        for rows, encodings in _encoded(batches, tokenizer.backend_tokenizer):
            for (file_index, path, row_index, row), enc in zip(rows, encodings):
                full = enc.ids  # a new Python list on every access: take it once
                ids = _fit(full, options, f"{path}, row {row_index}")
                if ids is None:
                    stats.overlong_filtered += 1
                    continue
                stats.truncated += len(ids) < len(full)
                out.write(np.asarray(ids, dtype=np.int32).tobytes())
                offsets.append(offsets[-1] + len(ids))
                stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(ids))
                meta.append({"data_source": row["data_source"], "ground_truth": row["reward_model"]["ground_truth"],
                             "ability": row.get("ability"), "extra_info": row.get("extra_info") or {},
                             "file": file_index, "row": row_index})
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


def prepare_prompts(files: Sequence[str | os.PathLike], tokenizer, options: PromptOptions,
                    cache_dir: str | os.PathLike | None = None,
                    length_setting: str = "data.max_prompt_length") -> PromptSet:
    """Tokenized prompts of ``files``; with ``cache_dir``, reused when files, tokenizer and options match.
    ``length_setting`` names where ``options.max_prompt_length`` came from, for the error when none is left.

    A bad row stops the load naming file, row and reason (or is skipped and counted with
    ``skip_bad_rows``); overlong prompts are filtered and counted, or truncated, per ``options``.
    """
    start = time.perf_counter()
    paths = [Path(os.path.expanduser(str(f))) for f in files]
    if not paths:
        raise DataFileError("no data files given (set data.train_files)")
    for path in paths:
        if not path.is_file():
            raise DataFileError(f"{path}: no such file")
        if not os.access(path, os.R_OK):
            raise DataFileError(f"{path}: not readable")
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
        stats = _tokenize(paths, tokenizer, options, work)
        if stats.kept == 0:
            raise DataFileError(f"no prompt left: {stats.rows_read} rows read, {stats.overlong_filtered} over "
                                f"{length_setting}={options.max_prompt_length}, {stats.bad_rows} bad")
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
