"""The rules of command-line options that are no config key: the data commands' test ratio, the synthetic
generator's tasks, hops and context lengths, and ``longqa plan --split``'s GPUs.

Each rule looks at the options' values alone (no file, folder, data or device), so it is a settings rule and
lives with the others in the config package; the commands call it where they take the options. The limits the
generator's rules state are defined here too, and ``longqa.data.synth`` builds on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from longqa.config.schema import ConfigError

__all__ = [
    "MAX_HOPS",
    "MIN_CONTEXT_TOKENS",
    "SYNTH_TASKS",
    "check_split_gpus",
    "check_synth_options",
    "check_test_ratio",
]

SYNTH_TASKS = ("hotpotqa", "musique", "2wikimqa")  # the source datasets whose question styles synth writes
MIN_CONTEXT_TOKENS = 256  # short contexts for CPU demos; the question's own passages may overrun the target
MAX_HOPS = 6  # deeper nesting reads as noise rather than as a question


def check_test_ratio(test_ratio: float) -> None:
    """A test ratio that holds out some rows and leaves some to train on: the recipe's split takes a fraction."""
    if not 0.0 < test_ratio < 1.0:
        raise ConfigError(f"test ratio must be in (0, 1), got {test_ratio}")


def check_synth_options(tasks: Sequence[str], min_hops: int, max_hops: int, lengths: Iterable[int]) -> None:
    """Tasks the generator knows, a hop range it can compose (a chain needs two hops) and context lengths it can
    fill, refused before any row is made."""
    unknown = [t for t in tasks if t not in SYNTH_TASKS]
    if unknown or not tasks:
        raise ConfigError(f"unknown tasks {unknown}; choose from {', '.join(SYNTH_TASKS)}")
    if not 2 <= min_hops <= max_hops <= MAX_HOPS:
        raise ConfigError(f"need 2 <= min_hops <= max_hops <= {MAX_HOPS}, got {min_hops}..{max_hops}")
    for length in lengths:
        if length < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"context lengths must be at least {MIN_CONTEXT_TOKENS} tokens, got {length}")


def check_split_gpus(gpus: int) -> None:
    """``longqa plan --split`` splits the GPUs between sampling and training: one GPU leaves no split."""
    if gpus < 2:
        raise ConfigError("sampler ranks of their own need at least 2 GPUs: plan with --gpus 2 or more")
