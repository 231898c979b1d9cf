"""Measured peak memory of one training micro-batch beside the planner's count of it.

Two real code paths, on random-weight models built from a shape (``model/shapes.py``) with any vocabulary
and number of layers: one micro-batch of the GRPO update (``Actor.accumulate_gradients``: the packed
micro-batch built, its forward, the PPO-clip loss, its backward) and one ``longqa sft`` step (``sft_loss``
and its backward, under the autocast ``longqa sft`` uses on a GPU). Each runs once first, so the weights'
gradients exist and lazy set-up is done, then again while measured; what it allocates above what existed
before is set beside ``activation_bytes`` (``planning/activations.py``), the count the checks use.

How the peak is measured (``peak_bytes``):

- CUDA: the caching allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats``, less what was
  allocated before;
- CPU: torch's profiler with ``profile_memory`` records every allocation and free of the CPU allocator with
  the allocator's running total, which counts only blocks allocated while it records (a block allocated
  before and freed during is not subtracted). Its largest value is the peak of tensor bytes above the state
  at the start, exact to the byte, and it includes the scratch tensors a kernel allocates inside one
  operator, which a ``TorchDispatchMode`` would not see (it sees operators' outputs) nor a tracker of
  storages alive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from longqa.planning.activations import Activations, Compute, sft_activations, update_activations


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes ``fn()`` allocates on ``device`` above what was allocated when it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _cpu_peak_bytes(fn)


def _cpu_peak_bytes(fn) -> int:
    """The CPU allocator's largest running total while ``fn()`` runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            peak = max(peak, fields.total_allocated)
    return peak


@dataclass
class Case:
    """One measured micro-batch: its settings, the count and the measurement."""

    path: str  # "grpo" (the actor's packed update) or "sft"
    shape: str
    layers: int
    vocab: int
    tokens: int  # the budget: actor.max_tokens_per_micro_batch or --batch-tokens
    span: int  # the longest attended block: a pack (prompt and n responses) or a padded row
    recomputed: float
    dtype: str
    autocast: bool
    backend: str
    compiled: bool
    predicted: Activations
    measured: int

    @property
    def ratio(self) -> float:
        """Predicted over measured: at least 1 when the count is an upper bound."""
        return self.predicted.total / self.measured

    def row(self) -> dict:
        """A flat record (for JSON)."""
        out = {k: v for k, v in asdict(self).items() if k != "predicted"}
        return {**out, "predicted": self.predicted.total, "parts": asdict(self.predicted), "ratio": self.ratio}


def _model(
    shape: str,
    device: torch.device,
    dtype: torch.dtype,
    recomputed: float,
    layers: int | None,
    vocab: int | None,
    compiled: bool = False,
):
    """A random-weight model of ``shape`` (``longqa bench``'s) and its sizes as the planner reads them."""
    from longqa.bench.speed import random_model
    from longqa.planning.planner import ModelSizes

    model = random_model(shape, device, dtype, recomputed, compiled, layers=layers, vocab=vocab)
    return model, ModelSizes.from_config(model.config)


def grpo_case(
    shape: str,
    *,
    prompt: int,
    response: int,
    n: int,
    groups: int = 1,
    budget: int | None = None,
    layers: int | None = None,
    vocab: int | None = None,
    recomputed: float = 0.0,
    device: str = "cpu",
    dtype: str | None = None,
    backend: str = "auto",
    compiled: bool = False,
) -> Case:
    """The micro-batches of the GRPO update over ``groups`` groups, each a ``prompt``-token prompt and ``n``
    responses of ``response`` tokens, at a token budget of ``budget`` (default: all of them in one; a smaller one
    cuts them, the largest micro-batch counts), through ``Actor``; ``compiled``: the decoder layers compiled, as
    ``longqa train`` compiles them on a GPU (the first, unmeasured pass compiles them)."""
    from longqa.config import load_config
    from longqa.train.actor import Actor, Samples

    dev = torch.device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    model, sizes = _model(shape, dev, getattr(torch, dtype), recomputed, layers, vocab, compiled)
    budget = budget or groups * (prompt + n * response)
    cfg = load_config(
        None,
        [
            f"rollout.n={n}",
            f"data.max_prompt_length={prompt}",
            f"data.max_response_length={response}",
            f"actor.max_tokens_per_micro_batch={budget}",
            f"data.train_batch_size={groups}",
            f"actor.ppo_mini_batch_size={groups}",
            f"actor.attention_backend={backend}",
        ],
    )
    actor = Actor(model, cfg, 1, dev)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, sizes.vocab, (prompt,), generator=g).tolist() for _ in range(groups)]
    responses = [torch.randint(0, sizes.vocab, (response,), generator=g).tolist() for _ in range(groups * n)]
    samples = Samples([p for p in prompts for _ in range(n)], responses, torch.randn(groups * n, generator=g), n)
    every = list(range(groups * n))

    def step():
        actor.accumulate_gradients(samples, every, None)

    step()
    measured = peak_bytes(step, dev)
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    compute = Compute(dtype_bytes=size, param_bytes=size, compiled=compiled, cuda=dev.type == "cuda")
    head_tokens = max(len(micro.inputs.targets) for micro in actor.micro_batches(samples, every))
    predicted = update_activations(
        sizes,
        compute,
        budget=budget,
        prompt_length=prompt,
        response_length=response,
        n=n,
        backend=actor.backend,
        recomputed=recomputed,
        head_tokens=head_tokens,
    )
    return Case(
        "grpo",
        shape,
        sizes.layers,
        sizes.vocab,
        budget,
        prompt + n * response,
        recomputed,
        dtype,
        False,
        actor.backend,
        compiled,
        predicted,
        measured,
    )


def sft_case(
    shape: str,
    *,
    batch_tokens: int,
    longest: int,
    layers: int | None = None,
    vocab: int | None = None,
    device: str = "cpu",
    autocast: bool | None = None,
) -> Case:
    """One ``longqa sft`` step on float32 weights: ``batch_tokens // longest`` rows padded to ``longest`` tokens,
    the first that long and the others shorter (padded), each a prompt and a response of a quarter of it; under
    bfloat16 autocast where ``longqa sft`` uses it (CUDA), or as asked."""
    from longqa.train.batching import collate_right
    from longqa.train.sft import sft_autocast, sft_loss

    dev = torch.device(device)
    model, sizes = _model(shape, dev, torch.float32, 0.0, layers, vocab)
    rows = max(1, batch_tokens // longest)
    lengths = [longest - (longest // 4) * i // rows for i in range(rows)]
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, sizes.vocab, (length,), generator=g).tolist() for length in lengths]
    ids, _, response = collate_right(sequences, [length - length // 4 for length in lengths], 0)
    ids, labels = ids.to(dev), ids.masked_fill(~response, -100).to(dev)
    autocast = dev.type == "cuda" if autocast is None else autocast

    def step():
        with sft_autocast(dev, autocast):
            loss = sft_loss(model, ids, labels)
        loss.backward()

    step()
    measured = peak_bytes(step, dev)
    compute = Compute(dtype_bytes=2 if autocast else 4, param_bytes=4, autocast=autocast)
    predicted = sft_activations(
        sizes, compute, batch_tokens=batch_tokens, longest=longest, head_tokens=int((labels[:, 1:] != -100).sum())
    )
    return Case(
        "sft",
        shape,
        sizes.layers,
        sizes.vocab,
        batch_tokens,
        longest,
        0.0,
        "float32",
        autocast,
        "sdpa, no mask (right-padded rows)",
        False,
        predicted,
        measured,
    )
