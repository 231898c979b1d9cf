"""The Triton source of the decode attention (``decode_kernel.py`` holds its launcher and its contract).

A module of its own because Triton resolves the functions a kernel calls among the module's globals,
and ``decode_kernel`` must import without Triton: this module is imported on first use.
"""

import triton
import triton.language as tl


@triton.jit
def attend_split(
    Q,
    K,
    V,
    OUT,
    LSE,
    rows,
    heads_m,
    valid_m,
    lo,
    hi,
    key_lo,
    key_hi,
    slot,
    stride_qr,
    stride_qh,
    stride_kn,
    stride_vn,
    scale_log2,
    softcap,
    heads,
    total_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Attention of the tile's queries (cell m = query row ``rows[m]`` of Q, head ``heads_m[m]``) over
    keys ``[lo, hi)`` of ``K``/``V`` (already at the tile's batch entry and kv head), stored as split
    ``slot`` of each cell: the normalised output and its base-2 log-sum-exp. With ``WINDOW`` cell m
    also skips keys below ``key_lo[m]``, with ``CAUSAL`` keys from ``key_hi[m]`` on; with ``SOFTCAP``
    scores are soft-capped at ``softcap``."""
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + rows[:, None] * stride_qr + heads_m[:, None] * stride_qh + offs_d[None, :], mask=valid_m[:, None], other=0.0
    )
    if WINDOW:  # no block below every cell's window
        lo = tl.maximum(lo, tl.min(tl.where(valid_m, key_lo, hi), 0))
    # Online softmax in base 2 (scores pre-multiplied by log2(e)). Without a window or a causal bound
    # every block inside [lo, hi) has a valid key for every cell, so the running max is finite after
    # the first block.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = (offs_n < hi)[None, :]
        if WINDOW:
            valid = valid & (offs_n[None, :] >= key_lo[:, None])
        if CAUSAL:
            valid = valid & (offs_n[None, :] < key_hi[:, None])
        k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=(offs_n < hi)[:, None], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :], mask=(offs_n < hi)[:, None], other=0.0)
        if IEEE:  # float32 stores: exact products (tl.dot would otherwise use tf32 on a GPU)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if SOFTCAP:  # cap * tanh(score / cap) on the natural-log score, back to base 2
            x = s * 0.6931471805599453 / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW or CAUSAL:  # a cell may have no key in this block yet: keep its sums at zero, not NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
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
    part = (rows * heads + heads_m) * total_splits + slot  # [rows, heads, splits]: a cell's splits side by side
    tl.store(OUT + part[:, None] * D + offs_d[None, :], acc / safe_l[:, None], mask=valid_m[:, None])
    tl.store(LSE + part, tl.where(has_keys, m_i + tl.log2(safe_l), float("-inf")), mask=valid_m)


@triton.jit
def partial_kernel(
    Q,
    PK,
    PV,
    PLEN,
    SK,
    SV,
    OLEN,
    OUT,
    LSE,
    stride_qr,
    stride_qh,
    stride_pkb,
    stride_pkh,
    stride_pkn,
    stride_pvb,
    stride_pvh,
    stride_pvn,
    stride_skb,
    stride_skh,
    stride_skn,
    stride_svb,
    stride_svh,
    stride_svn,
    scale_log2,
    softcap,
    window,
    kv_heads,
    n,
    r,
    queries,
    heads,
    READS,
    prompt_splits,
    own_splits,
    prompt_programs,
    m_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Programs ``[0, prompt_programs)`` take the prompt half (a group's cells in ``m_blocks`` tiles), the
    rest the own half. Row ``b`` feeds ``queries`` tokens, Q rows ``b * queries + i``; token i sits at
    position ``PLEN[group] + OLEN[b] - queries + i``, reads own keys below ``OLEN[b] - queries + 1 + i``
    and, with a window, keys at positions ``> its position - window`` only. ``READS``: the prompt and own key
    positions read (``[2]``), each half's split covering ``decode_kernel.chunk_of`` of them."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    total_splits = prompt_splits + own_splits
    if pid < prompt_programs:  # prompt half: cell c = (j*queries + i)*r + t is token i of row b*n + j, head h*r + t
        split, b, h, lo, hi = locate(pid // m_blocks, prompt_splits, BLOCK_N, kv_heads, PLEN, tl.load(READS))
        cell = pid % m_blocks * BLOCK_M + offs_m
        q_rows = b * n * queries + cell // r
        valid_m = cell < n * queries * r
        key_lo = tl.zeros([BLOCK_M], tl.int32)
        if WINDOW:
            own = tl.load(OLEN + q_rows // queries, mask=valid_m, other=1).to(tl.int32)
            key_lo = tl.load(PLEN + b).to(tl.int32) + own - queries + (cell // r) % queries + 1 - window
        attend_split(
            Q,
            PK + b * stride_pkb + h * stride_pkh,
            PV + b * stride_pvb + h * stride_pvh,
            OUT,
            LSE,
            q_rows,
            h * r + cell % r,
            valid_m,
            lo,
            hi,
            key_lo,
            tl.zeros([BLOCK_M], tl.int32) + hi,
            split,
            stride_qr,
            stride_qh,
            stride_pkn,
            stride_pvn,
            scale_log2,
            softcap,
            heads,
            total_splits,
            BLOCK_M,
            BLOCK_N,
            D,
            IEEE,
            WINDOW,
            SOFTCAP,
            False,
        )
    else:  # own half: cell m = i*r + t is token i of row b, head h*r + t
        split, b, h, lo, hi = locate(pid - prompt_programs, own_splits, BLOCK_N, kv_heads, OLEN, tl.load(READS + 1))
        token = offs_m // r
        key_hi = tl.load(OLEN + b).to(tl.int32) - queries + 1 + token  # token i reads own keys [0, key_hi)
        key_lo = tl.zeros([BLOCK_M], tl.int32)
        if WINDOW:  # own key j sits at position PLEN + j
            key_lo += key_hi - window
        attend_split(
            Q,
            SK + b * stride_skb + h * stride_skh,
            SV + b * stride_svb + h * stride_svh,
            OUT,
            LSE,
            b * queries + token,
            h * r + offs_m % r,
            offs_m < queries * r,
            lo,
            hi,
            key_lo,
            key_hi,
            prompt_splits + split,
            stride_qr,
            stride_qh,
            stride_skn,
            stride_svn,
            scale_log2,
            softcap,
            heads,
            total_splits,
            BLOCK_M,
            BLOCK_N,
            D,
            IEEE,
            WINDOW,
            SOFTCAP,
            CAUSAL,
        )


@triton.jit
def locate(p, splits, block_n, kv_heads, LENGTHS, view):
    """Program ``p`` of a half -> its split, batch entry, kv head and key range ``[lo, hi)`` (empty past
    the entry's length): ``view`` keys in ``splits`` chunks of ``decode_kernel.chunk_of(view, splits, block_n)``."""
    chunk = tl.maximum(block_n, tl.cdiv(tl.cdiv(view, splits), block_n) * block_n)
    split = p % splits
    b = (p // splits // kv_heads).to(tl.int64)
    h = (p // splits % kv_heads).to(tl.int64)
    lo = split * chunk
    return split, b, h, lo, tl.minimum(lo + chunk, tl.minimum(tl.load(LENGTHS + b).to(tl.int32), view))


@triton.jit
def merge_kernel(OUT, LSE, RESULT, splits, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """One (row, head): its splits' outputs weighted by 2^(lse - max lse)."""
    cell = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    lse = tl.load(LSE + cell * splits + offs_s, mask=offs_s < splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all: every weight 0, output 0
    w = tl.exp2(lse - top)
    parts = tl.load(
        OUT + (cell * splits + offs_s)[:, None] * D + offs_d[None, :], mask=(offs_s < splits)[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(RESULT + cell * D + offs_d, out.to(RESULT.dtype.element_ty))
