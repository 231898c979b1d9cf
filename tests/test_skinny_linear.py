"""The decode step's few-row linear kernel against ``F.linear`` (Triton's interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from longqa.rollout.skinny_linear import MAX_ROWS, plan, skinny_linear  # noqa: E402


@pytest.mark.parametrize("m,n,k,bias", [(8, 48, 64, False), (16, 40, 96, True), (3, 130, 200, True), (1, 16, 16, False)])
def test_equals_f_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for config in (None, (16, 32, 4, 2), (32, 64, 4, 2)):
        torch.testing.assert_close(skinny_linear(x, w, b, config), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_reads_strided_rows_and_refuses_too_many():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)[:, :32]  # a column slice: rows are strided
    w = torch.randn(24, 64, generator=g)[:, 32:]
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 16), torch.randn(16, 16))


def test_plan_covers_the_gpu_and_tiles_divide():
    for n, k in [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (151936, 2048)]:
        block_n, block_k, _, _ = plan(n, k, 132)
        assert -(-n // block_n) >= 2 * 132 or block_n == 16
        assert block_n * block_k * 2 <= 16384 and k % block_k == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_and_the_compiled_op():
    from longqa.rollout.skinny_linear import decode_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(4096, 2048), (2048, 6144), (12288, 2048)]:
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        ref = F.linear(x.float(), w.float())
        out = torch.compile(lambda a, b: decode_linear(a, b) * 2, fullgraph=True)(x, w) / 2
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
