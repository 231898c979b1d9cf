"""Speculative decoding in the fast engine: drafted tokens verified in one decode step, with exactly the
samples of plain decoding.

The engine samples by Gumbel-max with noise that is a pure function of (sample seed, token index,
vocabulary id), so the token a sample takes at index i is a fixed function of the logits there. A
verifying step feeds each row its last token followed by up to k drafts (``prompt_lookup.py``) and
samples at every fed position: pick j is the token plain decoding would take at index L + j provided
drafts 1..j were the tokens it took before. So the step keeps the picks up to and including the first
that differs from its draft (pick 0 is always plain decoding's next token; each further pick is right
because the draft before it was), then ends the row at a stop token or its length limit among the
kept tokens exactly as plain decoding would. Temperature, top-k and top-p act on each position's
logits as without drafts; stop strings are cut on the host from the same tokens. Drafts change how
many forward passes a sample takes, never what it samples (up to the float rounding of a wider step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("prompt_lookup",)


@dataclass(frozen=True)
class Speculation:
    """Draft up to ``tokens`` tokens per sample and step (k) from prompt lookup, matching the text's last
    ``min_match`` to ``max_match`` tokens."""

    tokens: int
    min_match: int = 2
    max_match: int = 8

    def __post_init__(self):
        for name in ("tokens", "min_match", "max_match"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"speculative min_match ({self.min_match}) must not exceed max_match ({self.max_match})")

    @property
    def queries(self) -> int:
        """Tokens a verifying step feeds per sample: the last one and k drafts."""
        return self.tokens + 1


def verify(
    sampled: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor, stops: torch.Tensor, room: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampled`` ``[rows, k + 1]``: the picks at each fed position; ``drafts`` ``[rows, k]``, the first
    ``draft_len`` real; ``room``: tokens each row may still take. -> ``(keep, stopped)``: how many picks
    each row keeps (at least 1 where ``room`` allows) and whether the last kept one is a stop token."""
    k = drafts.shape[1]
    place = torch.arange(k + 1, device=sampled.device)
    agree = (drafts == sampled[:, :k]) & (place[:k] < draft_len[:, None])
    accepted = agree.long().cumprod(1).sum(1)  # drafts confirmed before the first miss
    first_stop = torch.where(torch.isin(sampled, stops), place, k + 1).min(1).values
    keep = torch.minimum(torch.minimum(accepted, first_stop) + 1, room)
    return keep, first_stop < keep
