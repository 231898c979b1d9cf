"""The rules between settings are one list (``config/checks.py``), and every command that takes a config refuses
what it refuses, in the same words: `longqa train` (and the trainer itself), `longqa config show`, `longqa plan`
and the Ray driver's check before its workers start.

The list is enumerated, not copied: a new rule without a case below fails ``test_every_rule_has_a_case``.
"""

from __future__ import annotations

import pytest
from cli_refusal import refusal

from longqa.cli import main
from longqa.config import ConfigError, load_config, to_dict
from longqa.config.checks import CHECKS, check_settings
from longqa.data.demo import DEMO_CONFIG

# For each rule: overrides of the demo config (what `longqa train` runs without a config file) that break it and
# no rule before it, and the ranks of the job (WORLD_SIZE, --gpus, trainer.ray_workers).
CASES = {
    "check_sampler_ranks": (["rollout.sampler_ranks=1", "rollout.engine=hf"], 2),
    "check_batch_shares": (["actor.ppo_mini_batch_size=6"], 1),
    "check_parallel_support": (["rollout.engine=hf"], 2),
    "check_sequence_parallel": (["actor.sequence_parallel_size=2"], 1),
    "check_groups": (["rollout.n=1"], 1),
    "check_response_lengths": (["rollout.response_lengths=lognormal", "rollout.engine=hf"], 1),
    "check_speculative": (["rollout.speculative=prompt_lookup", "rollout.engine=hf"], 1),
    "check_one_step_off": (["rollout.overlap=true"], 1),
    "check_vllm_model": (["rollout.engine=vllm", "model.gguf_file=model.gguf"], 1),
    "check_offload": (["actor.cpu_offload=true", "rollout.engine=hf"], 1),
    "check_deepspeed_engine": (["actor.strategy=deepspeed", "rollout.engine=hf"], 1),
    "check_layer_memory": (
        ["model.gradient_checkpointing=true", "model.activation_offload=0.5", "model.checkpoint_fraction=0.75"],
        1,
    ),
}


def test_every_rule_has_a_case():
    assert [check.__name__ for check in CHECKS] == list(CASES)  # (in the list's order)


def _no_work(*args, **kwargs):
    raise AssertionError("the work began before the broken rule was refused")


@pytest.mark.parametrize("index", range(len(CHECKS)), ids=[check.__name__ for check in CHECKS])
def test_every_command_refuses_each_rule_in_its_words(index, tmp_path, monkeypatch, capsys):
    from longqa.train.trainer import Trainer, check_before_workers

    check = CHECKS[index]
    overrides, ranks = CASES[check.__name__]
    cfg = load_config(DEMO_CONFIG, overrides)
    check_settings(cfg, ranks, checks=CHECKS[:index])  # no rule before it is broken
    with pytest.raises(ConfigError) as broken:
        check_settings(cfg, ranks, checks=(check,))
    message = str(broken.value)

    monkeypatch.setattr("longqa.train.trainer.load_model", _no_work)
    monkeypatch.setenv("WORLD_SIZE", str(ranks))  # the job train and config show are in (torchrun's)
    monkeypatch.setenv("RANK", "0")
    run = [f"trainer.output_dir={tmp_path}/run", "data.train_files=x.parquet", "data.val_files=[]"]
    assert refusal(capsys, ["train", *overrides, *run]) == message
    assert refusal(capsys, ["config", "show", *overrides]) == message
    assert refusal(capsys, ["plan", *overrides, "--gpus", str(ranks)]) == message
    with pytest.raises(ConfigError) as refused:
        Trainer(load_config(DEMO_CONFIG, [*overrides, *run]))
    assert str(refused.value) == message
    monkeypatch.delenv("WORLD_SIZE")  # the driver's job is its Ray workers
    with pytest.raises(ConfigError) as refused:
        check_before_workers(
            load_config(DEMO_CONFIG, [*overrides, *run, "trainer.launcher=ray", f"trainer.ray_workers={ranks}"])
        )
    assert str(refused.value) == message


def test_config_show_counts_the_ranks_train_runs_on(monkeypatch, capsys):
    """A config that one process trains and two ranks do not: config show says so under torchrun's WORLD_SIZE, as
    train does, and plan for --gpus 2."""
    assert main(["config", "show", "rollout.engine=hf"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (
        refusal(capsys, ["config", "show", "rollout.engine=hf"]) == "rollout.engine=hf is not supported with 2 "
        "ranks yet"
    )


def test_filling_auto_returns_a_new_config_and_leaves_the_one_given_as_it_was():
    from longqa.planning.planner import CPU_MICRO_BATCH_TOKENS, GIB, check_run, model_sizes, resolve_auto

    cfg = load_config(None, ["actor.max_tokens_per_micro_batch=auto"])
    before = to_dict(cfg)
    filled, note = resolve_auto(cfg, 1, None)  # the CPU's budget
    assert filled.actor.max_tokens_per_micro_batch == CPU_MICRO_BATCH_TOKENS and "16,384 tokens" in note
    filled, note = resolve_auto(cfg, 1, 141 * GIB, model_sizes(cfg))  # a GPU's, sized by the memory plan
    assert isinstance(filled.actor.max_tokens_per_micro_batch, int) and note.startswith(
        "actor.max_tokens_per_micro_batch=auto: "
    )
    checked = check_run(cfg, 1, machine=False, gpu_bytes=141 * GIB)
    assert checked.config.actor.max_tokens_per_micro_batch == filled.actor.max_tokens_per_micro_batch
    assert to_dict(cfg) == before and cfg.actor.max_tokens_per_micro_batch == "auto"
    numbered = load_config(None, ["actor.max_tokens_per_micro_batch=4096"])
    assert resolve_auto(numbered, 1, 141 * GIB, model_sizes(numbered)) == (numbered, None)  # nothing to fill


def test_config_show_refuses_a_sequence_parallel_degree_in_one_line(monkeypatch, capsys):
    """A degree that does not divide the model's attention heads (the embedded model has 8), or the ranks."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    batch = ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3"]
    assert refusal(capsys, ["config", "show", *batch, "actor.sequence_parallel_size=3"]) == (
        "actor.sequence_parallel_size=3 must divide the model's 8 attention heads, which the ranks of a "
        "sequence-parallel group share: use one of [1, 2, 4, 8]"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert refusal(capsys, ["config", "show", "actor.sequence_parallel_size=4"]) == (
        "actor.sequence_parallel_size=4 must divide the 2 training ranks, which form groups of that many: use one "
        "of [1, 2]"
    )
    assert main(["config", "show", "actor.sequence_parallel_size=2"]) == 0
    assert "sequence_parallel_size: 2" in capsys.readouterr().out


def test_the_rules_on_what_a_run_reads_name_the_settings():
    """The two rules that need the prompts or the model (the trainer calls them once it has read them)."""
    from longqa.config.checks import check_positions, check_prompt_count

    cfg = load_config(None, ["data.train_batch_size=8", "data.max_response_length=100"])
    check_prompt_count(cfg, 8)
    with pytest.raises(ConfigError, match=r"^data.train_batch_size=8 is larger than the 7 training prompts left"):
        check_prompt_count(cfg, 7)
    check_positions(cfg, 1000, 1024)  # the fast engine samples past a plain-RoPE model's limit (with a warning)
    vllm = load_config(None, ["rollout.engine=vllm", "data.max_response_length=100"])
    check_positions(vllm, 924, 1024)
    with pytest.raises(
        ConfigError,
        match=r"^prompts of up to 925 tokens and responses of up to 100 need 1025 "
        r"positions, past the model's 1024, and rollout.engine=vllm samples none",
    ):
        check_positions(vllm, 925, 1024)
