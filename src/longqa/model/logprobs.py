"""Log-probs (and entropy) of response tokens through a chunked LM head.

Qwen3's vocabulary has 151,936 entries: full logits for a 20K-token sequence are 12 GB in float32.
Only response tokens need them, so the decoder's hidden states are gathered at those positions and
the LM head runs over them a chunk at a time; each chunk is checkpointed, so its logits exist only
while that chunk is computed, in the forward and again in the backward pass.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from longqa.model.attention import NO_MASK, prepare, use_longqa_attention
from longqa.model.attention_spec import LogitsSpec, logits_spec
from longqa.model.packing import PackedBatch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, ``logsumexp(z) - sum(softmax(z) * z)``.

    Never takes ``log(p)``, so it stays finite when probabilities underflow; half precision is computed in
    float32. Apply it chunk-wise over the sequence to bound the ``[*, V]`` temporaries.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _head_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float, logits_spec: LogitsSpec
):
    logits = logits_spec.apply(torch.nn.functional.linear(hidden, weight, bias).float())
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    return logp, entropy_from_logits(logits)


@functools.cache
def _compiled_head_chunk():
    """On a GPU the chunk's softmax passes over ``[chunk, vocab]`` fuse into a few kernels. One graph serves
    every chunk length: Inductor's matmul padding is off, because deciding whether to pad the head's
    product asks whether it is compute-bound at this length, which guards the length into ranges (an H200
    recompiled the chunk for 2-63 rows mid-run)."""
    return torch.compile(_head_chunk, dynamic=True, options={"shape_padding": False})


def chunked_head(
    model, states: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target given its hidden state, and the entropy there: ``[K]`` each. The model's
    logit transforms (``attention_spec.logits_spec``) apply, as in its own forward."""
    head = model.get_output_embeddings()
    transform = logits_spec(model.config)
    fn = _compiled_head_chunk() if states.is_cuda else _head_chunk
    logp_parts, ent_parts = [], []
    bounds = list(range(0, len(targets), chunk_size)) + [len(targets)]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:  # no last chunk of one row: the compiled chunk
        del bounds[-2]  # specialises on size 1 and would compile a graph of its own mid-run
    for start, end in zip(bounds, bounds[1:]):
        args = (states[start:end], head.weight, head.bias, targets[start:end], temperature, transform)
        logp, ent = checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)
        logp_parts.append(logp)
        ent_parts.append(ent)
    if not logp_parts:
        empty = states.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logp_parts), torch.cat(ent_parts)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, both ``[B, L]``: at every position ``j`` with ``target_mask[:, j]``, the
    log-prob of ``input_ids[:, j]`` given the tokens before it (and the entropy of that distribution);
    zeros elsewhere. Differentiable when grad is enabled. ``temperature`` divides the logits, as the
    sampler did, so these are the sampling distribution's log-probs. ``attention_mask`` may be None for
    right-padded rows, whose real tokens causal attention keeps from the padding anyway.
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    rows, cols = target_mask[:, 1:].nonzero(as_tuple=True)  # predicted position j = cols + 1, read at cols
    logp_flat, ent_flat = chunked_head(model, hidden[rows, cols], input_ids[rows, cols + 1], temperature, chunk_size)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logp)
    if len(rows):
        logp = logp.index_put((rows, cols + 1), logp_flat)
        entropy = entropy.index_put((rows, cols + 1), ent_flat)
    return logp, entropy


def packed_logprobs(
    model, pack: PackedBatch, temperature: float = 1.0, chunk_size: int = 2048
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, mask)``, each ``[len(pack.samples), longest response]``, one row per sample in
    ``pack.samples`` order: the shared-prompt layout's response-token log-probs (``model/packing.py``).
    The model is routed through longqa's attention (``use_longqa_attention``) if it is not yet."""
    prepare(pack, use_longqa_attention(model))
    if pack.shard is not None:
        return _sharded_logprobs(model, pack, temperature, chunk_size)
    hidden = model.base_model(
        input_ids=pack.input_ids,
        position_ids=pack.position_ids,
        attention_mask=NO_MASK.to(pack.input_ids.device),
        use_cache=False,
        longqa_pack=pack,
    ).last_hidden_state
    logp_flat, ent_flat = chunked_head(model, hidden[0, pack.predict_at], pack.targets, temperature, chunk_size)
    mask = pack.response_mask().to(pack.input_ids.device)
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, logp_flat)
    entropy = torch.zeros_like(logp).masked_scatter(mask, ent_flat)
    return logp, entropy, mask


def _sharded_logprobs(model, pack: PackedBatch, temperature: float, chunk_size: int):
    """``packed_logprobs`` of this rank's sequence shard (``pack.shard``): the decoder runs on the shard's rows (with
    the whole row's positions), the LM head on the response tokens those rows predict. The mask is True on those
    tokens alone; the other ranks of the shard's group hold the rest."""
    start, end = pack.rows()
    hidden = model.base_model(
        input_ids=pack.input_ids[:, start:end],
        position_ids=pack.position_ids[:, start:end],
        attention_mask=NO_MASK.to(pack.input_ids.device),
        use_cache=False,
        longqa_pack=pack,
    ).last_hidden_state
    here = pack.predicted_here()
    states, targets = hidden[0, pack.predict_at[here] - start], pack.targets[here]
    if len(targets):
        logp_flat, ent_flat = chunked_head(model, states, targets, temperature, chunk_size)
    else:  # a shard that predicts nothing (a prompt's middle) still runs the head on its no rows, so that its
        # backward pass runs as the other ranks' do: their gradients reach this shard's keys and values through
        # the attention's exchanges, and a sharded head's gradient is reduced on every rank, zeros here
        head = model.get_output_embeddings()
        logp_flat, ent_flat = _head_chunk(
            states, head.weight, head.bias, targets, temperature, logits_spec(model.config)
        )
    whole = pack.response_mask().to(pack.input_ids.device)
    mask = torch.zeros_like(whole).masked_scatter(whole, here)
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, logp_flat)
    entropy = torch.zeros_like(logp).masked_scatter(mask, ent_flat)
    return logp, entropy, mask
