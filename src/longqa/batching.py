"""Cutting samples into batches by a padded-token budget, shared by the SFT and GRPO updates."""

from __future__ import annotations

from typing import Sequence


def budget_batches(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``order`` cut so that each batch's padded size (rows x longest) fits
    ``budget``; a sample longer than the budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        grown = max(width, int(lengths[i]))
        if current and grown * (len(current) + 1) > budget:
            batches.append(current)
            current, grown = [], int(lengths[i])
        current.append(int(i))
        width = grown
    if current:
        batches.append(current)
    return batches
