"""Tiled MLP: each decoder layer's MLP computed over tiles of the sequence (DeepSpeed's ALST calls it TiledMLP).

An MLP computes every token on its own, and the tensors it keeps for its backward pass are the widest of the
layer: the gate, its activation, the up projection and their product, four of ``intermediate_size`` (three to five
times the hidden size) per token. At long rows they, not attention, set a layer's memory. Nothing crosses the
sequence, so the row can be cut into tiles: the forward pass computes each tile without keeping anything but the
MLP's input, which the layer holds anyway; the backward pass computes each tile again and backpropagates it,
writing its input's gradient into one buffer for the row and adding its parameters' gradients into their
``.grad``. The MLP's memory then grows with the tile, not the row, for one more MLP forward pass.

The tile is installed by wrapping each ``layer.mlp``'s forward (no model code is copied), and a call runs the
module's own forward on each tile, so whatever hooks the module's parameters have (FSDP2's unsharding around the
layer, ZeRO-3's gathering around each linear's own forward and backward) fire as they do untiled. Each tile's
tokens go through the same kernels as untiled, so outputs and input gradients are those of the untiled MLP; the
parameters' gradients are sums over the tiles, equal up to float rounding.

A row of at most one tile, a forward pass without grad (sampling, validation), and a forward traced by
``torch.compile`` run the MLP's own forward unchanged: the compiled decoder layers (``actor.compile_layers`` on a
GPU) untile their MLPs first (``untile_mlps``), since a backward pass that runs autograd inside itself cannot be
traced into their graphs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

TILE_MARK = "_longqa_mlp_tile"  # on a tiled MLP module: its tile in tokens
OWN_FORWARD = "_longqa_own_forward"  # on a tiled MLP module: the forward it had before


class TiledMLPError(TypeError):
    """A model's MLP cannot be computed in tiles."""


def _bounds(tokens: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, tokens)) for start in range(0, tokens, tile)]


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device_type`` and its dtype: the backward pass recomputes each tile as the
    forward pass computed it (``longqa sft`` trains under bfloat16 autocast on a GPU)."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return False, None
    return True, torch.get_autocast_dtype(device_type)


def _autocast(device_type: str, state: tuple[bool, torch.dtype | None]):
    enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _tile_output(y) -> torch.Tensor:
    if not torch.is_tensor(y):
        raise TiledMLPError(
            f"an MLP returned {type(y).__name__}, not one tensor: it cannot be tiled; set model.mlp_tile_tokens=0"
        )
    return y


def _zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """The module's ZeRO-3 parameters that train. Where ZeRO-3 hooks a parameter's own gradient (a module that is
    not inside a ZeRO-3 leaf), it reduces the gradient as soon as autograd adds it, unless ``ds_grad_is_ready``
    is False: the tiles but the last set it False, as DeepSpeed's own tiled computations do. (longqa makes each
    decoder layer a leaf, whose gradients ZeRO-3 reduces once the layer's backward pass is done.)"""
    return [p for p in module.parameters() if p.requires_grad and hasattr(p, "ds_id")]


class _TiledMLP(torch.autograd.Function):
    """``module``'s forward ``forward`` over ``x`` one tile of ``tile`` tokens at a time (the module docstring)."""

    @staticmethod
    def forward(ctx, module: nn.Module, forward, tile: int, x: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.forward, ctx.tile = module, forward, tile
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        rows = x.reshape(1, -1, x.shape[-1])  # each tile keeps the [batch, tokens, hidden] form MLPs are called with
        out = None
        for start, end in _bounds(rows.shape[1], tile):
            y = _tile_output(forward(rows[:, start:end]))
            if out is None:
                out = y.new_empty(1, rows.shape[1], *y.shape[2:])
            out[:, start:end] = y
        return out.view(*x.shape[:-1], *out.shape[2:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        rows = x.detach().reshape(1, -1, x.shape[-1])
        grads = grad.reshape(1, rows.shape[1], *grad.shape[x.dim() - 1 :])
        wants_input = ctx.needs_input_grad[3]
        x_grad = torch.empty_like(rows) if wants_input else None
        zero3 = _zero3_params(ctx.module)
        bounds = _bounds(rows.shape[1], ctx.tile)
        try:
            for i, (start, end) in enumerate(bounds):
                for p in zero3:
                    p.ds_grad_is_ready = i == len(bounds) - 1
                piece = rows[:, start:end].detach().requires_grad_(wants_input)
                with torch.enable_grad(), _autocast(x.device.type, ctx.autocast):
                    y = ctx.forward(piece)
                if y.requires_grad:
                    torch.autograd.backward(y, grads[:, start:end])
                if wants_input:
                    x_grad[:, start:end] = piece.grad if piece.grad is not None else 0
        finally:
            for p in zero3:
                p.ds_grad_is_ready = True
        return None, None, None, (x_grad.view_as(x) if wants_input else None)


def _tiled_forward(module: nn.Module, tile: int, x: torch.Tensor, *args, **kwargs):
    """The wrapped forward: tiles where it saves memory (a training forward over more than one tile), the
    module's own forward elsewhere."""
    own = getattr(module, OWN_FORWARD)
    tokens = x.numel() // x.shape[-1] if torch.is_tensor(x) and x.dim() else 0
    if args or kwargs or tokens <= tile or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return own(x, *args, **kwargs)
    return _TiledMLP.apply(module, own, tile, x)


def tile_mlp(module: nn.Module, tile: int) -> None:
    """Compute ``module`` (a decoder layer's MLP) over tiles of ``tile`` tokens in training forwards."""
    if tile < 1:
        raise ValueError(f"an MLP tile holds at least one token, got {tile}")
    if not hasattr(module, OWN_FORWARD):
        setattr(module, OWN_FORWARD, module.forward)
    setattr(module, TILE_MARK, tile)
    module.forward = functools.partial(_tiled_forward, module, tile)


def untile_mlp(module: nn.Module) -> None:
    """Give ``module`` back the forward it had before ``tile_mlp``."""
    if not hasattr(module, OWN_FORWARD):
        return
    own = getattr(module, OWN_FORWARD)
    delattr(module, OWN_FORWARD)
    delattr(module, TILE_MARK)
    if getattr(own, "__self__", None) is module and own.__func__ is type(module).forward:
        del module.forward  # the class's forward again, as before
    else:
        module.forward = own


def tile_mlps(model, tile: int) -> int:
    """Tile the MLP of every decoder layer of ``model`` (``model.mlp_tile_tokens``; 0 untiles them); returns how
    many layers are tiled. A decoder layer without an ``mlp`` module is refused."""
    layers = model.base_model.layers
    if not tile:
        untile_mlps(model)
        return 0
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise TiledMLPError(
                f"decoder layer {i} of {model.config.model_type} has no mlp module to tile; set model.mlp_tile_tokens=0"
            )
        tile_mlp(mlp, tile)
    return len(layers)


def untile_mlps(model) -> int:
    """Give every decoder layer's MLP its own forward back; returns how many were tiled."""
    tiled = 0
    for layer in model.base_model.layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module) and hasattr(mlp, TILE_MARK):
            untile_mlp(mlp)
            tiled += 1
    return tiled


def mlp_tile(model) -> int:
    """The tile the model's MLPs are computed in (0: untiled)."""
    tiles = {getattr(getattr(layer, "mlp", None), TILE_MARK, 0) for layer in model.base_model.layers}
    return max(tiles) if tiles else 0
