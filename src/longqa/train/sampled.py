"""What a step trains on: each prompt's sampled group with its rewards, and the groups of the next step sampled
ahead of it (``rollout.mode=one_step_off``), with their form in a checkpoint.

Groups sampled ahead are saved with the checkpoint (``trainer_state.json``'s ``sampled_ahead``): the weights that
drew them are gone by the time a resumed run needs them. The saved form is plain JSON, lists rather than objects,
and leaves the prompt out (the training set gives it back by index).
"""

from __future__ import annotations

from dataclasses import dataclass

from longqa.reward import RewardResult
from longqa.rollout.base import Sample


@dataclass
class SampledGroup:
    """One prompt's GRPO group: its ``n`` samples and each one's reward, in sample order."""

    index: int  # the prompt's row in the training set
    prompt: list[int]  # its token ids
    samples: list[Sample]
    results: list[RewardResult]

    def state(self) -> dict:
        """The group as a checkpoint saves it."""
        return {
            "index": self.index,
            "samples": [[s.token_ids, s.finish_reason, s.logprobs] for s in self.samples],
            "results": [[r.score, r.reason] for r in self.results],
        }

    @classmethod
    def from_state(cls, saved: dict, prompt: list[int]) -> SampledGroup:
        """``state``'s group back, given its prompt's token ids."""
        return cls(
            saved["index"],
            prompt,
            [Sample(tokens, finish, logprobs) for tokens, finish, logprobs in saved["samples"]],
            [RewardResult(score, why) for score, why in saved["results"]],
        )


@dataclass
class SampledAhead:
    """Step ``step``'s groups, sampled before the update of the step before it with the weights after
    ``sampled_with`` steps; ``stats`` are their sampling statistics (dynamic sampling's rounds and dropped groups),
    which that step logs."""

    step: int
    groups: list[SampledGroup]
    stats: dict
    sampled_with: int

    def state(self, groups: list[dict]) -> dict:
        """The record a checkpoint saves, with ``groups`` in their saved form (``SampledGroup.state``): every rank's,
        in rank order."""
        return {"step": self.step, "sampled_with": self.sampled_with, "stats": self.stats, "groups": groups}

    @classmethod
    def from_state(cls, saved: dict, groups: list[SampledGroup]) -> SampledAhead:
        """``state``'s record back, with ``groups`` (this rank's share of its saved ones) restored."""
        return cls(saved["step"], groups, saved["stats"], saved["sampled_with"])
