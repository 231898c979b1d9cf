"""The reference rollout engine against transformers' own generate and a plain full forward, on tiny
random models (float32, CPU)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from longqa.rollout.base import SamplingParams
from longqa.rollout.hf import HFRolloutEngine, filter_logits, response_logprobs

FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


def tiny_model(family: str = "qwen3", vocab_size: int = 128):
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return model_cls(config).float().eval()


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES}


def prompts_of(lengths, vocab_size=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens, eos):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(models, family):
    model, engine = models[family], HFRolloutEngine(models[family])
    prompts = prompts_of([5, 17, 40])
    # An EOS that the first prompt's greedy continuation reaches, so both "stop" and "length" occur.
    eos = engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=6))[0][0].token_ids[4]
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(eos,))
    single = engine.generate(prompts, params)
    group = engine.generate(prompts, SamplingParams(n=4, temperature=0, max_new_tokens=12, stop_token_ids=(eos,)))
    for prompt, [sample], samples in zip(prompts, single, group):
        expected = hf_greedy(model, prompt, 12, eos)
        assert sample.token_ids == expected
        assert sample.finish_reason == ("stop" if expected[-1] == eos else "length")
        assert [s.token_ids for s in samples] == [expected] * 4
    assert single[0][0].finish_reason == "stop" and len(single[0][0].token_ids) <= 5


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9), (1.0, 8, 0.7), (0.0, -1, 1.0)])
def test_logprobs_equal_a_full_forward(models, temperature, top_k, top_p):
    model = models["qwen3"]
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10)
    prompts = prompts_of([7, 30])
    out = HFRolloutEngine(model).generate(prompts, params, torch.Generator().manual_seed(0))
    for prompt, samples in zip(prompts, out):
        for s in samples:
            assert len(s.logprobs) == len(s.token_ids) == 10
            expected = response_logprobs(model, prompt, s.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)
            if top_k > 0:  # the sampled tokens are among the k best of the full-forward logits
                logits = model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
                ranks = (logits > logits.gather(-1, torch.tensor(s.token_ids)[:, None])).sum(-1)
                assert (ranks < top_k).all()


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (-1, 0.3), (-1, 0.9), (20, 0.8)])
def test_top_k_top_p_keep_the_tokens_transformers_keeps(top_k, top_p):
    logits = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filter_logits(logits, top_k, top_p).isinf(), expected.isinf())


def test_the_prompt_is_prefilled_once_per_prompt(models):
    model = models["qwen3"]
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        out = HFRolloutEngine(model).generate(
            prompts_of([9, 23]), SamplingParams(n=8, max_new_tokens=6), torch.Generator().manual_seed(0)
        )
    finally:
        hook.remove()
    assert [s for s in shapes if s[1] > 1] == [(1, 9), (1, 23)]
    assert shapes == [(1, 9)] + [(8, 1)] * 5 + [(1, 23)] + [(8, 1)] * 5
    assert all(len(s.token_ids) == 6 for samples in out for s in samples)


def test_chunked_prefill_gives_the_same_samples(models):
    model = models["qwen3"]
    prompts, params = prompts_of([23, 4]), SamplingParams(n=2, temperature=0, max_new_tokens=8)
    chunked = HFRolloutEngine(model, max_batch_tokens=10).generate(prompts, params)
    whole = HFRolloutEngine(model).generate(prompts, params)
    for a, b in zip(sum(chunked, []), sum(whole, [])):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_same_seed_same_samples_other_seed_other_samples(models):
    engine = HFRolloutEngine(models["qwen3"])
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=8)
    prompts = prompts_of([6, 11])

    def run(seed):
        return engine.generate(prompts, params, torch.Generator().manual_seed(seed))

    assert run(3) == run(3)
    assert [s.token_ids for g in run(3) for s in g] != [s.token_ids for g in run(4) for s in g]


def test_top_k_1_is_greedy_and_the_training_flag_is_restored(models):
    model = models["qwen3"]
    engine, prompts = HFRolloutEngine(model), prompts_of([8, 15])
    model.train()
    try:
        top1 = engine.generate(
            prompts, SamplingParams(n=3, top_k=1, max_new_tokens=8), torch.Generator().manual_seed(0)
        )
        assert model.training
    finally:
        model.eval()
    greedy = engine.generate(prompts, SamplingParams(n=3, temperature=0, max_new_tokens=8, return_logprobs=False))
    assert [s.token_ids for g in top1 for s in g] == [s.token_ids for g in greedy for s in g]
    assert all(s.logprobs is None for g in greedy for s in g)


def test_stop_tokens_end_samples_and_max_new_tokens_gives_length(models):
    stops = tuple(range(12))
    params = SamplingParams(n=16, max_new_tokens=10, stop_token_ids=stops)
    out = HFRolloutEngine(models["qwen3"]).generate(prompts_of([10]), params, torch.Generator().manual_seed(0))
    reasons = {s.finish_reason for s in out[0]}
    assert reasons == {"stop", "length"}
    for s in out[0]:
        assert not set(s.token_ids[:-1]) & set(stops)
        assert len(s.logprobs) == len(s.token_ids)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stops
        else:
            assert len(s.token_ids) == 10 and s.token_ids[-1] not in stops


def test_stop_strings_cut_right_after_the_completing_token(tokenizer):
    model = tiny_model("qwen3", vocab_size=len(tokenizer))
    engine = HFRolloutEngine(model, tokenizer)
    prompt = tokenizer.encode("Question: In which city was the founder of Morvane Industries born?")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24))[0][0].token_ids

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    # A stop string straddling two neighbouring tokens of the greedy response that decode to plain text.
    pieces = [text([t]) for t in free]
    k = next(
        k for k in range(1, len(free)) if all(p and p.isascii() and p.isprintable() for p in pieces[k - 1 : k + 1])
    )
    stop = pieces[k - 1][-2:] + pieces[k][:1]
    cut = next(j for j in range(len(free)) if stop in text(free[: j + 1]))
    assert cut > 0
    [[sample]] = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24, stop_strings=(stop,)))
    assert sample.token_ids == free[: cut + 1] and sample.finish_reason == "stop"

    # Sampled: every sample stops at the first token whose text completes a stop string, or runs to the end.
    stops = ("e", "in")
    out = engine.generate(
        [prompt], SamplingParams(n=8, max_new_tokens=16, stop_strings=stops), torch.Generator().manual_seed(0)
    )
    assert {s.finish_reason for s in out[0]} == {"stop", "length"}
    for s in out[0]:
        assert not any(x in text(s.token_ids[:-1]) for x in stops)
        assert any(x in text(s.token_ids) for x in stops) == (s.finish_reason == "stop")

    with pytest.raises(ValueError, match="tokenizer"):
        HFRolloutEngine(model).generate([prompt], SamplingParams(max_new_tokens=4, stop_strings=("e",)))


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("max_new_tokens", 0),
        ("stop_token_ids", (-1,)),
        ("stop_strings", ("",)),
        ("return_logprobs", "yes"),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{"max_new_tokens": 4, field: value})
    SamplingParams(max_new_tokens=4, stop_token_ids=[2, 3], stop_strings=["x"])  # lists are accepted
