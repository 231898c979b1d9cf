"""The shared-prompt layout: each prompt once, followed by its responses, in one packed row.

In GRPO a prompt has n responses, and with 16K-token prompts and 1-4K-token responses the naive
layout (one padded row per sample) spends most of the training compute on the same prompt n
times. Here a *pack* is one prompt followed by some of its responses; a micro-batch is packs laid
back to back in a single row with no padding. Exactness comes from two rules:

- positions: the prompt is ``0..P-1`` and every response restarts at ``P``, so a response sees the
  positions it would see alone;
- attention: a prompt token sees the earlier tokens of its prompt; a response token sees its whole
  prompt and its own earlier tokens, never another response and never another pack.

The last prompt token predicts the first token of every response, so its hidden state is read
once per response. Everything here is host-side bookkeeping (Python ints and index tensors, built
once per micro-batch), so the attention backends never synchronise with the host per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Pack:
    """One prompt and the samples (indices into the step's samples) whose responses follow it."""

    prompt: Sequence[int]
    samples: list[int]
    response_lengths: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + sum(self.response_lengths)


def plan_packs(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], groups: list[list[int]],
               budget: int) -> list[list[Pack]]:
    """Micro-batches of packs whose packed length fits ``budget`` tokens.

    ``groups`` lists the sample indices sharing each prompt. A group is never split across
    micro-batches unless it alone exceeds the budget; then its responses are cut into several packs
    that each carry the prompt (exact, only the prompt is recomputed). Packs are taken in the order
    given and a micro-batch is closed when the next pack would overflow it.
    """
    packs: list[Pack] = []
    for members in groups:
        prompt = prompt_ids[members[0]]
        current = Pack(prompt, [], [])
        for i in members:
            n = len(response_ids[i])
            if current.samples and len(current) + n > budget:
                packs.append(current)
                current = Pack(prompt, [], [])
            current.samples.append(i)
            current.response_lengths.append(n)
        packs.append(current)
    micro: list[list[Pack]] = []
    size = 0
    for pack in packs:
        if micro and micro[-1] and size + len(pack) <= budget:
            micro[-1].append(pack)
            size += len(pack)
        else:
            micro.append([pack])
            size = len(pack)
    return micro


@dataclass
class PackedBatch:
    """One micro-batch as a single packed row, with what attention and the LM head need.

    ``segments`` lists ``(start, prompt_length, response_lengths)`` per pack, host-side, for the
    dense reference backend; ``pack_id``/``segment_id``/``is_prompt`` are per-token device tensors
    for block-mask backends. ``predict_at[k]`` is the row position whose hidden state predicts
    response token ``k`` (in ``samples`` order, each response's tokens in turn), ``targets[k]`` its id.
    """

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    samples: list[int]
    response_lengths: list[int]
    segments: list[tuple[int, int, list[int]]]
    pack_id: torch.Tensor  # [T] int32
    segment_id: torch.Tensor  # [T] int32: 0 for prompt tokens, 1 + response number within the pack otherwise
    predict_at: torch.Tensor  # [K] long
    targets: torch.Tensor  # [K] long
    backend: str = "dense"  # which attention backend runs it (model/attention.py)
    block_masks: dict = field(default_factory=dict)  # the flex backend's BlockMask per sliding window (None: none)
    split_layout: object = None  # the split backend's SplitLayout (model/split_attention.py)
    pad_to: int = 1  # the row was padded to a multiple of this (the split backend buckets its kernels' shapes by it)
    length: int = field(init=False)

    def __post_init__(self):
        self.length = self.input_ids.shape[1]

    def to(self, device) -> "PackedBatch":
        for name in ("input_ids", "position_ids", "pack_id", "segment_id", "predict_at", "targets"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self

    def response_mask(self) -> torch.Tensor:
        """``[len(samples), longest response]`` bool, True on real response tokens (row order = ``samples``)."""
        lengths = torch.as_tensor(self.response_lengths)
        width = int(lengths.max()) if len(lengths) else 0
        return torch.arange(width)[None, :] < lengths[:, None]


def build_packed_batch(packs: list[Pack], response_ids: Sequence[Sequence[int]], pad_to: int = 1) -> PackedBatch:
    """Lay packs back to back in one row (padded at the end to a multiple of ``pad_to`` with a dummy
    pack of token 0, which attends only to itself and is never read)."""
    ids: list[int] = []
    positions: list[int] = []
    pack_id: list[int] = []
    segment_id: list[int] = []
    predict_at: list[int] = []
    targets: list[int] = []
    segments = []
    samples, lengths = [], []
    for p, pack in enumerate(packs):
        start, plen = len(ids), len(pack.prompt)
        if plen == 0:
            raise ValueError("a pack needs a prompt of at least one token")
        ids.extend(int(t) for t in pack.prompt)
        positions.extend(range(plen))
        pack_id.extend([p] * plen)
        segment_id.extend([0] * plen)
        for r, i in enumerate(pack.samples):
            response = [int(t) for t in response_ids[i]]
            first = len(ids)
            ids.extend(response)
            positions.extend(range(plen, plen + len(response)))
            pack_id.extend([p] * len(response))
            segment_id.extend([r + 1] * len(response))
            if response:
                predict_at.append(start + plen - 1)
                predict_at.extend(range(first, first + len(response) - 1))
                targets.extend(response)
            samples.append(i)
            lengths.append(len(response))
        segments.append((start, plen, list(pack.response_lengths)))
    pad = (-len(ids)) % pad_to
    if pad:
        ids.extend([0] * pad)
        positions.extend(range(pad))
        pack_id.extend([len(packs)] * pad)
        segment_id.extend([0] * pad)
    as_long = lambda xs: torch.as_tensor(xs, dtype=torch.long)  # noqa: E731
    return PackedBatch(input_ids=as_long(ids)[None], position_ids=as_long(positions)[None], samples=samples,
                       response_lengths=lengths, segments=segments,
                       pack_id=torch.as_tensor(pack_id, dtype=torch.int32),
                       segment_id=torch.as_tensor(segment_id, dtype=torch.int32),
                       predict_at=as_long(predict_at), targets=as_long(targets), pad_to=pad_to)
