"""Shared-prompt attention as two ordinary causal attentions per pack, merged by their log-sum-exp.

A response token attends to its pack's whole prompt and to its own earlier tokens. Each of the two key
sets is a plain attention problem that vendor kernels run at full speed, where one block-sparse kernel
over the packed row (flex_attention) does not: on an H200, cuDNN's fused kernels do the forward and
backward of a Qwen3-1.7B group (a prompt of 8,192 tokens and 8 responses of 1,024) in 5.7 ms against
flex_attention's 7.8 ms, 1.4x, and 1.4x again at Qwen3-8B's 16,384 + 8 x 2,048.

- prefix half: the pack's tokens over its prompt, causal aligned at the top left (the query sequence is
  the longer), so a prompt token sees the prompt up to itself and a response token all of it. Queries
  and keys are slices of the packed row, nothing is copied.
- own half: each response over itself, causal, as one batch padded to a common length (the padding
  comes after each sequence's tokens, so causality keeps it out of their view).

The prefix half's keys stop at a multiple of ``PROMPT_STEP``; the prompt's last tokens, its tail, join
the own half, which then holds the tail alone and the tail followed by each response (a response's
view of the tail is causal too, as the tail comes first). With query slices rounded up to the row's
padding step and own sequences to ``RESPONSE_STEP``, every shape is a multiple of a step, so a run meets
a bounded set of them however its prompt and response lengths vary: cuDNN builds an execution plan per
problem shape (hundreds of milliseconds) and caches it. The rows a rounded-up query slice reads past
its pack, and the tail's rows in the response sequences, are computed and dropped, with a zero gradient.

The softmax over the union of the two key sets is each half's softmax weighted by ``exp(lse_half -
lse)``, ``lse`` the log-sum-exp of both. For the backward pass each half's kernel is handed the merged
output and merged ``lse``: the probabilities it recomputes, ``exp(score - lse)``, and its correction term
``rowsum(dO * O)`` are then those of the whole softmax, so the two halves' gradients add up to the exact
gradient (the rule ring attention uses for key blocks held elsewhere).

On CUDA the kernels are cuDNN's (bfloat16/float16); elsewhere a float32 reference with the same
contract, which the tests hold to the dense masked backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128
PROMPT_STEP = 512  # the prefix half's prompt keys are a multiple of this; the rest joins the own half
RESPONSE_STEP = 128  # the own half's padded sequence length is a multiple of this


@dataclass
class PackRows:
    """One pack's place in the row and its two halves.

    The prefix half reads the first ``main`` prompt tokens (a multiple of ``PROMPT_STEP``) as keys; the
    prompt's last tokens, its tail, go to the own half, whose sequences are the tail alone and the tail
    followed by each response. Own-half inputs are gathered from row ``in_rows[i]`` into slot
    ``in_slots[i]`` of the flattened ``[sequences, width]`` batch (tail rows once per sequence); its outputs
    for the pack's rows from ``main`` on are slots ``out_slots``, in row order."""

    start: int
    prompt: int
    main: int  # prompt tokens the prefix half reads as keys
    length: int  # prompt + responses
    padded: int  # the prefix half's query length, rounded up
    sequences: int  # own-half sequences (0: none)
    width: int  # their padded length
    in_rows: torch.Tensor  # long
    in_slots: torch.Tensor  # long
    out_slots: torch.Tensor  # long [length - main]


@dataclass
class SplitLayout:
    packs: list[PackRows]


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def split_layout(
    segments: list[tuple[int, int, list[int]]], step: int, device, prompt_step: int | None = None
) -> SplitLayout:
    """The layout of a packed row whose packs are ``segments`` (``PackedBatch.segments``); prefix query
    lengths are rounded up to ``step`` (the row's padding step), prompt keys down to ``prompt_step``
    (default ``PROMPT_STEP``). The row's end padding is no pack: it is never read, so it is not attended."""
    prompt_step = prompt_step or PROMPT_STEP
    packs = []
    for start, prompt, lengths in segments:
        main = prompt - prompt % prompt_step
        tail = list(range(start + main, start + prompt))
        responses, first = [], start + prompt
        for n in lengths:
            if n:
                responses.append(list(range(first, first + n)))
            first += n
        sequences = ([tail] if tail else []) + [tail + rows for rows in responses]
        width = _round_up(max(map(len, sequences), default=0), RESPONSE_STEP)
        in_rows = [row for seq in sequences for row in seq]
        in_slots = [j * width + i for j, seq in enumerate(sequences) for i in range(len(seq))]
        out_slots = list(range(len(tail))) + [
            j * width + len(tail) + i
            for j, rows in enumerate(responses, start=1 if tail else 0)
            for i in range(len(rows))
        ]
        length = prompt + sum(lengths)

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        packs.append(
            PackRows(
                start,
                prompt,
                main,
                length,
                _round_up(length, max(step, 1)),
                len(sequences),
                width,
                as_tensor(in_rows),
                as_tensor(in_slots),
                as_tensor(out_slots),
            )
        )
    return SplitLayout(packs)


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, windows, softcapped: bool
) -> str | None:
    """Why the split backend cannot run a model (it computes plain causal softmax attention only), or None."""
    if windows - {None}:
        return "its layers use sliding windows"
    if softcapped:
        return "its layers soft-cap attention scores"
    if device.type == "cuda":
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available"
        if dtype not in HALF_DTYPES:
            return f"cuDNN attention needs bfloat16 or float16 activations, not {dtype}"
        if head_dim > MAX_HEAD_DIM or head_dim % 8:
            return f"cuDNN attention needs a head size that is a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
    return None


# The one primitive both halves use: causal (top-left) attention of [b, heads, Lq, d] queries over
# [b, kv_heads, Lk, d] keys, returning the output and its log-sum-exp [b, heads, Lq, 1] (float32), and its
# backward from a given output and log-sum-exp.


def attend(q, k, v, scale: float):
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1].view(*q.shape[:3], 1), r[2:8]
    return (*_reference(q, k, v, scale), ())


def attend_backward(grad, q, k, v, out, lse, state, scale: float):
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
        )
    return _reference_backward(grad, q, k, v, out, lse, scale)


def _probabilities(q, k, scale, lse=None):
    """Causal softmax probabilities ``[b, heads, Lq, Lk]`` in float32 or wider, and the ``lse`` used."""
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1).to(acc)
    s = torch.matmul(q.to(acc), keys.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    s = s.masked_fill(j > i, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.exp(s - lse), lse


def _reference(q, k, v, scale):
    p, lse = _probabilities(q, k, scale)
    values = v.repeat_interleave(q.shape[1] // v.shape[1], 1).to(p.dtype)
    return torch.matmul(p, values).to(q.dtype), lse


def _reference_backward(grad, q, k, v, out, lse, scale):
    p, _ = _probabilities(q, k, scale, lse)
    acc, repeat = p.dtype, q.shape[1] // k.shape[1]
    g = grad.to(acc)
    keys, values = (t.repeat_interleave(repeat, 1).to(acc) for t in (k, v))
    ds = p * (torch.matmul(g, values.transpose(-1, -2)) - (g * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, keys) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    dv = torch.matmul(p.transpose(-1, -2), g)

    def per_kv_head(t):
        b, _, length, d = t.shape
        return t.view(b, k.shape[1], repeat, length, d).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


# Layout helpers: the row is kept as [T, heads, d]; the kernels take [b, heads, L, d] views of it.


def _heads_first(t):
    """``[L, heads, d]`` -> ``[1, heads, L, d]`` (a view)."""
    return t.transpose(0, 1)[None]


def _rows_first(t):
    """``[b, heads, L, d]`` -> ``[b * L, heads, d]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _slice(t, start: int, length: int, keep: int | None = None):
    """Rows ``start:start + length`` of ``t`` ``[T, ...]``, zero-filled past the end of ``t`` (or past
    ``keep`` rows, when only those may be non-zero)."""
    if keep is None and start + length <= t.shape[0]:
        return t[start : start + length]
    keep = min(keep if keep is not None else length, t.shape[0] - start)
    out = t.new_zeros((length, *t.shape[1:]))
    out[:keep] = t[start : start + keep]
    return out


def _gather(t, pack: PackRows, rows, slots):
    """Rows ``rows`` of ``t`` ``[T, ...]`` at ``slots`` of the own half's ``[sequences, width, ...]`` batch,
    zeros elsewhere."""
    out = t.new_zeros((pack.sequences * pack.width, *t.shape[1:]))
    out[slots] = t[rows]
    return out.view(pack.sequences, pack.width, *t.shape[1:])


def _prefix(q, k, v, pack: PackRows):
    return (
        _heads_first(_slice(q, pack.start, pack.padded)),
        _heads_first(k[pack.start : pack.start + pack.main]),
        _heads_first(v[pack.start : pack.start + pack.main]),
    )


def _own(q, k, v, pack: PackRows):
    return tuple(_gather(t, pack, pack.in_rows, pack.in_slots).transpose(1, 2) for t in (q, k, v))


def _flat_lse(m):
    """``[b, heads, L, 1]`` -> ``[b * L, heads, 1]``."""
    return m.transpose(1, 2).reshape(-1, m.shape[1], 1)


class _SharedPromptAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: SplitLayout, scale: float):
        out = torch.zeros_like(q)
        lse = q.new_zeros((*q.shape[:2], 1), dtype=torch.promote_types(q.dtype, torch.float32))
        saved = []  # per pack: the kernels' states, and the lse of the query rows whose output is dropped
        for pack in layout.packs:
            s, main, L = pack.start, pack.main, pack.length
            prefix_state = own_state = own_lse = beyond = None
            if main:
                o, m, prefix_state = attend(*_prefix(q, k, v, pack), scale)
                o, m = _rows_first(o), _flat_lse(m)  # [padded, heads, d], [padded, heads, 1]
                beyond = m[L:]
            if pack.sequences:
                own_o, own_lse, own_state = attend(*_own(q, k, v, pack), scale)
                own_lse = _flat_lse(own_lse)
                rest_o, rest_m = _rows_first(own_o)[pack.out_slots], own_lse[pack.out_slots]
                if main:
                    first = m[main:L]
                    total = torch.logaddexp(first, rest_m)
                    mixed = o[main:L].to(total.dtype) * torch.exp(first - total) + rest_o.to(total.dtype) * torch.exp(
                        rest_m - total
                    )
                    rest_o, rest_m = mixed.to(o.dtype), total
                out[s + main : s + L], lse[s + main : s + L] = rest_o, rest_m
            if main:
                out[s : s + main], lse[s : s + main] = o[:main], m[:main]
            saved.append((prefix_state, own_state, own_lse, beyond))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.saved, ctx.scale = layout, saved, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        scale = ctx.scale
        dq = torch.zeros(q.shape, dtype=torch.float32 if q.dtype in HALF_DTYPES else q.dtype, device=q.device)
        dk, dv = torch.zeros_like(dq[:, : k.shape[1]]), torch.zeros_like(dq[:, : k.shape[1]])
        for pack, (prefix_state, own_state, own_lse, beyond) in zip(ctx.layout.packs, ctx.saved):
            s, main, L = pack.start, pack.main, pack.length
            if main:
                g = _heads_first(_slice(grad, s, pack.padded, keep=L))
                o = _heads_first(_slice(out, s, pack.padded, keep=L))
                m = torch.cat([lse[s : s + L], beyond]).transpose(0, 1)[None].contiguous()
                dq_p, dk_p, dv_p = attend_backward(g, *_prefix(q, k, v, pack), o, m, prefix_state, scale)
                dq[s : s + L] += _rows_first(dq_p)[:L]
                dk[s : s + main] += _rows_first(dk_p)
                dv[s : s + main] += _rows_first(dv_p)
            if pack.sequences:
                rows = torch.arange(s + main, s + L, device=q.device)
                g, o = (_gather(t, pack, rows, pack.out_slots).transpose(1, 2) for t in (grad, out))
                m = own_lse.index_copy(0, pack.out_slots, lse[s + main : s + L])  # merged where the output is kept
                m = m.view(pack.sequences, pack.width, -1, 1).transpose(1, 2).contiguous()
                grads = attend_backward(g, *_own(q, k, v, pack), o, m, own_state, scale)
                for total, part in zip((dq, dk, dv), grads):
                    total.index_add_(0, pack.in_rows, _rows_first(part)[pack.in_slots].to(total.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


@torch.compiler.disable
def shared_prompt_attention(query, key, value, layout: SplitLayout, scale: float) -> torch.Tensor:
    """``query`` ``[1, heads, T, d]``, ``key``/``value`` ``[1, kv_heads, T, d]`` of one packed row ->
    ``[1, heads, T, d]`` (zeros on the row's end padding). Left out of compiled decoder layers: the
    per-pack calls depend on the layout, which a traced graph would specialise on."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    return _SharedPromptAttention.apply(q, k, v, layout, scale).transpose(0, 1)[None]
