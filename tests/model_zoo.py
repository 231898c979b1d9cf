"""Every causal-LM family of the installed transformers as a tiny random model, for the family sweep.

The families are enumerated from transformers' own causal-LM mapping, not chosen. Each family's default
configuration, and its sub-configurations (vision towers), is shrunk by the common size keys (any the
config has), its layer kinds kept one of each (twice where later layers reuse earlier ones' keys and
values), its per-layer sizes cut with them, and its sliding window and soft-caps set small enough to
change the results at test lengths.
A family whose configuration cannot be shrunk this way is reported with the reason (``ZooError``).
"""

from __future__ import annotations

import warnings

import torch

VOCAB = 101
WINDOW = 5  # shorter than the test prompts: a window that is ignored changes the log-probs
ATTENTION_SOFTCAP = 2.0
FINAL_SOFTCAP = 3.0
MAX_PARAMETERS = 3_000_000

SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    ffn_hidden_size=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    d_model=32,
    n_positions=256,
    num_layers=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    v_head_dim=8,
    n_inner=64,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    num_heads=4,
    ffn_dim=64,
    rotary_dim=8,
    partial_rotary_factor=None,
    global_head_dim=8,
    num_global_key_value_heads=2,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=WINDOW,
    attn_logit_softcapping=ATTENTION_SOFTCAP,
    final_logit_softcapping=FINAL_SOFTCAP,
    tie_word_embeddings=False,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    n_group=1,
    topk_group=1,
)
FEATURES = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")  # off stays off
BUILT_FROM = ("global_head_dim", "num_global_key_value_heads")  # arguments a config turns into per-layer sizes


class ZooError(RuntimeError):
    """The family's default configuration could not be made into a tiny model."""


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _left_as_is(name: str, value, current) -> bool:
    """Whether ``name`` keeps the family's value: no tiny value for it, or a feature the family does not have."""
    return name == "partial_rotary_factor" or value is None or (current is None and name in FEATURES)


def _set(config, name, value) -> None:
    if not hasattr(config, name) or _left_as_is(name, value, getattr(config, name)):
        return
    try:
        setattr(config, name, value)
    except Exception:  # read-only properties of some configurations
        pass


def _distinct_kinds(kinds: list) -> list:
    """One layer of each kind (two of the only kind), in their order."""
    distinct = list(dict.fromkeys(kinds))
    return distinct if len(distinct) > 1 else distinct * 2


def _rebuilt_with_per_layer_sizes(cfg, overrides: dict):
    """A configuration with per-layer sizes (Gemma 4: its full-attention layers have a head_dim of their own)
    derives them when it is built, from its layer kinds and global sizes, and refuses a global one set
    afterwards: it is built again from the tiny values instead."""
    values = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in ("per_layer_config", "model_type", "transformers_version", "architectures")
    }
    for name, value in {**SIZES, **overrides}.items():
        if name in BUILT_FROM or (name in values and not _left_as_is(name, value, values[name])):
            values[name] = value
    if isinstance(values.get("layer_types"), list) and values["layer_types"]:
        values["layer_types"] = _distinct_kinds(values["layer_types"])
        values["num_hidden_layers"] = len(values["layer_types"])
    return type(cfg)(**values)


def tiny_config(family: str, **overrides):
    from transformers import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[family]()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if "per_layer_config" in text.to_dict():
            text = _rebuilt_with_per_layer_sizes(text, overrides)
            if config is not text and hasattr(config, "text_config"):
                config.text_config = text
            else:
                config = text
        parts = [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]  # vision towers, ...
        for cfg in {id(c): c for c in (config, text, *parts) if hasattr(c, "to_dict")}.values():
            if "per_layer_config" in cfg.to_dict():
                continue  # built tiny above
            per_layer = _per_layer_lists(cfg)
            for name, value in {**SIZES, **overrides}.items():
                _set(cfg, name, value)
            if getattr(cfg, "kv_lora_rank", None):  # latent attention expands keys per query head
                _set(cfg, "num_key_value_heads", cfg.num_attention_heads)
            kinds = getattr(cfg, "layer_types", None)
            if isinstance(kinds, list) and kinds:
                kinds = _distinct_kinds(kinds)
                if getattr(cfg, "num_kv_shared_layers", None):  # the last layers reuse earlier ones' keys and
                    _set(cfg, "num_kv_shared_layers", len(kinds))  # values: one layer of each kind shares
                    kinds = kinds * 2
                _set(cfg, "num_hidden_layers", len(kinds))
                _set(cfg, "layer_types", kinds)
            for name in per_layer:  # one entry a layer, the tiny size where the common keys set one
                value = getattr(cfg, name)
                _set(
                    cfg,
                    name,
                    value[: cfg.num_hidden_layers] if isinstance(value, list) else [value] * cfg.num_hidden_layers,
                )
    return config


def _per_layer_lists(cfg) -> list[str]:
    """Attributes holding one entry per layer (Gemma 3n's MLP sizes and activation sparsity), besides the
    layer kinds: they must shrink with the layer count."""
    layers = len(getattr(cfg, "layer_types", None) or []) or getattr(cfg, "num_hidden_layers", None)
    return [
        name
        for name, value in cfg.to_dict().items()
        if name != "layer_types" and isinstance(value, list) and len(value) == layers and layers > 1
    ]


def tiny_model(family: str, attn_implementation: str = "eager", **overrides):
    """A seeded float32 model of ``family`` (``overrides``: config keys beside the tiny sizes); ``ZooError``
    says why there is none."""
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(family, **overrides)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            raise ZooError(f"{size:,} parameters after shrinking the default configuration")
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        model = model.float().eval()
        model(input_ids=torch.arange(3, 9)[None])  # the model must at least run
        return model
    except ZooError:
        raise
    except Exception as err:
        raise ZooError(f"{type(err).__name__}: {str(err).splitlines()[0][:160]}") from None
