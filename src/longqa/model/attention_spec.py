"""What a model's attention and LM head need, read in one place, and refused where longqa cannot honour it.

longqa computes attention itself in two places: the packed shared-prompt update (``model/attention.py``)
and the fast engine's KV store (``rollout/fast.py``). Both replace the attention *mask* a transformers
model would build, so anything a model expresses through its mask or through extra arguments to its
attention function must be reproduced here, or the result is silently wrong. ``inspect_model`` finds
out by running the model once on a few tokens with longqa's dispatcher recording every attention call:

- per layer, the keyword arguments the layer hands its attention function: a sliding window and
  logit soft-capping are implemented (``AttentionSpec``); anything else that changes the result
  (attention sinks, position biases, sparse indices, bidirectional attention) is refused;
- that every decoder layer attends exactly once through the attention interface (a state-space,
  convolution or linear-attention layer would mix tokens across the packed responses);
- that the model reads its positions from ``position_ids`` (the packed layout restarts them per
  response; positions derived from the mask or the input length would be wrong);
- that the logits are the LM head of the last hidden states, up to the scaling and soft-capping
  longqa applies (``LogitsSpec``), since only response positions go through the head;
- and, from the configuration, mask kinds that never reach the attention function as arguments
  (chunked attention, bidirectional layers, non-attention layer types).

A refusal is an ``UnsupportedModelError`` naming the model type and the feature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Layer kinds whose masks longqa builds itself (transformers' ``config.layer_types`` vocabulary).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Arguments a transformers attention module may pass that do not change the result of causal attention
# over the keys it is given (bookkeeping for other kernels, or values longqa reads elsewhere).
NEUTRAL_ARGUMENTS = frozenset(
    {
        "dropout",
        "scaling",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",
        "deterministic",
        "layer_idx",
        "use_cache",
        "cache_position",
        "position_embeddings",
        "past_key_values",
    }
)
PROBE_TOKENS = 8


class UnsupportedModelError(ValueError):
    """The model needs something the packed update or the fast engine does not compute."""


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's rule beyond plain causal softmax attention.

    ``window``: a query at position ``p`` sees keys at positions ``> p - window`` (transformers' sliding
    window). ``softcap``: scores (already scaled) become ``softcap * tanh(score / softcap)``."""

    window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class LogitsSpec:
    """How the model turns the LM head's output into logits: ``logits * scale``, then soft-capped."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass
class ModelSpec:
    """What ``inspect_model`` found: each attention layer's spec (by ``layer_idx``), the key/value shape,
    and the logits rule. ``engine_problem`` says why the fast engine's KV store cannot hold the model."""

    model_type: str
    layers: dict[int, AttentionSpec]
    kv_heads: int
    head_dim: int
    logits: LogitsSpec = field(default_factory=LogitsSpec)
    engine_problem: str | None = None

    @property
    def windows(self) -> set[int | None]:
        return {spec.window for spec in self.layers.values()}


def _refuse(model_type: str, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"longqa cannot train or sample {model_type!r} models exactly: {feature}")


def read_call(module, kwargs: dict) -> AttentionSpec:
    """The spec of one attention call from the keyword arguments its module passed; refuses the rest."""
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    for name, value in kwargs.items():
        if name in NEUTRAL_ARGUMENTS or name in ("sliding_window", "softcap", "is_causal") or value is None:
            continue
        raise _refuse(model_type, f"its attention takes {name!r}, which longqa's attention does not implement")
    causal = kwargs.get("is_causal")
    if causal is None:  # transformers' kernels fall back on the module's own flag
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise _refuse(model_type, "a layer attends bidirectionally (is_causal=False)")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise _refuse(model_type, f"sliding window {window!r} is not a positive integer")
    return AttentionSpec(window=window, softcap=float(softcap) if softcap else None)


def logits_spec(config) -> LogitsSpec:
    """The logit transforms transformers' causal LMs apply after the head: Cohere's ``logit_scale``,
    Granite's ``logits_scaling`` (a divisor) and Gemma's ``final_logit_softcapping``."""
    scale = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitsSpec(scale=scale, softcap=float(softcap) if softcap else None)


def _check_config(config) -> None:
    model_type = config.model_type
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if kinds:
        raise _refuse(
            model_type,
            f"it has {', '.join(kinds)} layers (longqa attends with {' and '.join(ATTENTION_LAYER_TYPES)} layers only)",
        )
    if getattr(config, "attention_chunk_size", None):
        raise _refuse(model_type, "chunked attention (attention_chunk_size) is not implemented")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(model_type, "bidirectional attention is not implemented")


class Recorder:
    """Collects ``(module, spec, query, key, value)`` of each attention call of a probe forward."""

    def __init__(self):
        self.calls: list[tuple] = []


def _decoder_layers(model) -> list:
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        layers = getattr(model.base_model, "h", None)
    return list(layers) if layers is not None else []


@torch.no_grad()
def inspect_model(model) -> ModelSpec:
    """Probe ``model`` (already routed through longqa's dispatcher) once; raise ``UnsupportedModelError``
    for whatever longqa does not compute exactly."""
    config = model.config
    model_type = config.model_type
    _check_config(config)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    if not vocab:
        raise _refuse(model_type, "it has no output embeddings (LM head)")
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % max(1, vocab - 1) + 1
    positions = torch.arange(PROBE_TOKENS, device=device)[None]
    was_training = model.training
    model.eval()
    # Eagerly: traced into compiled decoder layers, the recording would recompile them once per layer.
    with torch.compiler.set_stance("force_eager"):
        try:
            return _probe(model, ids, positions)
        finally:
            model.train(was_training)


def _probe(model, ids, positions) -> ModelSpec:
    model_type = model.config.model_type
    recorder = Recorder()
    try:
        hidden = model.base_model(
            input_ids=ids, position_ids=positions, use_cache=False, longqa_probe=recorder
        ).last_hidden_state
        expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    except UnsupportedModelError:
        raise
    except Exception as err:  # a model that cannot take the probe's arguments cannot take longqa's either
        raise _refuse(
            model_type, f"a forward with position_ids and longqa's arguments fails ({type(err).__name__}: {err})"
        ) from None
    spec = _spec_from_calls(model, recorder.calls)
    _check_positions(model, ids, positions, hidden)
    _check_logits(model, spec.logits, hidden, expected)
    return spec


def _spec_from_calls(model, calls) -> ModelSpec:
    model_type = model.config.model_type
    if not calls:
        raise _refuse(
            model_type,
            "its attention does not go through transformers' attention interface with the forward's keyword arguments",
        )
    modules = [call[0] for call in calls]
    if len({id(m) for m in modules}) != len(modules):
        raise _refuse(model_type, "a layer calls its attention more than once per forward")
    layers = _decoder_layers(model)
    attended = {id(m) for m in modules}
    silent = [i for i, layer in enumerate(layers) if not any(id(m) in attended for m in layer.modules())]
    if silent or (layers and len(modules) != len(layers)):
        raise _refuse(
            model_type,
            f"decoder layers {silent or '?'} do not attend through the attention interface "
            f"(state-space, convolution or linear-attention layers mix tokens across "
            f"the packed responses)",
        )
    specs, shapes = {}, set()
    for index, (module, spec, _, k, v) in enumerate(calls):
        specs[getattr(module, "layer_idx", index)] = spec
        shapes.add((k.shape[1], k.shape[-1], v.shape[-1]))
    if len(specs) != len(calls):
        raise _refuse(model_type, "its attention layers do not have distinct layer_idx")
    kv_heads, head_dim, v_dim = max(shapes)
    problem = None
    if len(shapes) > 1:
        problem = f"its layers differ in key/value heads or widths {sorted(shapes)}"
    elif head_dim != v_dim:
        problem = f"its keys ({head_dim}) and values ({v_dim}) differ in width"
    return ModelSpec(model_type, specs, kv_heads, head_dim, logits_spec(model.config), problem)


def _check_positions(model, ids, positions, hidden) -> None:
    """The last token's hidden state must move when only its position does."""
    moved = positions.clone()
    moved[0, -1] += 3
    other = model.base_model(input_ids=ids, position_ids=moved, use_cache=False).last_hidden_state
    if torch.equal(other[0, -1], hidden[0, -1]):
        raise _refuse(
            model.config.model_type,
            "it does not read token positions from position_ids (the packed layout restarts them at every response)",
        )


def close(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to the rounding of the dtype the model computes in: a relative error (in norm) of 1e-4 in
    float32, 5% in 16-bit types, where different kernels round differently through many layers. What the
    checks look for (positions or masks the packed layout breaks) is an error of order one."""
    tolerance = 1e-4 if expected.dtype == torch.float32 and ours.dtype == torch.float32 else 5e-2
    ours, expected = ours.float(), expected.float()
    error = float((ours - expected).norm() / expected.norm().clamp(min=1e-30))
    return math.isfinite(error) and error <= tolerance


def _check_logits(model, logits: LogitsSpec, hidden, expected) -> None:
    head = model.get_output_embeddings()
    if not close(logits.apply(torch.nn.functional.linear(hidden, head.weight, head.bias).float()), expected):
        raise _refuse(
            model.config.model_type,
            "its logits are not its LM head applied to the last hidden states (up to logit scaling and soft-capping)",
        )
