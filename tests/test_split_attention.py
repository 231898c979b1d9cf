"""The split backend (prompt half + own half, merged by log-sum-exp) is exact: the dense masked backend and
the naive padded layout are the references."""

import copy

import pytest
import torch

from longqa.model.attention import pack_mask, resolve_backend, use_longqa_attention
from longqa.model.attention_spec import UnsupportedModelError
from longqa.model.split_attention import RESPONSE_STEP, shared_prompt_attention, split_layout
from test_packing import LENGTHS, PROMPTS, actor_for, assert_same, samples_for, windowed_lm
from tiny_models import tiny_lm

# (start, prompt length, response lengths) per pack and the padded row length: several packs, an empty
# response, one-token responses and prompts, and end padding.
LAYOUTS = [
    ([(0, 7, [3, 1, 5])], 16),
    ([(0, 7, [3, 1, 5])], 20),
    ([(0, 7, [3, 1, 5]), (16, 4, [2, 0, 6])], 32),
    ([(0, 1, [1]), (2, 9, [4, 4, 4, 4])], 40),
    ([(0, 12, [])], 12),
]


def dense_reference(q, k, v, segments, length, scale):
    """Every pack through SDPA with the explicit shared-prompt mask; the end padding is not attended (zeros)."""
    out = torch.zeros_like(q)
    for start, prompt, responses in segments:
        end = start + prompt + sum(responses)
        mask = pack_mask(prompt, responses, q.device)
        out[:, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], attn_mask=mask, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1])
    return out


@pytest.mark.parametrize("step", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("segments,length", LAYOUTS)
def test_split_attention_and_its_gradients_equal_masked_attention(segments, length, heads, kv_heads, step):
    """``step`` 16 rounds the prefix halves' query slices up past their packs (and past the row's end)."""
    g = torch.Generator().manual_seed(length + heads)
    q = torch.randn(1, heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, heads, length, 8, generator=g, dtype=torch.float64)
    layout = split_layout(segments, step, "cpu")
    got = shared_prompt_attention(q, k, v, layout, 0.3)
    want = dense_reference(q, k, v, segments, length, 0.3)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0), (a - b).abs().max()


def test_layout_rounds_shapes_up_and_gathers_each_response_row_once():
    layout = split_layout([(0, 7, [3, 1, 5]), (16, 4, [2, 0, 6])], 8, "cpu")
    first, second = layout.packs
    assert (first.start, first.prompt, first.length, first.padded) == (0, 7, 16, 16)
    assert (second.start, second.prompt, second.length, second.padded) == (16, 4, 12, 16)
    assert (first.responses, first.response_length, second.responses) == (3, RESPONSE_STEP, 2)
    assert first.rows.tolist() == list(range(7, 16)) and second.rows.tolist() == list(range(20, 28))
    width = RESPONSE_STEP
    assert first.slots.tolist() == [0, 1, 2, width, 2 * width, 2 * width + 1, 2 * width + 2, 2 * width + 3,
                                    2 * width + 4]
    assert second.slots.tolist() == [0, 1] + [width + i for i in range(6)]


@pytest.mark.parametrize("family,budget", [("qwen3", 100_000), ("qwen3", 40), ("qwen2", 40), ("llama", 40)])
def test_split_backend_log_probs_and_gradients_equal_the_naive_layout(family, budget):
    actor = assert_same(tiny_lm(family), samples_for(PROMPTS, LENGTHS), budget=budget,
                        extra=("actor.attention_backend=split",))
    assert actor.backend == "split"


def test_split_is_refused_where_it_cannot_run(monkeypatch):
    """The check is made from the model's spec and compute dtype (no GPU needed to make it)."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    cuda = torch.device("cuda")
    plain = use_longqa_attention(copy.deepcopy(tiny_lm("qwen3", head_dim=16)))
    assert resolve_backend("split", cuda, plain, torch.bfloat16) == "split"
    assert resolve_backend("auto", cuda, plain, torch.bfloat16) == "flex"
    assert resolve_backend("auto", torch.device("cpu"), plain, torch.float32) == "dense"
    with pytest.raises(UnsupportedModelError, match="bfloat16 or float16"):
        resolve_backend("split", cuda, plain, torch.float32)
    for family in ("mistral", "gemma2"):
        spec = use_longqa_attention(copy.deepcopy(windowed_lm(family)))
        with pytest.raises(UnsupportedModelError, match="sliding windows|soft-cap"):
            resolve_backend("split", cuda, spec, torch.bfloat16)


def test_split_refuses_windowed_models_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="sliding windows"):
        actor_for(windowed_lm("mistral"), shared=True, extra=("actor.attention_backend=split",))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN attention)")
@pytest.mark.parametrize("segments,length", LAYOUTS)
def test_cudnn_halves_equal_masked_attention_on_cuda(segments, length):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, 8, length, 64, **shape).requires_grad_()
    k = torch.randn(1, 2, length, 64, **shape).requires_grad_()
    v = torch.randn(1, 2, length, 64, **shape).requires_grad_()
    grad = torch.randn(1, 8, length, 64, **shape)
    got = shared_prompt_attention(q, k, v, split_layout(segments, 16, "cuda"), 0.125)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = dense_reference(*leaves, segments, length, 0.125)
    assert (got.double() - want).abs().max() < 2e-2
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, leaves, grad.double())
    for a, b in zip(got_grads, want_grads):
        assert (a.double() - b).abs().max() / b.abs().max() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN attention)")
def test_split_on_cuda_matches_flex_in_bfloat16():
    samples = samples_for(PROMPTS, LENGTHS)
    model = tiny_lm("qwen3", head_dim=16).to(torch.bfloat16)
    results = {}
    for backend in ("flex", "split"):
        m = copy.deepcopy(model).cuda()
        actor = actor_for(m, shared=True, budget=40, extra=(f"actor.attention_backend={backend}",), device="cuda")
        assert actor.backend == backend
        logp = actor.logprobs(samples)
        actor.accumulate_gradients(samples, list(range(len(samples))), [x - 0.05 for x in logp])
        results[backend] = (logp, {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
    (flex_logp, flex_grads), (split_logp, split_grads) = results["flex"], results["split"]
    for a, b in zip(flex_logp, split_logp):
        assert (a - b).abs().max() < 5e-2
    for name in flex_grads:
        scale = flex_grads[name].abs().max().clamp(min=1e-6)
        assert (flex_grads[name] - split_grads[name]).abs().max() / scale < 5e-2, name
