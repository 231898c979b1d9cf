"""``longqa bench``: speed of the training layouts on random-weight models of real shapes (no download).

``bench train`` times one GRPO group's forward+backward through the actor's real code path
(``Actor.micro_batches`` + ``Actor.forward``) in the naive padded layout and in the shared-prompt
layout, and reports tokens/s, the speed-up, peak memory and MFU. MFU counts model FLOPs of the tokens
each layout must compute (linear layers on every token, the LM head on response tokens, attention on
the pairs its mask allows; the gradient-checkpointing recompute excluded) over the bf16 datasheet peak.

``bench rollout`` and ``bench step`` sample from random-weight models, which never sample EOS: each
response is given a length drawn from ``longqa.rollout.lengths`` (``lengths="lognormal"``, the realistic case) or
the maximum (``"max"``, the worst case), and ends there as if it had sampled EOS. Their floors (an H200's HBM
bandwidth and bf16 peak) and the fractions of them are null on a CPU, as ``bench train``'s MFU: a CPU has no
such floor, and a fraction of an H200's would only read 0.0.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence

import torch

from longqa.model.shapes import SHAPES  # the shapes this module builds (also read by `longqa plan --shape`)
from longqa.planning.flops import (
    H200_BF16_PEAK,
    decode_floor_s,
    group_flops,
    ideal_decode_steps,
    step_floor_s,
)
from longqa.rollout.lengths import draw_response_lengths


def random_model(
    shape: str,
    device,
    dtype=torch.bfloat16,
    gradient_checkpointing: float = 1.0,
    compile_layers: bool = False,
    min_vocab: int = 0,
    activation_offload: float = 0.0,
    layers: int | None = None,
    vocab: int | None = None,
):
    """A random-weight Qwen3 of ``shape`` (``layers`` decoder layers and a vocabulary of ``vocab`` entries if
    given, at least ``min_vocab``); ``gradient_checkpointing`` is the fraction of decoder layers recomputed in
    the backward pass (True: all, False or 0: none), ``activation_offload`` the fraction (the first layers)
    whose activations wait in host memory."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    sizes = {
        **SHAPES[shape],
        "vocab_size": max(vocab or SHAPES[shape]["vocab_size"], min_vocab),
        **({"num_hidden_layers": layers} if layers else {}),
    }
    config = Qwen3Config(**sizes, max_position_embeddings=65536, rope_theta=1000000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    from longqa.model.load import arrange_layer_memory, compile_decoder_layers

    model.activation_offload = arrange_layer_memory(model, float(gradient_checkpointing), activation_offload)
    model.config.use_cache = False
    if compile_layers:
        compile_decoder_layers(model)
    return model.train()


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


def bench_train(
    shape: str = "qwen3-1.7b",
    prompt: int = 8192,
    response: int = 1024,
    n: int = 8,
    layouts: tuple[str, ...] = ("naive", "packed"),
    repeat: int = 3,
    device: str = "auto",
    gradient_checkpointing: float = 1.0,
    budget: int | None = None,
    backend: str = "auto",
    compile_layers: bool = False,
    peak_flops: float = H200_BF16_PEAK,
    activation_offload: float = 0.0,
) -> list[dict]:
    """Seconds per group (forward + backward of n samples of one prompt) for each layout;
    ``gradient_checkpointing`` is the fraction of decoder layers recomputed, ``activation_offload`` the
    fraction whose activations wait in host memory."""
    from longqa.config import load_config
    from longqa.model.load import pick_device
    from longqa.train.actor import Actor, Samples

    dev = pick_device(device, "--device")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(
        shape, dev, dtype, gradient_checkpointing, compile_layers, activation_offload=activation_offload
    )
    offload = model.activation_offload
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (response,), generator=g).tolist() for _ in range(n)]
    samples = Samples([prompt_ids] * n, responses, torch.ones(n), n)
    results = []
    for layout in layouts:
        shared = layout == "packed"
        cfg = load_config(
            None,
            [
                f"actor.shared_prompt={str(shared).lower()}",
                f"actor.attention_backend={backend}",
                f"actor.max_tokens_per_micro_batch={budget or prompt + n * response}",
                f"rollout.n={n}",
                "data.train_batch_size=1",
                "actor.ppo_mini_batch_size=1",
            ],
        )
        actor = Actor(model, cfg, 1, dev)

        def step():
            for micro in actor.micro_batches(samples, list(range(n))):
                logp, _, mask = actor.forward(actor.scorer, micro)
                (logp * mask).sum().backward()
            model.zero_grad(set_to_none=True)

        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        late_before = offload.late_loads if offload else 0
        seconds = _time(step, dev, repeat)
        count = group_flops(model.config, prompt, [response] * n, shared)
        row = {
            "layout": layout,
            "shape": shape,
            "prompt": prompt,
            "response": response,
            "n": n,
            "backend": actor.backend or "sdpa (padded rows)",
            "gradient_checkpointing": gradient_checkpointing,
            "activation_offload": activation_offload,
            "compiled_layers": compile_layers,
            "seconds_per_group": round(seconds, 4),
            "tokens_computed": count.tokens,
            "tokens_per_s": round(count.tokens / seconds),
            "model_tflops": round(count.flops / 1e12, 1),
            "mfu": round(count.flops / seconds / peak_flops, 4) if dev.type == "cuda" else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
        }
        if offload:  # copies back the backward pass had to wait for from the start (all timed groups)
            row["offload_late_loads"] = offload.late_loads - late_before
        results.append(row)
        print(json.dumps(row), flush=True)
    if len(results) == 2:
        speedup = results[0]["seconds_per_group"] / results[1]["seconds_per_group"]
        print(json.dumps({"speedup": round(speedup, 2)}), flush=True)
    return results


def _length_stats(lengths: Sequence[Sequence[int]]) -> dict:
    flat = [length for group in lengths for length in group]
    return {"response_length_mean": round(sum(flat) / len(flat), 1), "response_length_max": max(flat)}


def _forced_stop(lengths: Sequence[int], prompt: int, stop_id: int, device):
    """Logits processors for ``generate`` that make row r sample ``stop_id`` as its ``lengths[r]``-th
    token and never before, so that transformers does the very work the fast engine does under
    ``stop_at``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    last = torch.tensor(lengths, device=device) - 1  # the index of each row's last token

    class ForcedStop(LogitsProcessor):
        def __call__(self, input_ids, scores):
            banned = scores.index_fill(-1, torch.tensor([stop_id], device=scores.device), float("-inf"))
            forced = torch.full_like(scores, float("-inf"))
            forced[:, stop_id] = 0.0
            return torch.where((last == input_ids.shape[1] - prompt)[:, None], forced, banned)

    return LogitsProcessorList([ForcedStop()])


def _real_tokens(generated: torch.Tensor, stop_id: int) -> list[int]:
    """Each row's tokens up to and including its first ``stop_id`` (the padding after it is not work)."""
    hits = generated == stop_id
    first = torch.where(hits.any(1), hits.int().argmax(1) + 1, generated.shape[1])
    return first.tolist()


def _generate_row(model, prompt_ids: list[int], n: int, lengths: list[int], dev) -> dict:
    """transformers ``generate`` sampling n responses of one prompt, each of its drawn length."""
    stop_id = 0
    ids = torch.tensor([prompt_ids], device=dev)
    out = []

    def hf():
        with torch.no_grad():
            out[:] = [
                model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    num_return_sequences=n,
                    max_new_tokens=max(lengths),
                    eos_token_id=stop_id,
                    pad_token_id=stop_id,
                    logits_processor=_forced_stop(lengths, len(prompt_ids), stop_id, dev),
                )
            ]

    seconds = _time(hf, dev, 1)
    made = _real_tokens(out[0][:, len(prompt_ids) :], stop_id)
    return {"seconds": round(seconds, 3), "new_tokens_per_s": round(sum(made) / seconds), **_length_stats([made])}


def bench_rollout(
    shape: str = "qwen3-1.7b",
    prompt: int = 8192,
    new_tokens: int = 1024,
    n: int = 8,
    groups: tuple[int, ...] = (1, 16),
    hf_new_tokens: int | None = None,
    device: str = "auto",
    cuda_graphs: bool = True,
    engine_options: dict | None = None,
    lengths: str = "lognormal",
) -> list[dict]:
    """New tokens/s of transformers' ``generate`` (n samples of one prompt) and of the fast engine (1 and
    more groups of n), temperature 1, each response ending at its drawn length (at most ``new_tokens``);
    the fast engine against its memory-bandwidth floor for those lengths, and how full it kept its slots."""
    from longqa.model.load import pick_device
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    dev = pick_device(device, "--device")
    model = random_model(shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, False).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(max(groups))]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results = []
    if hf_new_tokens != 0:
        tokens = hf_new_tokens or new_tokens
        drawn = draw_response_lengths(lengths, n, tokens, (0, 0))  # prompt 0's, when tokens == new_tokens
        results.append(
            {
                "engine": "transformers generate",
                "groups": 1,
                "n": n,
                "prompt": prompt,
                "new_tokens": tokens,
                "lengths": lengths,
                **_generate_row(model, prompts[0], n, drawn, dev),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    engine = FastRolloutEngine(model, cuda_graphs=cuda_graphs, **(engine_options or {}))
    for count in groups:
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens)
        first = SamplingParams(n=n, temperature=1.0, max_new_tokens=1)
        batch = prompts[:count]
        stop_at = [draw_response_lengths(lengths, n, new_tokens, (0, i)) for i in range(count)]
        engine.generate(batch, params, seeds=list(range(count)), stop_at=stop_at)  # warm-up: graphs, allocator
        sync()
        start = time.perf_counter()
        engine.generate(batch, first, seeds=list(range(count)))
        sync()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = engine.generate(batch, params, seeds=list(range(count)), stop_at=stop_at)
        sync()
        seconds = time.perf_counter() - start
        row = {
            "engine": "longqa fast",
            **(engine_options or {}),
            "groups": count,
            "n": n,
            "prompt": prompt,
            "new_tokens": new_tokens,
            "lengths": lengths,
            "groups_in_flight": engine.kv.groups,
            **_fast_timings(model.config, prompt, out, engine, seconds, prefill, dev),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    if results and results[0]["engine"] == "transformers generate":
        one = next(r for r in results if r.get("groups") == 1 and r["engine"] == "longqa fast")
        print(json.dumps({"speedup_one_group": round(one["new_tokens_per_s"] / results[0]["new_tokens_per_s"], 1)}))
    return results


def gpu_floors(device: torch.device, figures: dict) -> dict:
    """``figures`` measured against an H200's floor as they are on a GPU; null on any other device, which has no
    such floor (a fraction of an H200's would read 0.0 and say nothing)."""
    return figures if device.type == "cuda" else dict.fromkeys(figures)


def _fast_timings(config, prompt: int, out, engine, seconds: float, prefill: float, device: torch.device) -> dict:
    """Speed of one fast-engine run against the floor for the lengths it made (on a GPU); per step means per step
    of the ideal schedule (for equal lengths, all groups in flight: one per new token)."""
    made = [[len(s.token_ids) for s in group] for group in out]
    total, decode, in_flight = sum(map(sum, made)), seconds - prefill, engine.kv.groups
    steps = ideal_decode_steps(made, in_flight)
    floor = decode_floor_s(config, prompt, made, in_flight=in_flight)
    unshared = decode_floor_s(config, prompt, made, in_flight=in_flight, shared=False)
    run = engine.last_run
    slot_steps = run["decode_steps"] * run["slots"]
    return {
        "seconds": round(seconds, 3),
        "prefill_seconds": round(prefill, 3),
        "new_tokens_per_s": round(total / seconds),
        "decode_tokens_per_s": round(total / decode),
        **_length_stats(made),
        "decode_ms_per_step": round(1e3 * decode / steps, 3),
        **gpu_floors(
            device,
            {
                "floor_ms_per_step": round(1e3 * floor / steps, 3),
                "fraction_of_floor": round(floor / decode, 3),
                "floor_ms_per_step_unshared": round(1e3 * unshared / steps, 3),
            },
        ),
        "decode_steps": run["decode_steps"],
        "slot_occupancy": round(run["busy_slot_steps"] / slot_steps, 3) if slot_steps else None,
        "row_occupancy": round(run["live_row_steps"] / (slot_steps * run["n"]), 3) if slot_steps else None,
        **speculation_stats(run),
    }


def speculation_stats(run: dict) -> dict:
    """A speculating engine's ``last_run`` as figures: the fraction of live row-steps with a draft, drafted
    tokens kept per such step, and tokens a live row-step made on average (1 without speculation)."""
    if "draft_fraction" not in run:
        return {}
    return {
        "draft_fraction": round(run["draft_fraction"], 3),
        "accepted_per_draft_step": round(run["accepted_per_draft_step"], 3),
        "tokens_per_row_step": round(1 + run["accepted_draft_tokens"] / max(run["live_row_steps"], 1), 3),
    }


class PhaseProfiler:
    """Kernel time per phase of a step, under torch's profiler: for each phase, the wall time, the device's
    busy time (the sum of its kernels), their count and the costliest kernels by name."""

    def __init__(self, device: torch.device, top: int = 12):
        self.device, self.top, self.phases = device, top, {}

    @contextlib.contextmanager
    def phase(self, name: str):
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        began = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            yield
        wall = time.perf_counter() - began
        kernels: dict[str, list[float]] = {}  # on the CPU, the top-level operations (their children inside them)
        for event in prof.events():
            if event.device_type == kind and (cuda or not event.cpu_parent):
                kernels.setdefault(event.name, []).append(event.device_time if cuda else event.cpu_time)
        busy = sum(sum(t) for t in kernels.values()) / 1e6
        top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: self.top]
        self.phases[name] = {
            "wall_s": round(wall, 3),
            "busy_s": round(busy, 3),
            "busy_fraction": round(busy / wall, 3),
            "kernels": sum(len(t) for t in kernels.values()),
            "top": [{"kernel": k[:100], "calls": len(t), "s": round(sum(t) / 1e6, 4)} for k, t in top],
        }


def bench_grpo_step(
    shape: str = "qwen3-1.7b",
    prompt: int = 8192,
    response: int = 1024,
    n: int = 8,
    prompts_per_step: int = 16,
    steps: int = 2,
    device: str = "auto",
    engine_options: dict | None = None,
    gradient_checkpointing: bool = False,
    lengths: str = "lognormal",
    strategy: str = "fsdp2",
    cpu_offload: bool = False,
    budget: int | None = None,
    backend: str = "auto",
    profile: bool = False,
    overlap: bool = False,
) -> list[dict]:
    """Seconds per phase of whole GRPO steps: fast-engine rollout of ``prompts_per_step`` x ``n``, each
    response ending at its drawn length (at most ``response``), group advantages, one packed
    shared-prompt update (on-policy: no old log-prob pass). A random-weight model cannot answer, so
    rewards are random coin flips (scoring text costs milliseconds anyway). Each step's prompts and rewards
    are drawn from a generator seeded by the step, so runs with other settings work on the same data.
    Gradient checkpointing is off by default, as in ``longqa train`` (``model.gradient_checkpointing``).
    ``budget`` is the update's micro-batch token budget (``actor.max_tokens_per_micro_batch``; default one
    group of the longest responses): a small model needs several groups per micro-batch to keep a GPU busy.
    ``backend`` is the update's packed attention (``actor.attention_backend``). ``profile`` runs the last step
    under torch's profiler and adds, per phase, the kernels' busy time against the wall time and the costliest
    kernels: a phase whose device sits idle is paying for launches and host synchronisation, not arithmetic.
    ``overlap`` samples each next step's prompts while the step's update runs (``rollout.mode=one_step_off
    rollout.overlap=true``: a thread of its own on a CUDA stream of its own, from the engine's copy of the weights
    one update old); a step's ``rollout_s`` is then the sampling of its groups, done beside the previous update
    (before it in step 0), and ``step_s`` its update with the wait for the next step's sampling.

    By default the bf16 model trains unsharded and the engine shares its weights. ``strategy="deepspeed"``
    (ZeRO-3) or ``cpu_offload`` (FSDP2's offload, or ZeRO-3's with DeepSpeed's CPU Adam) shard it in a
    process group of one, as ``actor.strategy`` and ``actor.cpu_offload`` do: fp32 master weights with bf16
    compute on a GPU, sampled from the engine's bf16 copy, refreshed within the update's time."""
    from concurrent.futures import ThreadPoolExecutor

    from longqa.config import load_config
    from longqa.distributed.env import DistEnv, leave_group
    from longqa.model.compile_watch import CompileWatch
    from longqa.model.load import compile_decoder_layers, compiled_graphs, pick_device
    from longqa.rollout.base import SamplingParams, weights_version
    from longqa.rollout.fast import FastRolloutEngine
    from longqa.train import algo
    from longqa.train.actor import Actor, Samples

    if overlap and profile:
        raise ValueError("profile times the phases one after the other: it cannot run with overlap")
    dev = pick_device(device, "--device")
    sharded = strategy == "deepspeed" or cpu_offload
    began = time.perf_counter()

    def done(stage: str) -> None:  # on stderr as each set-up stage ends: a run stopped early says how far it got
        print(f"bench step: {stage} after {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)

    own_group = DistEnv().init(dev, alone=sharded)
    bf16 = dev.type == "cuda"
    model = random_model(shape, dev, torch.float32 if sharded or not bf16 else torch.bfloat16, gradient_checkpointing)
    engine = FastRolloutEngine(
        model, own_copy=sharded or overlap, dtype=torch.bfloat16 if sharded and bf16 else None, **(engine_options or {})
    )  # a copy is made before the actor shards the model
    cfg = load_config(
        None,
        [
            f"rollout.n={n}",
            f"data.train_batch_size={prompts_per_step}",
            f"actor.ppo_mini_batch_size={prompts_per_step}",
            f"data.max_response_length={response}",
            f"actor.max_tokens_per_micro_batch={budget or prompt + n * response}",
            "actor.lr=1e-6",
            f"actor.strategy={strategy}",
            f"actor.cpu_offload={str(cpu_offload).lower()}",
            f"actor.attention_backend={backend}",
        ],
    )
    done("model and engine ready")
    actor = Actor(model, cfg, steps, dev)
    done(f"actor ready ({strategy}{', offloaded' if cpu_offload else ''})")
    if dev.type == "cuda":  # as `longqa train` runs it: decoder layers compiled for training, every length first
        compile_decoder_layers(model, with_hooks=strategy != "deepspeed")
        done(f"update compiled for {actor.compile_length_buckets()} packed lengths")
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=response)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    beside = ThreadPoolExecutor(1, "longqa-sampling") if overlap else None
    side = torch.cuda.Stream(dev) if overlap and dev.type == "cuda" else None

    def sample(step: int, at_version: int | None = None):
        """Step ``step``'s prompts and their groups, and the seconds sampling them took."""
        g = torch.Generator().manual_seed(step)
        prompts = [
            torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(prompts_per_step)
        ]
        stop_at = [draw_response_lengths(lengths, n, response, (step, i)) for i in range(prompts_per_step)]
        start = time.perf_counter()
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            groups = engine.generate(
                prompts,
                params,
                seeds=[step * 1000 + i for i in range(prompts_per_step)],
                stop_at=stop_at,
                at_version=at_version,
            )
        if side is not None:  # (beside an update: its own stream, not the device)
            side.synchronize()
        else:
            sync()
        return prompts, groups, time.perf_counter() - start

    results, ahead = [], None
    watch = CompileWatch(engine)
    for step in range(steps):
        sync()
        compiled, captured = compiled_graphs(), engine.graph_captures
        phases = PhaseProfiler(dev) if profile and step == steps - 1 else None
        t0 = time.perf_counter()
        if ahead is None:
            with phases.phase("rollout") if phases else contextlib.nullcontext():
                prompts, groups, rollout_s = sample(step)
        else:  # sampled beside the previous step's update
            prompts, groups, rollout_s = ahead
        t1 = time.perf_counter()
        if step == 0:
            done("first rollout sampled")
        rewards = torch.randint(0, 2, (prompts_per_step * n,), generator=torch.Generator().manual_seed(step)).float()
        advantages, _ = algo.group_advantages(rewards, n)
        samples = Samples(
            [p for p in prompts for _ in range(n)], [s.token_ids for grp in groups for s in grp], advantages, n
        )
        t2 = time.perf_counter()
        pending = None
        if beside is not None and step + 1 < steps:
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(dev))
            pending = beside.submit(sample, step + 1, weights_version(model))
        with phases.phase("update") if phases else contextlib.nullcontext():
            actor.update(samples)
            if dev.type == "cuda":  # (the update's stream: a device-wide wait would wait for the sampling too)
                torch.cuda.current_stream(dev).synchronize()
            t_updated = time.perf_counter()
            ahead = pending.result() if pending is not None else None
            if side is not None:
                torch.cuda.current_stream(dev).wait_stream(side)
            engine.sync_weights()
            sync()
        t3 = time.perf_counter()
        new_tokens = sum(len(s) for s in samples.response_ids)
        made = [[len(s.token_ids) for s in grp] for grp in groups]
        floor = step_floor_s(model.config, prompt, made, engine.kv.groups)
        row = {
            "step": step,
            "shape": shape,
            "strategy": strategy,
            "cpu_offload": cpu_offload,
            "budget": cfg.actor.max_tokens_per_micro_batch,
            "prompts": prompts_per_step,
            "n": n,
            "prompt": prompt,
            "response": response,
            "lengths": lengths,
            "gradient_checkpointing": gradient_checkpointing,
            "overlap": overlap,
            "rollout_s": round(rollout_s, 3),
            "reward_and_advantages_s": round(t2 - t1, 3),
            "update_s": round((t_updated if overlap else t3) - t2, 3),
            "step_s": round(t3 - t0, 3),
            "new_tokens": new_tokens,
            **_length_stats(made),
            "recompiles": compiled_graphs() - compiled,
            "graph_captures": engine.graph_captures - captured,
            "compile_events": watch.news(),  # what the step compiled again (and why) or captured
            **gpu_floors(
                dev,
                {
                    "rollout_floor_s": round(floor["rollout"], 3),
                    "update_floor_s": round(floor["update"], 3),
                    "fraction_of_floor": round((floor["rollout"] + floor["update"]) / (t3 - t0), 3),
                    "update_mfu": round(floor["update"] / ((t_updated if overlap else t3) - t2), 3),
                },
            ),
            "rollout_new_tokens_per_s": round(new_tokens / rollout_s),
            "update_tokens_per_s": round((prompts_per_step * prompt + new_tokens) / (t3 - t2)),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None,
            "backend": actor.backend,
            **({"profile": phases.phases} if phases else {}),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    if beside is not None:
        beside.shutdown()
    if own_group:
        leave_group()
    return results
