"""The GPU benchmarks' harness on the CPU with a tiny shape: what they run and what they record."""

import json

import pytest

from longqa.cli import main
from longqa.rollout.lengths import draw_response_lengths


def test_step_floor_adds_prefill_decode_and_update_at_their_limits():
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES
    from longqa.planning.flops import decode_floor_s, group_flops, step_floor_s

    config = Qwen3Config(**SHAPES["qwen3-1.7b"])
    lengths = [[100, 300], [50, 900]]
    floor = step_floor_s(config, 8192, lengths, in_flight=2, peak_flops=1e15)
    assert floor["update"] == pytest.approx(sum(group_flops(config, 8192, g, True).flops for g in lengths) / 1e15)
    h, layers, heads, head_dim = config.hidden_size, config.num_hidden_layers, config.num_attention_heads, 128
    params = layers * (
        h * heads * head_dim * 2 + h * config.num_key_value_heads * head_dim * 2 + 3 * h * config.intermediate_size
    )
    prefill = 2 * params * 8192 + 4 * head_dim * heads * layers * 8192 * 8193 / 2  # forward, causal pairs
    assert floor["rollout"] == pytest.approx(2 * prefill / 1e15 + decode_floor_s(config, 8192, lengths, in_flight=2))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_group_flops_count_what_a_flop_counter_counts(family):
    """The FLOPs the update's TFLOP/s and MFU are made of, against torch's FLOP counter on a forward and backward
    of one sequence (the LM head on its response tokens only, as the update computes it). The counter counts
    eager attention's full square of (query, key) pairs; the formula counts the causal half."""
    import torch
    from tiny_models import tiny_lm
    from torch.utils.flop_counter import FlopCounterMode

    from longqa.planning.flops import counts_flops, group_flops

    model = tiny_lm(family)
    model.config._attn_implementation = "eager"
    config = model.config
    assert counts_flops(config)
    prompt, response = 40, 9
    length = prompt + response
    ids = torch.randint(0, config.vocab_size, (1, length))
    with FlopCounterMode(display=False) as counter:
        model(ids, logits_to_keep=response).logits.float().square().mean().backward()
    counted = group_flops(config, prompt, [response], shared=False)
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    full_square = 12 * head_dim * heads * layers * length * length
    assert counter.get_total_flops() == counted.flops - counted.attention + full_square


def test_bench_step_records_each_phase_of_each_step(tmp_path):
    for checkpointing, lengths in ((False, "max"), (True, "lognormal")):
        out = tmp_path / f"step_{checkpointing}.json"
        args = [
            "bench",
            "step",
            "--shape",
            "qwen3-tiny",
            "--prompt",
            "24",
            "--response",
            "5",
            "-n",
            "3",
            "--prompts",
            "2",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--lengths",
            lengths,
        ]
        main(args + (["--gradient-checkpointing"] if checkpointing else []))
        rows = json.loads(out.read_text())
        assert [r["step"] for r in rows] == [0, 1]
        for r in rows:
            assert r["gradient_checkpointing"] is checkpointing and r["lengths"] == lengths
            drawn = [x for i in range(2) for x in draw_response_lengths(lengths, 3, 5, (r["step"], i))]
            assert r["new_tokens"] == sum(drawn)  # a random model never samples EOS: each sample ends where drawn
            assert r["response_length_max"] == max(drawn) and r["response_length_mean"] == round(sum(drawn) / 6, 1)
            assert r["rollout_s"] > 0 and r["update_s"] > 0
            assert abs(r["step_s"] - (r["rollout_s"] + r["reward_and_advantages_s"] + r["update_s"])) < 0.02
            assert r["recompiles"] == 0 and r["graph_captures"] == 0  # on the CPU nothing compiles or captures
            # an H200's floors, which a CPU has none of: null, not a fraction of 0.0
            assert all(
                r[key] is None for key in ("rollout_floor_s", "update_floor_s", "fraction_of_floor", "update_mfu")
            )
        if lengths == "max":
            assert all(r["new_tokens"] == 2 * 3 * 5 for r in rows)


def test_bench_step_profiles_the_last_step_phase_by_phase(tmp_path):
    """--profile: the last step (only) says, per phase, how long its operations kept the device busy (never more
    than the phase's wall time) and which cost most; the update's costliest include its matrix products."""
    out = tmp_path / "step.json"
    assert (
        main(
            [
                "bench",
                "step",
                "--shape",
                "qwen3-tiny",
                "--prompt",
                "24",
                "--response",
                "5",
                "-n",
                "3",
                "--prompts",
                "2",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--json",
                str(out),
                "--profile",
            ]
        )
        == 0
    )
    first, last = json.loads(out.read_text())
    assert "profile" not in first
    assert set(last["profile"]) == {"rollout", "update"}
    for name, phase in last["profile"].items():
        assert 0 < phase["busy_s"] <= phase["wall_s"] and phase["busy_fraction"] <= 1, name
        assert phase["kernels"] >= sum(k["calls"] for k in phase["top"]) > 0, name
        assert [k["s"] for k in phase["top"]] == sorted((k["s"] for k in phase["top"]), reverse=True), name
    assert last["profile"]["update"]["wall_s"] <= last["update_s"] + 0.05
    assert any(
        k["kernel"] in ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul")
        for k in last["profile"]["update"]["top"]
    )


def test_bench_step_samples_beside_the_update_on_the_same_work(tmp_path, capsys):
    """--overlap: each next step is sampled while this step's update runs (weights one update old); the steps
    work on the prompts and drawn lengths of the run that samples first, and say so."""
    rows = {}
    for overlap in (False, True):
        out = tmp_path / f"{overlap}.json"
        assert (
            main(
                [
                    "bench",
                    "step",
                    "--shape",
                    "qwen3-tiny",
                    "--prompt",
                    "24",
                    "--response",
                    "5",
                    "-n",
                    "3",
                    "--prompts",
                    "2",
                    "--steps",
                    "3",
                    "--device",
                    "cpu",
                    "--json",
                    str(out),
                    *(["--overlap"] if overlap else []),
                ]
            )
            == 0
        )
        rows[overlap] = json.loads(out.read_text())
    assert [r["overlap"] for r in rows[True]] == [True] * 3 and [r["overlap"] for r in rows[False]] == [False] * 3
    for key in ("new_tokens", "response_length_max", "response_length_mean"):
        assert [r[key] for r in rows[True]] == [r[key] for r in rows[False]], key
    assert all(r["rollout_s"] > 0 and r["update_s"] > 0 for r in rows[True])
    capsys.readouterr()
    assert main(["bench", "step", "--shape", "qwen3-tiny", "--device", "cpu", "--overlap", "--profile"]) == 2
    assert "--overlap runs them at once" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_step_runs_each_training_backend_on_the_same_work(tmp_path):
    """FSDP2's CPU offload and DeepSpeed ZeRO-3 in a process group of one, beside the unsharded default: the same
    samples, so the same work; the sharded backends sample from a copy that each update refreshes (a stale copy
    would refuse to sample). (ZeRO-3 steps torch's AdamW here, which compiles nothing; its CPU Adam takes the
    same update: tests/test_deepspeed.py.)"""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: pip install 'longqa[deepspeed]'")
    rows = {}
    for name, extra in (
        ("plain", []),
        ("fsdp2-offload", ["--cpu-offload"]),
        ("deepspeed", ["--strategy", "deepspeed"]),
    ):
        out = tmp_path / f"{name}.json"
        main(
            [
                "bench",
                "step",
                "--shape",
                "qwen3-tiny",
                "--prompt",
                "24",
                "--response",
                "5",
                "-n",
                "3",
                "--prompts",
                "2",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--json",
                str(out),
                *extra,
            ]
        )
        rows[name] = json.loads(out.read_text())
    assert [(r["strategy"], r["cpu_offload"]) for r in rows["deepspeed"]] == [("deepspeed", False)] * 2
    assert [(r["strategy"], r["cpu_offload"]) for r in rows["fsdp2-offload"]] == [("fsdp2", True)] * 2
    for key in ("new_tokens", "response_length_max", "response_length_mean"):
        assert (
            [r[key] for r in rows["plain"]]
            == [r[key] for r in rows["fsdp2-offload"]]
            == [r[key] for r in rows["deepspeed"]]
        ), key
    assert all(r["update_s"] > 0 for group in rows.values() for r in group)


@pytest.mark.parametrize("lengths", ["lognormal", "max"])
def test_bench_rollout_compares_generate_and_the_fast_engine(tmp_path, lengths):
    out = tmp_path / "rollout.json"
    main(
        [
            "bench",
            "rollout",
            "--shape",
            "qwen3-tiny",
            "--prompt",
            "24",
            "--new-tokens",
            "40",
            "-n",
            "2",
            "--groups",
            "1",
            "3",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--lengths",
            lengths,
        ]
    )
    rows = json.loads(out.read_text())
    assert [(r["engine"], r["groups"]) for r in rows] == [
        ("transformers generate", 1),
        ("longqa fast", 1),
        ("longqa fast", 3),
    ]
    assert all(r["new_tokens_per_s"] > 0 and r["lengths"] == lengths for r in rows)
    assert all(r["decode_ms_per_step"] > 0 for r in rows[1:])
    assert all(
        r[key] is None
        for key in ("floor_ms_per_step", "fraction_of_floor", "floor_ms_per_step_unshared")
        for r in rows[1:]
    )  # an H200's floor: none on the CPU
    drawn = [draw_response_lengths(lengths, 2, 40, (0, i)) for i in range(3)]
    for r in rows:  # generate did the same work as the engine: prompt 0's drawn lengths, exactly
        group = drawn[: r["groups"]]
        assert r["response_length_max"] == max(map(max, group))
        assert r["response_length_mean"] == round(sum(map(sum, group)) / (2 * r["groups"]), 1)
    for r in rows[1:]:
        assert 0 < r["row_occupancy"] <= r["slot_occupancy"] <= 1
        if lengths == "max":  # every slot busy every step, every row live
            assert r["slot_occupancy"] == r["row_occupancy"] == 1.0 and r["decode_steps"] == 39


def test_bench_rollout_with_speculation(tmp_path):
    """--speculative prompt_lookup: the engine drafts and verifies, and the rows say how often and how well
    (random prompts and weights: drafts are rare and wrong, so each step costs k + 1 tokens per row)."""
    out = tmp_path / "rollout.json"
    main(
        [
            "bench",
            "rollout",
            "--shape",
            "qwen3-tiny",
            "--prompt",
            "24",
            "--new-tokens",
            "20",
            "-n",
            "2",
            "--groups",
            "2",
            "--device",
            "cpu",
            "--hf-new-tokens",
            "0",
            "--speculative",
            "prompt_lookup",
            "--num-speculative-tokens",
            "3",
            "--json",
            str(out),
        ]
    )
    [row] = json.loads(out.read_text())
    assert (row["speculative"], row["num_speculative_tokens"]) == ("prompt_lookup", 3)
    assert 0 <= row["draft_fraction"] <= 1 and row["accepted_per_draft_step"] >= 0
    assert row["tokens_per_row_step"] >= 1 and row["decode_steps"] > 0


def test_the_decode_floor_of_the_qwen3_1_7b_shape():
    """RESULTS' floors (ms per step), from the bytes counted by hand: 1,720,451,072 bf16 weights
    (28 x (q,o 2048x2048 + k,v 2048x1024 + 3 x 2048x6144) + the 151,936 x 2048 head), 114,688 bytes of KV
    per token, at 4.3 TB/s."""
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES
    from longqa.planning.flops import decode_floor_s

    config = Qwen3Config(**SHAPES["qwen3-1.7b"])

    def by_hand(groups, shared=True):
        prompt_tokens = groups * (1 if shared else 8) * 8192
        own_tokens = groups * 8 * 1023 / 2  # mean over the 1,024 steps
        return (2 * 1_720_451_072 + 114_688 * (prompt_tokens + own_tokens)) / 4.3e12 * 1e3

    for groups, shared, documented in [(1, True, 1.128), (16, True, 6.042), (1, False, 2.657), (16, False, 30.514)]:
        ms = 1e3 * decode_floor_s(config, 8192, 1024, 8, groups, shared) / 1024
        assert round(ms, 3) == documented and abs(ms - by_hand(groups, shared)) < 1e-9
        assert decode_floor_s(config, 8192, [[1024] * 8] * groups, shared=shared) == pytest.approx(
            ms * 1.024, rel=1e-12
        )


def test_the_decode_floor_of_drawn_lengths_counts_the_ideal_schedule():
    """Three groups through two slots always full: (5 + 3 + 4) / 2 = 6 steps of weights; each group's
    prompt once per step it lives (unshared: once per sample step); each sample its own KV so far."""
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES
    from longqa.planning.flops import decode_floor_s, ideal_decode_steps

    config = Qwen3Config(**SHAPES["qwen3-1.7b"])
    lengths = [[5, 2], [3, 3], [1, 4]]
    weights, kv_token = 2 * 1_720_451_072, 114_688  # bytes per read
    own = sum(x * (x - 1) / 2 for g in lengths for x in g)
    assert ideal_decode_steps(lengths, 2) == 6
    for shared, prompt_steps in ((True, 5 + 3 + 4), (False, 7 + 6 + 5)):
        by_hand = (6 * weights + kv_token * (100 * prompt_steps + own)) / 4.3e12
        assert decode_floor_s(config, 100, lengths, in_flight=2, shared=shared) == pytest.approx(by_hand, rel=1e-12)
