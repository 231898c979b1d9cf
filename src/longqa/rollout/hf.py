"""The reference rollout engine: plain transformers forwards with our own sampling, one prompt at a time.

It is slow but simple enough to trust; faster engines are tested against it. Per prompt it prefills the
prompt once, copies that KV cache to the ``n`` samples, and decodes the samples together.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from longqa.rollout.base import RolloutEngine, Sample, SamplingParams, StaleWeightsError, weights_version


class HFRolloutEngine(RolloutEngine):
    """Samples from ``model``, the very object the trainer updates, so its weights are always current.

    ``tokenizer`` is needed only for stop strings. ``max_batch_tokens`` caps the tokens of one forward:
    longer prompts are prefilled in chunks of that many tokens, which bounds activation memory.

    Its samples come from one ``torch.Generator`` drawn in prompt order (not seeded per prompt), and it runs the
    model's own modules, one prompt at a time.
    """

    seeded = False
    calls_model_layers = True

    def __init__(self, model, tokenizer=None, max_batch_tokens: int | None = None):
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.cache_kwarg = _cache_kwarg(model)

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
        """``RolloutEngine.generate`` without ``seeds`` or ``stop_at``; ``at_version`` can only be the model's
        version now, since it samples the training model itself."""
        self.check_request(seeds, stop_at)
        if at_version is not None and at_version != weights_version(self.model):
            raise StaleWeightsError(
                f"asked to sample weights version {at_version}, but the training model this "
                f"engine samples is at {weights_version(self.model)}"
            )
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to HFRolloutEngine")
        if generator is not None and generator.device.type != self.model.device.type:
            raise ValueError(f"the generator is on {generator.device} but the model on {self.model.device}")
        prompts = [list(p) for p in prompts]
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        with eval_mode(self.model):
            return [self._generate_one(prompt, params, generator) for prompt in prompts]

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Runs ``input_ids`` on top of ``cache`` (extending it) and returns the last position's logits."""
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self.cache_kwarg: cache})
        return out.logits[:, -1].float()

    def _generate_one(self, prompt: list[int], params: SamplingParams, generator) -> list[Sample]:
        ids = torch.tensor([prompt], device=self.model.device)
        cache = DynamicCache(config=self.model.config)
        chunk = self.max_batch_tokens or len(prompt)
        for start in range(0, len(prompt), chunk):
            logits = self._forward(ids[:, start : start + chunk], cache)
        # The prompt's KV cache is computed once and copied to every sample; the last prompt position's
        # logits give every sample's first token.
        cache.batch_repeat_interleave(params.n)
        logits = logits.expand(params.n, -1)

        samples = [Sample([], "length", [] if params.return_logprobs else None) for _ in range(params.n)]
        active = list(range(params.n))  # the sample each cache row belongs to
        stop_window = max((len(s.encode()) for s in params.stop_strings), default=0) + 8
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_tokens(logits, params, generator)
            step_logprobs = logprobs.tolist() if logprobs is not None else None
            keep = []
            for row, (i, token) in enumerate(zip(active, tokens.tolist())):
                sample = samples[i]
                sample.token_ids.append(token)
                if step_logprobs is not None:
                    sample.logprobs.append(step_logprobs[row])
                if self._stopped(sample.token_ids, params, stop_window):
                    sample.finish_reason = "stop"
                else:
                    keep.append(row)
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(active):  # finished samples leave the batch and the cache
                rows = torch.tensor(keep, device=tokens.device)
                cache.batch_select_indices(rows)
                tokens = tokens[rows]
                active = [active[row] for row in keep]
            logits = self._forward(tokens[:, None], cache)
        return samples

    def _stopped(self, token_ids: list[int], params: SamplingParams, window: int) -> bool:
        """Whether the newest token is a stop token or completes a stop string.

        Only the last ``window`` tokens are decoded: with byte-level tokens a stop string of B bytes spans
        at most B tokens, and the margin covers tokens that decode to nothing. Earlier occurrences would
        have stopped the sample before. Special tokens are skipped, as in the text the reward sees.
        """
        if token_ids[-1] in params.stop_token_ids:
            return True
        if not params.stop_strings:
            return False
        tail = self.tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in params.stop_strings)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of float32 ``logits`` and, if asked, its log-prob under ``softmax(logits / T)``.

    The log-prob ignores top-k/top-p on purpose: the trainer recomputes it from full logits.
    """
    if params.greedy:
        scaled = logits
        tokens = logits.argmax(-1)
    else:
        scaled = logits / params.temperature
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    if not params.return_logprobs:
        return tokens, None
    return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Sets to -inf the tokens outside the ``top_k`` best, then outside the smallest set of the best that
    holds ``top_p`` of the remaining probability (transformers' order: temperature, top-k, top-p)."""
    if 0 < top_k < logits.shape[-1]:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # mass before a token already reaches top_p; never the best
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def response_logprobs(
    model, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float
) -> torch.Tensor:
    """Per-token log-probs of ``response_ids`` after ``prompt_ids`` by one plain forward, as the trainer
    computes them: ``log_softmax(logits / T)`` with T=1 when ``temperature`` is 0. float32, on the model's
    device; equals ``Sample.logprobs`` up to float error."""
    ids = torch.tensor([[*prompt_ids, *response_ids]], device=model.device)
    with eval_mode(model):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(response_ids) + 1).logits[0, :-1].float()
    targets = ids[0, len(prompt_ids) :, None]
    return (logits / (temperature or 1.0)).log_softmax(-1).gather(-1, targets).squeeze(-1)


@contextmanager
def eval_mode(model):
    """Inference mode with dropout off, then the model's training flag as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _cache_kwarg(model) -> str:
    """The forward's cache argument: ``past_key_values`` up to transformers 5.17 at least, ``cache`` by 5.24
    (where the old name still works but warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
