"""Scores grouped by what the rows say of themselves: context length and hop count, beside data sources."""

from __future__ import annotations

import pytest

from longqa.evaluation.evaluate import format_groups, format_table, score, score_answers, summarize_by, summarize_groups


def score_by(meta, responses, key):
    return summarize_by(meta, score_answers(meta, responses), key)


def score_groups(meta, responses):
    return summarize_groups(meta, score_answers(meta, responses))


def answered(text: str) -> str:
    return f"<think> reasoning </think> \\boxed{{{text}}}"


def results(*rows: tuple[dict, bool]) -> tuple[list[dict], list[str]]:
    """Meta and responses for (extra_info, right or wrong) pairs, all asking for "Tarvos"."""
    meta = [{"data_source": "synth_musique", "ground_truth": ["Tarvos"], "extra_info": info} for info, _ in rows]
    return meta, [answered("Tarvos" if right else "Quillex") for _, right in rows]


META, RESPONSES = results(
    ({"target_tokens": 4096, "hops": 2, "num_candidates": 4}, False),
    ({"target_tokens": 1024, "hops": 2, "num_candidates": 2}, True),
    ({"target_tokens": 1024, "hops": 3, "num_candidates": 2}, True),
    ({"target_tokens": 4096, "hops": 3, "num_candidates": 4}, True),
    ({"target_tokens": 1024, "hops": 4, "num_candidates": 2}, False),
    ({"hops": 4}, True),  # no length: counted by hops only
    ({}, True),  # neither
    ({"target_tokens": "long", "hops": True}, True),  # not counts: left out
)


def test_rows_are_grouped_by_each_key_they_carry():
    by_length = score_by(META, RESPONSES, "target_tokens")
    assert [(g["target_tokens"], g["n"], g["accuracy"]) for g in by_length] == [
        (1024, 3, pytest.approx(2 / 3)),
        (4096, 2, 0.5),
    ]
    assert by_length[0]["guess_baseline"] == 0.5 and by_length[1]["guess_baseline"] == 0.25
    by_hops = score_by(META, RESPONSES, "hops")
    assert [(g["hops"], g["n"], g["accuracy"]) for g in by_hops] == [(2, 2, 0.5), (3, 2, 1.0), (4, 2, 0.5)]
    assert by_hops[0]["em"] == 0.5 and by_hops[1]["f1"] == 1.0


def test_groupings_sit_beside_the_per_source_scores():
    result = {**score(META, RESPONSES), **score_groups(META, RESPONSES)}
    assert list(result) == ["all", "synth_musique", "by_length", "by_hops"]
    assert result["all"]["n"] == 8
    table = format_table(result)
    assert "by_" not in table and len(table.splitlines()) == 4  # header, two sources, guessing baseline
    assert format_groups(result).split("\n\n")[1:] == [
        "target_tokens                         n     acc      em      f1\n"
        "1024                                  3   0.667   0.667   0.667\n"
        "4096                                  2   0.500   0.500   0.500",
        "hops                                  n     acc      em      f1\n"
        "2                                     2   0.500   0.500   0.500\n"
        "3                                     2   1.000   1.000   1.000\n"
        "4                                     2   0.500   0.500   0.500",
    ]


def test_rows_without_groups_add_nothing():
    meta, responses = results(({}, True), ({"index": 3}, False))
    assert score_groups(meta, responses) == {}
    assert format_groups(score(meta, responses)) == ""
    meta, responses = results(({"hops": 2}, True))
    assert list(score_groups(meta, responses)) == ["by_hops"]


def test_a_reward_function_decides_accuracy_and_its_failures_are_counted(tokenizer):
    """Validation scores with the run's reward function (reward.path's when set), called once per answer, and
    counts the answers it failed on."""
    import numpy as np

    from longqa.data.prompts import PromptSet
    from longqa.evaluation.evaluate import evaluate
    from longqa.reward import RewardResult
    from longqa.rollout.base import RolloutEngine, Sample

    class Echo(RolloutEngine):
        seeded = True

        def generate(self, prompts, params, generator=None, **options):
            return [[Sample(list(p), "stop", None)] for p in prompts]

    ids = [tokenizer.encode(answered(name), add_special_tokens=False) for name in ("Tarvos", "Quillex", "Ada")]
    prompts = PromptSet(
        np.concatenate(ids).astype(np.int32),
        np.cumsum([0] + [len(x) for x in ids]),
        [{"data_source": "s", "ground_truth": "Tarvos", "extra_info": {"index": i}} for i in range(3)],
    )
    calls = []

    def custom(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(extra_info["index"])
        if "Ada" in solution_str:
            return RewardResult(0.0, "error:ValueError")
        return RewardResult(0.25)  # the hardened reward would give the first answer 1.0

    result = evaluate(None, tokenizer, prompts, 8, engine=Echo(), reward_fn=custom)
    assert sorted(calls) == [0, 1, 2]
    assert result["all"]["accuracy"] == pytest.approx(0.5 / 3) and result["all"]["em"] == pytest.approx(1 / 3)
    assert result["reward_errors"] == 1
    assert evaluate(None, tokenizer, prompts, 8, engine=Echo())["all"]["accuracy"] == pytest.approx(1 / 3)


def test_generate_batches_stay_within_their_attention_mask_budget(tokenizer):
    """transformers' generate builds a rows x length x length mask for a padded batch (256 MiB a row at 8K tokens):
    long prompts go in smaller batches, one at a time at worst, with the answers each prompt gets alone."""
    import torch
    from tiny_models import tiny_lm

    from longqa.evaluation.evaluate import greedy_responses

    model = tiny_lm()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (40, 12, 90, 33, 64, 20, 75)]
    budget = 4 * 64 * 64 * 2  # two rows of 64 tokens
    shapes = []
    generate = model.generate

    def spy(**kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return generate(**kwargs)

    model.generate = spy
    batched = greedy_responses(model, tokenizer, prompts, 6, batch_size=3, mask_bytes=budget)
    assert sum(rows for rows, _ in shapes) == len(prompts)
    assert all(rows <= 3 and (rows == 1 or 4 * rows * width * width <= budget) for rows, width in shapes)
    assert shapes == [(3, 33), (2, 64), (1, 75), (1, 90)]  # short prompts three at a time, the longest alone
    assert batched == [greedy_responses(model, tokenizer, [p], 6)[0] for p in prompts]


def test_generate_tells_a_response_that_stopped_from_one_the_limit_cut(tokenizer, monkeypatch):
    """In one padded batch, a response that wrote a stop token ends with ``stop`` and one that ran into
    max_new_tokens with ``length``, as the engines' samples say it."""
    import torch
    from tiny_models import tiny_lm

    import longqa.evaluation.evaluate as evaluation

    model = tiny_lm()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (12, 20, 16, 9, 30)]
    alone = [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    stop = alone[0][2]  # the first response's third token: it stops there; others that never write it run on
    expected = ["stop" if stop in tokens else "length" for tokens in alone]
    assert {"stop", "length"} <= set(expected)
    monkeypatch.setattr(evaluation, "stop_token_ids", lambda tokenizer: [stop])
    responses = evaluation.greedy_responses(model, tokenizer, prompts, 6, batch_size=8)
    assert [r.finish_reason for r in responses] == expected
