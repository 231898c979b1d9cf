"""Prompt-lookup drafts: what followed an earlier occurrence of a sample's latest tokens in its own text.

Answers to long-context questions copy from their context (the reasoning restates supporting facts
word for word, the answer repeats a name from the passages), and from themselves. So the sample's own
text, its prompt followed by what it has generated so far, is a free draft model: find where the
text's last tokens occurred before, the longest such match (at least ``min_match`` and at most
``max_match`` tokens; the earliest of equally long ones), and propose the up to ``k`` tokens that
followed it there.

Everything runs on the device with fixed shapes, for all rows at once and without looking at the
host, so the engine computes drafts inside its decode step (and its CUDA graph). Each row's text is
gathered from its group's prompt ids, stored once per group when the prompt is prefilled, and its own
tokens; then every position of the text is compared with the text's last ``max_match`` tokens, one
pass per match length: about ``max_match`` integer comparisons per text position and row, small
beside the attention's reading of the same prompt's keys and values in every layer.
"""

from __future__ import annotations

import torch

NO_TOKEN = -1  # past the end of a row's text
NEVER = -2  # a last-tokens entry before the start of a short text: equal to nothing


def row_text(
    prompt_ids: torch.Tensor, prefix_len: torch.Tensor, own_ids: torch.Tensor, own_len: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's text, ``[rows, P + S]``: its group's prompt (``prompt_ids`` ``[groups, P]``, the first
    ``prefix_len[g]`` valid) then its own tokens (``own_ids`` ``[rows, S]``, the first ``own_len[row]``
    valid), ``NO_TOKEN`` after; and each text's length. Rows are group-major, ``n`` per group. The lengths
    must fit the widths (``prefix_len <= P``, ``own_len <= S``): a text never reaches past what it is given."""
    rows, S = own_ids.shape
    P = prompt_ids.shape[1]
    prompt_len = prefix_len.repeat_interleave(n)[:, None]
    length = prompt_len[:, 0] + own_len
    both = torch.cat([prompt_ids.repeat_interleave(n, 0), own_ids], 1)
    at = torch.arange(P + S, device=own_ids.device)[None, :]
    source = torch.where(at < prompt_len, at, P + at - prompt_len).clamp(max=P + S - 1)
    text = torch.where(at < length[:, None], both.gather(1, source), NO_TOKEN)
    return text, length


def propose(
    text: torch.Tensor, length: torch.Tensor, k: int, min_match: int, max_match: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts ``[rows, k]`` and how many of each row's are real, ``[rows]`` (0: no match of at least
    ``min_match`` tokens). ``text`` ``[rows, T]`` (``NO_TOKEN`` past each row's ``length``).

    A candidate is a position ``c < length`` whose preceding tokens equal the text's last ones; its
    match length is how many of them do, up to ``max_match``. The draft is ``text[c : c + k]``, cut at
    the text's end. Unused draft places hold token 0 (a valid id, so the step can embed them)."""
    rows, T = text.shape
    position = torch.arange(T, device=text.device)
    last = torch.arange(1, max_match + 1, device=text.device)[None, :]  # j: the text's j-th token from the end
    tail = text.gather(1, (length[:, None] - last).clamp(min=0))
    tail = torch.where(length[:, None] - last >= 0, tail, NEVER)  # [rows, max_match]
    run = torch.ones(rows, T, dtype=torch.bool, device=text.device)
    matched = torch.zeros(rows, T, dtype=torch.int32, device=text.device)
    for j in range(1, min(max_match, T - 1) + 1):  # the j-th token before each candidate against the j-th from the end
        run[:, j - 1] = False  # candidate j - 1 has no j-th token before it
        run[:, j:] &= text[:, : T - j] == tail[:, j - 1 : j]
        matched += run
    matched = torch.where((position < length[:, None]) & (matched >= min_match), matched, 0).long()
    best = (matched * (T + 1) - position).argmax(1)  # the longest match, the earliest of equal ones
    found = matched.gather(1, best[:, None]).squeeze(1) > 0
    draft_len = torch.where(found, (length - best).clamp(max=k), 0)
    offset = torch.arange(k, device=text.device)
    drafts = text.gather(1, (best[:, None] + offset).clamp(max=T - 1))
    return torch.where(offset < draft_len[:, None], drafts, 0), draft_len
