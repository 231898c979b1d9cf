"""Speculative decoding in the fast engine: prompt-lookup drafts, their verification, and samples and log-probs
equal to plain decoding's for the same seeds."""

import math

import pytest
import torch
from tiny_models import VOCAB, tiny_lm

from longqa.rollout import fast
from longqa.rollout.base import SamplingParams
from longqa.rollout.fast import FastRolloutEngine
from longqa.rollout.prompt_lookup import NO_TOKEN, propose, row_text
from longqa.rollout.speculative import Speculation, verify

STOP = 5
SEEDS = [1, 2, 3, 4, 5]


def prompts(lengths=(3, 17, 1, 40, 9)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lengths]


def naive_draft(text: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    """The continuation of the longest (then earliest) earlier occurrence of the text's last tokens."""
    best, best_match = None, 0
    for c in range(len(text)):
        j = 0
        while j < max_match and c - j - 1 >= 0 and text[c - j - 1] == text[len(text) - j - 1]:
            j += 1
        if j >= min_match and j > best_match:
            best, best_match = c, j
    return [] if best is None else text[best : best + k]


def padded(texts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.full((len(texts), width), NO_TOKEN)
    for i, t in enumerate(texts):
        rows[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return rows, torch.tensor([len(t) for t in texts])


def test_a_draft_by_hand():
    text, length = padded([[7, 8, 9, 1, 7, 8], [7, 8, 9, 1, 7, 8], [3, 3, 3, 3], [4]], 8)
    drafts, count = propose(text, length, 3, 2, 8)
    # "7 8" ends the text and occurs at its start, followed by 9 1 7; "3 3 3" occurs first at the start
    assert count.tolist() == [3, 3, 1, 0]
    assert drafts[0].tolist() == [9, 1, 7] and drafts[2, :1].tolist() == [3]
    assert propose(text, length, 3, 3, 8)[1].tolist() == [0, 0, 1, 0]  # "9 7 8" never occurs before


@pytest.mark.parametrize("k, min_match, max_match", [(1, 1, 1), (3, 2, 4), (5, 1, 8), (4, 3, 3)])
def test_drafts_equal_a_plain_search(k, min_match, max_match):
    """Random texts over a 3-token alphabet (matches of every length, ties, drafts cut at the end)."""
    g = torch.Generator().manual_seed(k * 10 + min_match)
    texts = [torch.randint(0, 3, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (40,), generator=g)]
    drafts, count = propose(*padded(texts, 33), k, min_match, max_match)
    found = 0
    for t, row, c in zip(texts, drafts.tolist(), count.tolist()):
        assert row[:c] == naive_draft(t, k, min_match, max_match) and all(x == 0 for x in row[c:])
        found += c > 0
    assert 0 < found < len(texts)


def test_row_text_is_the_prompt_then_the_own_tokens():
    prompt_ids = torch.tensor([[10, 11, 12, 0], [20, 21, 0, 0]])  # the group's prompt, then unused places
    own_ids = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]])
    text, length = row_text(prompt_ids, torch.tensor([3, 2]), own_ids, torch.tensor([2, 1, 3, 0]), n=2)
    expected = [[10, 11, 12, 1, 2], [10, 11, 12, 3], [20, 21, 4, 5, 6], [20, 21]]
    assert length.tolist() == [len(t) for t in expected]
    assert text.tolist() == padded(expected, 7)[0].tolist()


def test_verify_keeps_the_picks_up_to_the_first_wrong_draft():
    sampled = torch.tensor([[4, 6, 7, 9], [4, 6, 7, 9], [4, 5, 7, 9], [4, 6, 8, 5], [9, 6, 8, 9], [4, 6, 8, 9]])
    drafts = torch.tensor([[4, 6, 8], [4, 6, 8], [4, 5, 7], [4, 6, 8], [4, 6, 8], [4, 6, 8]])
    draft_len = torch.tensor([3, 1, 3, 3, 3, 3])
    room = torch.tensor([9, 9, 9, 9, 9, 2])
    keep, stopped = verify(sampled, drafts, draft_len, torch.tensor([5]), room)
    # two drafts right (the third pick is plain decoding's next token); one real draft; a stop token
    # picked (and drafted) at index 1; all three right and the fourth pick stops; the first draft
    # wrong; all right but room for two
    assert keep.tolist() == [3, 2, 2, 4, 1, 2]
    assert stopped.tolist() == [False, False, True, True, False, False]


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="tokens must be an integer >= 1, got 0"):
        Speculation(0)
    with pytest.raises(ValueError, match=r"min_match \(4\) must not exceed max_match \(3\)"):
        Speculation(2, 4, 3)
    with pytest.raises(ValueError, match="speculative must be None or one of"):
        FastRolloutEngine(tiny_lm(), speculative="ngram")


def assert_same_samples(plain, spec, atol=1e-5):
    """Token for token and finish reason for finish reason; log-probs up to the float rounding of a step
    that computes several tokens per row."""
    assert [[(s.token_ids, s.finish_reason) for s in g] for g in spec] == [
        [(s.token_ids, s.finish_reason) for s in g] for g in plain
    ]
    for group_a, group_b in zip(plain, spec):
        for a, b in zip(group_a, group_b):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=atol, rtol=0)


def speculating(model, k, **options):
    return FastRolloutEngine(
        model,
        max_groups=2,
        sync_every=3,
        speculative="prompt_lookup",
        num_speculative_tokens=k,
        prompt_lookup_min=1,
        **options,
    )


STOP_AT = [[14, 3, 9], [14, 14, 1], [5, 14, 14], [2, 8, 14], [14, 14, 14]]


@pytest.mark.parametrize(
    "k, temperature, top_k, top_p", [(1, 0.0, -1, 1.0), (4, 0.0, -1, 1.0), (2, 1.0, -1, 1.0), (6, 0.8, 20, 0.9)]
)
def test_speculation_leaves_every_sample_unchanged(k, temperature, top_k, top_p):
    """Tiny random Qwen3, five prompts through two slots (refilled as groups finish), stop tokens,
    stop_at lengths and max_new_tokens: the same samples as without speculation."""
    model = tiny_lm()
    params = SamplingParams(
        n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=14, stop_token_ids=(STOP,)
    )
    reference = FastRolloutEngine(model, max_groups=2, sync_every=3)
    plain = reference.generate(prompts(), params, seeds=SEEDS, stop_at=STOP_AT)
    engine = speculating(model, k)
    assert_same_samples(plain, engine.generate(prompts(), params, seeds=SEEDS, stop_at=STOP_AT))
    run = engine.last_run
    assert run["draft_row_steps"] > 0 and 0 < run["draft_fraction"] <= 1
    # every live row-step makes one token plus the drafts it keeps
    assert run["live_row_steps"] + run["accepted_draft_tokens"] == sum(len(s.token_ids) - 1 for g in plain for s in g)
    if temperature == 0:  # a random model's greedy text repeats itself: drafts from its own output are right
        assert run["accepted_draft_tokens"] > 0 and run["decode_steps"] < reference.last_run["decode_steps"]


def test_stop_strings_cut_the_same_tokens(tokenizer):
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(len(tokenizer), 32, 2, 4, 2)).eval()
    ids = [tokenizer.encode(t) for t in ("Passage 1: Veldora", "Question: In which city")]
    reasons, accepted = [], 0
    for stops in (("a",), ("e",), ("Quillex",)):
        params = SamplingParams(n=2, temperature=0, max_new_tokens=15, stop_strings=stops)
        plain = FastRolloutEngine(model, tokenizer, sync_every=4).generate(ids, params)
        engine = FastRolloutEngine(
            model, tokenizer, sync_every=4, speculative="prompt_lookup", num_speculative_tokens=3, prompt_lookup_min=1
        )
        assert_same_samples(plain, engine.generate(ids, params))
        reasons += [s.finish_reason for g in plain for s in g]
        accepted += engine.last_run["accepted_draft_tokens"]
    assert "stop" in reasons and "length" in reasons and accepted > 0


def oracle(samples: list[list[int]], wrong_at: int | None):
    """A drafter that knows every sample (prompt + response): for a row whose text begins one, the next k
    tokens of it, the one at ``wrong_at`` (if any) replaced by another; none for a row holding no sample
    (a slot never filled). Samples are told apart by their prompts (one sample per prompt)."""

    def draft(text: list[int], k: int) -> list[int]:
        for full in samples:
            if full[: len(text)] == text:
                guess = full[len(text) : len(text) + k]
                if wrong_at is not None and wrong_at < len(guess):
                    guess[wrong_at] = (guess[wrong_at] + 1) % VOCAB
                return guess
        return []

    def propose_known(text, length, k, min_match, max_match):
        drafts = torch.zeros(text.shape[0], k, dtype=torch.long)
        count = torch.zeros(text.shape[0], dtype=torch.long)
        for row in range(text.shape[0]):
            guess = draft(text[row, : length[row]].tolist(), k)
            drafts[row, : len(guess)], count[row] = torch.tensor(guess, dtype=torch.long), len(guess)
        return drafts, count

    return draft, propose_known


@pytest.mark.parametrize("k, wrong_at", [(3, None), (3, 1), (4, 0), (1, None)])
def test_known_drafts_are_accepted_and_wrong_ones_rolled_back(monkeypatch, k, wrong_at):
    """Drafts from a drafter that knows the answer: all right (every step keeps k + 1 tokens, the multi-
    token path throughout), right up to a wrong one (its keys and values, and those after it, written
    then discarded), or wrong at once. The samples stay plain decoding's, and the steps each row took
    equal a host-side replay of the verification rule."""
    model = tiny_lm()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, stop_token_ids=(STOP,))
    stop_at = [[16], [11], [16], [4], [16]]
    plain = FastRolloutEngine(model, max_groups=2, sync_every=3).generate(
        prompts(), params, seeds=SEEDS, stop_at=stop_at
    )
    samples = [p + g[0].token_ids for p, g in zip(prompts(), plain)]
    draft, propose_known = oracle(samples, wrong_at)
    monkeypatch.setattr(fast, "propose", propose_known)
    engine = speculating(model, k)
    assert_same_samples(plain, engine.generate(prompts(), params, seeds=SEEDS, stop_at=stop_at))
    steps = kept = 0
    for prompt, full in zip(prompts(), samples):
        length = len(prompt) + 1  # the first token came with the prefill
        while length < len(full):
            guess = draft(full[:length], k)
            right = next((i for i, (a, b) in enumerate(zip(guess, full[length:])) if a != b), len(guess))
            take = min(right + 1, len(full) - length)
            steps, kept, length = steps + 1, kept + take - 1, length + take
    run = engine.last_run
    assert (run["live_row_steps"], run["accepted_draft_tokens"]) == (steps, kept)
    if wrong_at is None:  # k + 1 tokens a step, the last step what is left
        assert steps == sum(math.ceil((len(g[0].token_ids) - 1) / (k + 1)) for g in plain)
    assert kept == 0 if wrong_at == 0 else kept > 0


@pytest.mark.parametrize("family, options", [("llama", {"fused_decode": False}), ("mistral", {}), ("gemma2", {})])
def test_the_model_s_own_modules_windows_and_soft_caps(family, options):
    """Through the model's modules (no fused step), a sliding window of 5 (Mistral) and soft-capping
    (Gemma2): the same samples."""
    from model_zoo import tiny_model

    model = tiny_lm(family) if family == "llama" else tiny_model(family)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, stop_token_ids=(STOP,))
    plain = FastRolloutEngine(model, max_groups=2, sync_every=3, **options).generate(prompts(), params)
    engine = speculating(model, 3, **options)
    assert_same_samples(plain, engine.generate(prompts(), params))
    assert engine.last_run["accepted_draft_tokens"] > 0


@pytest.fixture(scope="module")
def demo_prompts(tmp_path_factory):
    """The embedded model and prompts of its demo's data (``longqa.data.demo``: 2-3 hops, ~500-token contexts,
    the demo's seed), as `longqa train` prepares them."""
    from longqa.data.demo import DEMO_DATA
    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.data.synth import generate
    from longqa.model.load import load_model

    root = tmp_path_factory.mktemp("demo-data")
    generate(root, **{**DEMO_DATA, "rows_per_task": 2})
    model, tokenizer = load_model(None)
    prompt_set = prepare_prompts(
        [root / "merged" / "test.parquet", root / "merged" / "train.parquet"], tokenizer, PromptOptions(1024)
    )
    return model, tokenizer, [prompt_set.ids(i).tolist() for i in range(6)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_embedded_model_on_its_demo_prompts(demo_prompts, temperature):
    """The embedded model's rollouts of the demo (n=4, 128 new tokens as in configs/demo.yaml): the same
    samples and log-probs, and drafts it accepts (it copies from its passages)."""
    from longqa.evaluation.evaluate import stop_token_ids

    model, tokenizer, ids = demo_prompts
    params = SamplingParams(
        n=4, temperature=temperature, max_new_tokens=128, stop_token_ids=tuple(stop_token_ids(tokenizer))
    )
    plain = FastRolloutEngine(model, tokenizer, max_groups=4).generate(ids, params, seeds=range(len(ids)))
    engine = FastRolloutEngine(model, tokenizer, max_groups=4, speculative="prompt_lookup", num_speculative_tokens=4)
    assert_same_samples(plain, engine.generate(ids, params, seeds=range(len(ids))), atol=1e-4)
    assert engine.last_run["accepted_draft_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["triton", "bmm"])
def test_cuda_graphs_per_k_sample_the_same(kernel):
    """On a GPU: the compiled fused step and decode attention replayed as CUDA graphs, one per (view
    bucket, k), equal to the same engine without speculation (float32)."""
    model = tiny_lm(head_dim=16).cuda()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=14, stop_token_ids=(STOP,))
    plain = FastRolloutEngine(model, max_groups=2, sync_every=3, decode_kernel=kernel).generate(
        prompts(), params, seeds=SEEDS, stop_at=STOP_AT
    )
    for k in (2, 5):
        engine = speculating(model, k, decode_kernel=kernel)
        assert engine.cuda_graphs
        assert_same_samples(plain, engine.generate(prompts(), params, seeds=SEEDS, stop_at=STOP_AT), atol=1e-4)
        assert engine.graph_captures >= 1
        greedy = SamplingParams(n=3, temperature=0, max_new_tokens=14, stop_token_ids=(STOP,))
        assert_same_samples(
            FastRolloutEngine(model, max_groups=2, decode_kernel=kernel).generate(prompts(), greedy),
            engine.generate(prompts(), greedy),
            atol=1e-4,
        )
        assert engine.last_run["accepted_draft_tokens"] > 0


# The shapes rollout batches take. A decode step reads the KV stores through views of the longest prompt
# and response still running, rounded up to steps (256 and 64 tokens in the engine; 4 here, so that small
# prompts and responses cross them): a group that finished, or a longer prompt's, leaves its slot holding
# more text than a later step's views show.
LENGTH_MIXES = {"equal": (6, 6, 6), "different": (3, 10, 1), "one much longer": (4, 30, 7)}
BATCHES = {
    "one group": ((30,), None),  # (prompt lengths, max_groups)
    **{f"{mix}, all at once": (lengths, None) for mix, lengths in LENGTH_MIXES.items()},
    **{f"{mix}, through two slots": (lengths, 2) for mix, lengths in LENGTH_MIXES.items()},
}
RESPONSE_LIMITS = (1, 2, 8)  # no decode step, one, across view steps
# k acts on shapes through the k + 1 tokens a step feeds per row, against the view step and the limits:
# one draft; fewer than a view step; more than a view step and than any response.
K_VALUES = (1, 3, 9)
STOPS = (STOP, 6, 7, 8)  # sampled responses end at one now and then


def response_limits(max_new: int, prompts: int) -> list[list[int]]:
    """``stop_at`` for three samples per prompt: the first prompt's run into ``max_new_tokens``, the
    second's end early (its group leaves while the others go on), the third's at and next to the limit."""
    table = [[max_new, max_new // 2, 3], [max_new - 2, max_new // 3, 1], [max_new, max_new - 1, max_new]]
    return [[min(max(1, length), max_new) for length in row] for row in table[:prompts]]


@pytest.fixture(scope="module")
def model():
    """One tiny model for the many calls below (engines only read its weights)."""
    return tiny_lm()


@pytest.fixture
def small_views(monkeypatch):
    """Views that grow by 4 tokens, prompt and response."""
    monkeypatch.setattr(fast, "PROMPT_VIEW_STEP", 4)
    monkeypatch.setattr(fast, "RESPONSE_VIEW_STEP", 4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_new", RESPONSE_LIMITS)
@pytest.mark.parametrize("batch", BATCHES)
def test_every_batch_shape_samples_as_plain_decoding(small_views, model, batch, max_new, temperature):
    """Every prompt-length mix, one group or several (all in slots at once, or streaming through fewer),
    responses of one token, two and several view steps (samples that stop early, at ``stop_at`` lengths and
    at ``max_new_tokens``), and k from one to more than any response: the same token ids, log-probs and
    finish reasons as without speculation. Greedy decoding accepts drafts (steps that keep several tokens,
    cut at the limits); sampling rejects most."""
    lengths, max_groups = BATCHES[batch]
    ids, seeds, stop_at = prompts(lengths), SEEDS[: len(lengths)], response_limits(max_new, len(lengths))
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=max_new, stop_token_ids=STOPS)
    plain = FastRolloutEngine(model, max_groups=max_groups, sync_every=3).generate(
        ids, params, seeds=seeds, stop_at=stop_at
    )
    for k in K_VALUES:
        engine = FastRolloutEngine(
            model,
            max_groups=max_groups,
            sync_every=3,
            speculative="prompt_lookup",
            num_speculative_tokens=k,
            prompt_lookup_min=1,
        )
        assert_same_samples(plain, engine.generate(ids, params, seeds=seeds, stop_at=stop_at))


@pytest.mark.parametrize("k", K_VALUES)
def test_a_reused_engine_samples_as_plain_decoding(small_views, model, k):
    """Calls on one engine, each with fewer, shorter prompts than the one before: the slots a call leaves
    empty still hold the earlier call's groups."""
    engine = FastRolloutEngine(
        model, sync_every=3, speculative="prompt_lookup", num_speculative_tokens=k, prompt_lookup_min=1
    )
    for lengths, max_new in [((4, 7, 30), 8), ((6, 6), 8), ((3,), 2)]:
        ids, seeds = prompts(lengths), SEEDS[: len(lengths)]
        params = SamplingParams(n=3, temperature=0, max_new_tokens=max_new, stop_token_ids=STOPS)
        plain = FastRolloutEngine(model, sync_every=3).generate(ids, params, seeds=seeds)
        assert_same_samples(plain, engine.generate(ids, params, seeds=seeds))
