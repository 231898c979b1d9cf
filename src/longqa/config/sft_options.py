"""The options of ``longqa sft``: one field per command-line flag.

Kept apart from ``train/sft.py`` (which needs torch) so the ``longqa`` command can build its flags without
importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SFTOptions:
    train_files: list[str]
    output_dir: str
    eval_files: list[str] = field(default_factory=list)
    init: str | None = field(
        default=None,
        metadata={
            "help": "continue from this model folder, hub id or GGUF file "
            "(default: none, a new model built on the data)"
        },
    )
    response_key: str = "reference_response"  # inside extra_info
    no_think_fraction: float = 0.0  # this share of responses answer at once: "<think> </think> \\boxed{...}"
    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    max_prompt_length: int = 2048
    # The model's position limit (max_position_embeddings): a new model's default is max(4096, twice
    # max_prompt_length); with --init, a RoPE model's limit can be raised to train it on longer examples.
    max_positions: int | None = field(
        default=None,
        metadata={
            "help": "the model's position limit (default: a new model's max(4096, twice --max-prompt-length); --init's "
            "own)"
        },
    )
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    batch_tokens: int = 131072
    max_steps: int = 100_000
    max_minutes: float = 10.0
    eval_every: int = 500
    eval_rows: int = 512
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        """Refuse sizes and rates no run can use, naming each flag, before any data or model is read."""
        from longqa.config import ConfigError

        counts = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_prompt_length",
            "max_positions",
            "batch_tokens",
            "max_steps",
            "eval_every",
            "eval_rows",
        )
        rules = [
            (counts, "at least 1", lambda v: v >= 1),
            (("no_think_fraction", "min_lr_ratio"), "a fraction from 0 to 1", lambda v: 0 <= v <= 1),
            (("warmup_steps", "weight_decay", "seed"), "at least 0", lambda v: v >= 0),
            (("lr", "max_minutes"), "above 0", lambda v: v > 0),
            (("lr", "max_minutes", "weight_decay"), "a finite number", math.isfinite),
        ]
        problems = [
            f"--{name.replace('_', '-')} must be {what}, got {value}"
            for names, what, ok in rules
            for name in names
            if (value := getattr(self, name)) is not None and not ok(value)
        ]
        if not problems and not self.init:  # the shape of the new model: whole heads, RoPE on pairs of dimensions
            if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
                problems.append(
                    f"--hidden-size {self.hidden_size} must be --num-heads {self.num_heads} times an even head size"
                )
            if self.num_heads % self.num_kv_heads:
                problems.append(
                    f"--num-heads {self.num_heads} must be a multiple of --num-kv-heads "
                    f"{self.num_kv_heads} (each key/value head serves a whole group of query heads)"
                )
        if problems:
            raise ConfigError("; ".join(problems))
