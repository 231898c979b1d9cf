"""The rollout engine a config names (``rollout.*``), built for where it runs: one function, which the trainer and
the sampler ranks call, so that neither names an engine's class or its settings."""

from __future__ import annotations

from typing import Protocol

from longqa.config import Config
from longqa.config.checks import logprobs_mode_for
from longqa.distributed.env import Split
from longqa.model.load import resolve_model_path
from longqa.rollout.base import SAMPLER_KV_SHARE, RolloutEngine
from longqa.rollout.fast import FastRolloutEngine
from longqa.rollout.hf import HFRolloutEngine
from longqa.rollout.remote import RemoteRolloutEngine
from longqa.rollout.vllm_engine import VLLMRolloutEngine


class EngineBuilder(Protocol):
    """What builds a run's engine: ``build_engine``, or a function of one's own passed as
    ``Trainer(cfg, build_engine=...)`` (it may ignore the keywords that do not concern its engine). The trainer
    uses what it returns through ``RolloutEngine`` alone."""

    def __call__(
        self,
        cfg: Config,
        model,
        tokenizer,
        *,
        split: Split | None = None,
        prompt_tokens: int = 0,
        own_copy: bool = False,
    ) -> RolloutEngine: ...


def build_engine(
    cfg: Config, model, tokenizer, *, split: Split | None = None, prompt_tokens: int = 0, own_copy: bool = False
) -> RolloutEngine:
    """``rollout.engine`` on ``model``, the training model, before the actor shards it (an engine that copies it or
    loads it into vLLM takes the whole weights; later syncs gather them).

    ``split``: the job's ranks when some of them only sample (``rollout.sampler_ranks``): on a training rank the
    engine that asks this rank's sampler, on a sampler rank the fast engine that serves them, its KV stores taking
    most of what the model leaves of the GPU (no update shares it). ``prompt_tokens``: the longest prompt the run
    will send, which the fast engine's KV stores hold from the first step on. ``own_copy``: the fast engine keeps
    weights of its own, where training shards the model or updates it while the engine samples
    (``rollout.overlap``)."""
    if split is not None:
        if split.is_sampler:
            return fast_engine(cfg, model, tokenizer, kv_share=SAMPLER_KV_SHARE)
        return RemoteRolloutEngine(model, split, prompt_tokens=prompt_tokens)
    engine = cfg.rollout.engine
    if engine == "fast":
        return fast_engine(cfg, model, tokenizer, prompt_tokens=prompt_tokens, own_copy=own_copy)
    if engine == "vllm":
        return vllm_engine(cfg, model)
    return HFRolloutEngine(model, tokenizer)


def fast_engine(cfg: Config, model, tokenizer, **options) -> FastRolloutEngine:
    """The fast engine on ``model`` as ``rollout.*`` sets it up (``options``: where it runs, e.g. ``own_copy``)."""
    r = cfg.rollout
    return FastRolloutEngine(
        model,
        tokenizer,
        kv_cache_bytes=r.kv_cache_bytes,
        cuda_graphs=r.cuda_graphs,
        speculative=None if r.speculative == "off" else r.speculative,
        num_speculative_tokens=r.num_speculative_tokens,
        prompt_lookup_min=r.prompt_lookup_min,
        prompt_lookup_max=r.prompt_lookup_max,
        **options,
    )


def vllm_engine(cfg: Config, model) -> VLLMRolloutEngine:
    """An in-process vLLM engine loaded with ``model``'s weights. Its context ends at the run's longest prompt and
    response, or at the model's position limit; its log-probs are those of ``logprobs_mode_for`` the sampling
    settings (where none is exact the trainer does not ask for them)."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    logprobs_mode = logprobs_mode_for(r.temperature, r.top_k, r.top_p)
    return VLLMRolloutEngine(
        model,
        resolve_model_path(m.path),
        tokenizer_path=m.tokenizer_path,
        dtype=m.dtype,
        tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_bytes=r.kv_cache_bytes,
        free_cache_engine=r.free_cache_engine,
        enforce_eager=r.enforce_eager,
        max_model_len=min(
            d.max_prompt_length + d.max_response_length,
            getattr(model.config, "max_position_embeddings", None) or 1 << 30,
        ),
        logprobs_mode=logprobs_mode or "processed_logprobs",
        seed=cfg.trainer.seed,
    )
