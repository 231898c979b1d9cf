"""The Triton decode attention (``rollout/decode_kernel.py``), and the batched-matmul one it replaces off
the GPU, against a naive per-row reference.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before anything imports Triton), so the shapes are tiny. On a GPU the same tests run the compiled
kernel, plus a bfloat16 test and one that captures the attention in a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys

import pytest
import torch

from longqa.rollout import decode_kernel
from longqa.rollout.decode_kernel import shared_prefix_attention, split_plan

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)


def store(batch, kv_heads, cap, d, lengths, dtype=torch.float32):
    """A KV store whose positions past each entry's length hold NaN: reading one would poison the output."""
    k = torch.randn(batch, kv_heads, cap, d, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, cap, d, dtype=torch.float64)
    for b, length in enumerate(lengths):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def naive(q, k, v, scaling, softcap=None):
    """One row: ``q`` ``[heads, d]`` over ``k``, ``v`` ``[kv_heads, L, d]`` -> (out ``[heads, d]``, lse ``[heads]``),
    in float64 with each kv head repeated for its r query heads."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    r = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(r, 0), v.repeat_interleave(r, 0)
    scores = torch.einsum("hd,hld->hl", q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_split_plan():
    assert split_plan(40, 4, 16, programs=6) == (4, 16)  # ceil(40/4) = 10 rounds up to one block
    assert split_plan(100, 3, 16, programs=6) == (3, 48)
    assert split_plan(40, None, 16, programs=6) == (3, 16)  # few programs: one block per split
    assert split_plan(32768, None, 64, programs=64, sms=132, waves=4) == (9, 3648)  # 576 programs >= 4 x 132
    assert split_plan(32768, None, 64, programs=64, sms=132) == (5, 6592)  # default 2 waves: 320 >= 2 x 132
    assert split_plan(300, None, 64, programs=4096) == (1, 320)  # enough programs: no split
    assert split_plan(0, None, 64, programs=8) == (1, 64)
    for view in (1, 63, 64, 65, 1000, 4097):
        for programs in (1, 8, 100, 600):
            splits, chunk = split_plan(view, None, 64, programs)
            assert chunk % 64 == 0 and chunk >= 64 and (splits - 1) * chunk < max(view, 1) <= splits * chunk


@needs_triton
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("r", [1, 2])
def test_prompt_half_per_split(n, r):
    """Every prompt split's output and log-sum-exp (rows without own keys), in the layout query
    m = j*r + t <-> row g*n + j, head h*r + t, and their merge."""
    torch.manual_seed(n * 10 + r)
    groups, kv_heads, view, d, block_n, scaling = 3, 2, 40, 16, 16, 0.25
    lengths = [40, 23, 5]  # == view, not a multiple of block_n, shorter than one block
    k, v = store(groups, kv_heads, view, d, lengths)
    own_k, own_v = store(groups * n, kv_heads, 16, d, [0] * groups * n)
    q = torch.randn(groups * n, kv_heads * r, d, device=DEVICE)
    no_own = torch.zeros(groups * n, dtype=torch.long, device=DEVICE)
    for splits in (1, 4, None):  # with 4: split 3 starts past view, and group 2 has keys in split 0 only
        merged, out, lse = shared_prefix_attention(
            q,
            k,
            v,
            torch.tensor(lengths, device=DEVICE),
            own_k,
            own_v,
            no_own,
            n,
            view,
            16,
            scaling,
            block_n,
            splits=(splits, None),
            partials=True,
        )
        splits, chunk = split_plan(view, splits, block_n, groups * kv_heads)
        assert out.shape[:3] == (groups * n, kv_heads * r, splits + 1) and lse.shape == out.shape[:3]
        assert torch.all(lse[:, :, splits] == float("-inf")) and torch.all(out[:, :, splits] == 0)  # the own split
        for g in range(groups):
            for s in range(splits):
                lo, hi = s * chunk, min((s + 1) * chunk, lengths[g])
                for j in range(n):
                    got_out, got_lse = out[g * n + j, :, s].cpu(), lse[g * n + j, :, s].cpu() * math.log(2)
                    if hi <= lo:
                        assert torch.all(got_lse == float("-inf")) and torch.all(got_out == 0)
                        continue
                    ref_out, ref_lse = naive(q[g * n + j], k[g, :, lo:hi], v[g, :, lo:hi], scaling)
                    torch.testing.assert_close(got_out.double(), ref_out, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(got_lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
        for row in range(groups * n):
            g = row // n
            ref, _ = naive(q[row], k[g, :, : lengths[g]], v[g, :, : lengths[g]], scaling)
            torch.testing.assert_close(merged[row].cpu().double(), ref, atol=1e-5, rtol=1e-5)


def naive_token(q, pk, pv, sk, sv, prefix_len, own_len, n, row, i, queries, scaling, window=None, softcap=None):
    """The naive attention of token ``i`` of ``row`` (``queries`` tokens a row, the last ``queries`` of its own
    keys): over its group's prompt keys and its own keys up to its own (with a window, the last ``window``)."""
    g, own = row // n, max(0, own_len[row] - queries + 1 + i)
    keys = torch.cat([pk[g, :, : prefix_len[g]], sk[row, :, :own]], 1)
    values = torch.cat([pv[g, :, : prefix_len[g]], sv[row, :, :own]], 1)
    if window is not None:
        keys, values = keys[:, -window:], values[:, -window:]
    return naive(q[row * queries + i], keys, values, scaling, softcap)[0]


def check_full(
    groups,
    n,
    kv_heads,
    r,
    d,
    prefix_len,
    own_len,
    prompt_view,
    own_view,
    dtype=torch.float32,
    tol=1e-5,
    block_n=16,
    splits=(None, None),
    window=None,
    softcap=None,
    queries=1,
    max_block_m=128,
):
    """Both halves merged == naive attention over [group's prompt keys ; own keys] for every token (with a
    window: only the last ``window`` of them, the token's own key being the last). A row feeds ``queries``
    tokens, its last ``queries`` own keys: token i reads own keys up to ``own_len - queries + i``."""
    rows, heads, scaling = groups * n, kv_heads * r, d**-0.5
    pk, pv = store(groups, kv_heads, prompt_view, d, prefix_len, dtype)
    sk, sv = store(rows, kv_heads, own_view, d, own_len, dtype)
    q = torch.randn(rows * queries, heads, d, device=DEVICE).to(dtype)
    prefix_t, own_t = torch.tensor(prefix_len, device=DEVICE), torch.tensor(own_len, device=DEVICE)
    got = shared_prefix_attention(
        q,
        pk,
        pv,
        prefix_t,
        sk,
        sv,
        own_t,
        n,
        prompt_view,
        own_view,
        scaling,
        block_n,
        splits=splits,
        window=window,
        softcap=softcap,
        queries=queries,
        max_block_m=max_block_m,
    )
    assert got.shape == (rows * queries, heads, d) and got.dtype == dtype
    for row in range(rows):
        for i in range(queries):
            ref = naive_token(q, pk, pv, sk, sv, prefix_len, own_len, n, row, i, queries, scaling, window, softcap)
            torch.testing.assert_close(got[row * queries + i].cpu().double(), ref, atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("n, kv_heads, r, d", [(3, 2, 2, 32), (4, 1, 5, 16)])  # M = 6 and 20 (BLOCK_M 16, 32)
def test_merge_of_both_halves(n, kv_heads, r, d):
    torch.manual_seed(n)
    groups = 3
    prefix_len = [0, 37, 50]  # group 0 has no prompt key: its rows attend to their own keys only
    # group 0's rows need own keys; later rows include 0 (no own key yet) and 12 (== own view)
    own_len = [1 + row if row < n else 0 if row % 3 == 0 else row * 5 % 13 for row in range(groups * n)]
    for splits in ((4, None), (None, 2), (1, 1)):
        check_full(groups, n, kv_heads, r, d, prefix_len, own_len, 50, 12, splits=splits)


@needs_triton
@pytest.mark.parametrize(
    "window, softcap, splits",
    [(1, None, (3, 2)), (7, None, (None, None)), (20, 0.5, (3, 2)), (None, 0.3, (None, None))],
)
def test_sliding_window_and_soft_capping(window, softcap, splits):
    """Windows that end inside the prompt, inside the own keys, and at the query itself; rows of one group
    whose windows start at different keys; fixed and planned splits."""
    torch.manual_seed(window or 0)
    groups, n = 2, 3
    prefix_len, own_len = [40, 9], [1, 6, 13, 2, 1, 12]
    check_full(groups, n, 2, 2, 16, prefix_len, own_len, 40, 13, splits=splits, window=window, softcap=softcap)


@needs_triton
@pytest.mark.parametrize(
    "queries, window, softcap, max_block_m", [(2, None, None, 128), (4, None, 0.5, 16), (3, 6, None, 16)]
)
def test_several_tokens_per_row(queries, window, softcap, max_block_m):
    """A step verifying drafts: each row feeds ``queries`` tokens, causal among themselves; rows whose
    tokens' own keys start inside a split, a finished row (no own key; without a window, where its
    tokens' positions are defined), a window ending among the new tokens, a group's cells in one tile
    or in two (``max_block_m``); on a GPU the compiled kernel against the same float64 reference."""
    torch.manual_seed(queries)
    groups, n = 2, 3
    prefix_len, own_len = [40, 9], [queries, 13, 0 if window is None else queries, 7, queries + 1, 16]
    check_full(
        groups,
        n,
        2,
        2,
        16,
        prefix_len,
        own_len,
        40,
        16,
        splits=(2, 3),
        window=window,
        softcap=softcap,
        queries=queries,
        max_block_m=max_block_m,
    )


@needs_triton
@pytest.mark.parametrize("window, queries", [(None, 1), (9, 2)])
def test_reads_on_the_device_shorter_than_the_views(window, queries):
    """A call whose views are the stores' whole caps (as a CUDA graph captured once is) and whose ``reads`` tensor
    says how far the groups got: the same attention as the naive one, each split covering ``chunk_of`` of the
    keys read (not of the view), and nothing past the reads touched (NaN there)."""
    from longqa.rollout.decode_kernel import chunk_of

    torch.manual_seed(queries)
    groups, n, kv_heads, r, d, block_n, scaling = 2, 3, 2, 2, 16, 16, 0.3
    prompt_cap, own_cap = 96, 40
    for prefix_len, own_len in (([33, 20], [queries, 7, 0, 11, queries + 1, 5]), ([70, 96], [40, 3, 9, 1, 22, 40])):
        if window is not None:  # (a row's tokens have positions once it holds them)
            own_len = [max(queries, length) for length in own_len]
        pk, pv = store(groups, kv_heads, prompt_cap, d, prefix_len)
        sk, sv = store(groups * n, kv_heads, own_cap, d, own_len)
        q = torch.randn(groups * n * queries, kv_heads * r, d, device=DEVICE)
        reads = torch.tensor([max(prefix_len), max(own_len)], dtype=torch.int32, device=DEVICE)
        out, parts, lse = shared_prefix_attention(
            q,
            pk,
            pv,
            torch.tensor(prefix_len, device=DEVICE),
            sk,
            sv,
            torch.tensor(own_len, device=DEVICE),
            n,
            prompt_cap,
            own_cap,
            scaling,
            block_n,
            splits=(4, 2),
            window=window,
            queries=queries,
            partials=True,
            reads=reads,
        )
        chunk = chunk_of(max(prefix_len), 4, block_n)
        for row in range(groups * n):
            g = row // n
            for s in range(4):  # the prompt splits: keys [s * chunk, (s + 1) * chunk) of those read
                lo, hi = s * chunk, min((s + 1) * chunk, prefix_len[g])
                if hi <= lo:
                    assert torch.all(lse[row * queries, :, s] == float("-inf"))
                elif window is None:
                    ref, _ = naive(q[row * queries], pk[g, :, lo:hi], pv[g, :, lo:hi], scaling)
                    torch.testing.assert_close(parts[row * queries, :, s].cpu().double(), ref, atol=1e-5, rtol=1e-5)
            for i in range(queries):
                ref = naive_token(q, pk, pv, sk, sv, prefix_len, own_len, n, row, i, queries, scaling, window)
                torch.testing.assert_close(out[row * queries + i].cpu().double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("queries, window, softcap", [(1, None, None), (3, None, None), (4, 5, 0.5)])
def test_the_matmul_attention_with_several_tokens_per_row(queries, window, softcap):
    """The batched-matmul decode attention (the path without Triton) against the same reference: token i
    of a row reads its group's prompt and its own keys up to index ``write_at + i``; garbage (finite, as
    in the engine's stores) past them is never read."""
    from longqa.rollout.fast import decode_attention

    torch.manual_seed(queries)
    groups, n, kv_heads, r, d = 2, 3, 2, 2, 16
    prefix_len, write_at = [11, 4], [0, 5, 2, 7, 1, 3]
    prompt_view, own_view, rows, scaling = 12, max(write_at) + queries + 2, groups * n, 0.3
    pk, pv = (x.nan_to_num(50.0) for x in store(groups, kv_heads, prompt_view, d, prefix_len))
    sk, sv = (x.nan_to_num(-50.0) for x in store(rows, kv_heads, own_view, d, [w + queries for w in write_at]))
    q = torch.randn(rows, queries, kv_heads * r, d, device=DEVICE)
    got = decode_attention(
        q,
        pk,
        pv,
        sk,
        sv,
        torch.tensor(prefix_len, device=DEVICE),
        torch.tensor(write_at, device=DEVICE),
        n,
        prompt_view,
        own_view,
        scaling,
        window,
        softcap,
    )
    assert got.shape == q.shape
    for row in range(rows):
        g = row // n
        for i in range(queries):
            keys = torch.cat([pk[g, :, : prefix_len[g]], sk[row, :, : write_at[row] + i + 1]], 1)
            values = torch.cat([pv[g, :, : prefix_len[g]], sv[row, :, : write_at[row] + i + 1]], 1)
            if window is not None:
                keys, values = keys[:, -window:], values[:, -window:]
            ref, _ = naive(q[row, i], keys, values, scaling, softcap)
            torch.testing.assert_close(got[row, i].cpu().double(), ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_strided_views_of_a_bigger_store():
    """Layer slices of a layer-stacked store, sequence-major storage, a view shorter than cap, and q a slice
    of a packed qkv tensor: nothing is copied and nothing past ``view`` is read (it is NaN there)."""
    torch.manual_seed(1)
    layers, groups, n, kv_heads, r, d, cap, view, own_cap, own_view = 2, 2, 3, 2, 2, 16, 64, 40, 24, 10
    rows, heads, scaling = groups * n, kv_heads * r, 0.3
    prefix_len, own_len = [40, 17], [1, 10, 4, 0, 9, 2]
    # [layers, groups, cap, kv_heads, d] storage seen as [groups, kv_heads, cap, d] per layer
    prefix = torch.full((2, layers, groups, cap, kv_heads, d), float("nan"), device=DEVICE)
    suffix = torch.full((2, layers, rows, kv_heads, own_cap, d), float("nan"), device=DEVICE)
    for g, length in enumerate(prefix_len):
        prefix[:, :, g, :length] = torch.randn(2, layers, length, kv_heads, d, device=DEVICE)
    for row, length in enumerate(own_len):
        suffix[:, :, row, :, :length] = torch.randn(2, layers, kv_heads, length, d, device=DEVICE)
    pk, pv = prefix[0, 1].transpose(1, 2), prefix[1, 1].transpose(1, 2)
    sk, sv = suffix[0, 1], suffix[1, 1]
    qkv = torch.randn(rows, heads + 2 * kv_heads, d, device=DEVICE)
    q = qkv[:, :heads]
    assert not (pk[:, :, :view].is_contiguous() or sk[:, :, :16].is_contiguous() or q.is_contiguous())
    # the prompt half gets a sliced view, the own half a longer slice than own_view (the kernel stops there)
    got = shared_prefix_attention(
        q,
        pk[:, :, :view],
        pv[:, :, :view],
        torch.tensor(prefix_len, device=DEVICE),
        sk[:, :, :16],
        sv[:, :, :16],
        torch.tensor(own_len, device=DEVICE),
        n,
        view,
        own_view,
        scaling,
        block_n=16,
    )
    for row in range(rows):
        g = row // n
        keys = torch.cat([pk[g, :, : prefix_len[g]], sk[row, :, : own_len[row]]], 1)
        values = torch.cat([pv[g, :, : prefix_len[g]], sv[row, :, : own_len[row]]], 1)
        ref, _ = naive(q[row], keys, values, scaling)
        torch.testing.assert_close(got[row].cpu().double(), ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_bad_inputs_are_clear_errors():
    q = torch.zeros(4, 2, 16, device=DEVICE)
    pk, sk, lengths = torch.zeros(2, 1, 32, 16, device=DEVICE), torch.zeros(4, 1, 8, 16, device=DEVICE), torch.ones(4)
    call = functools.partial(shared_prefix_attention, q, pk, pk)
    with pytest.raises(ValueError, match="prompt view 40 is outside"):
        call(lengths[:2], sk, sk, lengths, 2, 40, 8, 1.0)
    with pytest.raises(ValueError, match="own keys .* and values"):
        call(lengths[:2], sk, sk[:, :, :4], lengths, 2, 32, 4, 1.0)
    with pytest.raises(ValueError, match="shapes do not fit"):
        call(lengths[:2], sk, sk, lengths, 3, 32, 8, 1.0)  # 4 rows are not 2 groups of 3
    with pytest.raises(ValueError, match="shapes do not fit"):
        call(lengths[:2], sk, sk, lengths, 2, 32, 8, 1.0, queries=2)  # 4 query rows are not 4 rows x 2 tokens
    with pytest.raises(ValueError, match="queries must be >= 1"):
        call(lengths[:2], sk, sk, lengths, 2, 32, 8, 1.0, queries=0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        call(lengths[:2], sk.transpose(2, 3), sk.transpose(2, 3), lengths, 2, 16, 8, 1.0)


def test_imports_without_triton(monkeypatch):
    """longqa imports without triton; asking for the kernel then says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.setitem(sys.modules, "longqa.rollout.decode_triton", None)  # as if never importable
    spec = importlib.util.spec_from_file_location("decode_kernel_without_triton", decode_kernel.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    q, k = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16, 16)
    with pytest.raises(RuntimeError, match="triton"):
        none = torch.zeros(2, dtype=torch.long)
        module.shared_prefix_attention(q, k, k, none, k, k, none, 1, 16, 16, 1.0)


@needs_triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the compiled kernel in bfloat16")
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_bf16(d):
    torch.manual_seed(d)
    groups, n, kv_heads, r = 4, 8, 2, 4
    prefix_len = [1000, 777, 64, 1]
    own_len = torch.randint(0, 300, (groups * n,)).tolist()
    check_full(groups, n, kv_heads, r, d, prefix_len, own_len, 1000, 300, torch.bfloat16, tol=2e-2, block_n=64)
    check_full(
        groups,
        n,
        kv_heads,
        r,
        d,
        prefix_len,
        [max(1, o) for o in own_len],
        1000,
        300,
        torch.bfloat16,
        tol=2e-2,
        block_n=64,
        window=200,
        softcap=0.5,
    )


@needs_triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graph capture")
def test_cuda_graph_capture():
    """No host synchronisation inside: the attention captured once in a CUDA graph at the stores' whole views
    replays with new lengths and new reads (shorter and longer than at the capture), as the engine's decode
    step does."""
    torch.manual_seed(0)
    groups, n, kv_heads, r, d, view, own_view = 2, 4, 2, 2, 64, 512, 128
    rows, heads, scaling = groups * n, kv_heads * r, 0.125
    pk, pv = (torch.randn(groups, kv_heads, view, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sk, sv = (torch.randn(rows, kv_heads, own_view, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, heads, d, device="cuda", dtype=torch.bfloat16)
    prefix_t = torch.tensor([300, 200], device="cuda")
    own_t = torch.full((rows,), 5, device="cuda")
    reads = torch.tensor([300, 5], dtype=torch.int32, device="cuda")

    def step():
        return shared_prefix_attention(q, pk, pv, prefix_t, sk, sv, own_t, n, view, own_view, scaling, reads=reads)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for prefix, own in (
        ([100, 511], torch.arange(rows) * 7 + 1),
        ([40, 3], torch.arange(rows) % 3 + 1),
        ([512, 512], torch.full((rows,), 128)),
    ):
        prefix_t.copy_(torch.tensor(prefix, device="cuda"))
        own_t.copy_(own.to("cuda"))
        reads.copy_(torch.tensor([max(prefix), int(own.max())], dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
        for row in range(rows):
            g = row // n
            p, o = int(prefix_t[g]), int(own_t[row])
            keys = torch.cat([pk[g, :, :p], sk[row, :, :o]], 1)
            values = torch.cat([pv[g, :, :p], sv[row, :, :o]], 1)
            ref, _ = naive(q[row], keys, values, scaling)
            torch.testing.assert_close(out[row].cpu().double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2"])
def test_the_engine_samples_the_same_with_the_kernel_as_with_matmuls(family):
    """The fast engine end to end: the Triton attention in its decode step (the GPU default) against the
    batched-matmul attention, several prompt lengths, slots streaming, stops and drawn lengths (finished
    rows and groups are skipped by the kernel while the others go on); with a sliding window of 5
    (Mistral) and soft-capping (Gemma2)."""
    from model_zoo import tiny_model
    from tiny_models import VOCAB, tiny_lm

    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    model = (tiny_lm(head_dim=16) if family == "qwen3" else tiny_model(family, head_dim=16, hidden_size=64)).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, VOCAB, (length,), generator=g).tolist() for length in (5, 70, 1)]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=9, stop_token_ids=(5,))
    runs = [
        FastRolloutEngine(model, max_groups=2, sync_every=4, decode_kernel=kernel, cuda_graphs=False).generate(
            prompts, params, seeds=[1, 2, 3], stop_at=[[2, 9, 4], [9, 1, 9], [3, 3, 3]]
        )
        for kernel in ("triton", "bmm")
    ]
    for group_a, group_b in zip(*runs):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


@pytest.mark.slow
@needs_triton
def test_with_the_kernel_every_decode_step_has_the_same_graph_key(monkeypatch):
    """The decode step's views (its CUDA graph's key) through runs whose groups hold prompts of 1 to 70 tokens and
    responses that end early: with the Triton attention they stay at the KV stores' caps, so on a GPU one capture
    serves every step of a GRPO run; the batched-matmul attention narrows them to the lengths (in steps of 4
    tokens here), a key per view."""
    from tiny_models import VOCAB, tiny_lm

    from longqa.rollout import fast
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    monkeypatch.setattr(fast, "PROMPT_VIEW_STEP", 4)
    monkeypatch.setattr(fast, "RESPONSE_VIEW_STEP", 4)
    model = tiny_lm(head_dim=16).to(DEVICE)
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=9, stop_token_ids=(5,))
    for kernel in ("triton", "bmm"):
        engine = FastRolloutEngine(
            model, max_groups=2, sync_every=4, decode_kernel=kernel, cuda_graphs=False, prompt_tokens=70
        )
        views, step = [], engine._step

        def recorded(*args):
            views.append((engine.kv.prompt_view, engine.kv.response_view))
            return step(*args)

        engine._step = recorded
        for lengths in ((5, 70, 1), (2, 3), (40,)):
            prompts = [torch.randint(6, VOCAB, (length,), generator=g).tolist() for length in lengths]
            engine.generate(prompts, params, seeds=range(len(lengths)), stop_at=[[2, 9, 4]] * len(lengths))
        if kernel == "triton":
            assert set(views) == {(engine.kv.prompt_cap, engine.kv.own_cap)}
        else:
            assert len(set(views)) > 1


@needs_triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graph capture")
def test_the_engine_captures_one_graph_for_every_length():
    """On a GPU: prompts of other lengths, and responses ending at other lengths, in later calls replay the graph
    captured in the first (the same samples as an engine that captures nothing)."""
    from tiny_models import VOCAB, tiny_lm

    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    model = tiny_lm(head_dim=16).cuda()
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, stop_token_ids=(5,))
    graphs = FastRolloutEngine(model, max_groups=2, prompt_tokens=300)
    eager = FastRolloutEngine(model, max_groups=2, prompt_tokens=300, cuda_graphs=False)
    for lengths, stop_at in (((5, 300, 1), [[2, 40, 4]] * 3), ((20, 3), [[40, 40, 40]] * 2), ((150,), [[7, 1, 33]])):
        prompts = [torch.randint(6, VOCAB, (length,), generator=g).tolist() for length in lengths]
        got, want = (
            engine.generate(prompts, params, seeds=range(len(lengths)), stop_at=stop_at) for engine in (graphs, eager)
        )
        for group_a, group_b in zip(got, want):
            for a, b in zip(group_a, group_b):
                assert a.token_ids == b.token_ids
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert graphs.graph_captures == 1, graphs.graph_events
