"""Compiled decoder layers see a few static packed lengths, and the compilation counter the trainer logs counts."""

import pytest
import torch
from tiny_models import VOCAB, tiny_lm

from longqa.config import load_config
from longqa.model.attention import BLOCK, LENGTH_BUCKETS, length_step
from longqa.model.compile_watch import CompileWatch
from longqa.model.load import compile_decoder_layers, compiled_graphs
from longqa.rollout.base import SamplingParams
from longqa.rollout.fast import FastRolloutEngine
from longqa.train.actor import Actor, Samples

BUDGET = 16 * 256  # packed rows padded to a multiple of 256 tokens


def test_the_counter_counts_a_forced_recompilation():
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    start = compiled_graphs()
    double(torch.zeros(3))
    double(torch.ones(3))
    assert compiled_graphs() - start == 1
    double(torch.zeros(5))  # a new static shape: compiled again
    assert compiled_graphs() - start == 2


def test_the_watch_says_which_function_was_compiled_again_and_why():
    """Each recompilation since the last look, with the function and the guard that failed; a first compilation
    is not news, nor a call that reuses a graph."""

    def triple(x):
        return x * 3

    compiled = torch.compile(triple, backend="eager", dynamic=False)
    watch = CompileWatch()
    compiled(torch.zeros(3))
    compiled(torch.zeros(3))
    assert watch.news() == []
    compiled(torch.zeros(5))
    compiled(torch.zeros(3))  # (both graphs cached: no news)
    [line] = watch.news()
    assert line.startswith("recompiled triple (test_compile.py:") and "size mismatch" in line
    assert "expected 3, actual 5" in line
    assert watch.news() == []


def test_the_watch_puts_the_rare_failed_guard_before_the_many():
    """A function compiled for several sizes fails one guard per cached graph when it compiles again; grouped, the
    guard that says why (the graph of this very size was built in another mode) comes before the sizes."""

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2 if self.training else x * 3

    module = Scale()
    module.compile(backend="eager", dynamic=False)
    for size in (3, 4, 5):
        module(torch.zeros(size))
    watch = CompileWatch()
    module.eval()(torch.zeros(3))
    [line] = watch.news()
    where, why = line.split(": ", 1)
    assert where.startswith("recompiled forward (test_compile.py:")
    assert why.startswith("self.training == True")
    assert why.endswith("; tensor 'x' size mismatch at index 0. actual 3 (2 cached graphs)")


def test_the_watch_says_when_the_engine_re_sized_its_kv_stores():
    """The fast engine's KV stores grow for a longer prompt than they hold, which drops every captured decode graph
    (on a GPU all are captured again): said, with the sizes before and after."""
    model = tiny_lm("llama")
    engine = FastRolloutEngine(model, max_groups=2)
    params = SamplingParams(n=2, max_new_tokens=3, temperature=0.0)
    watch = CompileWatch(engine)
    engine.generate([[7] * 10, [8] * 20], params)
    first = watch.news()
    assert first == []  # the first allocation is not a re-sizing
    engine.generate([[7] * 300], params)  # the stores hold prompts of up to 256 tokens (the view step)
    [line] = watch.news()
    assert line == (
        "re-sized the KV stores for 1 prompts of up to 512 tokens, 3 new, n=2 (they held 2 groups of "
        "256, 3, n=2): 0 captured decode graphs dropped"
    )
    engine.generate([[7] * 400], params)  # fits what they hold now
    assert watch.news() == []


def test_stores_sized_for_the_longest_prompt_to_come_are_never_re_sized_for_it():
    """Told the longest prompt it will get (a training run's data), the engine holds it from the first call: a later
    call's longer prompt re-sizes nothing, and the samples are those of an engine that was not told."""
    model = tiny_lm("llama")
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    calls = [[[7] * 10, [8] * 20], [[9] * 300, [6] * 40]]
    told, untold = FastRolloutEngine(model, prompt_tokens=300), FastRolloutEngine(model)
    watch = CompileWatch(told)
    for prompts in calls:
        a, b = (engine.generate(prompts, params, seeds=[1, 2]) for engine in (told, untold))
        assert [[s.token_ids for s in group] for group in a] == [[s.token_ids for s in group] for group in b]
    assert watch.news() == [] and told.kv.prompt_cap == 512


def test_a_sampler_rank_s_stores_hold_the_longest_prompt_the_training_ranks_name():
    """A sampler rank (rollout.sampler_ranks) does not load the data: the training ranks name the longest prompt
    in their requests, and its engine's stores hold it from the first request on."""
    from longqa.rollout.base import weights_version
    from longqa.rollout.remote import _sample

    model = tiny_lm("llama")
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    engine = FastRolloutEngine(model)
    watch = CompileWatch(engine)
    for prompts in ([[7] * 10], [[9] * 300]):
        message = {
            "prompts": prompts,
            "params": params,
            "seeds": [1],
            "stop_at": None,
            "version": weights_version(model),
            "prompt_tokens": 300,
        }
        _sample(engine, [message])
    assert watch.news() == [] and engine.kv.prompt_cap == 512


def test_length_step_gives_at_most_the_bucket_count():
    assert length_step(1) == 128 and length_step(BUDGET) == 256
    assert length_step(16384) == 1024 and length_step(16384 + 1) == 1152
    for budget in (300, 5000, 16384, 40000, 147456):
        step = length_step(budget)
        assert step % 128 == 0 and -(-budget // step) <= LENGTH_BUCKETS


def samples(prompt: int, lengths: list[int], seed: int) -> Samples:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (prompt,), generator=g).tolist()
    responses = [torch.randint(1, VOCAB, (r,), generator=g).tolist() for r in lengths]
    return Samples([ids] * len(lengths), responses, torch.zeros(len(lengths)), len(lengths))


# Response lengths of a 40-token prompt's three samples, and the packed length each micro-batch pads to.
CASES = [
    ([5, 9, 20], 256),
    ([30, 2, 11], 256),
    ([50, 60, 70], 256),
    ([100, 100, 100], 512),
    ([120, 120, 150], 512),
    ([200, 200, 200], 768),
]


@pytest.mark.slow
def test_packed_lengths_within_a_bucket_reuse_the_compiled_layers():
    """Varied response lengths pad to a few packed lengths: within a bucket nothing compiles again, each new
    bucket compiles once more (static shapes: no dynamic graph), and the log-probs are the eager model's."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = tiny_lm()
    cfg = load_config(
        None,
        [
            "actor.shared_prompt=true",
            "actor.attention_backend=flex",
            "rollout.n=3",
            f"actor.max_tokens_per_micro_batch={BUDGET}",
            "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
        ],
    )
    eager = Actor(model, cfg, 1, torch.device("cpu"))
    assert [eager.micro_batches(samples(40, lengths, 0), [0, 1, 2])[0].inputs.length for lengths, _ in CASES] == [
        padded for _, padded in CASES
    ]
    reference = [eager.logprobs(samples(40, lengths, seed)) for seed, (lengths, _) in enumerate(CASES)]
    compile_decoder_layers(model, backend="eager")
    actor = Actor(model, cfg, 1, torch.device("cpu"))
    new_graphs = []
    for seed, (lengths, _) in enumerate(CASES):
        before = compiled_graphs()
        got = actor.logprobs(samples(40, lengths, seed))
        new_graphs.append(compiled_graphs() - before)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, reference[seed]))
    assert [count > 0 for count in new_graphs] == [True, False, False, True, False, True], new_graphs


def test_checkpointing_a_fraction_of_the_layers_recomputes_the_first_ones():
    from longqa.model.load import checkpoint_layers

    model = tiny_lm()
    assert checkpoint_layers(model, 0.5) == 1
    assert [layer.gradient_checkpointing for layer in model.base_model.layers] == [True, False]
    model = tiny_lm()
    assert checkpoint_layers(model, 0.0) == 0 and not model.is_gradient_checkpointing


NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled flex_attention with a backward"
)


@pytest.mark.parametrize(
    "device,backend,dtype",
    [
        ("cpu", "split", torch.float32),  # Dynamo's graphs and guards, without Inductor's kernels
        pytest.param("cuda", "flex", torch.float32, marks=NEEDS_CUDA),
        pytest.param("cuda", "split", torch.bfloat16, marks=NEEDS_CUDA),
    ],
)
@pytest.mark.slow
def test_after_compiling_every_length_bucket_no_update_compiles_again(device, backend, dtype):
    """Updates of random prompt and response lengths, off-policy (an old log-prob pass too), after
    ``compile_length_buckets``: no new graph. The model comes in evaluation mode, as a loaded model does: Dynamo
    guards on the mode, so buckets compiled in it would all be compiled again in the update's training mode."""
    budget = 4 * BLOCK  # four length buckets: Inductor compiles each one's forward and backward (minutes for 16)
    model = tiny_lm(head_dim=16).to(device, dtype).eval()
    compile_decoder_layers(model, backend="inductor" if device == "cuda" else "eager")
    cfg = load_config(
        None,
        [
            "actor.shared_prompt=true",
            f"actor.attention_backend={backend}",
            "rollout.n=3",
            f"actor.max_tokens_per_micro_batch={budget}",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",
            "data.max_response_length=100",
        ],
    )
    actor = Actor(model, cfg, 4, torch.device(device))
    assert length_step(budget) == BLOCK and actor.compile_length_buckets() == 4
    g = torch.Generator().manual_seed(0)
    before, watch = compiled_graphs(), CompileWatch()
    for _ in range(6):  # every group (a prompt of 20-199 tokens, three responses of 1-99) fits in one row
        groups = [
            samples(
                int(torch.randint(20, 200, (1,), generator=g)),
                torch.randint(1, 100, (3,), generator=g).tolist(),
                int(torch.randint(0, 99, (1,), generator=g)),
            )
            for _ in range(2)
        ]
        actor.update(
            Samples(
                [p for s in groups for p in s.prompt_ids],
                [r for s in groups for r in s.response_ids],
                torch.randn(6, generator=g),
                3,
            )
        )
    assert compiled_graphs() == before, watch.news()
