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

from longqa.model.sequence_parallel import SequenceShard


@dataclass
class Pack:
    """One prompt and the samples (indices into the step's samples) whose responses follow it."""

    prompt: Sequence[int]
    samples: list[int]
    response_lengths: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + sum(self.response_lengths)


def plan_packs(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], groups: list[list[int]], budget: int
) -> list[list[Pack]]:
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
    shard: SequenceShard | None = None  # under sequence parallelism, the part of the row this rank computes
    length: int = field(init=False)

    def __post_init__(self):
        self.length = self.input_ids.shape[1]

    def to(self, device) -> "PackedBatch":
        """Onto ``device``; to a GPU from page-locked copies, so the transfers do not wait for the kernels
        already queued (a copy from pageable memory would, leaving the GPU idle while the host packs the next
        micro-batch)."""
        pinned = torch.device(device).type == "cuda"
        for name in ("input_ids", "position_ids", "pack_id", "segment_id", "predict_at", "targets"):
            tensor = getattr(self, name)
            setattr(
                self,
                name,
                (tensor.pin_memory() if pinned and tensor.device.type == "cpu" else tensor).to(
                    device, non_blocking=True
                ),
            )
        return self

    def rows(self) -> tuple[int, int]:
        """The rows ``[start, end)`` of the packed row this rank computes: all of it, or its sequence shard."""
        return (0, self.length) if self.shard is None else self.shard.bounds(self.length)

    def predicted_here(self) -> torch.Tensor:
        """``[K]`` bool: the response tokens whose predicting row (``predict_at``) lies in this rank's rows."""
        start, end = self.rows()
        return (self.predict_at >= start) & (self.predict_at < end)

    def response_mask(self) -> torch.Tensor:
        """``[len(samples), longest response]`` bool, True on real response tokens (row order = ``samples``)."""
        lengths = torch.as_tensor(self.response_lengths)
        width = int(lengths.max()) if len(lengths) else 0
        return torch.arange(width)[None, :] < lengths[:, None]


def build_packed_batch(packs: list[Pack], response_ids: Sequence[Sequence[int]], pad_to: int = 1) -> PackedBatch:
    """Lay packs back to back in one row (padded at the end to a multiple of ``pad_to`` with a dummy
    pack of token 0, which attends only to itself and is never read).

    Built with tensor operations over whole sequences, not token by token: a micro-batch of four
    8,192-token groups took 25 ms of Python per token loop, during which the GPU waited."""
    sequences, pack_of, segment_of, position_from = [], [], [], []  # per sequence: a prompt or a response
    samples, lengths, segments = [], [], []
    start = 0
    for p, pack in enumerate(packs):
        plen = len(pack.prompt)
        if plen == 0:
            raise ValueError("a pack needs a prompt of at least one token")
        sequences.append(pack.prompt)
        pack_of.append(p), segment_of.append(0), position_from.append(0)
        for r, i in enumerate(pack.samples):
            sequences.append(response_ids[i])
            pack_of.append(p), segment_of.append(r + 1), position_from.append(plen)
            samples.append(i)
            lengths.append(len(response_ids[i]))
        segments.append((start, plen, list(pack.response_lengths)))
        start += plen + sum(len(response_ids[i]) for i in pack.samples)
    pad = (-start) % pad_to
    sizes = torch.as_tensor([len(x) for x in sequences] + [pad], dtype=torch.long)
    total = start + pad
    long = dict(dtype=torch.long)
    ids = torch.cat([torch.as_tensor(x, **long).view(-1) for x in sequences] + [torch.zeros(pad, **long)])
    first = torch.cumsum(sizes, 0) - sizes  # each sequence's first row
    offset = torch.arange(total) - first.repeat_interleave(sizes, output_size=total)  # index within its sequence
    positions = offset + torch.as_tensor(position_from + [0], **long).repeat_interleave(sizes, output_size=total)
    pack_id = torch.as_tensor(pack_of + [len(packs)], dtype=torch.int32).repeat_interleave(sizes, output_size=total)
    segment_id = torch.as_tensor(segment_of + [0], dtype=torch.int32).repeat_interleave(sizes, output_size=total)
    # Response token k is predicted by the row before it; a response's first token by its prompt's last row.
    response_rows = torch.nonzero(segment_id > 0).view(-1)
    predict_at = response_rows - 1
    prompt_last = torch.as_tensor([segment[0] + segment[1] - 1 for segment in segments], **long)
    opens = offset[response_rows] == 0
    predict_at[opens] = prompt_last[pack_id[response_rows[opens]].long()]
    return PackedBatch(
        input_ids=ids[None],
        position_ids=positions[None],
        samples=samples,
        response_lengths=lengths,
        segments=segments,
        pack_id=pack_id,
        segment_id=segment_id,
        predict_at=predict_at,
        targets=ids[response_rows],
        pad_to=pad_to,
    )
