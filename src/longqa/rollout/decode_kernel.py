"""Decode-time attention for the shared-prefix KV store as a Triton flash-decoding (split-K) kernel.

In a decode step every sample row has one query, so attention is a matrix-vector product bound by
reading the KV store. The store keeps each group's prompt once (``prefix_k`` ``[groups, kv_heads,
prompt_cap, d]``) and each sample's own tokens apart (``suffix_k`` ``[groups*n, kv_heads, response_cap,
d]``). A row's attention is over the union of its group's prompt keys and its own keys; it is computed
as two *partial* attentions, each returning a normalised output and its log-sum-exp, merged exactly.

``partial_attention`` is one kernel launch. A program owns one (batch entry, kv head) and one split of
the key axis; all queries that share those keys are rows of its one Q tile: for the prompt half the
n samples of a group times the r query heads of the kv head (so the prompt is read once per group, not
once per sample), for the own half the r heads of one row. Splitting the key axis (flash-decoding)
gives enough programs to fill the GPU when there are few groups and long prompts.

Nothing here reads tensor values on the host: grid and key ranges depend on shapes, ``view`` and
``splits`` only, so the step can be captured in a CUDA graph (one graph per view). Triton is imported
when the kernel is first asked for, so longqa imports without it.
"""

from __future__ import annotations

import functools
import math

import torch

SM_FALLBACK = 132  # H100/H200; used when the device is not a CUDA device (the interpreter)
WAVES = 2  # the default split count aims at this many programs per SM (measured: benchmarks/decode_attention_sweep.py)


def split_plan(view: int, splits: int | None, block_n: int, programs: int, sms: int = SM_FALLBACK,
               waves: float = WAVES) -> tuple[int, int]:
    """``(splits, chunk)``: split ``s`` reads keys ``[s*chunk, (s+1)*chunk)`` (clipped to ``view``).

    ``chunk`` is ``ceil(view/splits)`` rounded up to a multiple of ``block_n``, so every block a program
    loads is full-width except the last. Without ``splits``, enough splits that ``programs * splits``
    reaches ``WAVES * sms`` (latency of one program hides behind the others), but no split shorter
    than one block, and no split that starts past ``view`` (it would only write -inf).
    """
    if splits is None:
        blocks = max(1, math.ceil(view / block_n))
        want = min(blocks, max(1, math.ceil(waves * sms / max(programs, 1))))
        chunk = math.ceil(blocks / want) * block_n
        return max(1, math.ceil(view / chunk)), chunk  # fewer when the rounding left the last ones empty
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return splits, max(block_n, math.ceil(math.ceil(view / splits) / block_n) * block_n)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernel():
    """The jitted kernels (partial attention, merge), built on first use (``TRITON_INTERPRET`` is read
    here, at decoration)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("longqa's Triton decode attention needs the `triton` package "
                           "(it comes with CUDA builds of torch)") from err

    @triton.jit
    def partial_attention_kernel(
            Q, K, V, LENGTHS, OUT, LSE,
            stride_qr, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            scale_log2, kv_heads, n, r, view, chunk, heads, total_splits, split_offset,
            M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // kv_heads).to(tl.int64)
        h = (bh % kv_heads).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        # Query m = j*r + t is sample row b*n + j, head h*r + t.
        rows = b * n + offs_m // r
        heads_of_m = h * r + offs_m % r
        q = tl.load(Q + rows[:, None] * stride_qr + heads_of_m[:, None] * stride_qh + offs_d[None, :],
                    mask=(offs_m < M)[:, None], other=0.0)

        length = tl.minimum(tl.load(LENGTHS + b).to(tl.int32), view)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)  # a split past the valid keys runs no iteration
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh

        # Online softmax in base 2 (scores pre-multiplied by log2(e)); every block inside [lo, hi) has
        # at least one valid key, so the running max is finite after the first block.
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:  # float32 stores: exact products (tl.dot would otherwise use tf32 on a GPU)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # No valid key: l_i = 0, m_i = -inf -> output 0 and lse -inf (weight 0 in the merge).
        has_keys = l_i > 0
        safe_l = tl.where(has_keys, l_i, 1.0)
        out = acc / safe_l[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
        # Row-major partials: [rows, heads, total_splits], so the merge reads each (row, head) contiguously.
        cell = (rows * heads + heads_of_m) * total_splits + split_offset + split
        tl.store(OUT + cell[:, None] * D + offs_d[None, :], out, mask=(offs_m < M)[:, None])
        tl.store(LSE + cell, lse, mask=offs_m < M)

    @triton.jit
    def merge_kernel(OUT, LSE, RESULT, splits, BLOCK_S: tl.constexpr, D: tl.constexpr):
        """One (row, head): its splits' outputs weighted by exp(lse - logsumexp(lse))."""
        cell = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        lse = tl.load(LSE + cell * splits + offs_s, mask=offs_s < splits, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # no key at all: every weight 0, output 0
        w = tl.exp(lse - top)
        parts = tl.load(OUT + (cell * splits + offs_s)[:, None] * D + offs_d[None, :],
                        mask=(offs_s < splits)[:, None], other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
        tl.store(RESULT + cell * D + offs_d, out.to(RESULT.dtype.element_ty))

    return partial_attention_kernel, merge_kernel


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, n: int, view: int,
                      scaling: float, block_n: int = 64, splits: int | None = None, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None, split_offset: int = 0, num_warps: int = 4, num_stages: int = 3):
    """Attention of ``n`` query rows per batch entry over that entry's keys ``[0, lengths[b])``, in splits.

    ``q`` ``[batch*n, heads, d]``; ``k``, ``v`` ``[batch, kv_heads, cap, d]`` (any strides, last dim
    contiguous: a slice of the store, never copied); ``lengths`` ``[batch]`` ints, ``<= view``;
    ``view <= cap`` bounds the key positions read (a static number, so a CUDA graph per view).
    Returns ``out`` ``[rows, heads, S, d]`` float32, each split's softmax-normalised output over its
    keys (0 where it has none), and ``lse`` ``[rows, heads, S]`` float32, its log-sum-exp (-inf where it
    has no valid key). Given ``out``/``lse`` (from an earlier call over other keys of the same rows),
    this call's splits go to ``[split_offset, split_offset + splits)`` of them, so ``merge_partials``
    can combine both in one pass. ``num_warps``/``num_stages`` are Triton's launch options.
    """
    batch, kv_heads, cap, d = k.shape
    rows, heads = q.shape[0], q.shape[1]
    if v.shape != k.shape or q.shape[2] != d or rows != batch * n or heads % kv_heads:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, n={n}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if not 0 <= view <= cap:
        raise ValueError(f"view {view} is outside [0, {cap}]")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dimension")
    if q.stride(-1) != 1:
        q = q.contiguous()
    r = heads // kv_heads
    M = n * r
    splits, chunk = split_plan(view, splits, block_n, batch * kv_heads, _sm_count(q.device))
    if out is None:
        out = torch.empty(rows, heads, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    if out.shape[:2] != (rows, heads) or out.shape[2] < split_offset + splits or lse.shape != out.shape[:3]:
        raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} cannot take {splits} splits at "
                         f"{split_offset} for {rows} rows x {heads} heads")
    if batch * kv_heads == 0:
        return out, lse
    _kernel()[0][(batch * kv_heads, splits)](
        q, k, v, lengths.contiguous(), out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        scaling * math.log2(math.e), kv_heads, n, r, view, chunk, heads, out.shape[2], split_offset,
        M=M, BLOCK_M=max(16, _next_power_of_2(M)), BLOCK_N=block_n, D=d, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    return out, lse


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out`` ``[rows, heads, S, d]`` and ``lse`` ``[rows, heads, S]`` (splits of ``partial_attention``
    calls over disjoint key sets) -> the attention over all their keys, ``[rows, heads, d]`` in ``dtype``:
    one kernel, every split weighted by ``exp(lse_s - LSE)``. Splits without keys weigh 0; a row with no
    key at all (never the case in decode) gets 0, not NaN."""
    rows, heads, splits, d = out.shape
    result = torch.empty(rows, heads, d, dtype=dtype, device=out.device)
    if rows * heads:
        _kernel()[1][(rows * heads,)](out, lse, result, splits, BLOCK_S=_next_power_of_2(max(splits, 2)), D=d)
    return result


def shared_prefix_attention(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, own_len, n: int,
                            prompt_view: int, own_view: int, scaling: float, block_n: int = 64,
                            dtype: torch.dtype | None = None, waves: float = WAVES, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """One layer's decode attention over the store: ``q`` ``[rows, heads, d]`` (rows = groups*n,
    group-major) against its group's prompt keys ``[0, prefix_len[g])`` and its own keys
    ``[0, own_len[row])`` -> ``[rows, heads, d]`` in ``dtype`` (default ``q``'s). Three launches: the
    prompt half and the own half write their splits side by side, and one merge reads them."""
    groups, kv_heads = prefix_k.shape[:2]
    rows, heads, d = q.shape
    sms = _sm_count(q.device)
    prompt_splits, _ = split_plan(prompt_view, None, block_n, groups * kv_heads, sms, waves)
    own_splits, _ = split_plan(own_view, None, block_n, rows * kv_heads, sms, waves)
    launch = dict(num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(rows, heads, prompt_splits + own_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, prompt_splits + own_splits, dtype=torch.float32, device=q.device)
    partial_attention(q, prefix_k, prefix_v, prefix_len, n, prompt_view, scaling, block_n, prompt_splits, out, lse,
                      **launch)
    partial_attention(q, suffix_k, suffix_v, own_len, 1, own_view, scaling, block_n, own_splits, out, lse,
                      split_offset=prompt_splits, **launch)
    return merge_partials(out, lse, dtype or q.dtype)
