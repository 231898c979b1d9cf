"""verl itself on longqa's files and reward: verl's dataset class reads what ``longqa data synth`` and ``longqa
data loongrl`` write and builds the same prompt tokens as longqa's preparation, and verl's reward managers,
pointed at longqa's reward through ``custom_reward_function``, score every response as longqa does.

verl is installed without its dependencies (its metadata pins an older transformers; .ci/run does this),
plus the few its dataset and reward code import (the ``test`` extra). Importing it takes tens of seconds.
"""

import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import longqa.reward
from longqa.cli import main
from longqa.data.io import read_rows, write_rows
from longqa.data.loongrl import SUBSET_PAIRS
from longqa.data.prompts import PromptOptions, prepare_prompts

# verl imports Ray as it loads (the `test` extra installs it; .ci/run installs verl).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None,
        reason="needs verl and Ray, which verl imports: .ci/run installs both (pip install --no-deps verl, and the "
        "test extra)",
    ),
]


@pytest.fixture(scope="module")
def verl():
    """verl's parts, imported when these tests run rather than when the suite is collected: the import is slow
    and sets up logging and Ray variables the other tests need not share."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    from verl.workers.reward_manager import get_reward_manager_cls

    return types.SimpleNamespace(
        **{
            f.__name__: f
            for f in (
                OmegaConf,
                DataProto,
                RewardLoopWorker,
                get_custom_reward_fn,
                RLHFDataset,
                collate_fn,
                create_continuous_token_builder,
                get_reward_manager_cls,
            )
        }
    )


def _responses(truth: str) -> list[str]:
    """Right, wrong, unboxed and adversarial answers to a question whose answer is ``truth``."""
    return [
        f"<think> The passages say so. </think> \\boxed{{{truth}}}",
        "<think> A guess. </think> \\boxed{Nobody Knows}",
        f"<think> Easy. </think> The answer is {truth}.",
        "<think> x </think> \\boxed{}",
        "<think> x </think> \\boxed{.}",
        f"<think> x </think> \\boxed{{{truth.split()[0]}}}",
        f"<think> x </think> \\boxed{{{truth} or Nobody}}",
        f"<think> \\boxed{{{truth}}} </think> I am not sure.",
        f"<think> \\boxed{{{truth}}}",
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The merged train files of ``longqa data synth`` and of ``longqa data loongrl`` (from a local copy)."""
    root = tmp_path_factory.mktemp("verl-files")
    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(root / "synth"),
                "--rows-per-task",
                "4",
                "--context-tokens",
                "256",
                "--max-hops",
                "2",
            ]
        )
        == 0
    )
    source = root / "LoongRL-Train-Data"
    for subset in (s for pair in SUBSET_PAIRS.values() for s in pair):
        write_rows(
            [
                {
                    "input": f"q{i}",
                    "context": "c",
                    "answers": [f"Ans {i}"],
                    "data_source": f"custom_longcontext_needle_qa_{subset}",
                    "ability": "longcontext_qa",
                    "prompt": [
                        {
                            "role": "user",
                            "content": f"The following are given passages.\n{'fact ' * (3 * i)}"
                            f"\n\nQuestion: {subset} {i}?",
                        }
                    ],
                    "reward_model": {"style": "rule", "ground_truth": [f"Van Houten {i}", f"Milhouse {i}"]},
                    "extra_info": {"index": i, "split": "train"},
                }
                for i in range(3)
            ],
            source / subset / "train-00000-of-00001.parquet",
        )
    assert main(["data", "loongrl", "--output-dir", str(root / "loongrl"), "--source", str(source)]) == 0
    return {kind: root / kind / "merged" / "train.parquet" for kind in ("synth", "loongrl")}


def verl_config(verl, tokenizer_dir: Path, train_file: Path, tmp_path: Path, *overrides: str):
    """verl's own trainer config (every default as verl ships it) with a launch line's overrides. Its prompt filter
    runs in this process: datasets 5 forks a pool even for verl's one filter worker, and a fork of a test process
    holding other threads (gloo's, from an earlier test) hung."""
    shipped = Path(importlib.util.find_spec("verl").origin).parent / "trainer/config/_generated_ppo_trainer.yaml"
    reward_file = Path(longqa.reward.__file__)
    return verl.OmegaConf.merge(
        verl.OmegaConf.load(shipped),
        verl.OmegaConf.from_dotlist(
            [
                f"data.train_files=[{train_file}]",
                f"data.cache_dir={tmp_path / 'verl-cache'}",
                "data.filter_overlong_prompts=True",
                "data.filter_overlong_prompts_workers=null",
                f"actor_rollout_ref.model.path={tokenizer_dir}",
                f"reward.custom_reward_function.path={reward_file}",
                "reward.custom_reward_function.name=compute_score",
                *overrides,
            ]
        ),
    )


@pytest.mark.parametrize("kind", ["synth", "loongrl"])
def test_verl_reads_our_files_and_builds_our_prompt_tokens(verl, kind, files, tokenizer, tokenizer_dir, tmp_path):
    path = files[kind]
    lengths = prepare_prompts([path], tokenizer, PromptOptions(10**9)).lengths
    limit = int(np.median(lengths))  # some prompts over the limit, so both filters are exercised
    ours = prepare_prompts([path], tokenizer, PromptOptions(limit))
    assert 0 < len(ours) < len(lengths)
    cfg = verl_config(verl, tokenizer_dir, path, tmp_path, f"data.max_prompt_length={limit}")
    dataset = verl.RLHFDataset(data_files=cfg.data.train_files, tokenizer=tokenizer, config=cfg.data)
    builder = verl.create_continuous_token_builder(tokenizer, hf_model_type="qwen3")  # the rollout's prompt builder
    assert len(dataset) == len(ours)
    for i in range(len(dataset)):
        item = dataset[i]
        assert builder.build_initial_tokens(list(item["raw_prompt"])) == ours.ids(i).tolist()
        assert item["data_source"] == ours.meta[i]["data_source"]
        assert list(item["reward_model"]["ground_truth"]) == list(ours.meta[i]["ground_truth"])


def _rollout_batch(verl, dataset, tokenizer, builder):
    """What verl's rollout hands its reward: left-padded prompts, right-padded responses ending in EOS, and each
    row's columns repeated per response; with each (row, response text) for the reference scores."""
    items, cases, prompts, responses = [], [], [], []
    for i in range(len(dataset)):
        item = dataset[i]
        for text in _responses(item["reward_model"]["ground_truth"][0]):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text  # the text scored is the text written
            items.append(dataset[i])  # a row of its own per response, as verl's repeat makes them
            cases.append((i, text))
            prompts.append(builder.build_initial_tokens(list(item["raw_prompt"])))
            responses.append(ids + [tokenizer.eos_token_id])
    pad = tokenizer.pad_token_id
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    prompt = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    response = torch.tensor([r + [pad] * (width_r - len(r)) for r in responses])
    mask = torch.tensor(
        [
            [0] * (width_p - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (width_r - len(r))
            for p, r in zip(prompts, responses)
        ]
    )
    columns = {k: v for k, v in verl.collate_fn(items).items() if isinstance(v, np.ndarray)}
    data = verl.DataProto.from_dict(
        tensors={
            "prompts": prompt,
            "responses": response,
            "attention_mask": mask,
            "input_ids": torch.cat([prompt, response], dim=1),
        },
        non_tensors=columns,
    )
    return data, cases


@pytest.mark.parametrize("kind, mode", [("synth", None), ("loongrl", None), ("loongrl", "pure_exact_match")])
def test_verl_s_reward_managers_score_through_our_reward_as_we_do(
    verl, kind, mode, files, tokenizer, tokenizer_dir, tmp_path
):
    kwargs = [f"reward.custom_reward_function.reward_kwargs.mode={mode}"] if mode else []
    cfg = verl_config(verl, tokenizer_dir, files[kind], tmp_path, "data.max_prompt_length=4096", *kwargs)
    dataset = verl.RLHFDataset(data_files=cfg.data.train_files, tokenizer=tokenizer, config=cfg.data)
    builder = verl.create_continuous_token_builder(tokenizer, hf_model_type="qwen3")
    data, cases = _rollout_batch(verl, dataset, tokenizer, builder)
    rows = read_rows(files[kind])  # the reference reads the file with longqa's reader, not verl's
    assert len(dataset) == len(rows)
    extra = {"mode": mode} if mode else {}
    expected = [
        longqa.reward.compute_score(
            rows[i]["data_source"], text, rows[i]["reward_model"]["ground_truth"], rows[i]["extra_info"], **extra
        )
        for i, text in cases
    ]

    # The reward loop (verl's trainer path): the custom function loaded by path, the naive manager per response.
    worker = verl.RewardLoopWorker(cfg)
    assert worker.reward_manager.__class__.__name__ == "NaiveRewardManager"
    outputs = worker.loop.run_until_complete(worker.compute_score_batch(data))
    scores = [out["reward_score"] for out in outputs]
    assert scores == expected
    rm_scores = worker.reward_manager.assemble_rm_scores(data, scores)
    # The batch reward manager, fed by the same hook: each score on the response's last token (its EOS).
    batch_manager = verl.get_reward_manager_cls("naive")(
        tokenizer=tokenizer, num_examine=0, compute_score=verl.get_custom_reward_fn(cfg)
    )
    last = data.batch["attention_mask"][:, data.batch["prompts"].shape[1] :].sum(dim=1) - 1
    for tensor in (rm_scores, batch_manager(data)):
        assert tensor.sum(dim=1).tolist() == expected
        assert tensor[torch.arange(len(last)), last].tolist() == expected
    assert 0.0 in expected and 1.0 in expected  # the responses tell right from wrong
    adversarial = [score for (_, text), score in zip(cases, expected) if "\\boxed{}" in text]
    assert set(adversarial) == ({1.0} if mode == "pure_exact_match" else {0.0})  # the mode reached our reward


def test_verl_s_actor_strategies_map_to_longqa_s_or_are_named_in_the_error(tmp_path, tokenizer_dir, files, verl):
    """Every training strategy verl's actor configs define (read from verl itself), and the default of its
    shipped trainer config: FSDP (verl's fsdp or fsdp2) is longqa's fsdp2, and any other is refused naming the
    strategy and what longqa has instead."""
    import dataclasses

    import verl.workers.config.actor as actor_configs

    from longqa.config import ConfigError, load_config

    strategies = {
        field.default
        for cls in vars(actor_configs).values()
        if isinstance(cls, type) and issubclass(cls, actor_configs.ActorConfig)
        for field in dataclasses.fields(cls)
        if field.name == "strategy" and isinstance(field.default, str)
    }
    strategies.discard("???")  # the base class's "must be given"
    shipped = verl_config(verl, tokenizer_dir, files["synth"], tmp_path).actor_rollout_ref.actor.strategy
    assert {"fsdp", "megatron"} <= strategies and shipped == "fsdp"
    for strategy in sorted(strategies | {"fsdp2"}):
        line = [f"actor_rollout_ref.actor.strategy={strategy}"]
        if strategy in ("fsdp", "fsdp2"):
            assert load_config(None, line).actor.strategy == "fsdp2"
            continue
        with pytest.raises(
            ConfigError,
            match=f"actor_rollout_ref.actor.strategy={strategy}: longqa shards the "
            r"actor with FSDP2 \(fsdp, fsdp2\) or DeepSpeed ZeRO-3 \(deepspeed\)",
        ):
            load_config(None, line)
