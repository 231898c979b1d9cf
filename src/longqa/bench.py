"""``longqa bench``: speed of the training layouts on random-weight models of real shapes (no download).

``bench train`` times one GRPO group's forward+backward through the actor's real code path
(``Actor.micro_batches`` + ``Actor.forward``) in the naive padded layout and in the shared-prompt
layout, and reports tokens/s, the speed-up, peak memory and MFU. MFU counts model FLOPs of the tokens
each layout must compute (linear layers on every token, the LM head on response tokens, attention on
the pairs its mask allows; the gradient-checkpointing recompute excluded) over the bf16 datasheet peak.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

H200_BF16_PEAK = 989e12  # dense bf16 TFLOP/s, datasheet

SHAPES = {  # Qwen3 family shapes (config.json of the released models)
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}


def random_model(shape: str, device, dtype=torch.bfloat16, gradient_checkpointing: bool = True,
                 compile_layers: bool = False):
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=65536, rope_theta=1000000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if compile_layers:
        from longqa.model.load import compile_decoder_layers

        compile_decoder_layers(model)
    return model.train()


@dataclass
class GroupFlops:
    tokens: int  # tokens the layout computes
    flops: float  # model FLOPs of forward + backward (recompute excluded)


def group_flops(config, prompt: int, responses: list[int], shared: bool) -> GroupFlops:
    """Forward+backward model FLOPs: 6 x params x tokens for the decoder's linear layers, 6 x head x
    response tokens for the LM head, 12 x head_dim x heads x layers per attended (query, key) pair."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, head_dim = config.num_attention_heads, config.head_dim
    kv = config.num_key_value_heads
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * config.intermediate_size
    linear = per_layer * layers
    head = config.vocab_size * h
    if shared:
        tokens = prompt + sum(responses)
        pairs = prompt * (prompt + 1) // 2 + sum(r * prompt + r * (r + 1) // 2 for r in responses)
    else:
        tokens = sum(prompt + r for r in responses)
        pairs = sum((prompt + r) * (prompt + r + 1) // 2 for r in responses)
    flops = 6 * linear * tokens + 6 * head * sum(responses) + 12 * head_dim * heads * layers * pairs
    return GroupFlops(tokens, flops)


def _time(fn, device, repeat: int) -> float:
    fn()  # warm-up: compilation, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def bench_train(shape: str = "qwen3-1.7b", prompt: int = 8192, response: int = 1024, n: int = 8,
                layouts: tuple[str, ...] = ("naive", "packed"), repeat: int = 3, device: str = "auto",
                gradient_checkpointing: bool = True, budget: int | None = None, backend: str = "auto",
                compile_layers: bool = False, peak_flops: float = H200_BF16_PEAK) -> list[dict]:
    """Seconds per group (forward + backward of n samples of one prompt) for each layout."""
    from longqa.config import load_config
    from longqa.model.load import pick_device
    from longqa.train.actor import Actor, Samples

    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(shape, dev, dtype, gradient_checkpointing, compile_layers)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (response,), generator=g).tolist() for _ in range(n)]
    samples = Samples([prompt_ids] * n, responses, torch.ones(n), n)
    results = []
    for layout in layouts:
        shared = layout == "packed"
        cfg = load_config(None, [f"actor.shared_prompt={str(shared).lower()}", f"actor.attention_backend={backend}",
                                 f"actor.max_tokens_per_micro_batch={budget or prompt + n * response}",
                                 f"rollout.n={n}", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"])
        actor = Actor(model, cfg, 1, dev)

        def step():
            for micro in actor.micro_batches(samples, list(range(n))):
                logp, _, mask = actor.forward(model, micro)
                (logp * mask).sum().backward()
            model.zero_grad(set_to_none=True)

        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds = _time(step, dev, repeat)
        count = group_flops(model.config, prompt, [response] * n, shared)
        row = {"layout": layout, "shape": shape, "prompt": prompt, "response": response, "n": n,
               "backend": actor.backend or "sdpa (padded rows)", "gradient_checkpointing": gradient_checkpointing,
               "compiled_layers": compile_layers,
               "seconds_per_group": round(seconds, 4), "tokens_computed": count.tokens,
               "tokens_per_s": round(count.tokens / seconds), "model_tflops": round(count.flops / 1e12, 1),
               "mfu": round(count.flops / seconds / peak_flops, 4) if dev.type == "cuda" else None,
               "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None}
        results.append(row)
        print(json.dumps(row), flush=True)
    if len(results) == 2:
        speedup = results[0]["seconds_per_group"] / results[1]["seconds_per_group"]
        print(json.dumps({"speedup": round(speedup, 2)}), flush=True)
    return results
