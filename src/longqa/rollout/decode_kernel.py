"""Decode-time attention for the shared-prefix KV store as Triton flash-decoding (split-K) kernels.

In a decode step every sample row has one query (or a few, when the step verifies drafted tokens),
so attention is a matrix-vector product bound by reading the KV store. The store keeps each group's
prompt once (``prefix_k`` ``[groups, kv_heads, prompt_cap, d]``) and each sample's own tokens apart
(``suffix_k`` ``[groups*n, kv_heads, response_cap, d]``). A row's attention is over the union of its
group's prompt keys and its own keys; it is computed as *partial* attentions over splits of both key
sets, each a normalised output with its log-sum-exp, merged exactly.

Two launches per layer. In the first a program owns one (batch entry, kv head) and one split of the
key axis, of either half: for the prompt half all n samples of a group, times the tokens each feeds,
times the r query heads of the kv head, are rows of its one Q tile (so the prompt is read once per
group, not once per sample or token); for the own half the r heads of one row's tokens, each token
reading its row's keys up to its own. Splitting the key axis (flash-decoding) gives enough programs
to fill the GPU when there are few groups and long prompts, and with both halves in one grid the
short own-half programs fill in behind the long prompt-half ones instead of waiting for them to
finish. The second launch merges each (token, head)'s splits.

Nothing here reads tensor values on the host: the grid depends on shapes, views and split counts
only, and the key positions a call reads (``reads``) can be a device tensor that the kernel reads,
each split taking its share of them. So one CUDA graph, captured at the stores' whole views, serves
every decode step whatever the lengths its groups have reached. Triton is imported when the kernel is
first asked for, so longqa imports without it.
"""

from __future__ import annotations

import functools
import math

import torch

SM_FALLBACK = 132  # H100/H200; used when the device is not a CUDA device (the interpreter)
MAX_BLOCK_M = 128  # the most query cells of one prompt-half tile; a group with more takes several tiles
WAVES = 2  # the default split count aims at this many programs per SM (measured: benchmarks/decode_attention_sweep.py)


def chunk_of(view: int, splits: int, block_n: int) -> int:
    """Keys per split when ``splits`` splits share ``view`` keys: ``ceil(view/splits)`` rounded up to a multiple
    of ``block_n`` (every block a program loads is full-width except the last), at least one block. The kernel
    computes the same from the views it reads on the device (``decode_triton.partial_kernel``)."""
    return max(block_n, math.ceil(math.ceil(view / splits) / block_n) * block_n)


def split_plan(
    view: int, splits: int | None, block_n: int, programs: int, sms: int = SM_FALLBACK, waves: float = WAVES
) -> tuple[int, int]:
    """``(splits, chunk)``: split ``s`` reads keys ``[s*chunk, (s+1)*chunk)`` (clipped to ``view``), ``chunk``
    being ``chunk_of(view, splits, block_n)``.

    Without ``splits``, enough splits that ``programs * splits`` reaches ``WAVES * sms`` (latency of one
    program hides behind the others), but no split shorter than one block, and no split that starts past
    ``view`` (it would only write -inf).
    """
    if splits is None:
        blocks = max(1, math.ceil(view / block_n))
        want = min(blocks, max(1, math.ceil(waves * sms / max(programs, 1))))
        splits = max(1, math.ceil(view / (math.ceil(blocks / want) * block_n)))  # fewer when the last are empty
    elif splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return splits, chunk_of(view, splits, block_n)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernel():
    """The jitted kernels, imported on first use (``TRITON_INTERPRET`` is read then, at decoration)."""
    try:
        from longqa.rollout.decode_triton import merge_kernel, partial_kernel
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "longqa's Triton decode attention needs the `triton` package (it comes with CUDA builds of torch)"
        ) from err
    return partial_kernel, merge_kernel


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _check_store(name: str, k: torch.Tensor, v: torch.Tensor, view: int) -> None:
    if v.shape != k.shape or k.dim() != 4:
        raise ValueError(f"{name} keys {tuple(k.shape)} and values {tuple(v.shape)} must be [batch, kv_heads, cap, d]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"{name} keys and values need a contiguous last dimension")
    if not 0 <= view <= k.shape[2]:
        raise ValueError(f"{name} view {view} is outside [0, {k.shape[2]}]")


def shared_prefix_attention(
    q,
    prefix_k,
    prefix_v,
    prefix_len,
    suffix_k,
    suffix_v,
    own_len,
    n: int,
    prompt_view: int,
    own_view: int,
    scaling: float,
    block_n: int = 64,
    dtype: torch.dtype | None = None,
    waves: float = WAVES,
    num_warps: int = 4,
    num_stages: int = 3,
    splits: tuple[int | None, int | None] = (None, None),
    partials: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    queries: int = 1,
    max_block_m: int = MAX_BLOCK_M,
    reads: torch.Tensor | None = None,
):
    """One layer's decode attention over the store: ``q`` ``[rows * queries, heads, d]`` (rows =
    groups*n, group-major; ``queries`` consecutive tokens per row) against its group's prompt keys
    ``[0, prefix_len[g])`` and its own keys -> ``[rows * queries, heads, d]`` in ``dtype`` (default
    ``q``'s). A row's last token reads own keys ``[0, own_len[row])`` and its token i
    ``[0, own_len[row] - queries + 1 + i)``: causal among the row's new tokens, whose keys are the last
    ``queries`` of its own keys (a step verifying drafts feeds several).

    ``prefix_k``/``prefix_v`` ``[groups, kv_heads, >= prompt_view, d]`` and ``suffix_k``/``suffix_v``
    ``[rows, kv_heads, >= own_view, d]`` may have any strides with a contiguous last dimension (layer
    slices of the store, never copied); the views bound the key positions read and size the grid (each half's
    split count: ``split_plan``, or fixed by ``splits``). ``reads``: a ``[2]`` integer tensor on the device, the
    prompt and own key positions this call reads, at most the views (default: the views): the kernel reads
    it and spreads those positions over the splits, so a step captured once at the stores' whole views
    (a CUDA graph) reads no more than the groups' longest prompt and own keys at every replay.
    ``partials=True`` also returns every split's output ``[rows * queries, heads, S, d]`` and log-sum-exp
    ``[rows * queries, heads, S]`` (base 2; -inf where a split has no key), prompt splits first.
    ``window``: a token at position ``p`` (token i of a row: ``prefix_len[g] + own_len[row] - queries +
    i``) reads keys at positions ``> p - window`` only (prompt key i at position i, own key j at
    ``prefix_len[g] + j``); ``softcap``: scores become ``softcap * tanh(score / softcap)``. A group's
    prompt-half cells (n x queries x r) go in tiles of at most ``max_block_m`` (more when one row's
    queries x r need it): each tile reads the group's prompt once."""
    groups, kv_heads, _, d = prefix_k.shape
    heads = q.shape[1]
    rows = suffix_k.shape[0]
    _check_store("prompt", prefix_k, prefix_v, prompt_view)
    _check_store("own", suffix_k, suffix_v, own_view)
    if queries < 1:
        raise ValueError(f"queries must be >= 1, got {queries}")
    if (
        q.shape[2] != d
        or suffix_k.shape[3] != d
        or rows != groups * n
        or q.shape[0] != rows * queries
        or heads % kv_heads
        or suffix_k.shape[1] != kv_heads
    ):
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, prompt keys {tuple(prefix_k.shape)}, "
            f"own keys {tuple(suffix_k.shape)}, n={n}, queries={queries}"
        )
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    partial_kernel, merge_kernel = _kernel()
    r = heads // kv_heads
    block_m = max(16, _next_power_of_2(max(min(n * queries * r, max_block_m), queries * r)))
    m_blocks = -(-n * queries * r // block_m)
    sms = _sm_count(q.device)
    prompt_splits, _ = split_plan(prompt_view, splits[0], block_n, groups * kv_heads * m_blocks, sms, waves)
    own_splits, _ = split_plan(own_view, splits[1], block_n, rows * kv_heads, sms, waves)
    if reads is None:
        reads = torch.tensor([prompt_view, own_view], dtype=torch.int32, device=q.device)
    total = prompt_splits + own_splits
    cells = rows * queries  # query rows of q
    out = torch.empty(cells, heads, total, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(cells, heads, total, dtype=torch.float32, device=q.device)
    result = torch.empty(cells, heads, d, dtype=dtype or q.dtype, device=q.device)
    prompt_programs = groups * kv_heads * prompt_splits * m_blocks
    if cells * heads:
        partial_kernel[(prompt_programs + rows * kv_heads * own_splits,)](
            q,
            prefix_k,
            prefix_v,
            prefix_len.contiguous(),
            suffix_k,
            suffix_v,
            own_len.contiguous(),
            out,
            lse,
            q.stride(0),
            q.stride(1),
            *prefix_k.stride()[:3],
            *prefix_v.stride()[:3],
            *suffix_k.stride()[:3],
            *suffix_v.stride()[:3],
            scaling * math.log2(math.e),
            float(softcap or 0.0),
            int(window or 0),
            kv_heads,
            n,
            r,
            queries,
            heads,
            reads,
            prompt_splits,
            own_splits,
            prompt_programs,
            m_blocks,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            D=d,
            IEEE=q.dtype == torch.float32,
            WINDOW=window is not None,
            SOFTCAP=softcap is not None,
            CAUSAL=queries > 1,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        merge_kernel[(cells * heads,)](out, lse, result, total, BLOCK_S=_next_power_of_2(max(total, 2)), D=d)
    return (result, out, lse) if partials else result
