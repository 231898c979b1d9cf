"""`longqa sft`: a tokenizer and a small Qwen3 from scratch, response-only loss, model card."""

import json

import torch

from longqa.cli import main


def test_sft_builds_a_model_that_loads_and_a_card(tmp_path):
    from longqa.data.synth import generate
    from longqa.model.load import load_model

    generate(tmp_path / "data", rows_per_task=6, context_tokens=256, max_hops=2, test_ratio=0.34, seed=5)
    out = tmp_path / "model"
    assert (
        main(
            [
                "sft",
                "--train-files",
                str(tmp_path / "data/merged/train.parquet"),
                "--eval-files",
                str(tmp_path / "data/merged/test.parquet"),
                "--output-dir",
                str(out),
                "--vocab-size",
                "400",
                "--hidden-size",
                "32",
                "--num-layers",
                "2",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--max-steps",
                "4",
                "--eval-every",
                "2",
                "--eval-rows",
                "3",
                "--batch-tokens",
                "8192",
                "--warmup-steps",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == 4 and [e["step"] for e in summary["evals"]] == [2, 4, 4]
    assert summary["shape"]["num_hidden_layers"] == 2 and summary["final"]["all"]["n"] == 3
    card = (out / "README.md").read_text()
    assert "longqa sft --train-files" in card and "2 layers" in card and "guessing baseline" in card
    model, tokenizer = load_model(str(out))
    assert len(tokenizer) == model.config.vocab_size and model.config.eos_token_id == tokenizer.convert_tokens_to_ids(
        "<|im_end|>"
    )
    assert next(model.parameters()).dtype == torch.float32  # stored in bf16, loaded as asked


def test_sft_loss_is_on_response_tokens_only():
    import numpy as np

    from longqa.train.sft import _collate

    examples = [np.array([5, 6, 7, 8], dtype=np.int32), np.array([9, 10], dtype=np.int32)]
    ids, mask, labels = _collate(examples, np.array([3, 1]), [0, 1], pad=0, device="cpu")
    assert labels.tolist() == [[-100, -100, -100, 8], [-100, 10, -100, -100]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] and ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]


def test_a_seeded_share_of_targets_answers_without_thinking():
    from longqa.train.sft import _responses, without_thinking

    reference = "<think> A works for B. B is in C. So the answer is C. </think> \\boxed{C}"
    assert without_thinking(reference) == "<think> </think> \\boxed{C}"
    meta = [{"row": i, "file": "f", "extra_info": {"reference_response": reference}} for i in range(400)]
    mixed = _responses(meta, "reference_response", no_think_fraction=0.6, seed=1)
    direct = sum(r.startswith("<think> </think>") for r in mixed)
    assert 200 < direct < 280 and all(r.endswith("<|im_end|>") for r in mixed)
    assert mixed == _responses(meta, "reference_response", no_think_fraction=0.6, seed=1)
    assert _responses(meta, "reference_response")[0] == reference + "<|im_end|>"


def test_sft_from_a_model_raises_its_position_limit_or_refuses_examples_past_it(tmp_path, capsys):
    from longqa.data.synth import generate

    generate(tmp_path / "data", rows_per_task=2, context_tokens=256, max_hops=2, test_ratio=0.5, seed=5)
    common = [
        "--train-files",
        str(tmp_path / "data/merged/train.parquet"),
        "--max-steps",
        "1",
        "--batch-tokens",
        "8192",
        "--warmup-steps",
        "1",
        "--device",
        "cpu",
    ]
    first = tmp_path / "first"
    assert (
        main(
            [
                "sft",
                *common,
                "--output-dir",
                str(first),
                "--vocab-size",
                "400",
                "--hidden-size",
                "32",
                "--num-layers",
                "2",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--max-positions",
                "1000",
            ]
        )
        == 0
    )
    assert json.loads((first / "config.json").read_text())["max_position_embeddings"] == 1000
    assert (
        main(
            ["sft", *common, "--init", str(first), "--output-dir", str(tmp_path / "longer"), "--max-positions", "2000"]
        )
        == 0
    )
    assert json.loads((tmp_path / "longer/config.json").read_text())["max_position_embeddings"] == 2000
    card = (tmp_path / "longer/README.md").read_text()
    assert f"continued from `{first}`" in card and "2,000 positions" in card
    assert (
        main(["sft", *common, "--init", str(first), "--output-dir", str(tmp_path / "short"), "--max-positions", "64"])
        == 2
    )
    assert "raise --max-positions" in capsys.readouterr().err and not (tmp_path / "short/config.json").exists()
