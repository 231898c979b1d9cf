"""Shared-prompt attention, plugged into transformers' attention registry.

``use_longqa_attention(model)`` switches the model to ``longqa:<its implementation>``: a registered
attention function that runs the shared-prompt rule (``model/packing.py``) when the forward pass
carries a ``longqa_pack`` keyword, hands the step to the fast rollout engine's KV cache when it
carries ``longqa_kv`` (``rollout/fast.py``), and runs the model's own implementation otherwise (eager
included), so generation and plain forwards keep working unchanged. No model code is copied or
patched. Before switching, the model is probed once (``attention_spec.inspect_model``): each layer's
sliding window and logit soft-capping are honoured here and in the engine, and a model that needs
anything else is refused with an ``UnsupportedModelError`` instead of being computed without it.

Backends, chosen per call:
- ``dense``: per pack, PyTorch SDPA with an explicit boolean mask. Exact and simple; the reference,
  and the CPU path. Each pack is attended separately, so memory is per pack, not per micro-batch.
- ``flex``: one ``flex_attention`` call over the whole packed row with a block mask built once per
  micro-batch from the layout (blocks of other responses and other packs are skipped, the prompt
  block rows are read once by all responses). Any model longqa accepts, sliding windows and
  soft-capping included.
- ``split``: the prompt half and the own half as two ordinary causal attentions merged by their
  log-sum-exp (``model/split_attention.py``), on CUDA cuDNN's kernels: 2.5-9% faster than flex per
  group once cuDNN has planned its shapes (each new shape costs it 0.2-0.8 s on an H200; shapes are
  rounded to a bounded set). Opt-in, for models with plain causal attention in bfloat16 or float16.
None copies the prompt's keys and values per response or synchronises with the host per layer. Under sequence
parallelism (a pack with a ``shard``) each rank passes its shard of the row, and the backend runs unchanged on whole
rows of its share of the heads, between the exchanges of ``model/sequence_parallel.py``.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from longqa.model.attention_spec import AttentionSpec, ModelSpec, UnsupportedModelError, close, inspect_model, read_call
from longqa.model.packing import PackedBatch
from longqa.model.sequence_parallel import heads_to_sequence, split_heads
from longqa.model.split_attention import shared_prompt_attention, split_layout
from longqa.model.split_attention import unsupported_reason as split_unsupported

PREFIX = "longqa:"
BLOCK = 128  # flex_attention's block size: the packed row is padded to a multiple of it
LENGTH_BUCKETS = 16  # packed rows of a token budget are padded to one of this many lengths
BACKENDS = ("auto", "dense", "flex", "split")
PADDED_BACKENDS = ("flex", "split")  # rows padded to length buckets for the compiled layers


def length_step(budget: int) -> int:
    """The flex and split backends pad each packed row to a multiple of this (at least ``BLOCK``): a sixteenth of
    the micro-batch token budget. Compiled kernels then see at most ``LENGTH_BUCKETS`` (+1 for a row
    over the budget) static lengths, each compiled once before the first step
    (``Actor.compile_length_buckets``). With lengths left dynamic, Inductor compiles slower kernels (the
    flex backward of a 16K-token Qwen3-1.7B row took 8.3 instead of 6.3 ms on an H200) and recompiles on
    a new length; the padding costs a few percent of tokens."""
    return BLOCK * max(1, -(-budget // (LENGTH_BUCKETS * BLOCK)))


def allow_length_buckets() -> None:
    """Let Dynamo keep a graph per length bucket and per grad mode (its default limit of 8 graphs per
    function would send later buckets back to eager kernels)."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * (LENGTH_BUCKETS + 1))


def pack_mask(prompt_length: int, response_lengths: list[int], device=None, window: int | None = None) -> torch.Tensor:
    """``[L, L]`` bool for one pack: True where query row may attend to key column (and, with a sliding
    window, where the key's position is within ``window`` of the query's)."""
    segment = torch.cat(
        [torch.zeros(prompt_length, dtype=torch.long, device=device)]
        + [torch.full((n,), r + 1, dtype=torch.long, device=device) for r, n in enumerate(response_lengths)]
    )
    row = torch.arange(len(segment), device=device)
    mask = (row[:, None] >= row[None, :]) & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    if window is not None:
        position = torch.cat(
            [torch.arange(prompt_length, device=device)]
            + [torch.arange(prompt_length, prompt_length + n, device=device) for n in response_lengths]
        )
        mask &= position[:, None] - position[None, :] < window
    return mask


def masked_attention(query, key, value, mask, scaling, softcap: float | None = None):
    """Attention of ``[b, heads, q, d]`` queries over ``[b, kv_heads, k, d]`` keys where ``mask`` allows.

    Without soft-capping it is SDPA; with it (SDPA cannot transform scores) the scores are formed
    explicitly, as transformers' eager attention does: scaled, capped, masked, softmax in float32."""
    gqa = key.shape[1] != query.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(value.dtype), value)


def _dense(query, key, value, pack: PackedBatch, scaling, spec: AttentionSpec):
    parts = []
    for start, prompt_length, response_lengths in pack.segments:
        end = start + prompt_length + sum(response_lengths)
        mask = pack_mask(prompt_length, response_lengths, query.device, spec.window)
        parts.append(
            masked_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], mask, scaling, spec.softcap
            )
        )
    if end < query.shape[2]:  # the padding pack is never read
        parts.append(query.new_zeros(query.shape[0], query.shape[1], query.shape[2] - end, query.shape[3]))
    return torch.cat(parts, dim=2)


def block_mask(pack: PackedBatch, window: int | None = None):
    """The flex_attention BlockMask of a packed row, classified block by block from the layout.

    For every query token the allowed keys are at most two intervals (its pack's prompt up to the
    token, and its own response up to the token; a sliding window raises both lower ends), so the
    number of allowed pairs in each (query block, key block) is a sum of interval overlaps: exact,
    and without ever forming the ``T x T`` token mask.
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

    prompt_lo, own_lo = pack_start, segment_start
    position = pack.position_ids[0].to(torch.int32)
    if window is not None:  # keys at positions > p - window: prompt rows from pack_start + that position on,
        reach = position - window + 1  # own rows from the response's start + (that position - prompt length)
        prompt_lo = pack_start + reach.clamp(min=0)
        own_lo = segment_start + (reach - (prompt_end - pack_start)).clamp(min=0)
    allowed = overlap(prompt_lo, torch.minimum(prompt_end, t + 1))
    allowed += torch.where((segment > 0)[:, None], overlap(own_lo, t + 1), 0)
    counts = allowed.view(blocks, BLOCK, blocks).sum(1)
    full = counts == BLOCK * BLOCK
    partial = (counts > 0) & ~full

    def as_kv(kind):
        order = torch.argsort((~kind).to(torch.int8), dim=-1, stable=True)
        return kind.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    pid, seg = pack.pack_id, pack.segment_id

    def mask_mod(b, h, q, k):
        return (pid[q] == pid[k]) & (k <= q) & ((seg[k] == 0) | (seg[k] == seg[q]))

    def window_mod(b, h, q, k):
        return mask_mod(b, h, q, k) & (position[q] - position[k] < window)

    kv_num, kv_idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod if window is None else window_mod,
        seq_lengths=(pack.length, pack.length),
    )


@functools.cache
def _flex_kernel(compiled: bool):
    """flex_attention is fast only compiled (its eager form is a slow reference, fine for CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    allow_length_buckets()
    return torch.compile(flex_attention, dynamic=False)


def prepare(pack: PackedBatch, spec: ModelSpec) -> None:
    """Build what the pack's backend needs once per micro-batch (shared by every layer and by the
    checkpointing recompute), before the forward pass so it is never traced into a compiled layer:
    one block mask per sliding window the model's layers use, or the split backend's layout."""
    if pack.backend == "split" and pack.split_layout is None:
        pack.split_layout = split_layout(pack.segments, pack.pad_to, pack.input_ids.device)
    if pack.backend == "flex":
        for window in spec.windows - pack.block_masks.keys():
            pack.block_masks[window] = block_mask(pack, window)


@functools.cache
def _softcap_mod(softcap: float):
    """flex_attention's score transform for logit soft-capping (one function per cap, so compiled kernels
    are reused)."""

    def score_mod(score, b, h, q, k):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _flex(query, key, value, pack: PackedBatch, scaling, spec: AttentionSpec):
    if spec.window not in pack.block_masks:
        raise UnsupportedModelError(
            f"no block mask was prepared for sliding window {spec.window}: the pack was "
            f"prepared for windows {sorted(pack.block_masks, key=str)}"
        )
    if torch.compiler.is_compiling():  # inside a compiled decoder layer: traced into the layer's graph
        from torch.nn.attention.flex_attention import flex_attention as kernel
    else:
        kernel = _flex_kernel(query.is_cuda)
    return kernel(
        query,
        key,
        value,
        block_mask=pack.block_masks[spec.window],
        scale=scaling,
        score_mod=_softcap_mod(spec.softcap) if spec.softcap else None,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def _split(query, key, value, pack: PackedBatch, scaling, spec: AttentionSpec):
    if spec.window is not None or spec.softcap:
        raise UnsupportedModelError(
            "the split attention backend computes plain causal attention: this layer has "
            "a sliding window or soft-capping (use actor.attention_backend=flex)"
        )
    return shared_prompt_attention(
        query, key, value, pack.split_layout, scaling if scaling is not None else query.shape[-1] ** -0.5
    )


def resolve_backend(backend: str, device: torch.device, spec: ModelSpec, dtype: torch.dtype) -> str:
    """The backend to run: ``auto`` is flex on CUDA and dense elsewhere; a split backend that cannot run
    the model is refused with the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if backend == "split":
        problem = split_unsupported(
            device, dtype, spec.head_dim, spec.windows, any(layer.softcap for layer in spec.layers.values())
        )
        if problem:
            raise UnsupportedModelError(f"actor.attention_backend=split cannot run this model: {problem}")
    return backend


def own_attention(module):
    """The attention function the model would call without longqa: its registered implementation, or for
    ``eager`` the ``eager_attention_forward`` of the module's own modeling file (not in the registry)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = module.config._attn_implementation.removeprefix(PREFIX)
    if inner != "eager":
        return ALL_ATTENTION_FUNCTIONS[inner]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} has no eager_attention_forward beside it to hand "
            f"plain forwards back to; load the model with attn_implementation='sdpa'"
        )
    return eager


def _attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    longqa_pack=None,
    longqa_kv=None,
    longqa_probe=None,
    **kwargs,
):
    if longqa_kv is None and longqa_pack is None:
        if longqa_probe is not None:
            longqa_probe.calls.append((module, read_call(module, kwargs), query, key, value))
        return own_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    spec = read_call(module, kwargs)
    if longqa_kv is not None:
        # Contiguous, as transformers' own kernels return it (some modules view the output).
        return longqa_kv.attend(module.layer_idx, query, key, value, scaling, spec).contiguous(), None
    if dropout:
        raise ValueError("shared-prompt attention does not implement attention dropout")
    run = {"flex": _flex, "split": _split}.get(longqa_pack.backend, _dense)
    shard = longqa_pack.shard
    if shard is None:
        out = run(query, key, value, longqa_pack, scaling, spec)
    else:  # this rank's sequence shard of every head <-> whole rows of its share of the heads
        out = heads_to_sequence(run(*split_heads(query, key, value, shard), longqa_pack, scaling, spec), shard)
    return out.transpose(1, 2).contiguous(), None


def _register(name: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    inner = name.removeprefix(PREFIX)
    AttentionInterface.register(name, _attention)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # plain forwards build the inner kind's masks
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[inner])


def use_longqa_attention(model) -> ModelSpec:
    """Route the model's attention through longqa's dispatcher (idempotent) and return what its layers need
    (``attention_spec.ModelSpec``); a model longqa cannot compute exactly is refused and left as it was."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith(PREFIX):
        return model.longqa_spec
    name = PREFIX + current
    _register(name)
    model.set_attn_implementation(name)
    try:
        model.longqa_spec = inspect_model(model)
        _check_packed(model, model.longqa_spec)
    except UnsupportedModelError:
        model.set_attn_implementation(current)
        raise
    return model.longqa_spec


@torch.no_grad()
def _check_packed(model, spec: ModelSpec) -> None:
    """One small pack (a prompt and two responses) against a plain forward of each sample: whatever a model
    does outside its attention calls that the packed layout would break (its own use of the mask, state
    carried along the sequence) shows here, before any training."""
    from longqa.model.packing import Pack, build_packed_batch

    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt, responses = [1 % vocab, 5 % vocab, 2 % vocab, 7 % vocab], [[3 % vocab, 4 % vocab], [6 % vocab]]
    pack = build_packed_batch([Pack(prompt, [0, 1], [2, 1])], responses).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            packed = model.base_model(
                input_ids=pack.input_ids,
                position_ids=pack.position_ids,
                attention_mask=NO_MASK.to(device),
                use_cache=False,
                longqa_pack=pack,
            ).last_hidden_state[0]
            for start, response in ((4, responses[0]), (6, responses[1])):
                ids = torch.tensor([prompt + response], device=device)
                plain = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
                if not close(torch.cat([packed[:4], packed[start : start + len(response)]]), plain):
                    raise UnsupportedModelError(
                        f"longqa cannot train or sample {spec.model_type!r} models exactly: "
                        f"a packed forward differs from plain forwards of the same samples"
                    )
    except UnsupportedModelError:
        raise
    except Exception as err:
        raise UnsupportedModelError(
            f"longqa cannot train or sample {spec.model_type!r} models exactly: a packed "
            f"forward fails ({type(err).__name__}: {err})"
        ) from None
    finally:
        model.train(was_training)


# A 4-D placeholder handed to the model as ``attention_mask`` in packed calls: transformers returns a
# 4-D mask as it is, so no ``T x T`` mask is built from the position ids (which restart per response).
NO_MASK = torch.empty(1, 1, 0, 0, dtype=torch.bool)
