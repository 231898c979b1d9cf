"""The seed recipe's data: LoongRL-Train-Data, prepared exactly as the reference recipe prepares it.

Per task the recipe concatenates two subsets (the original ``*_qwen_0_2500`` rows and the
KeyChain-injected ``*_distractor_2500_5000`` rows), keeps only verl's columns, prepends the system
prompt, splits with ``train_test_split(test_size, seed)`` and writes per-task and merged parquet
files. Our machines cannot reach the Hub, so the same subsets can come from a local folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from longqa.data.io import ROW_FILE_SUFFIXES, DataFileError, iter_rows, write_task_splits
from longqa.data.schema import row_problem, verl_columns_only, with_system_prompt

HUB_ID = "OldKingMeister/LoongRL-Train-Data"

SUBSET_PAIRS = {
    "hotpotqa": ("hotpotqa_qwen_0_2500", "hotpotqa_distractor_2500_5000"),
    "musique": ("musique_qwen_0_2500", "musique_distractor_2500_5000"),
    "2wikimqa": ("2wikipedia_qwen_0_2500", "2wikipedia_distractor_2500_5000"),
}


class SourceError(RuntimeError):
    """The LoongRL subsets could not be found or fetched."""


def _hub_snapshot(repo_id: str) -> Path:
    """Download only the six subsets from the Hub; one clear error when the Hub is out of reach."""
    from huggingface_hub import snapshot_download

    subsets = [s for pair in SUBSET_PAIRS.values() for s in pair]
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=[f"*{s}*" for s in subsets]))
    except Exception as e:  # network, auth or missing repo: all end the same way for the user
        raise SourceError(
            f"cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: {str(e).splitlines()[0]}).\n"
            f"On a machine that reaches the Hub run\n"
            f"  hf download {repo_id} --repo-type dataset --local-dir LOONGRL_DIR\n"
            f"then copy LOONGRL_DIR here and pass --source LOONGRL_DIR (a folder holding the subsets "
            f"{', '.join(subsets)} as parquet or jsonl, one folder or file per subset)."
        ) from None


def subset_files(root: Path, subset: str) -> list[Path]:
    """The row files of one subset under ``root``: a folder named after it, or a file with its name.

    Inside a subset folder, files named ``train*`` are preferred when present, because a Hub layout may
    also hold other splits and the recipe reads ``split="train"``.
    """

    def rows_in(folder: Path) -> list[Path]:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in ROW_FILE_SUFFIXES)
        train = [p for p in files if p.name.startswith("train")]
        return train or files

    for folder in sorted(p for p in root.rglob(subset) if p.is_dir()):
        if files := rows_in(folder):
            return files
    files = sorted(p for p in root.rglob(f"{subset}.*") if p.is_file() and p.suffix.lower() in ROW_FILE_SUFFIXES)
    if not files:
        raise SourceError(
            f"subset {subset!r} not found under {root}: expected a folder {subset}/ with parquet or "
            f"jsonl files, or a file {subset}.parquet / {subset}.jsonl"
        )
    return files[:1]


def _recipe_row(row: dict, where: str) -> dict:
    row = verl_columns_only(row)
    if isinstance(row.get("prompt"), (list, tuple)):
        row["prompt"] = with_system_prompt(list(row["prompt"]))
    if problem := row_problem(row):
        raise DataFileError(f"{where}: {problem}")
    return row


def load_task_rows(root: Path) -> dict[str, list[dict]]:
    """Each task's rows: its two subsets concatenated in the recipe's order, converted like the recipe."""
    rows_by_task = {}
    for task, subsets in SUBSET_PAIRS.items():
        rows = []
        for subset in subsets:
            for path in subset_files(root, subset):
                rows.extend(_recipe_row(r, f"{path}, row {i}") for i, r in enumerate(iter_rows(path)))
        rows_by_task[task] = rows
    return rows_by_task


def resolve_source(source: str) -> Path:
    """A local folder when ``source`` names one, else a Hub dataset id."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise SourceError(f"--source {source!r} is neither a folder nor a Hub dataset id like {HUB_ID}")
    return _hub_snapshot(source)


def prepare_loongrl(
    output_dir: str | os.PathLike, source: str = HUB_ID, test_ratio: float = 0.05, seed: int = 42
) -> dict[str, dict[str, int]]:
    """Write ``output_dir/<task>/{train,test}.parquet`` and ``output_dir/merged/...``; return row counts."""
    return write_task_splits(load_task_rows(resolve_source(source)), output_dir, test_ratio, seed)
