"""The decode step of Llama-family models (Qwen3, Qwen2, Llama, Mistral) as a few fused kernels per layer.

A decode step moves one token per sample through the model: its matrices are tiny, so the time goes
to kernel count, not arithmetic. Run through the transformers modules, each decoder layer is about
fifty kernels (every RMSNorm is six, rotary ten), which on an H200 costs several times the step's
memory-bandwidth floor even replayed as a CUDA graph. Here each layer is two functions of plain
tensors, the part before attention (norm, projections, q/k norms, rotary) and the part after it
(output projection, residual, norm, MLP, residual), compiled once on a GPU and called for every layer
with that layer's weights as arguments, so one compiled graph serves all layers and every length.

The weights are the model's own parameter tensors (read at each call, so updates made in place by the
optimizer or by ``sync_weights`` are seen). The arithmetic is the transformers modules', operation for
operation; tests hold the step to the module path and to ``generate``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMSNorm: float32 statistics, the weight applied in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(h, cos, sin, norm_w, q_w, q_b, k_w, k_b, v_w, v_b, q_norm_w, k_norm_w, *, eps: float,
                     head_eps: float, heads: int, kv_heads: int, head_dim: int):
    """``h`` ``[rows, hidden]`` -> rotated queries and keys, and values, ``[rows, heads, 1, head_dim]``."""
    rows = h.shape[0]
    x = rms_norm(h, norm_w, eps)
    q = F.linear(x, q_w, q_b).view(rows, heads, head_dim)
    k = F.linear(x, k_w, k_b).view(rows, kv_heads, head_dim)
    v = F.linear(x, v_w, v_b).view(rows, kv_heads, head_dim)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, head_eps), rms_norm(k, k_norm_w, head_eps)
    return rotate(q, cos, sin)[:, :, None], rotate(k, cos, sin)[:, :, None], v[:, :, None]


def layer_output(h, attn, o_w, o_b, norm_w, gate_w, gate_b, up_w, up_b, down_w, down_b, *, eps: float, act):
    """The residual stream after the layer, given its attention output ``attn`` ``[rows, heads * head_dim]``."""
    h = h + F.linear(attn, o_w, o_b)
    x = rms_norm(h, norm_w, eps)
    return h + F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


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
        for module, names in ((layer, ("input_layernorm", "post_attention_layernorm")),
                              (attention, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (mlp, ("gate_proj", "up_proj", "down_proj"))):
            if not all(hasattr(module, n) for n in names):
                return f"a {type(module).__name__} lacks one of {names}"
    return None


class DecodeStep:
    """``forward(ids, positions, kv)`` -> final hidden states ``[rows, hidden]`` of one decode step, with
    attention delegated to ``kv.attend(layer, q, k, v, scaling)``."""

    def __init__(self, model, compiled: bool):
        config, base = model.config, model.base_model
        self.base = base
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = base.layers[0].self_attn.scaling
        first = base.layers[0]
        q_norm = getattr(first.self_attn, "q_norm", None)
        shapes = dict(eps=first.input_layernorm.variance_epsilon,
                      head_eps=q_norm.variance_epsilon if q_norm is not None else 0.0,
                      heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        pre = functools.partial(attention_inputs, **shapes)
        post = functools.partial(layer_output, eps=first.post_attention_layernorm.variance_epsilon,
                                 act=ACTIVATIONS[config.hidden_act])
        # fullgraph: a graph break would silently bring back the kernels this module exists to remove.
        self.pre = torch.compile(pre, fullgraph=True, dynamic=False) if compiled else pre
        self.post = torch.compile(post, fullgraph=True, dynamic=False) if compiled else post

    @staticmethod
    def _pre_weights(layer):
        a = layer.self_attn
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
                a.v_proj.weight, a.v_proj.bias, q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None)

    @staticmethod
    def _post_weights(layer):
        a, m = layer.self_attn, layer.mlp
        return (a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight, m.gate_proj.weight,
                m.gate_proj.bias, m.up_proj.weight, m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        base = self.base
        h = base.embed_tokens(ids)  # [rows, hidden]
        cos, sin = base.rotary_emb(h, positions[:, None])  # [rows, 1, head_dim]: broadcasts over heads
        for index, layer in enumerate(base.layers):
            q, k, v = self.pre(h, cos, sin, *self._pre_weights(layer))
            attn = kv.attend(index, q, k, v, self.scaling)  # [rows, 1, heads, head_dim]
            h = self.post(h, attn.reshape(h.shape[0], -1), *self._post_weights(layer))
        return base.norm(h)
