"""Shared-prompt attention, plugged into transformers' attention registry.

``use_longqa_attention(model)`` switches the model to ``longqa:<its implementation>``: a registered
attention function that runs the shared-prompt rule (``model/packing.py``) when the forward pass
carries a ``longqa_pack`` keyword, hands the step to the fast rollout engine's KV cache when it
carries ``longqa_kv`` (``rollout/fast.py``), and runs the model's own implementation otherwise, so
generation and plain forwards keep working unchanged. No model code is copied or patched: any
decoder whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` (Qwen3, Qwen2, Llama, ...) works,
GQA included, since keys and values arrive with their own head count.

Backends, chosen per call:
- ``dense``: per pack, PyTorch SDPA with an explicit boolean mask. Exact and simple; the reference,
  and the CPU path. Each pack is attended separately, so memory is per pack, not per micro-batch.
- ``flex``: one ``flex_attention`` call over the whole packed row with a block mask built once per
  micro-batch from the layout (blocks of other responses and other packs are skipped, the prompt
  block rows are read once by all responses). The GPU default.
Neither copies the prompt's keys and values per response nor synchronises with the host per layer.
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F

from longqa.model.packing import PackedBatch

PREFIX = "longqa:"
BLOCK = 128  # flex_attention's block size: the packed row is padded to a multiple of it
BACKENDS = ("auto", "dense", "flex")


def pack_mask(prompt_length: int, response_lengths: list[int], device=None) -> torch.Tensor:
    """``[L, L]`` bool for one pack: True where query row may attend to key column."""
    segment = torch.cat([torch.zeros(prompt_length, dtype=torch.long, device=device)] +
                        [torch.full((n,), r + 1, dtype=torch.long, device=device) for r, n in enumerate(response_lengths)])
    position = torch.arange(len(segment), device=device)
    causal = position[:, None] >= position[None, :]
    return causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))


def _dense(query, key, value, pack: PackedBatch, scaling):
    parts = []
    for start, prompt_length, response_lengths in pack.segments:
        end = start + prompt_length + sum(response_lengths)
        mask = pack_mask(prompt_length, response_lengths, query.device)
        parts.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=mask, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1]))
    if end < query.shape[2]:  # the padding pack is never read
        parts.append(query.new_zeros(query.shape[0], query.shape[1], query.shape[2] - end, query.shape[3]))
    return torch.cat(parts, dim=2)


def block_mask(pack: PackedBatch):
    """The flex_attention BlockMask of a packed row, classified block by block from the layout.

    For every query token the allowed keys are at most two intervals (its pack's prompt up to the
    token, and its own response up to the token), so the number of allowed pairs in each
    (query block, key block) is a sum of interval overlaps: exact, and without ever forming the
    ``T x T`` token mask.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if pack.length % BLOCK:
        raise ValueError(f"the packed row ({pack.length} tokens) must be padded to a multiple of {BLOCK}")
    device = pack.input_ids.device
    pack_id, segment = pack.pack_id, pack.segment_id
    t = torch.arange(pack.length, device=device, dtype=torch.int32)
    first = torch.ones_like(pack_id, dtype=torch.bool)
    first[1:] = pack_id[1:] != pack_id[:-1]
    pack_start = torch.cummax(torch.where(first, t, 0), 0).values
    prompt_length = torch.zeros_like(t).index_add_(0, pack_id.long(), (segment == 0).int())
    prompt_end = pack_start + prompt_length[pack_id.long()]
    new_segment = first.clone()
    new_segment[1:] |= segment[1:] != segment[:-1]
    segment_start = torch.cummax(torch.where(new_segment, t, 0), 0).values
    blocks = pack.length // BLOCK
    lo = torch.arange(blocks, device=device, dtype=torch.int32) * BLOCK

    def overlap(a, b):  # |[a, b) ∩ each key block|, [T, blocks]
        return (torch.minimum(b[:, None], lo[None] + BLOCK) - torch.maximum(a[:, None], lo[None])).clamp(min=0)

    allowed = overlap(pack_start, torch.minimum(prompt_end, t + 1))
    allowed += torch.where((segment > 0)[:, None], overlap(segment_start, t + 1), 0)
    counts = allowed.view(blocks, BLOCK, blocks).sum(1)
    full = counts == BLOCK * BLOCK
    partial = (counts > 0) & ~full

    def as_kv(kind):
        order = torch.argsort((~kind).to(torch.int8), dim=-1, stable=True)
        return kind.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    pid, seg = pack.pack_id, pack.segment_id

    def mask_mod(b, h, q, k):
        return (pid[q] == pid[k]) & (k <= q) & ((seg[k] == 0) | (seg[k] == seg[q]))

    kv_num, kv_idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(pack.length, pack.length))


@functools.cache
def _flex_kernel(compiled: bool):
    """flex_attention is fast only compiled (its eager form is a slow reference, fine for CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def prepare(pack: PackedBatch) -> None:
    """Build what the pack's backend needs once per micro-batch (shared by every layer and by the
    checkpointing recompute), before the forward pass so it is never traced into a compiled layer."""
    if pack.backend == "flex" and pack.block_mask is None:
        pack.block_mask = block_mask(pack)


def _flex(query, key, value, pack: PackedBatch, scaling):
    prepare(pack)
    # Inside a compiled decoder layer the plain function is traced into the layer's graph.
    kernel = _flex_kernel(query.is_cuda and not torch.compiler.is_compiling())
    return kernel(query, key, value, block_mask=pack.block_mask, scale=scaling,
                  enable_gqa=key.shape[1] != query.shape[1])


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return backend


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, longqa_pack=None,
               longqa_kv=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if longqa_kv is not None:
        return longqa_kv.attend(module.layer_idx, query, key, value, scaling), None
    if longqa_pack is None:
        inner = module.config._attn_implementation.removeprefix(PREFIX)
        return ALL_ATTENTION_FUNCTIONS[inner](module, query, key, value, attention_mask, scaling=scaling,
                                              dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("shared-prompt attention does not implement attention dropout")
    run = _flex if longqa_pack.backend == "flex" else _dense
    out = run(query, key, value, longqa_pack, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register(name: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    inner = name.removeprefix(PREFIX)
    AttentionInterface.register(name, _attention)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # plain forwards build the inner kind's masks
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[inner])


def use_longqa_attention(model) -> None:
    """Route the model's attention through longqa's dispatcher (idempotent)."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith(PREFIX):
        return
    name = PREFIX + current
    _register(name)
    model.set_attn_implementation(name)


# A 4-D placeholder handed to the model as ``attention_mask`` in packed calls: transformers returns a
# 4-D mask as it is, so no ``T x T`` mask is built from the position ids (which restart per response).
NO_MASK = torch.empty(1, 1, 0, 0, dtype=torch.bool)
