"""TRL's GRPOTrainer on the work of a longqa GRPO step: the baseline ``longqa bench step`` is compared with.

The setting users of TRL would pick without vLLM: transformers generation, beta 0 (no reference
model), gradient checkpointing, bf16; a random-weight Qwen3 shape; ``--prompts`` prompts of
``--prompt`` tokens and ``--n`` samples each per step, every completion forced to ``--response``
tokens (``min_new_tokens``). Prints one JSON line per optimizer step with its wall time, measured
around the whole step (generation, rewards, forward and backward, optimizer):

    python benchmarks/trl_grpo_step.py --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2

Compare with ``longqa bench step`` on the same numbers. Needs ``pip install trl datasets``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def prompt_texts(tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """Texts that the tokenizer reads as exactly ``length`` tokens: random words that are one token each
    with their leading space (the pre-tokenizer splits at spaces, so the words never merge)."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if (
            text.startswith(" ")
            and text[1:].isalpha()
            and text[1:].islower()
            and len(text) > 3
            and tokenizer(text, add_special_tokens=False).input_ids == [token_id]
        ):
            words.append(text)
    g = torch.Generator().manual_seed(seed)
    texts = [
        "".join(words[i] for i in torch.randint(0, len(words), (length,), generator=g).tolist()) for _ in range(count)
    ]
    assert all(len(tokenizer(t, add_special_tokens=False).input_ids) == length for t in texts)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        raise SystemExit(f"trl_grpo_step.py needs TRL and datasets ({err}): pip install trl datasets") from None
    from transformers import TrainerCallback

    from longqa.bench.speed import random_model
    from longqa.model.load import EMBEDDED_MODEL, load_model_tokenizer, pick_device

    dev = pick_device("auto")
    cuda = dev.type == "cuda"
    tokenizer = load_model_tokenizer(str(EMBEDDED_MODEL))
    model = random_model(
        args.shape,
        dev,
        torch.bfloat16 if cuda else torch.float32,
        gradient_checkpointing=False,
        min_vocab=len(tokenizer),
    )
    model.config.use_cache = True  # generation with a KV cache; TRL turns checkpointing on for training
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    texts = prompt_texts(tokenizer, args.prompts * args.steps, args.prompt)
    rows = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            rows.append(
                {
                    "engine": "trl GRPOTrainer",
                    "step": state.global_step,
                    "shape": args.shape,
                    "prompts": args.prompts,
                    "n": args.n,
                    "prompt": args.prompt,
                    "response": args.response,
                    "step_s": round(time.perf_counter() - self.start, 2),
                    "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    def reward(completions, **_):  # any varying reward: the work is the same
        return [float(len(c) % 2) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.n,
            num_generations=args.n,
            max_completion_length=args.response,
            beta=0.0,
            gradient_checkpointing=True,
            bf16=cuda,
            use_cpu=not cuda,
            learning_rate=1e-6,
            max_steps=args.steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            temperature=1.0,
            shuffle_dataset=False,
            generation_kwargs={"min_new_tokens": args.response, "use_cache": True},
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            callbacks=[StepTimer()],
        )
        trainer.train()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
