"""Every causal-LM family of the installed transformers: exact, or refused with a clear error, never silently wrong.

For each family (``model_zoo.families()``, enumerated from transformers itself) a tiny random model with a
sliding window and soft-caps small enough to matter is checked three ways against references that do not
use longqa's attention: the packed shared-prompt log-probs and their gradients against one plain forward
per sample; the fast engine's greedy tokens against greedy decoding by full forwards; and the model's own
forward after longqa has routed its attention, against the same forward before.
"""

import pytest
import torch
from model_zoo import VOCAB, ZooError, families, tiny_model

from longqa.model.attention import use_longqa_attention
from longqa.model.attention_spec import UnsupportedModelError
from longqa.model.logprobs import packed_logprobs
from longqa.model.packing import build_packed_batch, plan_packs
from longqa.rollout.base import SamplingParams
from longqa.rollout.fast import FastRolloutEngine

PROMPTS = [[7, 31, 12, 55, 3, 90, 18, 44, 61, 27, 9], [66, 14, 80, 23, 5, 47, 38]]
RESPONSES = [[11, 73, 29, 4, 58, 36, 95], [42, 8, 77], [19, 64, 33, 50, 21, 86]]  # two for prompt 0, one for 1
NEW_TOKENS = 7


def build(family: str):
    try:
        return tiny_model(family)
    except ZooError as err:
        pytest.skip(f"no tiny {family} model from its default configuration: {err}")


def own_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPTS[0]])).logits


def plain_logprobs(model, prompt, response) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def refused(model, family: str, err: UnsupportedModelError, before: torch.Tensor) -> str:
    assert family in str(err) or type(model).__name__ in str(err), f"the refusal does not name the model: {err}"
    assert torch.allclose(own_logits(model), before, atol=1e-5), "a refused model was not left as it was"
    return f"refused: {err}"


def packed_outcome(family: str) -> str:
    """'exact', or 'refused: why'; an AssertionError where the packed update is silently wrong."""
    model = build(family)
    before = own_logits(model)
    pairs = [(PROMPTS[0], RESPONSES[0]), (PROMPTS[0], RESPONSES[1]), (PROMPTS[1], RESPONSES[2])]
    reference = [plain_logprobs(model, p, r) for p, r in pairs]
    sum(r.sum() for r in reference).backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    try:
        use_longqa_attention(model)
    except UnsupportedModelError as err:
        return refused(model, family, err, before)
    prompt_ids = [p for p, _ in pairs]
    response_ids = [r for _, r in pairs]
    packs = plan_packs(prompt_ids, response_ids, [[0, 1], [2]], budget=10_000)
    assert len(packs) == 1
    logp, _, mask = packed_logprobs(model, build_packed_batch(packs[0], response_ids))
    for row, expected in enumerate(reference):
        assert torch.allclose(logp[row][mask[row]], expected.detach(), atol=1e-4), f"{family}: log-probs differ"
    logp[mask].sum().backward()
    overall = max(g.abs().max() for g in expected_grads.values())
    for name, p in model.named_parameters():
        if name in expected_grads:  # a tensor whose true gradient is 0 (a key bias) is held to the overall scale
            scale = torch.maximum(expected_grads[name].abs().max(), 1e-3 * overall)
            assert torch.allclose(p.grad, expected_grads[name], atol=1e-4 * scale, rtol=1e-3), (
                f"{family}: gradient of {name} differs"
            )
    assert torch.allclose(own_logits(model), before, atol=1e-5), f"{family}: its own forward changed"
    return "exact"


def greedy_by_full_forwards(model, prompt) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def engine_outcome(family: str) -> str:
    """'exact', or 'refused: why'; an AssertionError where the fast engine samples other tokens."""
    model = build(family)
    before = own_logits(model)
    expected = [greedy_by_full_forwards(model, p) for p in PROMPTS]
    try:
        engine = FastRolloutEngine(model, max_groups=1, prefill_chunk=4, sync_every=3)
    except UnsupportedModelError as err:
        return refused(model, family, err, before)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=(VOCAB + 1,))
    for group, tokens in zip(engine.generate(PROMPTS, params), expected):
        for sample in group:
            assert sample.token_ids == tokens, f"{family}: engine {sample.token_ids} vs greedy {tokens}"
    assert torch.allclose(own_logits(model), before, atol=1e-5), f"{family}: its own forward changed"
    assert greedy_by_full_forwards(model, PROMPTS[1]) == expected[1]
    return "exact"


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_packed_update_is_exact_or_refused(family):
    packed_outcome(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_fast_engine_is_exact_or_refused(family, monkeypatch):
    """With a prompt's later prefill pieces attending one query row at a time (``PREFILL_SCORES_BYTES`` at its
    least), each row's keys cut to its sliding window where the layer has one."""
    import longqa.rollout.fast

    monkeypatch.setattr(longqa.rollout.fast, "PREFILL_SCORES_BYTES", 1)
    engine_outcome(family)
