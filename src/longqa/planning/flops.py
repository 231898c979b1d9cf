"""What a GRPO step's work costs at best: model FLOPs of a packed group's forward and backward pass, and the
floor that HBM bandwidth sets under decoding. ``longqa plan``'s step time, the trainer's MFU and ``longqa bench``'s
floors all count with these.

The peak and the bandwidth are an H200's (bf16 datasheet peak; the bandwidth a large copy reaches, measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

H200_BF16_PEAK = 989e12  # dense bf16 TFLOP/s, datasheet


@dataclass
class GroupFlops:
    tokens: int  # tokens the layout computes
    flops: float  # model FLOPs of forward + backward (recompute excluded)
    attention: float = 0.0  # the part of ``flops`` that attention's (query, key) pairs make


def counts_flops(config) -> bool:
    """Whether :func:`group_flops` applies: a dense decoder (no experts) whose config names its sizes."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    experts = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    return all(isinstance(getattr(config, key, None), int) for key in sizes) and not experts


def group_flops(config, prompt: int, responses: list[int], shared: bool) -> GroupFlops:
    """Forward+backward model FLOPs: 6 x params x tokens for the decoder's linear layers, 6 x head x
    response tokens for the LM head, 12 x head_dim x heads x layers per attended (query, key) pair."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * config.intermediate_size
    linear = per_layer * layers
    head = config.vocab_size * h
    if shared:
        tokens = prompt + sum(responses)
        pairs = prompt * (prompt + 1) // 2 + sum(r * prompt + r * (r + 1) // 2 for r in responses)
    else:
        tokens = sum(prompt + r for r in responses)
        pairs = sum((prompt + r) * (prompt + r + 1) // 2 for r in responses)
    attention = 12 * head_dim * heads * layers * pairs
    return GroupFlops(tokens, 6 * linear * tokens + 6 * head * sum(responses) + attention, attention)


HBM_BYTES_PER_S = 4.3e12  # H200 bandwidth a large copy reaches, measured; the datasheet says 4.8e12


def per_sample_lengths(
    new_tokens: int | Sequence[Sequence[int]], n: int | None = None, groups: int | None = None
) -> list[list[int]]:
    """Each group's samples' lengths: ``new_tokens`` for all ``groups`` x ``n``, or as given."""
    if isinstance(new_tokens, int):
        return [[new_tokens] * n for _ in range(groups)]
    lengths = [list(group) for group in new_tokens]
    if (groups is not None and len(lengths) != groups) or (n is not None and any(len(g) != n for g in lengths)):
        raise ValueError(f"expected {groups} groups of {n} lengths, got {lengths}")
    return lengths


def ideal_decode_steps(lengths: Sequence[Sequence[int]], in_flight: int) -> float:
    """Decode steps of an engine whose ``in_flight`` slots are always full: each group holds a slot for
    as many steps as its longest sample."""
    return sum(max(group) for group in lengths) / min(in_flight, len(lengths))


def decode_floor_s(
    config,
    prompt: int,
    new_tokens: int | Sequence[Sequence[int]],
    n: int | None = None,
    groups: int | None = None,
    shared: bool = True,
    dtype_bytes: int = 2,
    bandwidth: float = HBM_BYTES_PER_S,
    in_flight: int | None = None,
) -> float:
    """Seconds of decoding if every step only had to read from HBM, once, the weights (decoder + LM
    head), the prompt KV of each group it holds (of each live sample when not ``shared``) and each live
    sample's own KV so far.

    ``new_tokens`` is every sample's length (``groups`` x ``n`` samples, all in flight: ``new_tokens``
    steps) or each group's list of its samples' lengths. Then the schedule is the ideal one, with
    ``in_flight`` slots (default: every group) always full: a group lives as many steps as its longest
    sample, and the weights are read once per step, ``ideal_decode_steps`` times."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    weights = layers * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * config.intermediate_size) + config.vocab_size * h
    kv_token = 2 * layers * kv * d  # elements per token of KV
    lengths = per_sample_lengths(new_tokens, n, groups)
    steps = ideal_decode_steps(lengths, in_flight or len(lengths))
    if shared:  # a group's prompt, once per step it lives
        prompt_reads = prompt * sum(max(group) for group in lengths)
    else:  # once per sample, per step of that sample
        prompt_reads = prompt * sum(sum(group) for group in lengths)
    own_tokens = sum(length * (length - 1) / 2 for group in lengths for length in group)  # summed over steps
    return dtype_bytes * (steps * weights + kv_token * (prompt_reads + own_tokens)) / bandwidth


def step_floor_s(
    config, prompt: int, lengths: Sequence[Sequence[int]], in_flight: int, peak_flops: float = H200_BF16_PEAK
) -> dict:
    """The least a GRPO step of these groups could take on this GPU, per phase: the rollout's prefills at
    the bf16 peak (no LM head: one token each) plus its decoding at the HBM floor (``decode_floor_s``,
    ``in_flight`` slots always full), and the packed update's model FLOPs (``group_flops``, unique tokens) at the
    bf16 peak."""
    prefill = group_flops(config, prompt, [], True).flops / 3  # a forward pass: a third of forward + backward
    rollout = len(lengths) * prefill / peak_flops
    rollout += decode_floor_s(config, prompt, lengths, in_flight=in_flight)
    update = sum(group_flops(config, prompt, list(group), True).flops for group in lengths) / peak_flops
    return {"rollout": rollout, "update": update}
