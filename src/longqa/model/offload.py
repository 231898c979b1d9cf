"""Activation offload: a decoder layer's saved activations wait in host memory between its forward and
its backward, instead of on the GPU.

Recomputing a layer (gradient checkpointing) frees its activations for the price of a second forward
pass, a third more of the layer's training FLOPs. Copying them to pinned host memory frees the same
memory for the price of host-device transfers, which run on their own CUDA streams beside the compute:
the first layers' copies out overlap the rest of the forward pass, and their copies back start early in
the backward pass. A Qwen3-8B layer of a 32K-token pack saves about 4 GB: about 75 ms each way at the
55 GB/s an H200's host link measured (benchmarks/RESULTS.md), against about 40 ms of forward and 80 ms
of backward compute per layer.

With k layers offloaded, layer j comes back when the backward pass reaches layer j + k, so each copy
has k layers of backward compute to arrive in. The device then holds at most k + 1 layers' activations
during the backward pass (the k - i brought back early and the i + 1 kept ones not yet freed), no more
than the forward pass's L - k as long as k is under half of the L layers.

Only activations travel: tensors below ``MIN_BYTES`` stay, and so do weights (a saved parameter is a
reference to memory that stays anyway). Each tensor comes back with its shape and strides, since
compiled backward graphs assume the layout they were traced with.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

MIN_BYTES = 1 << 20  # smaller tensors are not worth a transfer


class _Saved:
    """One saved activation: its host copy, and the device copy brought back for the backward pass."""

    __slots__ = ("host", "device", "size", "stride", "ready", "back")

    def __init__(self, host: torch.Tensor, like: torch.Tensor, ready):
        self.host, self.device, self.size, self.stride = host, like.device, like.size(), like.stride()
        self.ready = ready  # CUDA event: the last copy (out, then back) has finished
        self.back: torch.Tensor | None = None


def _is_weight(t: torch.Tensor) -> bool:
    base = t if t._base is None else t._base
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory (a broadcast view would be copied out once per element)."""
    return all(stride or size <= 1 for size, stride in zip(t.size(), t.stride()))


class ActivationOffload:
    """Keeps the activations of layers ``[0, offloaded)`` in host memory. ``run`` is each wrapped layer's
    training forward (transformers calls it where gradient checkpointing's function would go).
    ``bytes_offloaded`` counts the bytes copied out so far, ``late_loads`` the tensors the backward pass
    needed before their copy back had been started."""

    def __init__(self, offloaded: int, lookahead: int | None = None, min_bytes: int = MIN_BYTES):
        self.offloaded, self.min_bytes = offloaded, min_bytes
        self.lookahead = offloaded if lookahead is None else lookahead  # layers between a copy back and its use
        self.pending: dict[int, list[_Saved]] = {}  # per layer, activations not yet brought back
        self.bytes_offloaded = 0
        self.late_loads = 0
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def run(self, index: int, inner, function, *args):
        """Layer ``index``'s forward (``inner``: the layer's recomputing wrapper, if it has one)."""
        call = (lambda: function(*args)) if inner is None else (lambda: inner(function, *args))
        if index < self.offloaded:
            self.pending[index] = []
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, index), self._unpack):
                out = call()
        else:
            out = call()
        hidden = out[0] if isinstance(out, tuple) else out
        if index - self.lookahead < self.offloaded and torch.is_tensor(hidden) and hidden.requires_grad:
            # Fires when the gradient of this layer's output is ready, i.e. as its own backward begins.
            hidden.register_hook(functools.partial(self._bring_back_before, index))
        return out

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _pack(self, index: int, t: torch.Tensor):
        if t.numel() * t.element_size() < self.min_bytes or _is_weight(t) or not _dense(t):
            return t
        ready = None
        if t.device.type == "cuda":
            stream = self._stream(t.device, "out")
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by work queued so far
            with torch.cuda.stream(stream):
                source = t.contiguous()
                host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
                host.copy_(source, non_blocking=True)
                t.record_stream(stream)  # its memory is not reused before the copy has read it
                ready = stream.record_event()
        else:  # already in host memory; copied anyway, so the same path runs everywhere
            host = t.contiguous().clone()
        saved = _Saved(host, t, ready)
        self.pending[index].append(saved)
        self.bytes_offloaded += host.numel() * host.element_size()
        return saved

    def _bring_back_before(self, index: int, grad: torch.Tensor) -> None:
        for layer in range(index, index - self.lookahead - 1, -1):  # the nearest first: needed soonest
            for saved in self.pending.pop(layer, ()):
                self._bring_back(saved)

    def _bring_back(self, saved: _Saved) -> None:
        if saved.back is not None:
            return
        if saved.device.type == "cuda":
            stream = self._stream(saved.device, "back")
            with torch.cuda.stream(stream):
                stream.wait_event(saved.ready)  # the copy out has finished writing the host copy
                back = _restride(saved.host.to(saved.device, non_blocking=True), saved)
                saved.ready = stream.record_event()
        else:
            back = _restride(saved.host.clone(), saved)
        saved.back = back

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.back is None:
            self.late_loads += 1
            self._bring_back(saved)
        back, saved.back = saved.back, None  # the device copy lives as long as the backward uses it
        if back.device.type == "cuda":
            current = torch.cuda.current_stream(back.device)
            current.wait_event(saved.ready)
            back.record_stream(current)
        return back


def _restride(t: torch.Tensor, saved: _Saved) -> torch.Tensor:
    if t.stride() == saved.stride:
        return t
    return torch.empty_strided(saved.size, saved.stride, dtype=t.dtype, device=t.device).copy_(t)


def offload_layers(
    model, fraction: float, lookahead: int | None = None, min_bytes: int = MIN_BYTES
) -> ActivationOffload | None:
    """Keep the activations of the first ``fraction`` of the decoder layers in host memory during
    training; returns the offload (None when no layer is offloaded). Layers recomputed by
    ``checkpoint_layers`` must come after the offloaded ones."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = model.base_model.layers
    count = round(fraction * len(layers))
    if not count:
        return None
    offload = ActivationOffload(count, lookahead, min_bytes)
    for i, layer in enumerate(layers[: count + offload.lookahead]):
        if not isinstance(layer, GradientCheckpointingLayer):
            raise TypeError(
                f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer: its "
                f"activations cannot be offloaded"
            )
        inner = layer._gradient_checkpointing_func if layer.gradient_checkpointing else None
        if i < count and inner is not None:
            raise ValueError(f"decoder layer {i} is both recomputed and offloaded; offloaded layers come first")
        layer._gradient_checkpointing_func = functools.partial(offload.run, i, inner)
        layer.gradient_checkpointing = True  # transformers then calls the function above in training
    return offload
