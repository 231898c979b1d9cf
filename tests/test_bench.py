"""The GPU benchmarks' harness on the CPU with a tiny shape: what they run and what they record."""

import json

from longqa.cli import main


def test_bench_step_records_each_phase_of_each_step(tmp_path):
    for checkpointing in (False, True):
        out = tmp_path / f"step_{checkpointing}.json"
        args = ["bench", "step", "--shape", "qwen3-tiny", "--prompt", "24", "--response", "5", "-n", "3",
                "--prompts", "2", "--steps", "2", "--device", "cpu", "--json", str(out)]
        main(args + (["--gradient-checkpointing"] if checkpointing else []))
        rows = json.loads(out.read_text())
        assert [r["step"] for r in rows] == [0, 1]
        for r in rows:
            assert r["gradient_checkpointing"] is checkpointing
            assert r["new_tokens"] == 2 * 3 * 5  # end of text ignored: every sample runs to --response
            assert r["rollout_s"] > 0 and r["update_s"] > 0
            assert abs(r["step_s"] - (r["rollout_s"] + r["reward_and_advantages_s"] + r["update_s"])) < 0.02


def test_bench_rollout_compares_generate_and_the_fast_engine(tmp_path):
    out = tmp_path / "rollout.json"
    main(["bench", "rollout", "--shape", "qwen3-tiny", "--prompt", "24", "--new-tokens", "6", "-n", "2",
          "--groups", "1", "3", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["engine"], r["groups"]) for r in rows] == [("transformers generate", 1), ("longqa fast", 1),
                                                         ("longqa fast", 3)]
    assert all(r["new_tokens_per_s"] > 0 for r in rows)
    assert all("fraction_of_floor" in r and "decode_ms_per_step" in r for r in rows[1:])


def test_the_decode_floor_of_the_qwen3_1_7b_shape():
    """RESULTS' floors (ms per step), from the bytes counted by hand: 1,720,451,072 bf16 weights
    (28 x (q,o 2048x2048 + k,v 2048x1024 + 3 x 2048x6144) + the 151,936 x 2048 head), 114,688 bytes of KV
    per token, at 4.3 TB/s."""
    from transformers import Qwen3Config

    from longqa.bench import SHAPES, decode_floor_s

    config = Qwen3Config(**SHAPES["qwen3-1.7b"])

    def by_hand(groups, shared=True):
        prompt_tokens = groups * (1 if shared else 8) * 8192
        own_tokens = groups * 8 * 1023 / 2  # mean over the 1,024 steps
        return (2 * 1_720_451_072 + 114_688 * (prompt_tokens + own_tokens)) / 4.3e12 * 1e3

    for groups, shared, documented in [(1, True, 1.128), (16, True, 6.042), (1, False, 2.657), (16, False, 30.514)]:
        ms = 1e3 * decode_floor_s(config, 8192, 1024, 8, groups, shared) / 1024
        assert round(ms, 3) == documented and abs(ms - by_hand(groups, shared)) < 1e-9
