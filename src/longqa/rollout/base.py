"""What every rollout engine takes and returns, so the trainer can swap engines without noticing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

ENGINE_KV_SHARE = 0.4  # the fast engine's default KV budget: this share of the GPU memory the model leaves free
# A sampler rank's (rollout.sampler_ranks): no update shares its GPU, so its KV cache takes most of what the model
# leaves; the rest is the prefill's activations, the logits and the decode step's graphs.
SAMPLER_KV_SHARE = 0.85


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample: ``n`` responses per prompt (the GRPO group), each at most ``max_new_tokens`` long.

    ``temperature=0`` is greedy; ``top_k=-1`` and ``top_p=1`` switch those filters off. ``stop_token_ids``
    must list EOS if EOS should stop: engines add nothing of their own. ``max_new_tokens`` has no default
    because a silent cap would cut every response of a run.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    return_logprobs: bool = True

    def __post_init__(self):
        # Lists (from YAML, say) become tuples so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        rules = {
            "n": (_is_int(self.n) and self.n >= 1, "an integer >= 1"),
            "temperature": (_is_real(self.temperature) and self.temperature >= 0, "a number >= 0 (0 means greedy)"),
            "top_p": (_is_real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 (off) or an integer >= 1"),
            "max_new_tokens": (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            "stop_token_ids": (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "non-negative integers"),
            "stop_strings": (all(isinstance(s, str) and s for s in self.stop_strings), "non-empty strings"),
            "return_logprobs": (isinstance(self.return_logprobs, bool), "a bool"),
        }
        for name, (ok, rule) in rules.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Sample:
    """One response. ``token_ids`` excludes the prompt and ends with the stop token when one stopped it, or
    with the token that completed a stop string.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under ``softmax(logits / T)``, with T the
    temperature (1 when greedy) and no top-k/top-p renormalisation: exactly what the trainer recomputes as
    the old policy's log-probs, so the importance ratio starts at 1.
    """

    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    logprobs: list[float] | None = None


VERSION_ATTRIBUTE = "longqa_weights_version"


def weights_version(model) -> int:
    """How many optimizer steps have changed ``model`` (the actor bumps it after each step)."""
    return getattr(model, VERSION_ATTRIBUTE, 0)


def bump_weights_version(model) -> None:
    setattr(model, VERSION_ATTRIBUTE, weights_version(model) + 1)


def prompt_seeds(count: int, generator: "torch.Generator | None" = None, seeds=None) -> list[int]:
    """One seed per prompt for engines that seed each prompt's samples: ``seeds`` as given (checked), or
    drawn from ``generator`` (so the same generator state gives the same samples)."""
    import torch

    if seeds is None:
        device = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**62, (count,), generator=generator, device=device).tolist()
    if len(seeds) != count:
        raise ValueError(f"{len(seeds)} seeds for {count} prompts")
    return list(seeds)


class StaleWeightsError(RuntimeError):
    """An engine holding its own copy of the weights was asked to sample after an update it has not loaded."""


class RolloutEngine(ABC):
    """Samples responses for token-id prompts. The trainer, its validation and the sampler ranks use an engine
    through this class alone: what an engine can do it declares below, and ``generate`` refuses what it cannot
    (``check_request``), so a new engine needs no change to its callers. ``rollout/build.py`` builds the engine a
    config names; ``Trainer(cfg, build_engine=...)`` takes another.

    The declarations are class attributes, or properties where they depend on how the engine was built."""

    seeded: bool = False
    """``generate`` takes ``seeds``, one per prompt, and a prompt's samples depend on its seed alone: not on the
    batch, the slot or the rank that drew them. The trainer then seeds each prompt from (seed, step, prompt), so a
    resumed run, or one on another number of ranks, samples the same; otherwise it hands ``generate`` a
    ``torch.Generator`` seeded from (seed, step), and the samples depend on the prompts' order too."""

    ends_at_given_lengths: bool = False
    """``generate`` takes ``stop_at``: lengths at which samples end as if they had sampled EOS
    (``rollout.response_lengths=lognormal``, for random-weight models that never do)."""

    holds_own_weights: bool = False
    """It samples from weights of its own (a copy, vLLM's, a sampler rank's), loaded by ``sync_weights``, rather
    than from the training model's tensors: it may sample while an update changes those
    (``rollout.overlap``), and refuses (``StaleWeightsError``) to sample a version it has not loaded."""

    answers_validation: bool = False
    """The trainer's greedy validation answers come from it (many prompts at once, from the whole current model
    even where training shards it) rather than from transformers' batched ``generate`` on the training model,
    which beats an engine that answers one prompt at a time (the reference engine)."""

    calls_model_layers: bool = True
    """``generate`` runs the model's own decoder-layer modules in this process. Layers compiled for the update's
    packed shapes would recompile for every shape generation feeds them, so validation through such an engine
    runs them eagerly."""

    compiled_update_layers: bool = False
    """The trainer compiles the update's decoder layers (``actor.compile_layers``, on a GPU) beside this engine:
    where it samples through the fused decode step (``decode_step.py``: the Llama-family layers as functions of
    their weights), here or on sampler ranks, which never calls the compiled modules, and which the memory plan
    (``planning``) counts compiled layers for."""

    graph_captures: int = 0
    """Decode-step graphs captured so far (``perf/graph_captures`` is the step's difference): 0 for an engine that
    captures none."""

    graph_events: Sequence[str] = ()
    """Each capture and each re-sizing that dropped captured graphs, said in a line (``CompileWatch``)."""

    @abstractmethod
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
        """``params.n`` samples for each prompt, in prompt order.

        ``generator``: where the randomness comes from (the same state gives the same samples). ``seeds``, for a
        ``seeded`` engine: one per prompt (drawn from ``generator`` when not given: ``prompt_seeds``).
        ``stop_at[i][j]``, for an engine that ``ends_at_given_lengths``: the length in ``[1, max_new_tokens]`` at
        which sample j of prompt i ends as if it had sampled EOS. ``at_version``: the training model's weights
        version the caller means to sample (default: its version now), named by a caller that samples while an
        update runs beside it, so that the check cannot race the optimizer step; an engine that would sample
        other weights raises ``StaleWeightsError``."""

    def check_request(self, seeds: Sequence[int] | None, stop_at: Sequence[Sequence[int]] | None) -> None:
        """Refuse the arguments of ``generate`` that this engine does not declare it honours: ignored, they would
        change the samples silently."""
        name = type(self).__name__
        if seeds is not None and not self.seeded:
            raise ValueError(f"{name} does not seed each prompt's samples: pass a torch.Generator, not seeds")
        if stop_at is not None and not self.ends_at_given_lengths:
            raise ValueError(f"{name} cannot end samples at given lengths (stop_at)")

    def sleep(self) -> None:
        """Called by the trainer before each update. A no-op by default; an engine colocated with training
        (vLLM on the training GPUs) frees its memory here and takes it back in ``sync_weights``."""

    def sync_weights(self) -> None:
        """Called by the trainer after each optimizer step (and after a resume loads weights). A no-op for
        engines that share the training model's tensors; an engine holding its own copy of the weights (vLLM,
        say) reloads them here."""

    def close(self, finished: bool = True) -> None:
        """Called by the trainer once its run ends (``finished``: without an error). A no-op by default; an
        engine whose sampling runs elsewhere (sampler ranks) tells it that it is done."""
