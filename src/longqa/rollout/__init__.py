"""Rollout: sampling the GRPO group of responses for each prompt, behind one engine interface."""

from longqa.rollout.base import RolloutEngine, Sample, SamplingParams
from longqa.rollout.hf import HFRolloutEngine, response_logprobs

__all__ = ["HFRolloutEngine", "RolloutEngine", "Sample", "SamplingParams", "response_logprobs"]
