"""``x @ weight.T (+ bias)`` for a handful of rows, as one Triton kernel that streams the weight once.

A decode step multiplies 8 to 16 rows by each weight matrix: the product is a read of the matrix, so
its time is the matrix's bytes over memory bandwidth plus the kernel's start and tail. cuBLAS's
choices at these shapes reach about half the bandwidth on an H200 (a 2048 x 2048 projection takes
6.5 us where its bytes need 1.8 us), because its tiles leave many SMs idle. Here each program owns
``BLOCK_N`` output columns for all rows and walks the whole K axis, so the grid is ``N / BLOCK_N``
programs and every weight byte is loaded exactly once; ``BLOCK_N`` is picked per shape so that the
grid covers the GPU (``plan``).

Used by the fused decode step (``decode_step.py``) on a GPU through ``torch.ops.longqa.skinny_linear``,
an opaque op to ``torch.compile``; tests run the kernel in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools

import torch

MAX_ROWS = 16  # one 16-row tile: the tensor-core minimum, and n = 8 or 16 samples of one or two groups
SM_FALLBACK = 132


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_linear_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows, cols = offs_m < M, offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offs_k
            if EVEN_K:
                x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=rows[:, None], other=0.0)
                w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=cols[:, None], other=0.0)
            else:
                inside = (ks < K)[None, :]
                x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=rows[:, None] & inside, other=0.0)
                w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=cols[:, None] & inside,
                            other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=rows[:, None] & cols[None, :])

    return skinny_linear_kernel


def plan(n: int, k: int, sms: int = SM_FALLBACK) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``n x k`` weight: the widest column block
    whose grid still gives every SM at least two programs (one program per SM leaves its memory
    pipeline half empty), and K tiles of 16 KB per operand stage."""
    block_n = 128
    while block_n > 16 and -(-n // block_n) < 2 * sms:
        block_n //= 2
    block_k = max(64, min(512, 8192 // block_n))
    return block_n, block_k, 4, 4


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[M <= 16, K]``; ``config`` overrides ``plan``."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows and a [N, {k}] weight: "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or plan(n, k, _sm_count(x.device))
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    _kernel()[(-(-n // block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y


@torch.library.custom_op("longqa::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel as an op ``torch.compile`` keeps whole (it cannot trace into a Triton launch's grid plan)."""
    return skinny_linear(x, weight, bias)


@skinny_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The decode step's linear: the skinny kernel for a few rows on a GPU, ``F.linear`` otherwise."""
    if x.is_cuda and x.shape[0] <= MAX_ROWS:
        return skinny_linear_op(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
