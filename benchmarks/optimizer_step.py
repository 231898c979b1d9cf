"""The host-side optimizer step of an offloaded optimizer on one GPU: FSDP2 with torch's AdamW on the host
(``actor.strategy=fsdp2 actor.cpu_offload=true``) against DeepSpeed ZeRO-3 with its CPU Adam
(``actor.strategy=deepspeed actor.cpu_offload=true``), through the actor's own code on a random-weight
Qwen3 shape in a process group of one.

One backend per process, so that the host memory it reports is that backend's alone: the peak resident
set of the process and what it holds after the steps. Each step accumulates the gradient of one packed
group (a prompt and ``n`` responses) and then applies it: ``optimizer_step_s`` times the apply alone
(gradient norm, clipping, the AdamW update; under ZeRO-3 also the new bf16 weights' copy to the GPU, which
FSDP2 makes at the next forward instead), after a first step that allocates the optimizer's state. It
prints one JSON line.

    python benchmarks/optimizer_step.py --backend deepspeed --shape qwen3-8b [--layers 18] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

GIB = 2**30
HOST_BYTES_PER_PARAM = 18  # fp32 weights, gradients and two AdamW moments on the host (+ ZeRO-3's bf16 copy)


def check_host_memory(params: int) -> None:
    """Refuse a shape whose offloaded state cannot fit in the host's free memory, before building it."""
    import psutil

    need, free = HOST_BYTES_PER_PARAM * params, psutil.virtual_memory().available
    if need > 0.9 * free:
        raise SystemExit(
            f"{params / 1e9:.2f}B parameters need about {need / GIB:.0f} GiB of host memory for the "
            f"offloaded optimizer, but {free / GIB:.0f} GiB are free: pass --layers to bench fewer "
            f"decoder layers (the step's time and memory grow with the parameters)"
        )


def packed_group(vocab: int, prompt: int, response: int, n: int):
    from longqa.train.actor import Samples

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (response,), generator=g).tolist() for _ in range(n)]
    return Samples([ids] * n, responses, torch.randn(n, generator=g), n)


def host_rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / GIB


def run(
    backend: str, shape: str, layers: int | None, prompt: int, response: int, n: int, steps: int, device: str
) -> dict:
    from transformers import Qwen3Config

    from longqa.bench.speed import random_model
    from longqa.config import load_config
    from longqa.distributed.env import DistEnv
    from longqa.model.load import pick_device
    from longqa.model.shapes import SHAPES
    from longqa.planning.planner import ModelSizes
    from longqa.train.actor import Actor

    dev = pick_device(device, "--device")
    shape_config = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    sizes = ModelSizes.from_config(Qwen3Config(**shape_config))
    check_host_memory(sizes.params)
    DistEnv().init(dev, alone=True)  # FSDP2's offload and ZeRO-3 both shard in a process group, here of one
    # float32, as `longqa train` loads it: both backends compute in bf16 on a GPU beside fp32 master weights.
    # Every layer recomputed, as in long-context training; activations are not what is measured.
    model = random_model(shape, dev, torch.float32, gradient_checkpointing=1.0, layers=layers)
    cfg = load_config(
        None,
        [
            f"actor.strategy={backend}",
            "actor.cpu_offload=true",
            f"rollout.n={n}",
            "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
            "actor.lr=1e-6",
            f"data.max_response_length={response}",
            "actor.attention_backend=dense",
            f"actor.max_tokens_per_micro_batch={prompt + n * response}",
        ],
    )
    actor = Actor(model, cfg, steps + 1, dev)
    samples = packed_group(model.config.vocab_size, prompt, response, n)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    backward, step = [], []
    for _ in range(steps + 1):  # the first allocates the optimizer's state: not timed
        sync()
        t0 = time.perf_counter()
        actor.accumulate_gradients(samples, list(range(n)), None)
        sync()
        t1 = time.perf_counter()
        actor.apply_gradients()
        sync()
        t2 = time.perf_counter()
        backward.append(t1 - t0)
        step.append(t2 - t1)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "backend": backend,
        "optimizer": "DeepSpeed CPU Adam" if backend == "deepspeed" else "torch AdamW",
        "shape": shape,
        "layers": model.config.num_hidden_layers,
        "params": sizes.params,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "host_threads": torch.get_num_threads(),
        "steps": steps,
        "optimizer_step_s": round(statistics.median(step[1:]), 3),
        "optimizer_step_s_per_b_params": round(statistics.median(step[1:]) / (sizes.params / 1e9), 3),
        "optimizer_step_s_all": [round(s, 3) for s in step[1:]],
        "first_step_s": round(step[0], 3),
        "forward_backward_s": round(statistics.median(backward[1:]), 3),
        "host_peak_rss_gib": round(peak_kib / 2**20, 1),
        "host_rss_gib": round(host_rss_gib(), 1),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated(dev) / GIB, 1) if dev.type == "cuda" else None,
    }


def main() -> None:
    from longqa.model.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        choices=["fsdp2", "deepspeed"],
        required=True,
        help="fsdp2: FSDP2 offload, torch's AdamW on the host; deepspeed: ZeRO-3, DeepSpeed's CPU Adam",
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the packed group (default 1024)")
    p.add_argument("--response", type=int, default=256, help="tokens of each response (default 256)")
    p.add_argument("-n", type=int, default=4, help="responses (default 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also append the result to this file")
    args = p.parse_args()
    result = run(args.backend, args.shape, args.layers, args.prompt, args.response, args.n, args.steps, args.device)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
