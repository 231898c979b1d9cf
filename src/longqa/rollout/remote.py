"""Sampling on ranks of their own (``rollout.sampler_ranks``): the training ranks' side of the engine interface,
and the loop the sampler ranks run to serve it.

A job of W ranks under torchrun sets its last S apart to sample only; the other W - S train, sharded over a group
of their own (``env.init_split``). A training rank keeps the engine interface: ``RemoteRolloutEngine.generate``
sends its prompts, with their seeds, drawn lengths and the weights version it means to sample, to the sampler rank
that serves it, and waits for the samples; ``sync_weights`` gathers the new weights over the training ranks a
layer at a time (as the colocated engine's refresh does) while training rank 0 broadcasts them to every sampler
in buckets. Every training rank makes the same calls in the same order (the trainer's steps and its validation
are in lockstep), so a sampler that serves several training ranks takes one message from each in turn and
samples all their prompts in one batch; samples are seeded per prompt, so who samples changes none of them.

With ``rollout.mode=one_step_off`` the trainer sends the next step's request from its sampling thread while its
update runs: the samplers sample step k + 1 with the weights of step k while the training ranks update on step
k (verl's one-step-off-policy schedule, on separate devices).
"""

from __future__ import annotations

import pickle
import signal
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist

from longqa.distributed.env import Split
from longqa.distributed.gather import full_parameters
from longqa.rollout.base import (
    VERSION_ATTRIBUTE,
    RolloutEngine,
    Sample,
    SamplingParams,
    StaleWeightsError,
    prompt_seeds,
    weights_version,
)
from longqa.rollout.decode_step import unsupported_reason

BUCKET_BYTES = 256 << 20  # weights broadcast at most this many bytes at a time (plus the tensor that overflows it)


class SamplerError(RuntimeError):
    """A sampler rank failed to sample a training rank's request; its traceback is in the message."""


class RemoteRolloutEngine(RolloutEngine):
    """A training rank's engine when other ranks sample (see the module's docstring). Built before the actor
    shards the model: the samplers hold the weights in the dtype the model was loaded in, which it records.

    It declares what the samplers' fast engine does: seeded samples, drawn lengths, weights of its own, the
    validation's answers, and on the Llama-family layers the fused decode step (so the update's layers compile).
    """

    seeded = True
    ends_at_given_lengths = True
    holds_own_weights = True
    answers_validation = True
    calls_model_layers = False

    @property
    def compiled_update_layers(self) -> bool:
        """Where the samplers' fast engine runs the fused decode step: the same model, so the same answer."""
        return unsupported_reason(self.model) is None

    def __init__(self, model, split: Split, bucket_bytes: int = BUCKET_BYTES, prompt_tokens: int = 0):
        """``prompt_tokens``: the longest prompt the run will send (its data's), passed on to the sampler's engine
        with each request so that its KV stores hold it from the first step on (``FastRolloutEngine``)."""
        self.model, self.split, self.bucket_bytes = model, split, bucket_bytes
        self.prompt_tokens = prompt_tokens
        self.sampler = split.sampler_of(split.job.rank)
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device  # (an offloaded shard's whole tensor may be on the host)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        *,
        seeds: Sequence[int] | None = None,
        stop_at: Sequence[Sequence[int]] | None = None,
        at_version: int | None = None,
    ) -> list[list[Sample]]:
        """As ``FastRolloutEngine.generate``, sampled on this rank's sampler. Sent even for no prompts: the sampler
        takes one message from each training rank it serves in turn."""
        prompts = [list(p) for p in prompts]
        seeds = prompt_seeds(len(prompts), generator, seeds)
        version = weights_version(self.model) if at_version is None else at_version
        reply = self._ask(
            {
                "kind": "generate",
                "prompts": prompts,
                "params": params,
                "seeds": seeds,
                "stop_at": None if stop_at is None else [list(s) for s in stop_at],
                "version": version,
                "prompt_tokens": self.prompt_tokens,
            }
        )
        if "trace" in reply:
            failure = SamplerError(
                f"sampler rank {self.sampler} could not sample for training rank "
                f"{self.split.job.rank}:\n{reply['trace']}"
            )
            if reply["error"] is None:
                raise failure
            raise reply["error"] from failure  # the sampler's own error (a KV budget too small, say), as it was
        return reply["samples"]

    def sync_weights(self) -> None:
        """The model's current weights to every sampler (collective over the training ranks and the samplers)."""
        version = weights_version(self.model)
        _send({"kind": "weights", "version": version}, self.sampler)
        lead = self.split.job.rank == 0
        bucket, size = [], 0
        for name, tensor in full_parameters(self.model):  # (every training rank gathers, in the same order)
            if not lead:
                continue
            bucket.append((name, tensor.detach().to(self.device, self.dtype, copy=True)))
            size += bucket[-1][1].numel() * bucket[-1][1].element_size()
            if size >= self.bucket_bytes:
                self._broadcast(bucket)
                bucket, size = [], 0
        if lead:
            if bucket:
                self._broadcast(bucket)
            dist.broadcast_object_list([[]], src=0, group=self.split.weights_group)  # (the end)

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        manifest = [(name, tuple(tensor.shape)) for name, tensor in bucket]
        dist.broadcast_object_list([manifest], src=0, group=self.split.weights_group)
        dist.broadcast(torch.cat([tensor.reshape(-1) for _, tensor in bucket]), src=0, group=self.split.weights_group)

    def close(self, finished: bool = True) -> None:
        """Tell this rank's sampler that it is done (see ``stop_sampler``)."""
        stop_sampler(self.split, finished)

    def _ask(self, message: dict) -> dict:
        _send(message, self.sampler)
        return _receive(self.sampler)


def stop_sampler(split: Split, finished: bool) -> None:
    """Tell this training rank's sampler that it is done (the sampler stops once every rank it serves said so);
    ``finished``: without an error (else this rank is about to exit, and the sampler must not wait for it)."""
    _send({"kind": "stop", "finished": finished}, split.sampler_of(split.job.rank))


def _send(message, rank: int) -> None:
    dist.send_object_list([message], dst=rank)


def _receive(rank: int):
    box = [None]
    dist.recv_object_list(box, src=rank)
    return box[0]


def receive_weights(model, group) -> None:
    """A sampler's side of ``RemoteRolloutEngine.sync_weights``: the buckets, into ``model``'s parameters."""
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if not box[0]:
            return
        sizes = [torch.Size(shape).numel() for _, shape in box[0]]
        flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        dist.broadcast(flat, src=0, group=group)
        with torch.no_grad():
            for (name, shape), part in zip(box[0], flat.split(sizes)):
                params[name].copy_(part.view(shape))


def serve(engine, split: Split) -> bool:
    """A sampler rank's run: answer the training ranks it serves until each of them says stop. ``engine`` is a
    fast engine on this rank's own model, which the weight broadcasts load. Whether they all finished without an
    error."""
    model = engine.source
    trainers = split.served_by(split.job.rank)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop request is the training ranks' to answer: they say stop
        signal.signal(sig, signal.SIG_IGN)
    while True:
        messages = [_receive(t) for t in trainers]
        kinds = {m["kind"] for m in messages}
        if len(kinds) != 1:
            raise RuntimeError(
                f"sampler rank {split.job.rank}: training ranks {trainers} are out of step "
                f"(asked for {[m['kind'] for m in messages]})"
            )
        kind = kinds.pop()
        if kind == "stop":
            return all(m["finished"] for m in messages)
        if kind == "weights":
            receive_weights(model, split.weights_group)
            setattr(model, VERSION_ATTRIBUTE, messages[0]["version"])
            continue
        try:
            replies = [{"samples": part} for part in _sample(engine, messages)]
        except Exception as error:  # the training ranks raise it, with this traceback, and end the job
            sent = error if _picklable(error) else None
            replies = [{"error": sent, "trace": traceback.format_exc()}] * len(messages)
        for trainer, reply in zip(trainers, replies):
            _send(reply, trainer)


def _picklable(error: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True


def _sample(engine, messages: list[dict]) -> list[list[list[Sample]]]:
    """Every training rank's prompts of one request, sampled in one batch; each rank's samples."""
    held = weights_version(engine.source)
    for message in messages:
        if message["version"] != held:
            raise StaleWeightsError(
                f"asked to sample with weights version {message['version']}, but this sampler holds version {held}"
            )
    params = messages[0]["params"]
    if any(m["params"] != params for m in messages):
        raise ValueError("the training ranks asked for different sampling parameters in one request")
    prompts = [p for m in messages for p in m["prompts"]]
    seeds = [s for m in messages for s in m["seeds"]]
    limited = [m["stop_at"] is not None for m in messages]
    stop_at = [s for m in messages for s in m["stop_at"]] if all(limited) else None
    if any(limited) and not all(limited):
        raise ValueError("the training ranks disagree on drawn response lengths in one request")
    engine.prompt_tokens = max(engine.prompt_tokens, *(m.get("prompt_tokens", 0) for m in messages))
    samples = engine.generate(prompts, params, seeds=seeds, stop_at=stop_at) if prompts else []
    parts, start = [], 0
    for message in messages:
        parts.append(samples[start : start + len(message["prompts"])])
        start += len(message["prompts"])
    return parts
