"""The fast rollout engine: one prompt, n samples, the prompt's keys and values stored and read once.

GRPO samples n responses per prompt. A general engine stores (or at best shares pages of) the
prompt per sample and its decode attention reads the prompt once per sample. Here a *group slot*
holds one prompt's KV once and the n samples' own tokens beside it, and decode attention is split
in two exact halves merged by their log-sum-exp: all n samples' queries against the shared prompt
(one batched matmul that reads the prompt once per group), and each sample against its own tokens.

By default the model is the training model itself (the very modules and tensors the optimizer
updates, so the weights are never stale; the fused decode step below stacks each layer's q/k/v and
gate/up projections into matrices refilled from them at every ``generate``). Asked for another dtype,
the engine keeps
its own copy, refreshed in place by ``sync_weights`` (so captured graphs stay valid) and checked
against the training model's weights version before every ``generate``, so a stale copy is never
sampled. For Llama-family models (Qwen3, Qwen2, Llama, Mistral) prefill and decode run as plain
functions of the layers' weights (``decode_step.py``: on a GPU a decode step is a few compiled kernels
per layer); other models run their own modules with attention routed through longqa's dispatcher
(``model/attention.py``). Either way each layer's queries, keys and values reach
``SharedPrefixKV.attend``, whose decode attention on a GPU is a Triton split-K kernel
(``decode_kernel.py``) and elsewhere two batched matmuls.

Groups stream through a fixed number of slots sized from a memory budget: when all n samples of a
group stop, its slot takes the next prompt. The decode step works on fixed-size tensors (every slot,
finished or not), so on a GPU it is captured as a CUDA graph and replayed; the host looks at the
device only every ``sync_every`` steps, to retire finished groups and admit new ones. The Triton
attention reads how far the groups have got from the device, so one graph per sampling setting
serves a KV store's whole life: a warm GRPO step captures nothing. The batched-matmul attention
reads views of the stores as wide as the longest prompt and response still running, rounded up to
steps, and is captured once per such (prompt, response) view.

``generate(..., stop_at=...)`` ends each sample at a given length as if it had sampled EOS there, so
that benchmarks on random-weight models (which never sample it) see the varied lengths of real
responses; ``last_run`` says how full the last call kept the slots.

Sampling draws its noise from a counter-based hash of (request seed, token index, vocabulary id),
so a request's samples depend on its seed alone: not on the batch, the slot or the device order.

That also makes speculative decoding exact (``speculative=``, off by default): each step feeds every
row its last token and up to k tokens drafted from its own text (``prompt_lookup.py``), attends with
k + 1 queries per row in both halves, and keeps the sampled tokens up to the first that differs from
its draft (``speculative.py``), so every sample is token for token the one it would have been.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import numbers
import time
from collections import deque
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from longqa.distributed.gather import full_parameters
from longqa.model.attention import NO_MASK, masked_attention, use_longqa_attention
from longqa.model.attention_spec import AttentionSpec, UnsupportedModelError
from longqa.model.compile_cache import use_user_cache
from longqa.rollout.base import (
    ENGINE_KV_SHARE,
    RolloutEngine,
    Sample,
    SamplingParams,
    StaleWeightsError,
    prompt_seeds,
    weights_version,
)
from longqa.rollout.decode_kernel import shared_prefix_attention
from longqa.rollout.decode_step import DecodeStep, unsupported_reason
from longqa.rollout.hf import eval_mode, filter_logits
from longqa.rollout.prompt_lookup import propose, row_text
from longqa.rollout.slot import Slot
from longqa.rollout.speculative import METHODS as SPECULATIVE_METHODS
from longqa.rollout.speculative import Speculation, verify

MASK32 = 0xFFFFFFFF
VOCAB_CHUNKS = 64
# A decode step reads the KV stores through views of the longest prompt and response still running,
# rounded up to these steps (tokens), so that a few shapes (and CUDA graphs) serve every batch.
PROMPT_VIEW_STEP, RESPONSE_VIEW_STEP = 256, 64
PREFILL_ACTIVATION_BYTES = 1 << 30
# The most float32 attention scores (bytes) one attention call of a prefill may form, should the kernel form them
# (a masked SDPA can fall back to the explicit one): a piece that does not start its prompt attends a block of its
# queries at a time. Without the bound a 21,845-token piece of a 131,072-token prompt (Qwen3-8B's) would form
# 366 GB of scores.
PREFILL_SCORES_BYTES = 1 << 30

PLAIN_ATTENTION = AttentionSpec()  # causal softmax, no window or soft-capping: a layer that says nothing else


def prefill_tokens(model) -> int:
    """Tokens of one prefill forward by default: as many as keep its widest activation (the MLP's gate
    and up products, two intermediate widths) within ``PREFILL_ACTIVATION_BYTES``, between 8,192 and
    65,536. A small model then prefills several prompts per forward (SmolLM2-135M: eight of 8,192 tokens),
    a 32B model one 8,192-token chunk at a time."""
    config = model.config
    width = 2 * (getattr(config, "intermediate_size", None) or 4 * config.hidden_size)
    size = next(model.parameters()).element_size()
    return max(8192, min(65536, PREFILL_ACTIVATION_BYTES // (width * size)))


class KVBudgetError(ValueError):
    """Not even one group fits the KV cache budget."""


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (products stay below 2**63, so nothing overflows)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def request_seeds(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """One 32-bit stream key per sample: sample j of a prompt with seed s."""
    base = _mix32((seeds & MASK32) ^ _mix32(seeds >> 32))
    return _mix32(
        base.repeat_interleave(n) ^ (torch.arange(n, device=seeds.device).repeat(len(seeds)) * 0x27D4EB2D & MASK32)
    )


def hashed_vocab(vocab: int, device) -> torch.Tensor:
    """Each vocabulary id's term in the noise hash, ``[vocab]``. Built once and handed to the compiled
    sampler as a tensor: computed inside it from ``arange``, Inductor folds the constants into its index
    arithmetic and overflows int32 once the vocabulary is chunked."""
    return (torch.arange(vocab, device=device) * 0x2C1B3C6D) & MASK32


def gumbel_noise(keys: torch.Tensor, index: torch.Tensor, vocab_terms: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` standard Gumbel noise, a pure function of (key, token index, vocabulary id);
    ``vocab_terms`` is ``hashed_vocab(vocab)``."""
    row = _mix32(keys ^ ((index * 0x9E3779B1) & MASK32))
    u = (_mix32(row[:, None] ^ vocab_terms[None, :]).float() + 0.5) / 2.0**32
    u = u.clamp(1e-7, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def _vocab_chunks(x: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` -> ``[rows, VOCAB_CHUNKS, width]``, padded with -inf. A decode step samples a few
    rows: reduced row by row, a vocabulary-wide reduction runs as one program per row and leaves most
    of a GPU idle (64 us a step for 16 rows on an H200); reduced chunk by chunk, then across chunks, it
    spreads over the whole device."""
    rows, vocab = x.shape
    width = -(-vocab // VOCAB_CHUNKS)
    return F.pad(x, (0, width * VOCAB_CHUNKS - vocab), value=float("-inf")).view(rows, VOCAB_CHUNKS, width)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for ``[rows, vocab]`` (the first of equal maxima), in two stages."""
    best, at = _vocab_chunks(x).max(-1)
    chunk = best.argmax(-1)  # the first chunk that holds the maximum, and the first place in it
    return chunk * -(-x.shape[-1] // VOCAB_CHUNKS) + at.gather(-1, chunk[:, None]).squeeze(-1)


def log_softmax_at(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``x.log_softmax(-1)`` at ``tokens``, its log-sum-exp in two stages."""
    return x.gather(-1, tokens[:, None]).squeeze(-1) - _vocab_chunks(x).logsumexp(-1).logsumexp(-1)


def sample_rows(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, index: torch.Tensor, vocab_terms: torch.Tensor
):
    """Tokens and their log-probs under ``softmax(logits / T)`` (no top-k/top-p renormalisation, as the
    trainer recomputes them). Sampling is Gumbel-max over the filtered, tempered logits."""
    logits = logits.float()
    if params.greedy:
        scaled = logits
        tokens = first_argmax(logits)
    else:
        scaled = logits / params.temperature
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tokens = first_argmax(filtered + gumbel_noise(keys, index, vocab_terms))
    return tokens, log_softmax_at(scaled, tokens)


class SharedPrefixKV:
    """KV storage of ``groups`` slots: each slot's prompt once, ``[layers, groups, kv_heads, prompt_cap,
    head_dim]``, and each of its ``n`` samples' generated tokens, ``[layers, groups * n, kv_heads,
    response_cap + queries - 1, head_dim]``; plus the attention that reads them (``attend``).

    A decode step feeds ``queries`` tokens per sample: 1, or with speculative decoding the last token and
    ``queries - 1`` drafts, whose keys and values go past the last real token (hence the extra room in the
    own stores). A rejected draft's are never read (each token reads own keys up to its own index only)
    and the next step overwrites them. Each slot's prompt token ids are kept too, for drafting."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        groups: int,
        n: int,
        prompt_cap: int,
        response_cap: int,
        dtype,
        device,
        kernel: str = "bmm",
        queries: int = 1,
    ):
        self.groups, self.n, self.prompt_cap, self.response_cap = groups, n, prompt_cap, response_cap
        self.kernel, self.queries = kernel, queries
        self.own_cap = response_cap + queries - 1
        self.prefix_k = torch.zeros(layers, groups, kv_heads, prompt_cap, head_dim, dtype=dtype, device=device)
        self.prefix_v = torch.zeros_like(self.prefix_k)
        self.suffix_k = torch.zeros(layers, groups * n, kv_heads, self.own_cap, head_dim, dtype=dtype, device=device)
        self.suffix_v = torch.zeros_like(self.suffix_k)
        self.prompt_ids = torch.zeros(groups, prompt_cap, dtype=torch.long, device=device)
        rows = groups * n
        self.rows = torch.arange(rows, device=device)
        self.prefix_len = torch.ones(groups, dtype=torch.long, device=device)  # >= 1: an empty slot stays finite
        self.write_at = torch.zeros(rows, dtype=torch.long, device=device)  # suffix index of the (first) token fed now
        self.own_len = torch.ones(rows, dtype=torch.long, device=device)  # write_at + queries; 0 once a row finished
        # Where the step's rows * queries new keys go: row query_rows[i], own index query_at[i] (write_at + j
        # for the row's j-th token). With one query per row these are ``rows`` and ``write_at`` themselves.
        self.query_rows = self.rows.repeat_interleave(queries) if queries > 1 else self.rows
        self.query_at = torch.zeros(rows * queries, dtype=torch.long, device=device) if queries > 1 else self.write_at
        self.query_offset = torch.arange(queries, device=device)
        # The prompt length a decode step reads (the Triton decode attention, drafts): 0 once all the group's
        # samples finished, so a slot whose group is done costs no KV reads while the others go on (its
        # outputs are ignored).
        self.prompt_read = torch.ones(groups, dtype=torch.long, device=device)
        self.mode = "decode"
        # A prefill forward's tokens, in order: (slot, start, length) pieces, each a prompt's tokens from
        # ``start`` on (several prompts per forward; a prompt longer than a forward comes in several pieces).
        self.prefill_pieces: list[tuple[int, int, int]] = []
        # How much of the stores a decode step may read (the bmm attention's widths; the Triton kernel's grid).
        self.prompt_view = prompt_cap
        self.response_view = self.own_cap
        # The prompt and own key positions the step reads, set on the device by each step: the Triton kernel
        # spreads them over its splits, so a graph captured at the whole views serves every length.
        self.reads = torch.tensor([prompt_cap, self.own_cap], dtype=torch.int32, device=device)

    def set_write_at(self, write_at: torch.Tensor) -> None:
        """Place this step's new tokens: row i's j-th at own index ``write_at[i] + j`` (in place: graphs)."""
        self.write_at.copy_(write_at)
        if self.queries > 1:
            self.query_at.copy_((write_at[:, None] + self.query_offset).view(-1))

    @staticmethod
    def bytes_per_group(layers, kv_heads, head_dim, n, prompt_cap, response_cap, dtype, queries: int = 1) -> int:
        size = torch.empty(0, dtype=dtype).element_size()
        return 2 * layers * kv_heads * head_dim * size * (prompt_cap + n * (response_cap + queries - 1))

    def own_slot(self, layer: int):
        """Where a decode step's new keys and values go: ``(k_store, v_store, rows, at)`` with new token
        ``i``'s (row-major, ``queries`` per row) at ``k_store[rows[i], :, at[i]]`` (the fused decode step
        writes them itself)."""
        return self.suffix_k[layer], self.suffix_v[layer], self.query_rows, self.query_at

    def attend(self, layer: int, q, k, v, scaling, spec: AttentionSpec = PLAIN_ATTENTION):
        """Attention of this step's queries under the layer's ``spec`` (sliding window, soft-capping);
        ``k``/``v`` None in decode when they are already in ``own_slot``."""
        if self.mode == "prefill":
            return self._prefill(layer, q, k, v, scaling, spec)
        return self._decode(layer, q, k, v, scaling, spec)

    def _prefill(self, layer, q, k, v, scaling, spec: AttentionSpec):
        """A prefill forward's pieces (``prefill_pieces``), each stored and attended on its own."""
        outputs, offset = [], 0
        for g, start, length in self.prefill_pieces:
            piece = slice(offset, offset + length)
            outputs.append(
                self._prefill_piece(layer, g, start, q[:, :, piece], k[:, :, piece], v[:, :, piece], scaling, spec)
            )
            offset += length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)

    def _prefill_piece(self, layer, g, start, q, k, v, scaling, spec: AttentionSpec):
        """One piece of one prompt: store its keys/values, attend causally to the prompt so far."""
        end = start + q.shape[2]
        self.prefix_k[layer, g, :, start:end] = k[0]
        self.prefix_v[layer, g, :, start:end] = v[0]
        keys, values = self.prefix_k[layer, g, :, :end][None], self.prefix_v[layer, g, :, :end][None]
        if start == 0 and spec == AttentionSpec():
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scaling, enable_gqa=keys.shape[1] != q.shape[1]
            )
        else:
            out = blocked_prefix_attention(q, keys, values, start, scaling, spec)
        return out.transpose(1, 2)

    def _decode(self, layer, q, k, v, scaling, spec: AttentionSpec):
        """``queries`` new tokens per sample row, ``q`` ``[rows * queries, heads, 1, d]`` (the fused step)
        or ``[rows, heads, queries, d]`` (the model's modules, with ``k``/``v`` to store): the shared
        prompt read once per group, merged exactly with each row's own tokens -> ``[rows, queries, heads, d]``."""
        rows, m = self.rows.shape[0], self.queries
        if k is not None:
            kv_heads, d = k.shape[1], k.shape[3]
            self.suffix_k[layer, self.query_rows, :, self.query_at] = k.transpose(1, 2).reshape(rows * m, kv_heads, d)
            self.suffix_v[layer, self.query_rows, :, self.query_at] = v.transpose(1, 2).reshape(rows * m, kv_heads, d)
        heads, d = q.shape[1], q.shape[3]
        q = q.transpose(1, 2).reshape(rows, m, heads, d)
        if self.kernel == "triton":
            out = shared_prefix_attention(
                q.reshape(rows * m, heads, d),
                self.prefix_k[layer],
                self.prefix_v[layer],
                self.prompt_read,
                self.suffix_k[layer],
                self.suffix_v[layer],
                self.own_len,
                self.n,
                self.prompt_view,
                self.response_view,
                scaling,
                window=spec.window,
                softcap=spec.softcap,
                queries=m,
                reads=self.reads,
            )
            return out.view(rows, m, heads, d)
        math_fn = _compiled_decode_attention() if q.is_cuda else decode_attention
        return math_fn(
            q,
            self.prefix_k[layer],
            self.prefix_v[layer],
            self.suffix_k[layer],
            self.suffix_v[layer],
            self.prefix_len,
            self.write_at,
            self.n,
            self.prompt_view,
            self.response_view,
            scaling,
            spec.window,
            spec.softcap,
        )


def blocked_prefix_attention(q, keys, values, start: int, scaling, spec: AttentionSpec = PLAIN_ATTENTION):
    """Causal attention of the queries at positions ``start``.. over the keys at 0.. (``[1, heads, L, d]`` queries,
    ``[1, kv_heads, start + L, d]`` keys and values), a block of query rows at a time so that no call forms more than
    ``PREFILL_SCORES_BYTES`` of scores: each block reads the keys its rows see (from the window's start, where the
    layer has one, to its last row), under the rows of the causal mask that are its own."""
    heads, length, end = q.shape[1], q.shape[2], keys.shape[2]
    rows = max(1, PREFILL_SCORES_BYTES // (4 * heads * end))
    outputs = []
    for first in range(0, length, rows):
        last = min(first + rows, length)  # rows [first, last): positions start + first ..
        lo = max(0, start + first - spec.window + 1) if spec.window else 0
        hi = start + last
        distance = torch.arange(start + first, hi, device=q.device)[:, None] - torch.arange(lo, hi, device=q.device)
        mask = (distance >= 0) & (distance < (spec.window or hi + 1))
        outputs.append(
            masked_attention(q[:, :, first:last], keys[:, :, lo:hi], values[:, :, lo:hi], mask, scaling, spec.softcap)
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 2)


def _batched(store: torch.Tensor, length: int) -> torch.Tensor:
    """``[a, b, cap, d]`` -> a ``[a * b, length, d]`` view of the first ``length`` positions (no copy:
    batched matmuls read it with its strides)."""
    a, b, cap, d = store.shape
    return store.view(a * b, cap, d)[:, :length]


def _softmax_part(q, keys, values, outside, scaling, softcap):
    """Attention of ``q`` ``[batch, m, d]`` over ``keys``/``values`` ``[batch, L, d]`` with the
    ``outside`` keys masked, returned with its log-sum-exp so two parts can be merged exactly
    (-inf where a query has no key in this part)."""
    scores = torch.bmm(q, keys.transpose(1, 2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(outside, float("-inf"))
    lse = scores.logsumexp(-1)
    weights = (scores - lse.clamp(min=torch.finfo(lse.dtype).min)[..., None]).exp()
    out = torch.bmm(weights.to(values.dtype), values)
    return out.float(), lse


def decode_attention(
    q,
    prefix_k,
    prefix_v,
    suffix_k,
    suffix_v,
    prefix_len,
    write_at,
    n: int,
    prompt_view: int,
    response_view: int,
    scaling,
    window: int | None = None,
    softcap: float | None = None,
):
    """``q`` ``[rows, m, heads, d]``: m new tokens per row (rows = groups x n, group-major), the i-th
    written at own index ``write_at + i`` -> ``[rows, m, heads, d]``. Token i reads its group's prompt
    and its row's own keys up to index ``write_at + i`` (causal among the m new tokens; m > 1 when a
    step verifies drafts). With a ``window`` a token at position ``p`` reads keys at positions
    ``> p - window`` only."""
    rows, m, heads, d = q.shape
    groups, kv_heads = prefix_k.shape[0], prefix_k.shape[1]
    r = heads // kv_heads
    P, S = prompt_view, response_view
    at = write_at[:, None] + torch.arange(m, device=q.device)  # [rows, m]: each new token's own index
    # Prompt part: the n samples' m tokens of a group (x r heads sharing a KV head) as one batch row.
    q_group = q.reshape(groups, n, m, kv_heads, r, d).permute(0, 3, 1, 2, 4, 5).reshape(groups * kv_heads, n * m * r, d)
    outside = torch.arange(P, device=q.device)[None, :] >= prefix_len[:, None]  # [groups, P]
    later = torch.arange(S, device=q.device)[None, None, :] > at[:, :, None]  # [rows, m, S]
    if window is None:  # one mask row for all the group's queries
        outside = outside[:, None, None, :].expand(groups, kv_heads, 1, P).reshape(groups * kv_heads, 1, P)
    else:  # a row per token: token i of a row sits at position prefix_len + write_at + i
        reach = (prefix_len.repeat_interleave(n)[:, None] + at - window + 1).view(groups, 1, n, m, 1, 1)
        outside = outside[:, None, None, None, None, :] | (torch.arange(P, device=q.device) < reach)
        outside = outside.expand(groups, kv_heads, n, m, r, P).reshape(groups * kv_heads, n * m * r, P)
        later = later | (torch.arange(S, device=q.device)[None, None, :] < at[:, :, None] - window + 1)
    out_p, lse_p = _softmax_part(q_group, _batched(prefix_k, P), _batched(prefix_v, P), outside, scaling, softcap)
    out_p = out_p.view(groups, kv_heads, n, m, r, d).permute(0, 2, 3, 1, 4, 5).reshape(rows, m, kv_heads, r, d)
    lse_p = lse_p.view(groups, kv_heads, n, m, r).permute(0, 2, 3, 1, 4).reshape(rows, m, kv_heads, r)
    # Own part: each row's tokens against its generated tokens up to and including their own.
    later = later[:, None, :, None, :].expand(rows, kv_heads, m, r if m > 1 else 1, S).reshape(rows * kv_heads, -1, S)
    q_own = q.reshape(rows, m, kv_heads, r, d).transpose(1, 2).reshape(rows * kv_heads, m * r, d)
    out_o, lse_o = _softmax_part(q_own, _batched(suffix_k, S), _batched(suffix_v, S), later, scaling, softcap)
    out_o, lse_o = out_o.view(rows, kv_heads, m, r, d).transpose(1, 2), lse_o.view(rows, kv_heads, m, r).transpose(1, 2)
    top = torch.maximum(lse_p, lse_o)  # finite: the own part always holds the token itself
    w_p, w_o = (lse_p - top).exp()[..., None], (lse_o - top).exp()[..., None]
    out = (out_p * w_p + out_o * w_o) / (w_p + w_o)
    return out.to(q.dtype).reshape(rows, m, heads, d)


@functools.cache
def _compiled_decode_attention():
    """On a GPU the masking, log-sum-exp, exponent and merge fuse into a few kernels around the two
    batched matmuls; without it the float32 score passes cost more HBM traffic than the KV reads."""
    return torch.compile(decode_attention, dynamic=True)


def _fill(pieces: list[tuple[int, int, int]], tokens: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive ``(slot, start, length)`` pieces (each at most ``tokens`` long) grouped into forwards of at
    most ``tokens`` tokens, in order: a prompt's later piece always comes in a later forward than its
    earlier ones, whose keys and values it reads."""
    forwards, width = [], tokens
    for piece in pieces:
        if width + piece[2] > tokens:
            forwards.append([])
            width = 0
        forwards[-1].append(piece)
        width += piece[2]
    return forwards


def _bucket(length: int, step: int, cap: int) -> int:
    return min(cap, max(step, math.ceil(length / step) * step))


class FastRolloutEngine(RolloutEngine):
    """Shared-prefix sampling on the training model's own weights.

    ``kv_cache_bytes`` bounds the KV stores (default: ``kv_share`` of the free GPU memory, 40%, which leaves the
    rest to a colocated update; 2 GiB on a CPU); as many groups run at once as fit. ``prefill_chunk`` bounds the
    tokens of one prefill forward, which holds several prompts where they fit (default: ``prefill_tokens(model)``).
    ``cuda_graphs`` captures the decode step as CUDA graphs (CUDA only): one per sampling setting with the
    Triton attention, one per (prompt, response) view with the batched-matmul one. ``fused_decode`` runs the
    decode step of Llama-family models as a few compiled kernels per layer (``decode_step.py``; compiled
    on a GPU only); ``None`` uses it wherever the model is supported, ``False`` runs the model's modules.
    ``decode_kernel`` computes decode attention with a Triton split-K kernel (``triton``, the default on a
    GPU where Triton is installed: ``decode_kernel.py``) or batched matmuls (``bmm``, any device).
    ``speculative="prompt_lookup"`` drafts up to ``num_speculative_tokens`` tokens per sample and step from
    the sample's own text (``prompt_lookup.py``, matching its last ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens) and verifies them in the step (``speculative.py``): the same samples,
    in fewer steps where drafts are right. ``prompt_tokens``: the longest prompt it will be given, where known
    (a training run's data): the KV stores hold it from the first call on, so that a later call's longer prompt
    does not re-size them and drop every captured graph mid-run.

    Its samples depend on each prompt's seed alone, and it ends samples at given lengths (``stop_at``).
    """

    seeded = True
    ends_at_given_lengths = True
    answers_validation = True

    @property
    def holds_own_weights(self) -> bool:
        """Whether it samples a copy of its own (``own_copy``, or another dtype) rather than the training model's
        very tensors."""
        return self.model is not self.source

    @property
    def calls_model_layers(self) -> bool:
        """Without the fused decode step (a model it does not support) it runs the model's modules."""
        return self.decode_step is None

    @property
    def compiled_update_layers(self) -> bool:
        """With the fused decode step it never calls the modules that the update compiles."""
        return self.decode_step is not None

    def __init__(
        self,
        model,
        tokenizer=None,
        kv_cache_bytes: int | None = None,
        prefill_chunk: int | None = None,
        sync_every: int = 16,
        cuda_graphs: bool = True,
        max_groups: int | None = None,
        dtype=None,
        own_copy: bool = False,
        fused_decode: bool | None = None,
        decode_kernel: str = "auto",
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 8,
        kv_share: float = ENGINE_KV_SHARE,
        prompt_tokens: int = 0,
    ):
        self.source, self.tokenizer = model, tokenizer
        self.prompt_tokens = prompt_tokens
        self.model = model
        if own_copy or (dtype is not None and dtype != next(model.parameters()).dtype):
            # Made before the trainer shards the model (own_copy): sharded weights are gathered into it.
            self.model = copy.deepcopy(model).to(dtype or next(model.parameters()).dtype).requires_grad_(False)
        self.version = weights_version(model)
        if decode_kernel not in ("auto", "bmm", "triton"):
            raise ValueError(f"decode_kernel must be 'auto', 'bmm' or 'triton', got {decode_kernel!r}")
        if speculative not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative must be None or one of {SPECULATIVE_METHODS}, got {speculative!r}")
        self.speculation = (
            Speculation(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max) if speculative else None
        )
        self.queries = self.speculation.queries if self.speculation else 1  # tokens a decode step feeds per row
        self.kv_cache_bytes, self.kv_share, self.sync_every = kv_cache_bytes, kv_share, sync_every
        self.prefill_chunk = prefill_chunk or prefill_tokens(model)
        self.max_groups = max_groups
        first = next(self.model.parameters())
        self.device, self.dtype = first.device, first.dtype
        if decode_kernel == "auto":
            decode_kernel = "triton" if self.device.type == "cuda" and importlib.util.find_spec("triton") else "bmm"
        self.decode_kernel = decode_kernel
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        spec = use_longqa_attention(self.model)
        if spec.engine_problem:
            raise UnsupportedModelError(
                f"the fast engine cannot hold {spec.model_type!r} models in its KV store: "
                f"{spec.engine_problem}; use rollout.engine=hf"
            )
        self.layers = max(spec.layers) + 1
        self.kv_heads, self.head_dim, self.logits_spec = spec.kv_heads, spec.head_dim, spec.logits
        self.kv: SharedPrefixKV | None = None
        self.state: DecodeState | None = None  # sized with the KV stores (graphs capture both)
        self.graphs: dict = {}
        self.graph_captures = 0  # decode-step graphs captured so far
        self.graph_events: list[str] = []  # each capture and KV re-sizing, said (compile_watch.CompileWatch)
        self.stop_ids: dict = {}
        self.last_run: dict = {}  # how the last generate used the slots: see _run
        reason = unsupported_reason(self.model)
        if fused_decode and reason:
            raise ValueError(f"fused_decode=True but {reason}")
        compiled = self.device.type == "cuda"
        if compiled:
            use_user_cache()  # what it compiles is kept for the next start
        # A copy only the engine holds may have its projections re-bound as views of stacked matrices.
        self.decode_step = (
            DecodeStep(self.model, compiled, views=self.model is not self.source)
            if fused_decode is not False and not reason
            else None
        )
        self.sample = torch.compile(sample_rows, dynamic=False) if compiled else sample_rows
        self.vocab_terms = hashed_vocab(self.model.get_output_embeddings().weight.shape[0], self.device)

    def sync_weights(self) -> None:
        """Load the training model's current weights into the engine's copy (in place); free when shared.

        Sharded (FSDP2 or ZeRO-3) weights are gathered a layer or a tensor at a time
        (``gather.full_parameters``), in the same order on every rank, so no second full copy ever exists
        beside the engine's."""
        if self.model is not self.source:
            mine = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, theirs in full_parameters(self.source):
                    mine[name].copy_(theirs)
        self.version = weights_version(self.source)

    # --------------------------------------------------------------------------------------- memory

    def _budget(self) -> int:
        if self.kv_cache_bytes is not None:
            return int(self.kv_cache_bytes)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(self.kv_share * free)
        return 2 << 30

    def _ensure_kv(self, prompts: list[list[int]], params: SamplingParams) -> SharedPrefixKV:
        # Rounded up to the view step, so a decode step reads the same views whatever earlier calls allocated (an
        # exact cap would make the widths, and so the float rounding of the log-probs, depend on the history).
        prompt_cap = _bucket(max(self.prompt_tokens, *(len(p) for p in prompts)), PROMPT_VIEW_STEP, 1 << 62)
        response_cap = params.max_new_tokens
        kv = self.kv
        if (
            kv is not None
            and kv.n == params.n
            and kv.prompt_cap >= prompt_cap
            and kv.response_cap >= response_cap
            and kv.groups >= min(len(prompts), self.max_groups or len(prompts))
        ):
            return kv
        if kv is not None:
            self.graph_events.append(
                f"re-sized the KV stores for {len(prompts)} prompts of up to {prompt_cap} tokens, {response_cap} new, "
                f"n={params.n} (they held {kv.groups} groups of {kv.prompt_cap}, {kv.response_cap}, n={kv.n}): "
                f"{len(self.graphs)} captured decode graphs dropped"
            )
        self.kv, self.graphs = None, {}  # free the old stores (and the graphs that point at them) first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        per_group = SharedPrefixKV.bytes_per_group(
            self.layers, self.kv_heads, self.head_dim, params.n, prompt_cap, response_cap, self.dtype, self.queries
        )
        budget = self._budget()
        groups = min(len(prompts), budget // per_group, self.max_groups or len(prompts))
        if groups < 1:
            raise KVBudgetError(
                f"one group (n={params.n}, a {prompt_cap}-token prompt, {response_cap} new tokens) needs "
                f"{per_group / 2**30:.2f} GiB of KV cache but the budget is {budget / 2**30:.2f} GiB: raise "
                f"rollout.kv_cache_bytes, or lower data.max_prompt_length, data.max_response_length or rollout.n"
            )
        self.kv = SharedPrefixKV(
            self.layers,
            self.kv_heads,
            self.head_dim,
            groups,
            params.n,
            prompt_cap,
            response_cap,
            self.dtype,
            self.device,
            self.decode_kernel,
            self.queries,
        )
        # Captured graphs read and write these very tensors: they live as long as the KV stores.
        self.state = DecodeState(groups * params.n, response_cap, self.device, self.queries)
        self.stop_ids = {}
        return self.kv

    # ------------------------------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        *,
        seeds: Sequence[int] | None = None,
        stop_at: Sequence[Sequence[int]] | None = None,
        at_version: int | None = None,
    ) -> list[list[Sample]]:
        """``params.n`` samples per prompt. ``seeds`` (one per prompt) make each prompt's samples a
        function of its seed alone; without them seeds are drawn from ``generator``.

        ``at_version``: the training model's weights version the caller means to sample (default: its version
        now). A caller that samples from the engine's copy while an update runs beside it (``rollout.overlap``)
        names the version it took before starting the update, so the check cannot race the optimizer step.

        ``stop_at[i][j]`` (in ``[1, max_new_tokens]``) ends sample j of prompt i after that many tokens as
        if it had sampled EOS there: its tokens and log-probs are the first ``stop_at[i][j]`` it would
        otherwise have produced, and it finishes "stop" (a real stop token or string may end it earlier).
        A limit of ``max_new_tokens`` is no limit: such a sample finishes "length" like any other that
        runs into it, so drawn lengths clipped at the maximum count as truncated responses."""
        prompts = [list(p) for p in prompts]
        if not prompts:
            return []
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        limits = _check_stop_at(stop_at, len(prompts), params)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to FastRolloutEngine")
        expected = weights_version(self.source) if at_version is None else at_version
        if self.model is not self.source and self.version != expected:
            raise StaleWeightsError(
                f"the engine's weights copy is version {self.version} but the training model is "
                f"at {expected}: call sync_weights() after each update"
            )
        seeds = prompt_seeds(len(prompts), generator, seeds)
        with eval_mode(self.model):
            if self.decode_step is not None:
                self.decode_step.refresh()
            return self._run(prompts, params, torch.as_tensor(list(seeds), dtype=torch.long), limits)

    def _run(self, prompts, params: SamplingParams, seeds: torch.Tensor, limits: list[list[int]]) -> list[list[Sample]]:
        """Stream the prompts' groups through the slots. The host follows each ``Slot``'s age (decode steps
        since admission, each of which adds at least one token to every live row) and the longest length
        its rows may reach (each step adds at most ``queries``), and looks at the device only between
        runs of ``sync_every`` steps, or as soon as a slot must have finished, to retire and admit groups
        and to learn the lengths reached.

        ``last_run`` records ``decode_steps``; ``busy_slot_steps``, the sum over decode steps of the
        slots holding a group that still needed them; ``live_row_steps``, the same count for rows (a
        finished row still computes, ignored, until its group leaves). With speculation also
        ``draft_row_steps``, the live row-steps that had a draft, and ``accepted_draft_tokens``, the
        drafted tokens kept: ``draft_fraction`` and ``accepted_per_draft_step`` are their ratios, and a
        live row-step made ``1 + accepted_draft_tokens / live_row_steps`` tokens on average."""
        kv = self._ensure_kv(prompts, params)
        n, dev, state = params.n, self.device, self.state
        state.reset()
        stops = self.stop_ids.setdefault(
            params.stop_token_ids, torch.as_tensor(params.stop_token_ids or (-1,), device=dev)
        )
        keys = request_seeds(seeds.to(dev), n)  # [len(prompts) * n]
        row_limits = torch.as_tensor(limits, dtype=torch.long).view(-1).to(dev)  # [len(prompts) * n]
        pending = deque(range(len(prompts)))
        slots = [Slot() for _ in range(kv.groups)]  # slot g holds rows g * n to (g + 1) * n of the state
        results: list[list[Sample] | None] = [None] * len(prompts)
        self.last_run = {"decode_steps": 0, "busy_slot_steps": 0, "live_row_steps": 0, "slots": kv.groups, "n": n}
        while True:
            admitted = []
            for g, slot in enumerate(slots):
                if slot.free and pending:
                    i = pending.popleft()
                    admitted.append((g, i))
                    slot.admit(i, len(prompts[i]), max(limits[i]))
            if admitted:
                self._admit(admitted, prompts, params, keys, row_limits, state, stops)
            active, reach = torch.stack(
                [state.active.view(kv.groups, n).any(1).long(), state.length.view(kv.groups, n).max(1).values]
            ).tolist()
            freed = False
            for g, slot in enumerate(slots):  # groups that finished (possibly at their first token)
                slot.reach = reach[g]
                if not slot.free and not active[g]:
                    results[slot.prompt] = self._collect(g, params, state)
                    self._count_steps(state.steps[g * n : (g + 1) * n].tolist())
                    slot.prompt, freed = None, True
            if freed and pending:
                continue  # a freed slot takes the next prompt before the next decode step
            if not any(active):
                break
            occupied = [slot for slot in slots if not slot.free]
            longest_prompt = max(slot.prompt_len for slot in occupied)
            for _ in range(self.sync_every):
                if kv.kernel != "triton":  # (the Triton kernel reads the lengths on the device: views stay whole)
                    # own keys a step reads: the fed tokens' (from the row's last one on) and all before them
                    longest_response = max(slot.reach for slot in occupied) + self.queries - 1
                    kv.prompt_view = _bucket(longest_prompt, PROMPT_VIEW_STEP, kv.prompt_cap)
                    kv.response_view = _bucket(longest_response, RESPONSE_VIEW_STEP, kv.own_cap)
                self._decode_step(params, state, stops)
                self.last_run["decode_steps"] += 1
                for slot in occupied:
                    slot.stepped(self.queries)
                if any(slot.age >= slot.done_at for slot in occupied):
                    break
            if params.stop_strings:
                self._apply_stop_strings(params, state, slots)
        if self.speculation:
            run = self.last_run
            run.update(state.speculation_counts())
            run["draft_fraction"] = run["draft_row_steps"] / max(run["live_row_steps"], 1)
            run["accepted_per_draft_step"] = run["accepted_draft_tokens"] / max(run["draft_row_steps"], 1)
        return results

    def _count_steps(self, steps: list[int]) -> None:
        """A group's rows' decode steps while live: its slot was needed for as many as its longest row's."""
        self.last_run["busy_slot_steps"] += max(steps)
        self.last_run["live_row_steps"] += sum(steps)

    def _admit(
        self, admitted: list[tuple[int, int]], prompts, params, keys, limits, state: "DecodeState", stops
    ) -> None:
        """Prefill the prompts of ``admitted`` (slot, prompt index) pairs into their slots and sample each of
        their rows' first token (``keys`` and ``limits`` are per row of every prompt). A forward holds up to
        ``prefill_chunk`` tokens of several prompts: one prompt per forward leaves a small model's GPU
        waiting on the host's launches (SmolLM2-135M: 27 ms a prompt of 8,192 tokens for 10 ms of kernels)."""
        kv, n, dev = self.kv, params.n, self.device
        lengths = [len(prompts[i]) for _, i in admitted]
        pieces = [
            (g, start, min(self.prefill_chunk, length - start))
            for (g, _), length in zip(admitted, lengths)
            for start in range(0, length, self.prefill_chunk)
        ]
        # Tokens and positions as tensors, then one copy to the device (flattening 64 prompts of 8,192 tokens
        # in Python cost 0.1 s of GPU idle).
        ids = torch.cat([torch.as_tensor(prompts[i], dtype=torch.long) for _, i in admitted])
        ids, positions = torch.stack([ids, torch.cat([torch.arange(length) for length in lengths])]).to(dev)
        ends = []  # each admitted prompt's last hidden state, in order
        kv.mode, offset = "prefill", 0
        for forward in _fill(pieces, self.prefill_chunk):
            width = sum(length for _, _, length in forward)
            kv.prefill_pieces = forward
            hidden = self._prefill_forward(ids[offset : offset + width], positions[offset : offset + width], kv)
            end = 0
            for _, start, length in forward:
                end += length
                if start + length == lengths[len(ends)]:  # the piece that ends the next prompt
                    ends.append(hidden[end - 1])
            offset += width
        kv.mode = "decode"
        logits = self._logits(torch.stack(ends)).repeat_interleave(n, 0)  # [admitted * n, vocab]
        rows = torch.cat([torch.arange(i * n, (i + 1) * n) for _, i in admitted]).to(dev)
        tokens, logp = sample_rows(
            logits, params, keys[rows], torch.zeros(len(rows), dtype=torch.long, device=dev), self.vocab_terms
        )
        offset = 0
        for j, ((g, i), length) in enumerate(zip(admitted, lengths)):
            slot_rows, picked = slice(g * n, (g + 1) * n), slice(j * n, (j + 1) * n)
            kv.prefix_len[g] = length
            kv.prompt_ids[g, :length] = ids[offset : offset + length]
            state.keys[slot_rows] = keys[i * n : (i + 1) * n]
            state.start(slot_rows, tokens[picked], logp[picked], stops, limits[i * n : (i + 1) * n])
            offset += length

    def _prefill_forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: SharedPrefixKV) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of one prefill forward (``kv.prefill_pieces`` says whose)."""
        if self.decode_step is not None:
            return self.decode_step.prefill(ids, positions, kv)
        return self.model.base_model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=NO_MASK.to(self.device),
            use_cache=False,
            longqa_kv=kv,
        ).last_hidden_state[0]

    def _decode_step(self, params, state: "DecodeState", stops) -> None:
        if not self.cuda_graphs:
            return self._step(params, state, stops)
        key = (self.kv.prompt_view, self.kv.response_view, params, self.queries)
        graph = self.graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            graph = self.graphs[key] = self._capture(params, state, stops)
            self.graph_captures += 1
            self.graph_events.append(
                f"captured the decode step for prompt view {key[0]}, response view {key[1]} "
                f"({self.kv.groups} groups of {params.n}) in {time.perf_counter() - start:.2f} s"
            )
        graph.replay()

    def _capture(self, params, state, stops):
        """Warm up on a side stream, then record one decode step; replay re-runs it on the same buffers."""
        snapshot = state.snapshot()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(params, state, stops)
                state.restore(snapshot)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls meanwhile (an update running beside the sampling,
        # rollout.overlap) are not part of the capture and do not invalidate it
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._step(params, state, stops)
        state.restore(snapshot)  # capturing ran nothing; the first replay does the step
        return graph

    def _step(self, params, state: "DecodeState", stops) -> None:
        """One step for every row (finished rows compute and are ignored): fixed shapes, no host sync. It
        feeds each row's last token, and with speculation its drafts after it (``queries`` tokens a row),
        and samples at every fed position."""
        kv, n, m = self.kv, params.n, self.queries
        index = state.length  # index of the token sampled after the last one; that one sits at index - 1
        kv.set_write_at((index - 1).clamp(0, kv.response_cap - 1))
        kv.own_len.copy_(torch.where(state.active, kv.write_at + m, 0))
        kv.prompt_read.copy_(torch.where(state.active.view(-1, n).any(1), kv.prefix_len, 0))
        if kv.kernel == "triton":
            kv.reads.copy_(torch.stack([kv.prompt_read.max(), kv.own_len.max()]))
        positions = kv.prefix_len.repeat_interleave(n) + index - 1
        feed = state.last[:, None]
        if self.speculation:
            spec = self.speculation
            # Drafts come from the text the step reads: the prompts of groups still running and the tokens of
            # live rows. A finished group's slot keeps its text, which can be longer than the views.
            text, length = row_text(
                kv.prompt_ids[:, : kv.prompt_view],
                kv.prompt_read,
                state.tokens[:, : kv.response_view],
                torch.where(state.active, index, 0),
                n,
            )
            drafts, draft_len = propose(text, length, spec.tokens, spec.min_match, spec.max_match)
            feed = torch.cat([feed, drafts], 1)
            positions = positions[:, None] + kv.query_offset
        if self.decode_step is not None:
            hidden = self.decode_step.decode(feed.view(-1), positions.reshape(-1), kv)
        else:
            hidden = self.model.base_model(
                input_ids=feed,
                position_ids=positions.view(-1, m),
                attention_mask=NO_MASK.to(self.device),
                use_cache=False,
                longqa_kv=kv,
            ).last_hidden_state.flatten(0, 1)
        logits = self._logits(hidden)
        if not self.speculation:
            tokens, logp = self.sample(logits, params, state.keys, index, self.vocab_terms)
            return state.advance(tokens, logp, stops)
        at = (index[:, None] + kv.query_offset).view(-1)  # the index each fed position samples
        tokens, logp = self.sample(logits, params, state.keys.repeat_interleave(m), at, self.vocab_terms)
        state.advance_verified(tokens.view(-1, m), logp.view(-1, m), drafts, draft_len, stops)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from final hidden states: its LM head and logit transforms, in float32."""
        return self.logits_spec.apply(self.model.get_output_embeddings()(hidden).float())

    def _collect(self, g: int, params, state: "DecodeState") -> list[Sample]:
        n = params.n
        rows = slice(g * n, (g + 1) * n)
        lengths = state.length[rows].tolist()
        tokens = state.tokens[rows].tolist()
        logps = state.logp[rows].tolist() if params.return_logprobs else None
        stopped = state.stopped[rows].tolist()
        # A row shorter than max_new_tokens was ended by a stop token or string, or by its stop_at limit.
        return [
            Sample(
                tokens[j][: lengths[j]],
                "stop" if stopped[j] or lengths[j] < params.max_new_tokens else "length",
                logps[j][: lengths[j]] if logps is not None else None,
            )
            for j in range(n)
        ]

    def _apply_stop_strings(self, params, state: "DecodeState", slots: list[Slot]) -> None:
        """Cut rows at the first token that completes a stop string (searched on the host, per sync)."""
        window = max(len(s.encode()) for s in params.stop_strings) + 8
        lengths, tokens = state.length.tolist(), state.tokens.tolist()
        for row, length in enumerate(lengths):
            if slots[row // params.n].free:
                continue
            for end in range(state.checked[row] + 1, length + 1):
                tail = self.tokenizer.decode(tokens[row][max(0, end - window) : end], skip_special_tokens=True)
                if any(s in tail for s in params.stop_strings):
                    state.cut(row, end)
                    length = end
                    break
            state.checked[row] = length


def _check_stop_at(stop_at, prompts: int, params: SamplingParams) -> list[list[int]]:
    """Each row's length limit: ``stop_at`` checked (one sequence of ``params.n`` integers in
    ``[1, max_new_tokens]`` per prompt), or ``max_new_tokens`` everywhere."""
    top = params.max_new_tokens
    if stop_at is None:
        return [[top] * params.n for _ in range(prompts)]
    stop_at = [list(row) if hasattr(row, "__len__") and not isinstance(row, (str, bytes)) else row for row in stop_at]
    if len(stop_at) != prompts:
        raise ValueError(f"stop_at has {len(stop_at)} entries for {prompts} prompts: give one per prompt")
    for i, row in enumerate(stop_at):
        if not isinstance(row, list) or len(row) != params.n:
            raise ValueError(f"stop_at[{i}] must be a sequence of n={params.n} lengths, got {row!r}")
        for j, length in enumerate(row):
            if not isinstance(length, numbers.Integral) or isinstance(length, bool) or not 1 <= length <= top:
                raise ValueError(f"stop_at[{i}][{j}] must be an integer in [1, max_new_tokens={top}], got {length!r}")
    return [[int(length) for length in row] for row in stop_at]


class DecodeState:
    """Per-row device tensors of one ``generate`` call, updated in place (so CUDA graphs can replay)."""

    def __init__(self, rows: int, max_new: int, device, queries: int = 1):
        self.rows = rows
        # Room past max_new for the picks a verifying step makes and does not keep (written, then ignored).
        self.tokens = torch.zeros(rows, max_new + queries, dtype=torch.long, device=device)
        self.logp = torch.zeros(rows, max_new + queries, dtype=torch.float32, device=device)
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        # Each row's length limit (stop_at, or max_new_tokens), set at admission: a device tensor, so a
        # captured decode step reads the limits of whichever groups hold the slots when it is replayed.
        self.limit = torch.full((rows,), max_new, dtype=torch.long, device=device)
        self.steps = torch.zeros(rows, dtype=torch.long, device=device)  # decode steps each row was live
        # Over the whole call: live row-steps that had a draft, and drafted tokens kept.
        self.draft_steps = torch.zeros((), dtype=torch.long, device=device)
        self.accepted = torch.zeros((), dtype=torch.long, device=device)
        self.row_ids = torch.arange(rows, device=device)
        self.checked = [0] * rows  # host: tokens already searched for stop strings

    def reset(self) -> None:
        for flag in (self.length, self.active, self.stopped, self.draft_steps, self.accepted):
            flag.zero_()
        self.checked = [0] * self.rows

    def start(self, rows: slice, tokens, logp, stops, limits: torch.Tensor) -> None:
        self.tokens[rows, 0], self.logp[rows, 0] = tokens, logp
        self.length[rows], self.last[rows] = 1, tokens
        self.limit[rows] = limits
        self.steps[rows] = 0
        stopped = torch.isin(tokens, stops)
        self.stopped[rows] = stopped
        self.active[rows] = ~stopped & (limits > 1)
        for row in range(rows.start, rows.stop):
            self.checked[row] = 0

    def advance(self, tokens, logp, stops) -> None:
        at = self.length.clamp(max=self.tokens.shape[1] - 1)
        live = self.active
        self.tokens[self.row_ids, at] = torch.where(live, tokens, self.tokens[self.row_ids, at])
        self.logp[self.row_ids, at] = torch.where(live, logp, self.logp[self.row_ids, at])
        self.last.copy_(torch.where(live, tokens, self.last))
        stopped = live & torch.isin(tokens, stops)
        self.stopped.copy_(self.stopped | stopped)
        self.length.add_(live.long())
        self.steps.add_(live.long())
        self.active.copy_(live & ~stopped & (self.length < self.limit))

    def advance_verified(self, tokens, logp, drafts, draft_len, stops) -> None:
        """``advance`` for a verifying step: ``tokens``/``logp`` ``[rows, k + 1]`` the picks at the fed
        positions, of which each live row keeps what ``speculative.verify`` allows."""
        live = self.active
        keep, stopped = verify(tokens, drafts, draft_len, stops, self.limit - self.length)
        keep = torch.where(live, keep, 0)
        at = self.length[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # < max_new + queries
        kept = torch.arange(tokens.shape[1], device=tokens.device) < keep[:, None]
        rows = self.row_ids[:, None]
        self.tokens[rows, at] = torch.where(kept, tokens, self.tokens[rows, at])
        self.logp[rows, at] = torch.where(kept, logp, self.logp[rows, at])
        self.last.copy_(torch.where(live, tokens.gather(1, (keep - 1).clamp(min=0)[:, None]).squeeze(1), self.last))
        stopped = live & stopped
        self.stopped.copy_(self.stopped | stopped)
        self.length.add_(keep)
        self.steps.add_(live.long())
        self.draft_steps.add_((live & (draft_len > 0)).sum())
        self.accepted.add_((keep - 1).clamp(min=0).sum())
        self.active.copy_(live & ~stopped & (self.length < self.limit))

    def speculation_counts(self) -> dict:
        """The call's draft statistics (see ``FastRolloutEngine._run``), read from the device once."""
        draft_steps, accepted = torch.stack([self.draft_steps, self.accepted]).tolist()
        return {"draft_row_steps": draft_steps, "accepted_draft_tokens": accepted}

    def cut(self, row: int, length: int) -> None:
        self.length[row], self.active[row], self.stopped[row] = length, False, True

    def snapshot(self) -> dict:
        return {
            name: getattr(self, name).clone()
            for name in ("tokens", "logp", "length", "last", "active", "stopped", "steps", "draft_steps", "accepted")
        }

    def restore(self, snapshot: dict) -> None:
        for name, value in snapshot.items():
            getattr(self, name).copy_(value)
