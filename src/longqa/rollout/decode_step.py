"""The forward passes of the fast engine for Llama-family models (Qwen3, Qwen2, Llama, Mistral): the decode
step as a few fused kernels per layer, and prefill without the model's modules.

A decode step moves one token per sample through the model: its matrices are tiny, so the time goes
to kernel count, not arithmetic. Run through the transformers modules, each decoder layer is about
fifty kernels (every RMSNorm is six, rotary ten), which on an H200 costs several times the step's
memory-bandwidth floor even replayed as a CUDA graph. Here each layer is two functions of plain
tensors, the part before attention (one stacked q/k/v product, q/k norms, rotary, and the write of the
new keys and values into the KV store, which Inductor fuses into the same kernel) and the part after
it (output projection, residual, norm, one stacked gate/up product, MLP, residual, and the *next*
layer's input norm, which fuses with that residual add), compiled once on a GPU and called for every
layer with that layer's weights as arguments, so one compiled graph serves all layers.

Prefill runs the same functions, compiled for dynamic lengths (one graph for every chunk length), so
the engine never calls the decoder layer modules: the trainer can compile those for training without
the engine's shapes recompiling them. The arithmetic is the transformers modules', operation for
operation; tests hold both to the module path and to ``generate``.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMSNorm: float32 statistics, the weight applied in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(
    x, cos, sin, qkv_w, qkv_b, q_norm_w, k_norm_w, *, head_eps: float, heads: int, kv_heads: int, head_dim: int
):
    """``x`` ``[rows, hidden]`` (already through the layer's input norm) -> rotated queries and keys, and
    values, ``[rows, heads, 1, head_dim]``."""
    rows = x.shape[0]
    q, k, v = F.linear(x, qkv_w, qkv_b).split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    q, k, v = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, head_eps), rms_norm(k, k_norm_w, head_eps)
    return rotate(q, cos, sin)[:, :, None], rotate(k, cos, sin)[:, :, None], v[:, :, None]


def store_and_query(x, cos, sin, qkv_w, qkv_b, q_norm_w, k_norm_w, k_store, v_store, rows, at, **shape):
    """``attention_inputs`` for one decode token per row that writes the row's new key and value into
    its own slot of the KV store (``k_store[rows, :, at]``) and returns only the queries: compiled, the
    write is part of the kernel that computes them instead of two scatter launches of its own."""
    q, k, v = attention_inputs(x, cos, sin, qkv_w, qkv_b, q_norm_w, k_norm_w, **shape)
    k_store[rows, :, at] = k[:, :, 0]
    v_store[rows, :, at] = v[:, :, 0]
    return q


def layer_output(h, attn, o_w, o_b, norm_w, gate_up_w, gate_up_b, down_w, down_b, next_norm_w, *, eps: float, act):
    """The residual stream after the layer, given its attention output ``attn`` ``[rows, heads * head_dim]``,
    and that stream through the next norm (the next layer's input norm, or the final one): computed
    here, the norm fuses into the kernel that adds the residual instead of starting the next layer."""
    h = residual_add(h, F.linear(attn, o_w, o_b))
    gate, up = F.linear(rms_norm(h, norm_w, eps), gate_up_w, gate_up_b).chunk(2, -1)
    h = residual_add(h, F.linear(act(gate) * up, down_w, down_b))
    return h, rms_norm(h, next_norm_w, eps)


def residual_add(h: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``h + update``, written in float32, which is what a bfloat16 add computes (so the result is the same
    bit for bit). Written plainly, Inductor turns a product plus ``h`` into ``addmm``, which for a 2-D
    ``h`` first copies it into the output: one more kernel, twice per layer, where the add could have
    joined the norm kernel that follows."""
    return (h.float() + update.float()).to(h.dtype)


def _own_copy(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object, up to a limit
    of 8 that ``fullgraph`` turns into an error: decode (one graph per batch shape) and prefill (one
    dynamic graph) each compile their own copy rather than share, and exhaust, one cache."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


DECODE_NORM, DECODE_POST = _own_copy(rms_norm), _own_copy(layer_output)
PREFILL_NORM, PREFILL_POST = _own_copy(rms_norm), _own_copy(layer_output)


@functools.cache
def _compiled(fn, dynamic: bool):
    """``fn`` compiled once per process, so every engine reuses the graphs of the shapes already seen.
    ``fullgraph``: a graph break would silently bring back the kernels this module exists to remove."""
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot take the fused step (it then runs through its own modules), or None."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {FAMILIES}"
    if ACTIVATIONS.get(getattr(config, "hidden_act", None)) is None:
        return f"activation {getattr(config, 'hidden_act', None)!r} is not one of {sorted(ACTIVATIONS)}"
    base = model.base_model
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not hasattr(base, name):
            return f"the decoder has no {name}"
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for module, names in (
            (layer, ("input_layernorm", "post_attention_layernorm")),
            (attention, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            if not all(hasattr(module, n) for n in names):
                return f"a {type(module).__name__} lacks one of {names}"
        for stacked in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if len({lin.bias is None for lin in stacked}) > 1:
                return "only some of the projections that read one input have a bias"
    norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if len({getattr(n, "variance_epsilon", None) for n in norms}) > 1:
        return "its RMSNorms do not share one epsilon"
    return None


class FusedLinear:
    """The weights (and biases) of several linears that read the same input, stacked into one matrix so a
    decode step runs one matrix product instead of several.

    ``views=True`` makes the stacked matrix the linears' own storage (their parameters become row blocks
    of it): no extra memory and nothing to copy, for a model only the engine owns and updates in place.
    A model that others also hold (the training model, which may be saved, cast or re-bound) is never
    re-bound: it gets a stacked copy, refilled by ``refresh`` before every generate call."""

    def __init__(self, linears, views: bool):
        self.linears, self.views = linears, views
        biased = [lin.bias is not None for lin in linears]
        if any(biased) and not all(biased):
            raise ValueError("cannot stack linears of which only some have a bias")
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(biased) else None
        if views:
            self._bind()

    def _pairs(self):
        return [(self.weight, "weight")] + ([(self.bias, "bias")] if self.bias is not None else [])

    def _bind(self) -> None:
        for stacked, name in self._pairs():
            start = 0
            for lin in self.linears:
                param = getattr(lin, name)
                param.data = stacked[start : start + param.shape[0]]
                start += param.shape[0]

    def _bound(self) -> bool:
        """Whether every parameter still lives in the stacked storage (a cast or a re-bind breaks that)."""
        return all(
            getattr(lin, name).untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
            for stacked, name in self._pairs()
            for lin in self.linears
        )

    @torch.no_grad()
    def refresh(self) -> None:
        if self.views and self._bound():
            return
        for stacked, name in self._pairs():
            parts = [getattr(lin, name) for lin in self.linears]
            if self.views:  # some parts may still be views of ``stacked``: read them all before writing
                stacked.copy_(torch.cat(parts))
            else:
                torch.cat(parts, out=stacked)
        if self.views:
            self._bind()


class DecodeStep:
    """``decode(ids, positions, kv)`` and ``prefill(ids, positions, kv)`` -> final hidden states of one
    step, attention delegated to ``kv.attend(layer, q, k, v, scaling, spec)``. ``views``: see ``FusedLinear``."""

    def __init__(self, model, compiled: bool, views: bool = False):
        config, base = model.config, model.base_model
        self.base = base
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        first = base.layers[0]
        self.scaling = first.self_attn.scaling
        spec = model.longqa_spec  # the engine routed the model through longqa's attention, which reads it
        self.specs = [spec.layers[index] for index in range(len(base.layers))]
        q_norm = getattr(first.self_attn, "q_norm", None)
        eps = first.input_layernorm.variance_epsilon  # all of them (unsupported_reason)
        shape = dict(
            head_eps=q_norm.variance_epsilon if q_norm is not None else 0.0,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
        )
        # Decode shapes are fixed per KV allocation: one graph each, shared by every layer. Prefill
        # chunks vary in length: one dynamic-shape graph for all of them (eager, its norms, rotary and
        # activation cost as much as its matrix products).
        decode = (lambda fn: _compiled(fn, False)) if compiled else (lambda fn: fn)
        prefill = (lambda fn: _compiled(fn, True)) if compiled else (lambda fn: fn)
        post = dict(eps=eps, act=ACTIVATIONS[config.hidden_act])
        self.decode_fns = (
            functools.partial(decode(DECODE_NORM), eps=eps),
            functools.partial(decode(store_and_query), **shape),
            functools.partial(decode(DECODE_POST), **post),
        )
        self.prefill_fns = (
            functools.partial(prefill(PREFILL_NORM), eps=eps),
            functools.partial(prefill(attention_inputs), **shape),
            functools.partial(prefill(PREFILL_POST), **post),
        )
        self.qkv = [
            FusedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], views)
            for layer in base.layers
        ]
        self.gate_up = [FusedLinear([layer.mlp.gate_proj, layer.mlp.up_proj], views) for layer in base.layers]

    def refresh(self) -> None:
        """Bring the stacked projections up to the model's current weights (before each generate)."""
        for fused in self.qkv + self.gate_up:
            fused.refresh()

    def _weights(self, index: int, layer):
        a, m = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        qkv, gate_up = self.qkv[index], self.gate_up[index]
        layers = self.base.layers
        next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else self.base.norm
        pre = (
            qkv.weight,
            qkv.bias,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
        )
        post = (
            a.o_proj.weight,
            a.o_proj.bias,
            layer.post_attention_layernorm.weight,
            gate_up.weight,
            gate_up.bias,
            m.down_proj.weight,
            m.down_proj.bias,
            next_norm.weight,
        )
        return pre, post

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        """One token per row: ``ids``, ``positions`` ``[rows]`` -> ``[rows, hidden]``. The new keys and
        values go straight into ``kv.own_slot(layer)``; attention gets queries ``[rows, heads, 1,
        head_dim]``."""
        norm, store_pre, post = self.decode_fns

        def attention(index, x, cos, sin, weights):
            q = store_pre(x, cos, sin, *weights, *kv.own_slot(index))
            return kv.attend(index, q, None, None, self.scaling, self.specs[index])

        return self._forward(ids, positions, norm, attention, post)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        """A chunk of one prompt: ``ids``, ``positions`` ``[T]`` -> ``[T, hidden]`` (attention gets
        ``[1, heads, T, head_dim]``)."""
        norm, pre, post = self.prefill_fns

        def attention(index, x, cos, sin, weights):
            q, k, v = (t[:, :, 0].transpose(0, 1)[None] for t in pre(x, cos, sin, *weights))
            return kv.attend(index, q, k, v, self.scaling, self.specs[index])

        return self._forward(ids, positions, norm, attention, post)

    def _forward(self, ids, positions, norm, attention, post) -> torch.Tensor:
        """The residual stream ``h`` and its normed copy ``x`` through every layer; returns the last
        ``x``, which the last layer's ``post`` put through the final norm."""
        base = self.base
        h = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(h, positions[:, None])  # [rows, 1, head_dim]: broadcasts over heads
        x = norm(h, base.layers[0].input_layernorm.weight)
        for index, layer in enumerate(base.layers):
            pre_weights, post_weights = self._weights(index, layer)
            attn = attention(index, x, cos, sin, pre_weights)
            h, x = post(h, attn.reshape(h.shape[0], -1), *post_weights)
        return x
