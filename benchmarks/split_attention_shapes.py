"""What a new problem shape costs the split attention backend: one packed group's attention forward and
backward (Qwen3-1.7B heads: 16 query, 8 key/value, head size 128) the first time cuDNN meets its shapes
(it builds and caches an execution plan per shape) and again once cached.

    python benchmarks/split_attention_shapes.py

Needs a CUDA GPU with cuDNN.
"""

import time

import torch

from longqa.model.split_attention import shared_prompt_attention, split_layout

HEADS, KV_HEADS, HEAD_DIM, STEP = 16, 8, 128, 1024


def group_ms(prompt: int, responses: list[int]) -> float:
    length = -(-(prompt + sum(responses)) // STEP) * STEP
    q = torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    layout = split_layout([(0, prompt, responses)], STEP, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    shared_prompt_attention(q, k, v, layout, HEAD_DIM**-0.5).sum().backward()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


if __name__ == "__main__":
    # In order: a group, the same shapes again, new lengths twice, varied response lengths, one response a
    # token longer (the same rounded-up shapes), then a new prompt length.
    runs = [
        (8192, [1024] * 8),
        (8192, [1024] * 8),
        (8000, [1000] * 8),
        (8000, [1000] * 8),
        (8100, [700, 300, 1000, 20, 5, 900, 600, 400]),
        (8100, [700, 300, 1000, 20, 5, 900, 600, 401]),
        (7777, [700] * 8),
    ]
    for prompt, responses in runs:
        print(f"prompt {prompt}, responses {sum(responses)} tokens: {group_ms(prompt, responses):.1f} ms", flush=True)
