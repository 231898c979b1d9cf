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


def collate_right(sequences: Sequence[Sequence[int]], response_starts: Sequence[int], pad: int):
    """Right-padded ``(ids, attention_mask, response_mask)`` tensors for prompt+response sequences;
    ``response_starts[i]`` is where sequence i's response begins."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    response = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (seq, start) in enumerate(zip(sequences, response_starts)):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        attention[row, : len(seq)] = 1
        response[row, start : len(seq)] = True
    return ids, attention, response
