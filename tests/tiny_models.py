"""The small random causal LMs the tests build (no downloads): one shape, three families, GQA."""

import torch

VOCAB = 97


def tiny_lm(family: str = "qwen3", head_dim: int = 8):
    """Two layers, four query heads sharing two key/value heads, float32, seeded."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config = {
        "qwen3": lambda: Qwen3Config(head_dim=head_dim, **common),
        "qwen2": lambda: Qwen2Config(**common),
        "llama": lambda: LlamaConfig(**common),
    }[family]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def save_tiny_qwen3(path, tokenizer):
    """A two-layer random Qwen3 sized to ``tokenizer``, saved with it as a model folder (``model.path``)."""
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    config = qwen3_config(
        len(tokenizer),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
