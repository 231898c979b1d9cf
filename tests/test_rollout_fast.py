"""The fast shared-prefix engine against transformers: greedy tokens, log-probs, seeds, slots, budget."""

import pytest
import torch
from tiny_models import VOCAB, tiny_lm

from longqa.rollout.base import SamplingParams
from longqa.rollout.fast import FastRolloutEngine, KVBudgetError, first_argmax, log_softmax_at
from longqa.rollout.hf import HFRolloutEngine, response_logprobs

STOP = 5


def prompts(lengths=(3, 17, 1, 40, 9)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=[STOP],
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(STOP) + 1] if STOP in out else out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("n,groups,chunk", [(1, None, 8192), (3, 2, 4), (2, None, 8)])
def test_greedy_equals_transformers_generate(family, n, groups, chunk):
    """Several prompt lengths, chunked prefill, fewer slots than prompts (groups stream through); several
    prompts in one prefill forward (all of them at 8,192 tokens; at 8, a prompt's last piece beside the
    next prompt's first)."""
    model = tiny_lm(family)
    engine = FastRolloutEngine(model, max_groups=groups, prefill_chunk=chunk, sync_every=3)
    params = SamplingParams(n=n, temperature=0, max_new_tokens=12, stop_token_ids=(STOP,))
    for prompt, group in zip(prompts(), engine.generate(prompts(), params)):
        expected = hf_greedy(model, prompt, 12)
        assert len(group) == n
        for sample in group:
            assert sample.token_ids == expected
            assert sample.finish_reason == ("stop" if expected[-1] == STOP else "length")


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_equal_the_training_recompute(temperature, top_k, top_p):
    model = tiny_lm()
    engine = FastRolloutEngine(model, max_groups=2, sync_every=4)
    params = SamplingParams(
        n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, stop_token_ids=(STOP,)
    )
    out = engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    distinct = set()
    for prompt, group in zip(prompts(), out):
        for sample in group:
            distinct.add(tuple(sample.token_ids))
            recomputed = response_logprobs(model, prompt, sample.token_ids, temperature)
            assert torch.allclose(torch.tensor(sample.logprobs), recomputed, atol=1e-4)
    assert len(distinct) > 5  # it samples


def test_a_seed_gives_the_same_samples_whatever_the_batch():
    model = tiny_lm()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, stop_token_ids=(STOP,))
    together = FastRolloutEngine(model, sync_every=2).generate(prompts(), params, seeds=[10, 11, 12, 13, 14])
    alone = FastRolloutEngine(model, max_groups=1, sync_every=5).generate(prompts()[3:4], params, seeds=[13])
    assert [s.token_ids for s in alone[0]] == [s.token_ids for s in together[3]]
    again = FastRolloutEngine(model).generate(prompts(), params, generator=torch.Generator().manual_seed(7))
    same = FastRolloutEngine(model).generate(prompts(), params, generator=torch.Generator().manual_seed(7))
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in same]


def test_stop_strings_cut_like_the_reference_engine(tokenizer):
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(len(tokenizer), 32, 2, 4, 2)).eval()
    ids = [tokenizer.encode(t) for t in ("Passage 1: Veldora", "Question: In which city")]
    vocab_text = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    stop = next(t.strip() for t in vocab_text if len(t.strip()) >= 2)  # some string greedy decoding may produce
    reasons = []
    for stops in ((stop,), ("a",), ("e",)):
        params = SamplingParams(n=2, temperature=0, max_new_tokens=15, stop_strings=stops)
        fast = FastRolloutEngine(model, tokenizer, sync_every=4).generate(ids, params)
        ref = HFRolloutEngine(model, tokenizer).generate(ids, params)
        assert [[(s.token_ids, s.finish_reason) for s in g] for g in fast] == [
            [(s.token_ids, s.finish_reason) for s in g] for g in ref
        ]
        reasons += [s.finish_reason for g in fast for s in g]
    assert "stop" in reasons and "length" in reasons


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_fused_decode_step_equals_the_model_s_own_modules(family):
    """Same samples and log-probs from the fused step (decode_step.py) as from the transformers modules
    (biases: Qwen2; q/k norms: Qwen3; neither: Llama)."""
    model = tiny_lm(family)
    fused, modules = FastRolloutEngine(model, fused_decode=True), FastRolloutEngine(model, fused_decode=False)
    assert fused.decode_step is not None and modules.decode_step is None
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, stop_token_ids=(STOP,))
    a = fused.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    b = modules.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    for group_a, group_b in zip(a, b):
        for x, y in zip(group_a, group_b):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def test_the_training_model_is_never_rebound():
    """Its projections stay its own tensors (it may be saved or cast); the engine stacks copies of them."""
    model = tiny_lm("qwen2")
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    engine = FastRolloutEngine(model)
    engine.generate(prompts()[:1], SamplingParams(n=2, temperature=0, max_new_tokens=3))
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages


@pytest.mark.parametrize("views", [False, True])
def test_stacked_projections_follow_the_weights(views):
    from longqa.rollout.decode_step import FusedLinear

    torch.manual_seed(0)
    linears = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)]
    fused = FusedLinear(linears, views)
    with torch.no_grad():
        linears[0].weight.add_(1.0)  # an in-place update (an optimizer step)
        linears[1].weight.data = torch.randn(2, 4)  # a re-bind (a cast, a load with assign=True)
    fused.refresh()
    assert torch.equal(fused.weight, torch.cat([lin.weight for lin in linears]))
    assert torch.equal(fused.bias, torch.cat([lin.bias for lin in linears]))
    assert fused._bound() == views


def test_an_unsupported_model_runs_through_its_modules():
    model = tiny_lm()
    model.config.hidden_act = "tanh"  # not a fused activation (the modules keep their own)
    assert FastRolloutEngine(model).decode_step is None
    with pytest.raises(ValueError, match="activation 'tanh'"):
        FastRolloutEngine(model, fused_decode=True)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    assert [g[0].token_ids for g in FastRolloutEngine(model).generate(prompts()[:2], params)] == [
        hf_greedy(model, p, 6) for p in prompts()[:2]
    ]
    model = tiny_lm()
    model.model.norm.variance_epsilon = 1e-3  # the fused step applies the final norm with the layers' epsilon
    with pytest.raises(ValueError, match="epsilon"):
        FastRolloutEngine(model, fused_decode=True)


def test_weights_are_the_training_model_s_own():
    model = tiny_lm()
    engine = FastRolloutEngine(model)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    before = engine.generate(prompts()[:2], params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = engine.generate(prompts()[:2], params)
    assert [g[0].token_ids for g in after] == [hf_greedy(model, p, 6) for p in prompts()[:2]]
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2"])
def test_cuda_graph_replays_equal_transformers_and_the_recompute(family):
    """The compiled fused step (Qwen3, Mistral with a sliding window of 5) or the model's modules (Gemma2:
    windows and soft-capping) and the Triton decode attention, replayed as CUDA graphs."""
    from model_zoo import tiny_model

    model = (tiny_lm(head_dim=16) if family == "qwen3" else tiny_model(family, head_dim=16, hidden_size=64)).cuda()
    engine = FastRolloutEngine(model, max_groups=2, sync_every=3)
    assert engine.cuda_graphs and (engine.decode_step is not None) == (family != "gemma2")
    params = SamplingParams(n=3, temperature=0, max_new_tokens=12, stop_token_ids=(STOP,))
    for prompt, group in zip(prompts(), engine.generate(prompts(), params)):
        assert all(s.token_ids == hf_greedy(model, torch.tensor(prompt).cuda().tolist(), 12) for s in group)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, stop_token_ids=(STOP,))
    out = engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    assert out == engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    for prompt, group in zip(prompts(), out):
        for sample in group:
            recomputed = response_logprobs(model, prompt, sample.token_ids, 1.0).cpu()
            assert torch.allclose(torch.tensor(sample.logprobs), recomputed, atol=1e-4)


def test_a_copy_in_another_dtype_refreshes_and_is_never_sampled_stale():
    from longqa.config import load_config
    from longqa.rollout.base import StaleWeightsError
    from longqa.train.actor import Actor

    model = tiny_lm()
    engine = FastRolloutEngine(model, dtype=torch.float64)
    assert engine.model is not model and next(engine.model.parameters()).dtype == torch.float64
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    reference = tiny_lm().double()
    assert [g[0].token_ids for g in engine.generate(prompts()[:2], params)] == [
        hf_greedy(reference, p, 6) for p in prompts()[:2]
    ]
    actor = Actor(model, load_config(None, ["actor.lr=0.1"]), 1, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    actor.apply_gradients()  # an optimizer step: the copy is now stale
    with pytest.raises(StaleWeightsError, match="call sync_weights"):
        engine.generate(prompts()[:2], params)
    engine.sync_weights()
    reference.load_state_dict(model.state_dict())
    assert [g[0].token_ids for g in engine.generate(prompts()[:2], params)] == [
        hf_greedy(reference, p, 6) for p in prompts()[:2]
    ]


def test_a_group_that_cannot_fit_is_a_clear_error():
    engine = FastRolloutEngine(tiny_lm(), kv_cache_bytes=1000)
    with pytest.raises(KVBudgetError, match="needs .* GiB of KV cache but the budget is"):
        engine.generate(prompts(), SamplingParams(n=8, max_new_tokens=64))


def test_max_new_tokens_of_one_and_immediate_stops():
    model = tiny_lm()
    params = SamplingParams(n=2, temperature=0, max_new_tokens=1)
    out = FastRolloutEngine(model, max_groups=2).generate(prompts(), params)
    assert [g[0].token_ids for g in out] == [hf_greedy(model, p, 1) for p in prompts()]
    assert all(s.finish_reason in ("length", "stop") and len(s.token_ids) == 1 for g in out for s in g)


@pytest.mark.parametrize("vocab", [2, 63, 64, 100, 1000])
def test_two_stage_argmax_and_log_softmax_equal_the_flat_ones(vocab):
    """Chunked over the vocabulary (padding included), the first maximum and the log-softmax of the picked
    token are torch's own, ties and -inf (filtered) entries included."""
    torch.manual_seed(vocab)
    x = torch.randn(6, vocab)
    x[0] = 0.5  # every entry ties: the first one wins
    x[1, vocab // 2 :] = float("-inf")
    x[2, -1] = 10.0  # the maximum in the last, padded chunk
    tokens = first_argmax(x)
    assert torch.equal(tokens, x.argmax(-1))
    torch.testing.assert_close(log_softmax_at(x, tokens), x.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))


def pick_stop_token(runs, max_new):
    """A token some sample produced before its last step, that no sample meets first at its very last
    step (there a stop token and the length limit end a sample alike, and only the token says "stop")."""
    for group in runs:
        for sample in group:
            for t in sample.token_ids[: max_new - 1]:
                firsts = [s.token_ids.index(t) for g in runs for s in g if t in s.token_ids]
                if max_new - 1 not in firsts:
                    return t
    raise AssertionError("no usable stop token")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("max_groups", [None, 1])
def test_stop_at_ends_a_sample_exactly_as_a_stop_token_would(temperature, max_groups):
    """A sample cut by ``stop_at`` at the length a stop token ended it is that sample: same tokens, same
    log-probs, same finish reason, whether the groups run together or stream through one slot."""
    model, max_new = tiny_lm(), 12
    engine = FastRolloutEngine(model, max_groups=max_groups, sync_every=3)
    seeds = [3, 4, 5, 6, 7]
    free = engine.generate(prompts(), SamplingParams(n=3, temperature=temperature, max_new_tokens=max_new), seeds=seeds)
    stop = pick_stop_token(free, max_new)
    stopped = engine.generate(
        prompts(),
        SamplingParams(n=3, temperature=temperature, max_new_tokens=max_new, stop_token_ids=(stop,)),
        seeds=seeds,
    )
    lengths = [[len(s.token_ids) for s in group] for group in stopped]
    assert any(length < max_new for row in lengths for length in row)
    cut = engine.generate(
        prompts(), SamplingParams(n=3, temperature=temperature, max_new_tokens=max_new), seeds=seeds, stop_at=lengths
    )
    assert [[(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in cut] == [
        [(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in stopped
    ]


def test_stop_at_limits_of_one_and_of_max_new_tokens():
    model, max_new = tiny_lm(), 7
    engine = FastRolloutEngine(model, max_groups=2, sync_every=2)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=max_new)
    free = engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5])
    limits = [[1, max_new, 3], [1, 1, 1], [max_new] * 3, [2, 1, max_new], [4, 5, 6]]
    cut = engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5], stop_at=limits)
    for row, whole, part in zip(limits, free, cut):  # groups change slots here: log-probs may differ in the last bits
        for limit, a, b in zip(row, whole, part):
            assert b.token_ids == a.token_ids[:limit]
            assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs[:limit]), atol=1e-5)
            assert b.finish_reason == ("length" if limit == max_new else "stop")
    steps = [[limit - 1 for limit in row] for row in limits]  # the first token comes with the prefill
    run = engine.last_run
    assert run["live_row_steps"] == sum(map(sum, steps)) and run["busy_slot_steps"] == sum(map(max, steps))
    assert run["busy_slot_steps"] <= run["decode_steps"] * run["slots"]
    assert engine.generate(prompts(), params, seeds=[1, 2, 3, 4, 5], stop_at=[[max_new] * 3] * 5) == free


@pytest.mark.parametrize(
    "stop_at, message",
    [
        ([[2, 2]] * 4, "4 entries for 5 prompts"),
        ([[2, 2]] * 4 + [[2, 2, 2]], r"stop_at\[4\] must be a sequence of n=2"),
        ([[2, 2]] * 4 + [5], r"stop_at\[4\] must be a sequence"),
        ([[2, 0]] + [[2, 2]] * 4, r"stop_at\[0\]\[1\] must be an integer in \[1, max_new_tokens=6\], got 0"),
        ([[2, 7]] + [[2, 2]] * 4, r"stop_at\[0\]\[1\] .* got 7"),
        ([[2, 2.5]] + [[2, 2]] * 4, r"got 2.5"),
        ([[True, 2]] + [[2, 2]] * 4, r"got True"),
    ],
)
def test_bad_stop_at_is_refused(stop_at, message):
    engine = FastRolloutEngine(tiny_lm())
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts(), SamplingParams(n=2, max_new_tokens=6), seeds=[1, 2, 3, 4, 5], stop_at=stop_at)


@pytest.mark.parametrize("kv_share", [0.4, 0.85])
def test_the_kv_budget_is_the_engine_s_share_of_the_free_gpu_memory(monkeypatch, kv_share):
    """On a GPU the KV stores take ``kv_share`` of the memory free when sampling starts: 40% by default, which
    leaves the rest to an update on the same GPU, more on a sampler rank that holds nothing else."""
    engine = FastRolloutEngine(tiny_lm("llama"), kv_share=kv_share)
    monkeypatch.setattr(engine, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))
    assert engine._budget() == int(kv_share * (10 << 30))
    assert FastRolloutEngine(tiny_lm("llama"), kv_cache_bytes=123, kv_share=kv_share)._budget() == 123


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_long_prompt_s_later_pieces_attend_a_block_of_queries_at_a_time(family, rows, monkeypatch):
    """A prompt longer than a prefill forward comes in pieces; each piece after the first attends a block of its
    query rows at a time, so that no attention call forms more than ``PREFILL_SCORES_BYTES`` of scores (at 131,072
    tokens an unblocked piece formed 64 GiB on the CPU). Bounded to ``rows`` rows of the longest prompt's scores:
    the greedy tokens of transformers' generate, and no call past the bound."""
    import longqa.rollout.fast as fast

    model = tiny_lm(family)
    longest, heads = max(len(p) for p in prompts()), model.config.num_attention_heads
    bound = 4 * heads * longest * rows
    monkeypatch.setattr(fast, "PREFILL_SCORES_BYTES", bound)
    formed, attend = [], fast.masked_attention

    def measured(q, k, v, mask, scaling, softcap=None):
        formed.append(4 * q.shape[1] * q.shape[2] * k.shape[2])
        return attend(q, k, v, mask, scaling, softcap)

    monkeypatch.setattr(fast, "masked_attention", measured)
    engine = FastRolloutEngine(model, prefill_chunk=7, sync_every=3)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, stop_token_ids=(STOP,))
    for prompt, group in zip(prompts(), engine.generate(prompts(), params)):
        assert all(sample.token_ids == hf_greedy(model, prompt, 6) for sample in group)
    pieces_after_the_first = sum(-(-len(p) // 7) - 1 for p in prompts())
    assert max(formed) <= bound and len(formed) > pieces_after_the_first  # blocks, each within the bound
