"""The small random causal LMs the tests build (no downloads): one shape, three families, GQA."""

import torch

VOCAB = 97


def tiny_lm(family: str = "qwen3", head_dim: int = 8):
    """Two layers, four query heads sharing two key/value heads, float32, seeded."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config = {"qwen3": lambda: Qwen3Config(head_dim=head_dim, **common),
              "qwen2": lambda: Qwen2Config(**common),
              "llama": lambda: LlamaConfig(**common)}[family]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
