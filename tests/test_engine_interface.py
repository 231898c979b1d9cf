"""The rollout engine interface: the trainer reads what an engine declares and nothing else, so an engine written
against ``RolloutEngine`` alone trains a model through the real trainer, plugged in by ``Trainer(build_engine=)``;
each engine refuses the arguments it cannot honour; the groups sampled ahead keep their checkpoint form."""

import ast
import json
import random
from pathlib import Path

import pytest
import torch
from test_train import overrides, records, tiny_model_dir  # noqa: F401 - a fixture
from tiny_models import tiny_lm

from longqa.config import ConfigError, load_config
from longqa.reward import RewardResult
from longqa.rollout.base import RolloutEngine, Sample, SamplingParams, prompt_seeds
from longqa.train.sampled import SampledAhead, SampledGroup

TRAIN = Path(__file__).resolve().parent.parent / "src" / "longqa" / "train"
THE_ENGINE = ("engine", "self.engine")  # how train/ names the rollout engine (the actor's DeepSpeed engine aside)


def engine_probes(folder: Path) -> list[str]:
    """Where the modules under ``folder`` ask what an engine is rather than what it declares: an engine class
    imported from ``longqa.rollout``, ``isinstance``/``issubclass`` against an engine class, ``getattr``/``hasattr``
    or ``type()`` on the engine, or its ``__class__``; as ``file:line: code``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longqa.rollout"):
                probe = any(a.name.endswith(("Engine", "ENGINES")) and a.name != "RolloutEngine" for a in node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name, args = node.func.id, node.args
                if name in ("isinstance", "issubclass") and len(args) == 2:
                    named = {
                        n.id if isinstance(n, ast.Name) else n.attr
                        for n in ast.walk(args[1])
                        if isinstance(n, (ast.Name, ast.Attribute))
                    }
                    probe = any(n.endswith(("Engine", "ENGINES")) for n in named - {"RolloutEngine"})
                else:
                    probe = name in ("getattr", "hasattr", "type") and bool(args) and ast.unparse(args[0]) in THE_ENGINE
            elif isinstance(node, ast.Attribute):
                probe = node.attr == "__class__" and ast.unparse(node.value) in THE_ENGINE
            else:
                continue
            if probe:
                found.append((path.name, node.lineno, ast.unparse(node)))
    return [f"{name}:{line}: {code}" for name, line, code in sorted(found)]


def test_the_trainer_tests_no_engine_class():
    assert engine_probes(TRAIN) == []


def test_the_check_finds_each_way_of_testing_an_engine_class(tmp_path):
    (tmp_path / "probing.py").write_text(
        "from longqa.rollout.fast import FastRolloutEngine\n"
        "from longqa.rollout.base import RolloutEngine, SamplingParams\n"
        "SEEDED = (FastRolloutEngine,)\n"
        "def f(self, engine):\n"
        "    a = isinstance(self.engine, SEEDED_ENGINES)\n"
        "    b = isinstance(engine, (fast.FastRolloutEngine, int))\n"
        "    c = getattr(self.engine, 'graph_captures', 0)\n"
        "    d = hasattr(engine, 'close')\n"
        "    e = type(self.engine).__name__ == 'X' or self.engine.__class__\n"
        "    f = getattr(self.actor.engine, 'module', None) and isinstance(self.engine, RolloutEngine)\n"
    )
    assert [line.split(": ")[0] for line in engine_probes(tmp_path)] == [
        "probing.py:1",
        "probing.py:5",
        "probing.py:6",
        "probing.py:7",
        "probing.py:8",
        "probing.py:9",
        "probing.py:9",
    ]


class Scripted(RolloutEngine):
    """An engine written against the interface alone: each sample a few token ids drawn from its prompt's seed,
    with made-up log-probs. It declares seeded samples and no other capability."""

    seeded = True

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.calls: list[dict] = []

    def generate(self, prompts, params, generator=None, *, seeds=None, stop_at=None, at_version=None):
        self.check_request(seeds, stop_at)
        self.calls.append({"prompts": len(prompts), "seeded": seeds is not None})
        groups = []
        for seed in prompt_seeds(len(prompts), generator, seeds):
            draw, group = random.Random(seed), []
            for _ in range(params.n):
                tokens = [draw.randrange(self.vocab) for _ in range(draw.randint(1, params.max_new_tokens))]
                finish = "length" if len(tokens) == params.max_new_tokens else "stop"
                logprobs = [-draw.random() for _ in tokens] if params.return_logprobs else None
                group.append(Sample(tokens, finish, logprobs))
            groups.append(group)
        return groups


def scripted(cfg, model, tokenizer, **where) -> Scripted:
    return Scripted(len(tokenizer))


def test_an_engine_of_one_s_own_trains_through_the_trainer_unchanged(tiny_model_dir, data_dir, tmp_path):
    """Plugged in through ``Trainer(build_engine=...)``, the scripted engine's samples train the tiny model one
    GRPO step (a reward that prefers odd lengths gives them different advantages); the step's metrics come out as
    any engine's, the trainer seeds each prompt as it does for a seeded engine, and ends the run with ``close``."""
    from longqa.train.trainer import Trainer

    scorer = tmp_path / "odd.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    run = tmp_path / "run"
    cfg = load_config(
        None,
        overrides(
            tiny_model_dir,
            data_dir,
            run,
            **{
                "trainer.max_steps": 1,
                "trainer.test_freq": 0,
                "trainer.save_freq": 0,
                "rollout.n": 4,
                "reward.path": scorer,
            },
        ),
    )
    trainer = Trainer(cfg, build_engine=scripted)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.run()
    assert result["steps"] == 1 and isinstance(trainer.engine, Scripted)
    assert trainer.engine.calls == [{"prompts": 4, "seeded": True}]
    [row] = records(run)
    for key in (
        "reward/mean",
        "reward/std",
        "response_length/mean",
        "response/truncated",
        "zero_variance_groups",
        "grad_norm",
        "lr",
        "entropy",
    ):
        assert key in row, key
    assert 0 < row["reward/mean"] < 1 and row["zero_variance_groups"] < 4
    moved = [not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters())]
    assert any(moved)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"rollout.response_lengths": "lognormal"},
            r"needs an engine that ends a sample at a drawn length "
            r"\(ends_at_given_lengths\), which the engine built does not",
        ),
        ({"rollout.mode": "one_step_off", "rollout.overlap": "true"}, "needs an engine with weights of its own"),
    ],
)
def test_an_engine_lacking_what_the_settings_ask_is_refused(tiny_model_dir, data_dir, tmp_path, settings, message):
    from longqa.train.trainer import Trainer

    cfg = load_config(None, overrides(tiny_model_dir, data_dir, tmp_path / "run", **settings))
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg, build_engine=scripted)


def test_an_engine_refuses_the_arguments_it_does_not_declare():
    """The reference engine draws from a generator (not per-prompt seeds) and cannot end samples at given lengths;
    it samples the training model itself, so only that model's weights version. vLLM cannot end samples at given
    lengths either (refused before vLLM is reached). The fast engine takes both."""
    from longqa.rollout.base import StaleWeightsError
    from longqa.rollout.fast import FastRolloutEngine
    from longqa.rollout.hf import HFRolloutEngine
    from longqa.rollout.vllm_engine import VLLMRolloutEngine

    model = tiny_lm("llama")
    params = SamplingParams(n=2, max_new_tokens=3)
    reference = HFRolloutEngine(model)
    assert not reference.seeded and not reference.ends_at_given_lengths and not reference.holds_own_weights
    with pytest.raises(ValueError, match="HFRolloutEngine does not seed each prompt's samples"):
        reference.generate([[5, 6]], params, seeds=[1])
    with pytest.raises(ValueError, match=r"HFRolloutEngine cannot end samples at given lengths \(stop_at\)"):
        reference.generate([[5, 6]], params, stop_at=[[1, 2]])
    with pytest.raises(StaleWeightsError, match="asked to sample weights version 3"):
        reference.generate([[5, 6]], params, torch.Generator().manual_seed(0), at_version=3)
    assert len(reference.generate([[5, 6]], params, torch.Generator().manual_seed(0), at_version=0)) == 1
    unbuilt = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # (vLLM itself need not be installed)
    assert unbuilt.seeded and unbuilt.holds_own_weights and not unbuilt.ends_at_given_lengths
    with pytest.raises(ValueError, match=r"VLLMRolloutEngine cannot end samples at given lengths \(stop_at\)"):
        unbuilt.generate([[5, 6]], params, seeds=[1], stop_at=[[1, 2]])
    fast = FastRolloutEngine(model)
    assert fast.seeded and fast.ends_at_given_lengths and not fast.holds_own_weights and fast.answers_validation
    [group] = fast.generate([[5, 6]], params, seeds=[1], stop_at=[[1, 2]])
    assert [len(s.token_ids) for s in group] == [1, 2]


def test_groups_sampled_ahead_keep_their_checkpoint_form():
    """What ``trainer_state.json`` holds under ``sampled_ahead``: plain lists, keys in this order, and the same
    groups back from it."""
    groups = [
        SampledGroup(
            3,
            [9, 8],
            [Sample([1, 2], "stop", [-0.5, -0.25]), Sample([4], "length", [-1.0])],
            [RewardResult(1.0, None), RewardResult(0.0, "no_boxed")],
        )
    ]
    ahead = SampledAhead(step=2, groups=groups, stats={"dropped_groups": 1}, sampled_with=1)
    saved = json.loads(json.dumps(ahead.state([g.state() for g in groups])))
    assert saved == {
        "step": 2,
        "sampled_with": 1,
        "stats": {"dropped_groups": 1},
        "groups": [
            {
                "index": 3,
                "samples": [[[1, 2], "stop", [-0.5, -0.25]], [[4], "length", [-1.0]]],
                "results": [[1.0, None], [0.0, "no_boxed"]],
            }
        ],
    }
    assert list(saved) == ["step", "sampled_with", "stats", "groups"]
    back = SampledAhead.from_state(saved, [SampledGroup.from_state(g, [9, 8]) for g in saved["groups"]])
    assert back == ahead
