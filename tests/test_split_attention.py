"""The split backend (prompt half + own half, merged by log-sum-exp) is exact: the dense masked backend and
the naive padded layout are the references."""

import copy

import pytest
import torch
from test_packing import LENGTHS, PROMPTS, actor_for, assert_same, samples_for, windowed_lm
from tiny_models import tiny_lm

from longqa.model import split_attention
from longqa.model.attention import pack_mask, resolve_backend, use_longqa_attention
from longqa.model.attention_spec import UnsupportedModelError
from longqa.model.split_attention import RESPONSE_STEP, shared_prompt_attention, split_layout

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
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            attn_mask=mask,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    return out


@pytest.mark.parametrize("step,prompt_step", [(1, 4), (16, 4), (1, 512)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("segments,length", LAYOUTS)
def test_split_attention_and_its_gradients_equal_masked_attention(segments, length, heads, kv_heads, step, prompt_step):
    """``step`` 16 rounds the prefix halves' query slices up past their packs (and past the row's end);
    ``prompt_step`` 4 splits prompts between the prefix half and a tail in the own half (512: whole prompts
    in the own half, 1: whole prompts in the prefix half)."""
    g = torch.Generator().manual_seed(length + heads)
    q = torch.randn(1, heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, heads, length, 8, generator=g, dtype=torch.float64)
    layout = split_layout(segments, step, "cpu", prompt_step)
    got = shared_prompt_attention(q, k, v, layout, 0.3)
    want = dense_reference(q, k, v, segments, length, 0.3)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0), (a - b).abs().max()


def test_whole_prompts_in_the_prefix_half_too():
    segments, length = LAYOUTS[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, length, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = shared_prompt_attention(q, k, v, split_layout(segments, 1, "cpu", 1), 0.3)
    assert torch.allclose(got, dense_reference(q, k, v, segments, length, 0.3), atol=1e-12, rtol=0)


def test_layout_rounds_shapes_and_moves_prompt_tails_to_the_own_half():
    layout = split_layout([(0, 7, [3, 1, 5]), (16, 4, [2, 0, 6])], 8, "cpu", prompt_step=4)
    first, second = layout.packs
    assert (first.start, first.prompt, first.main, first.length, first.padded) == (0, 7, 4, 16, 16)
    assert (second.start, second.prompt, second.main, second.length, second.padded) == (16, 4, 4, 12, 16)
    # the first pack's tail (rows 4-6) alone, then before each response; the second has no tail
    assert (first.sequences, first.width, second.sequences) == (4, RESPONSE_STEP, 2)
    w = RESPONSE_STEP
    assert first.in_rows.tolist() == [4, 5, 6] + [4, 5, 6, 7, 8, 9] + [4, 5, 6, 10] + [4, 5, 6, 11, 12, 13, 14, 15]
    assert first.in_slots.tolist() == [0, 1, 2] + [w + i for i in range(6)] + [2 * w + i for i in range(4)] + [
        3 * w + i for i in range(8)
    ]
    assert first.out_slots.tolist() == [0, 1, 2, w + 3, w + 4, w + 5, 2 * w + 3] + [3 * w + 3 + i for i in range(5)]
    assert second.in_rows.tolist() == [20, 21, 22, 23, 24, 25, 26, 27]
    assert second.out_slots.tolist() == [0, 1] + [w + i for i in range(6)]


def test_shapes_stay_few_whatever_the_prompt_lengths():
    """Prompt lengths from 8,000 to 8,999 tokens and responses up to 1,024: at most a few dozen kernel
    shapes, where one per prompt length would be a thousand."""
    g = torch.Generator().manual_seed(0)
    shapes = set()
    for _ in range(300):
        prompt = int(torch.randint(8000, 9000, (1,), generator=g))
        responses = torch.randint(1, 1025, (8,), generator=g).tolist()
        pack = split_layout([(0, prompt, responses)], 1024, "cpu").packs[0]
        shapes.add(("prefix", pack.padded, pack.main))
        shapes.add(("own", pack.sequences, pack.width))
    assert len(shapes) <= 40, len(shapes)


@pytest.mark.parametrize(
    "family,budget,prompt_step", [("qwen3", 100_000, 4), ("qwen3", 40, 512), ("qwen2", 40, 4), ("llama", 40, 4)]
)
def test_split_backend_log_probs_and_gradients_equal_the_naive_layout(family, budget, prompt_step, monkeypatch):
    """``prompt_step`` 4: the prompts (5 and 11 tokens) split between the two halves; 512: all in the own half."""
    monkeypatch.setattr(split_attention, "PROMPT_STEP", prompt_step)
    actor = assert_same(
        tiny_lm(family), samples_for(PROMPTS, LENGTHS), budget=budget, extra=("actor.attention_backend=split",)
    )
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
    got = shared_prompt_attention(q, k, v, split_layout(segments, 16, "cuda", prompt_step=4), 0.125)
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
