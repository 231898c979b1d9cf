"""Log-probs (and entropy) of response tokens through a chunked LM head.

Qwen3's vocabulary has 151,936 entries: full logits for a 20K-token sequence are 12 GB in float32.
Only response tokens need them, so the decoder's hidden states are gathered at those positions and
the LM head runs over them a chunk at a time; each chunk is checkpointed, so its logits exist only
while that chunk is computed, in the forward and again in the backward pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from longqa.algo import entropy_from_logits


def _head_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy_from_logits(logits)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor,
                   temperature: float = 1.0, chunk_size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, both ``[B, L]``: at every position ``j`` with ``target_mask[:, j]``, the
    log-prob of ``input_ids[:, j]`` given the tokens before it (and the entropy of that distribution);
    zeros elsewhere. Differentiable when grad is enabled. ``temperature`` divides the logits, as the
    sampler did, so these are the sampling distribution's log-probs.
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    rows, cols = target_mask[:, 1:].nonzero(as_tuple=True)  # predicted position j = cols + 1, read at cols
    states = hidden[rows, cols]
    targets = input_ids[rows, cols + 1]
    logp_parts, ent_parts = [], []
    for start in range(0, len(targets), chunk_size):
        args = (states[start:start + chunk_size], head.weight, head.bias, targets[start:start + chunk_size],
                temperature)
        logp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _head_chunk(*args)
        logp_parts.append(logp)
        ent_parts.append(ent)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logp)
    if logp_parts:
        logp = logp.index_put((rows, cols + 1), torch.cat(logp_parts))
        entropy = entropy.index_put((rows, cols + 1), torch.cat(ent_parts))
    return logp, entropy
