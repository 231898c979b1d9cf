"""Reading and writing row files: parquet (verl's format), jsonl and json.

Parquet files are written through pyarrow alone (no pandas index, no timestamps), so the same rows
always give the same bytes, and atomically (a temporary file renamed into place), so a killed run
never leaves half a file that a later load would trust.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from longqa.config import ConfigError
from longqa.config.command_options import check_test_ratio

ROW_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


class DataFileError(ValueError):
    """A data file is missing, unreadable or holds something other than rows."""


class TooFewRowsError(ConfigError):
    """The rows to split are too few for the test ratio: its test rows would leave none to train on, so the ratio
    or the data given is what to change. A ``ConfigError``, reported in one line."""


def check_data_file(path: Path) -> None:
    """``path`` is a file rows can be read from: a folder given where a data file goes is said as a folder (with
    the data files it holds), and a path that names nothing as missing."""
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in ROW_FILE_SUFFIXES and p.is_file())
        what = (
            f"one of its files ({', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''})"
            if inside
            else f"a {', '.join(ROW_FILE_SUFFIXES[:-1])} or {ROW_FILE_SUFFIXES[-1]} file"
        )
        raise DataFileError(f"{path} is a folder, not a data file: give {what}")
    if not path.is_file():
        raise DataFileError(f"{path}: no such file")


def iter_rows(path: str | os.PathLike, batch_size: int = 256) -> Iterator[dict]:
    """Yield the rows of one file as plain Python objects, without holding the whole file twice."""
    path = Path(path)
    check_data_file(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
                yield from batch.to_pylist()
        elif suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataFileError(f"{path}: line {line_no} is not JSON ({e.msg})") from None
        elif suffix == ".json":
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):  # {"data": [...]} or column-less single object
                data = data.get("data", [data])
            if not isinstance(data, list):
                raise DataFileError(f"{path}: expected a list of rows")
            yield from data
        else:
            raise DataFileError(f"{path}: unsupported file type {suffix!r}; use {', '.join(ROW_FILE_SUFFIXES)}")
    except (pa.ArrowException, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{path}: cannot be read ({e})") from e


def read_rows(path: str | os.PathLike) -> list[dict]:
    return list(iter_rows(path))


def write_rows(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write rows as parquet, atomically, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    table = pa.Table.from_pylist(rows) if rows else pa.table({})
    for i, col in enumerate(table.schema):
        if pa.types.is_struct(col.type) and col.type.num_fields == 0:  # {} everywhere: parquet has no empty struct
            table = table.set_column(i, col.name, pa.nulls(len(table)))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def split_train_test(n_rows: int, test_ratio: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test row indices exactly as ``datasets.Dataset.train_test_split`` draws them.

    The recipe splits with ``train_test_split(test_size=test_ratio, seed=seed)``: ceil(ratio * n) test
    rows, the rest for training, both taken from one ``np.random.default_rng(seed).permutation(n)``.
    Reproducing the draw (not only the sizes) gives the very rows the recipe trains on.
    """
    check_test_ratio(test_ratio)
    n_test = math.ceil(test_ratio * n_rows)
    if n_test >= n_rows:
        raise TooFewRowsError(
            f"{n_rows} rows are too few for a test ratio of {test_ratio}: no training row would be left"
        )
    permutation = np.random.default_rng(seed).permutation(n_rows)
    return permutation[n_test:], permutation[:n_test]


def task_splits(rows_by_task: dict[str, list[dict]], test_ratio: float, seed: int) -> dict[str, dict[str, list[dict]]]:
    """The recipe's splits: each task split on its own with the same seed, then ``merged``, the per-task
    splits concatenated in task order. The same seed and row count hold out the same row indices, so
    files made of the same questions (at several context lengths) hold out the same questions."""
    merged: dict[str, list[dict]] = {"train": [], "test": []}
    splits: dict[str, dict[str, list[dict]]] = {}
    for task, rows in rows_by_task.items():
        train_idx, test_idx = split_train_test(len(rows), test_ratio, seed)
        splits[task] = {"train": [rows[i] for i in train_idx], "test": [rows[i] for i in test_idx]}
        for split, split_rows in splits[task].items():
            merged[split].extend(split_rows)
    splits["merged"] = merged
    return splits


def write_splits(splits: dict[str, dict[str, list[dict]]], output_dir: str | os.PathLike) -> dict[str, dict[str, int]]:
    """Write ``<name>/<split>.parquet`` under ``output_dir`` for every name and split; return their row counts."""
    output_dir = Path(output_dir)
    for name, parts in splits.items():
        for split, split_rows in parts.items():
            write_rows(split_rows, output_dir / name / f"{split}.parquet")
    return {name: {split: len(split_rows) for split, split_rows in parts.items()} for name, parts in splits.items()}


def write_task_splits(
    rows_by_task: dict[str, list[dict]], output_dir: str | os.PathLike, test_ratio: float, seed: int
) -> dict[str, dict[str, int]]:
    """Write the recipe's layout: ``<task>/{train,test}.parquet`` and ``merged/{train,test}.parquet``
    (see ``task_splits``). Returns the row count of every file written."""
    return write_splits(task_splits(rows_by_task, test_ratio, seed), output_dir)
