"""LongBench v1 scoring: hand-computed F1 values, the files in LongBench's formats, and `longqa eval --longbench`."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_qwen3

from longqa.cli import main
from longqa.data.io import DataFileError
from longqa.data.schema import QA_PREFIX, SYSTEM_PROMPT, question_suffix
from longqa.evaluation import longbench

PRED_KEYS = {"pred", "answers", "all_classes", "length"}


def write_jsonl(path, items) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")


def longbench_row(i: int, dataset: str, length: int = 1200) -> dict:
    """A row as LongBench ships it, with the fields this code does not read too."""
    context = "\n".join(f"Passage {k}:\nTitle {k}\nFact{(i + k) % 7} was born in Quillex in 195{k}." for k in (1, 2, 3))
    return {
        "input": f"Where was person {i} born?",
        "context": context,
        "answers": [f"Town {i}", "Quillex"],
        "length": length,
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"{dataset}-{i}",
    }


# --- the scoring rules, on hand-made cases --------------------------------------------------------


@pytest.mark.parametrize(
    "text, normal",
    [
        ("The Eiffel Tower!", "eiffel tower"),  # case, punctuation, a leading article
        ("an apple, the pear & a plum", "apple pear plum"),
        ("A.B.C.", "abc"),  # punctuation goes first, so "a.b.c." is one word
        ("Anne theater", "anne theater"),  # articles only as whole words
        ("  Paris\n\tFrance ", "paris france"),
        ("The", ""),
    ],
)
def test_answers_are_normalised_as_longbench_does(text, normal):
    assert longbench.normalize_answer(text) == normal


@pytest.mark.parametrize(
    "prediction, answer, f1",
    [
        ("Paris.", "paris", 1.0),
        ("The Eiffel Tower", "eiffel tower", 1.0),
        # 2 of 4 words right: precision 1/2, recall 1: F1 = 2 * 1/2 / (3/2) = 2/3
        ("the Eiffel Tower in Paris", "Eiffel Tower", 2 / 3),
        # 2 of 3 answer words: precision 1, recall 2/3: F1 = (4/3) / (5/3) = 0.8
        ("Barack Obama", "Barack Hussein Obama", 0.8),
        # a multiset: "paris" twice in the prediction matches once: precision 1/2, recall 1
        ("paris paris", "Paris", 2 / 3),
        # not cut at the first line (eval.py does that only for trec, triviaqa, samsum, lsht): "the" goes, so
        # precision 1/5, recall 1: F1 = (2/5) / (6/5) = 1/3
        ("Paris\nbecause the passage says so", "Paris", 1 / 3),
        ("", "Paris", 0.0),
        ("the", "Paris", 0.0),  # empty once normalised
        ("Paris", "", 0.0),
        ("London", "Paris", 0.0),
    ],
)
def test_qa_f1_by_hand(prediction, answer, f1):
    assert longbench.qa_f1_score(prediction, answer) == pytest.approx(f1)


def test_the_best_answer_counts():
    assert longbench.best_score("Barack Obama", ["Obama", "Barack Hussein Obama"]) == pytest.approx(0.8)
    assert longbench.best_score("Obama", ["Barack Hussein Obama", "Obama"]) == 1.0
    assert longbench.best_score("Obama", []) == 0.0


def test_length_buckets_have_longbench_e_bounds():
    assert [longbench.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 50000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


def test_scores_of_lines_overall_and_by_length():
    lines = [
        {"pred": "Paris", "answers": ["paris"], "length": 3999},  # 1
        {"pred": "paris paris", "answers": ["Paris"], "length": 4000},  # 2/3
        {"pred": "Barack Obama", "answers": ["Obama", "Barack Hussein Obama"], "length": 7999},  # 0.8
        {"pred": "", "answers": ["Paris"], "length": 8000},
    ]  # 0
    result = longbench.score_lines(lines)
    # (1 + 2/3 + 0.8 + 0) / 4 = 0.61666... -> 61.67; the buckets: 1 -> 100, (2/3 + 0.8) / 2 -> 73.33, 0
    assert result == {
        "n": 4,
        "score": 61.67,
        "by_length": {"0-4k": 100.0, "4-8k": 73.33, "8k+": 0.0},
        "by_length_n": {"0-4k": 1, "4-8k": 2, "8k+": 1},
    }
    short = longbench.score_lines(lines[:1])
    assert short["by_length"] == {"0-4k": 100.0, "4-8k": None, "8k+": None}  # NaN in LongBench
    without = longbench.score_lines([{k: v for k, v in line.items() if k != "length"} for line in lines])
    assert without == {"n": 4, "score": 61.67}
    with pytest.raises(DataFileError, match="prediction 2 has no 'length'"):
        longbench.score_lines([lines[0], {"pred": "x", "answers": ["x"]}])


def test_the_two_roundings_of_longbench_are_kept():
    """(5 + 0.75) / 40 = 14.375 exactly in decimals: eval.py's overall score (a Python float) rounds it
    to 14.38, its LongBench-E bucket (numpy's mean and round) to 14.37."""
    lines = (
        [{"pred": "w1", "answers": ["w1"], "length": 100}] * 5
        + [{"pred": "w1 w2 w3", "answers": ["w1 w2 w3 w4 w5"], "length": 100}]  # precision 1, recall 3/5: 0.75
        + [{"pred": "z", "answers": ["w1"], "length": 100}] * 34
    )
    result = longbench.score_lines(lines)
    assert (result["score"], result["by_length"]["0-4k"]) == (14.38, 14.37)


# --- prompts and predictions -------------------------------------------------------------------------


def test_a_longbench_row_becomes_a_row_in_the_recipes_shape(data_dir):
    from longqa.data.io import read_rows

    example = longbench_row(3, "hotpotqa")
    row = longbench.to_row("hotpotqa", example)
    system, user = row["prompt"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    assert user["content"] == f"{QA_PREFIX}{example['context']}\n\nQuestion: {example['input']}"
    assert row["reward_model"]["ground_truth"] == example["answers"]
    synth = read_rows(data_dir / "hotpotqa" / "test.parquet")[0]  # the shape a longqa model trains on
    text = synth["prompt"][1]["content"]
    assert text.startswith(QA_PREFIX) and text.endswith(question_suffix(synth["extra_info"]["question"]))


@pytest.mark.parametrize(
    "response, pred",
    [
        ("<think> it is Paris </think> \\boxed{Paris}", "Paris"),
        # the last box after the reasoning
        ("<think> \\boxed{Rome} </think> \\boxed{\\text{Paris}} and \\boxed{Lyon}", "Lyon"),
        ("\\boxed{}", ""),  # an empty box is an empty answer
        ("  Paris, France.\n", "Paris, France."),  # no box: the whole output
        ("<think> cut off \\boxed{Paris}", "<think> cut off \\boxed{Paris}"),
    ],
)
def test_the_prediction_is_the_last_box_else_the_whole_output(response, pred):
    assert longbench.prediction(response) == pred


def test_overlong_prompts_lose_their_middle():
    assert longbench.middle_truncated(list(range(10)), 4) == [0, 1, 8, 9]
    assert longbench.middle_truncated(list(range(10)), 5) == [0, 1, 8, 9]  # half of the limit at each end
    assert longbench.middle_truncated(list(range(4)), 4) == [0, 1, 2, 3]


# --- the files ---------------------------------------------------------------------------------------------


def test_reading_longbench_files_and_their_errors(tmp_path):
    write_jsonl(tmp_path / "musique.jsonl", [longbench_row(i, "musique") for i in range(3)])
    (tmp_path / "narrativeqa.jsonl").write_text("not read\n")
    examples = longbench.read_longbench(tmp_path, limit=2)
    assert list(examples) == ["musique"] and [e["_id"] for e in examples["musique"]] == ["musique-0", "musique-1"]

    with pytest.raises(DataFileError, match="no such folder"):
        longbench.read_longbench(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileError) as e:
        longbench.read_longbench(empty)
    assert str(empty) in str(e.value) and "hotpotqa.jsonl, 2wikimqa.jsonl, musique.jsonl" in str(e.value)

    bad = tmp_path / "bad"
    good = json.dumps(longbench_row(0, "hotpotqa"))
    for text, complaint in [
        (f"{good}\n\n{{oops\n", "hotpotqa.jsonl, line 3: not JSON"),
        (f"{good}\n[1, 2]\n", "line 2: expected a JSON object"),
        (json.dumps({**longbench_row(0, "hotpotqa"), "answers": "Paris"}), "line 1: 'answers'"),
        (json.dumps({**longbench_row(0, "hotpotqa"), "length": "long"}), "line 1: 'length'"),
        (json.dumps({"context": "c", "answers": [], "length": 1}), "line 1: 'input'"),
        ("\n", "hotpotqa.jsonl: no rows"),
    ]:
        bad.mkdir(exist_ok=True)
        (bad / "hotpotqa.jsonl").write_text(text)
        with pytest.raises(DataFileError, match=complaint):
            longbench.read_longbench(bad)


def test_scoring_a_folder_of_prediction_files(tmp_path, capsys):
    write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [
            {"pred": "The Eiffel Tower", "answers": ["Eiffel Tower"], "all_classes": None, "length": 2000},  # 1
            {
                "pred": "the Eiffel Tower in Paris",
                "answers": ["Eiffel Tower"],
                "all_classes": None,
                "length": 9000,
            },  # 2/3
        ],
    )
    write_jsonl(tmp_path / "musique.jsonl", [{"pred": "", "answers": ["Paris"], "all_classes": None, "length": 5000}])
    write_jsonl(tmp_path / "narrativeqa.jsonl", [{"pred": "x", "answers": ["x"], "all_classes": None, "length": 1}])
    assert main(["eval", "--longbench-scores", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    expected = {
        "hotpotqa": {
            "n": 2,
            "score": 83.33,
            "by_length": {"0-4k": 100.0, "4-8k": None, "8k+": 66.67},
            "by_length_n": {"0-4k": 1, "4-8k": 0, "8k+": 1},
        },
        "musique": {
            "n": 1,
            "score": 0.0,
            "by_length": {"0-4k": None, "4-8k": 0.0, "8k+": None},
            "by_length_n": {"0-4k": 0, "4-8k": 1, "8k+": 0},
        },
    }
    assert json.loads((tmp_path / "result.json").read_text()) == expected
    assert "hotpotqa" in out and "83.33" in out and "66.67" in out and "narrativeqa" not in out
    assert f"wrote {tmp_path / 'result.json'}" in out


@pytest.mark.parametrize(
    "files, complaint",
    [
        ({}, "holds no prediction file to score: expected hotpotqa.jsonl, 2wikimqa.jsonl, musique.jsonl"),
        (
            {"2wikimqa.jsonl": '{"pred": "x", "answers": ["x"]}\n{"pred": 3, "answers": ["x"]}\n'},
            "2wikimqa.jsonl, line 2: 'pred' must be a string",
        ),
        (
            {"2wikimqa.jsonl": '{"pred": "x", "answers": ["x"], "length": 9}\nnot json\n'},
            "2wikimqa.jsonl, line 2: not JSON",
        ),
        ({"2wikimqa.jsonl": ""}, "2wikimqa.jsonl: no predictions to score"),
    ],
)
def test_bad_prediction_folders_get_one_clear_line(tmp_path, capsys, files, complaint):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert main(["eval", "--longbench-scores", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longqa: error: ") and complaint in err and len(err.strip().splitlines()) == 1


# --- longqa eval --longbench, end to end -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-model"), tokenizer)


def test_eval_longbench_end_to_end(tiny_model_dir, tmp_path, capsys):
    data, pred = tmp_path / "data", tmp_path / "pred"
    rows = {
        "hotpotqa": [longbench_row(i, "hotpotqa", length) for i, length in enumerate((100, 5000, 12000))],
        "musique": [longbench_row(i, "musique", 4100) for i in range(2)],
    }
    for dataset, items in rows.items():
        write_jsonl(data / f"{dataset}.jsonl", items)
    (pred).mkdir()
    (pred / "2wikimqa.jsonl").write_text("left from another run: not scored\n")
    argv = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--longbench",
        str(data),
        "--output",
        str(pred),
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--max-prompt-length",
        "48",
        "--device",
        "cpu",
        "--samples",
        str(tmp_path / "samples.jsonl"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 rows answered" in out and "4 prompts over --max-prompt-length=48 lost their middle" in out

    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["_id"] for s in samples] == ["hotpotqa-0", "hotpotqa-1", "musique-0", "musique-1"]
    for dataset in rows:
        lines = [json.loads(line) for line in (pred / f"{dataset}.jsonl").read_text(encoding="utf-8").splitlines()]
        assert len(lines) == 2 and all(set(line) == PRED_KEYS for line in lines)
        for line, source in zip(lines, rows[dataset]):
            assert (line["answers"], line["length"], line["all_classes"]) == (source["answers"], source["length"], None)
            assert isinstance(line["pred"], str)
        preds = [s["pred"] for s in samples if s["_id"].startswith(dataset)]
        assert (
            [line["pred"] for line in lines]
            == preds
            == [longbench.prediction(s["response"]) for s in samples if s["_id"].startswith(dataset)]
        )
    result = json.loads((pred / "result.json").read_text())
    assert list(result) == ["hotpotqa", "musique"]
    assert result == longbench.score_folder(pred, ["hotpotqa", "musique"])
    hotpot = [json.loads(line) for line in (pred / "hotpotqa.jsonl").read_text().splitlines()]
    scores = [longbench.best_score(line["pred"], line["answers"]) for line in hotpot]
    assert result["hotpotqa"]["score"] == round(100 * (scores[0] + scores[1]) / 2, 2)
    assert result["hotpotqa"]["by_length_n"] == {"0-4k": 1, "4-8k": 1, "8k+": 0}
    assert result["musique"]["by_length_n"] == {"0-4k": 0, "4-8k": 2, "8k+": 0}

    # the same files scored on their own give the same numbers (without the stale file, which would be scored)
    (pred / "2wikimqa.jsonl").unlink()
    assert main(["eval", "--longbench-scores", str(pred)]) == 0
    assert json.loads((pred / "result.json").read_text()) == result


@pytest.mark.parametrize(
    "extra, complaint",
    [
        ([], "--longbench needs --output"),
        (["--output", "x", "--max-prompt-length", "1"], "--max-prompt-length must be at least 2, got 1"),
    ],
)
def test_eval_longbench_option_errors(tmp_path, capsys, extra, complaint):
    assert main(["eval", "--longbench", str(tmp_path), *extra]) == 2
    assert complaint in capsys.readouterr().err


def test_eval_longbench_checks_the_files_before_loading_a_model(tmp_path, capsys):
    assert (
        main(
            [
                "eval",
                "--model",
                str(tmp_path / "no-model"),
                "--longbench",
                str(tmp_path),
                "--output",
                str(tmp_path / "pred"),
            ]
        )
        == 2
    )
    assert "holds none of LongBench's multi-hop QA files" in capsys.readouterr().err


def test_eval_takes_exactly_one_kind_of_input(capsys):
    for argv in (["eval"], ["eval", "--data", "x.parquet", "--longbench-scores", "y"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert "one of the arguments --data --longbench --longbench-scores is required" in capsys.readouterr().err
