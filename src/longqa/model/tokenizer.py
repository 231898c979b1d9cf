"""Loading a tokenizer from a local folder or hub id, with errors that say what to do."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot prepare chat prompts."""


def load_tokenizer(path: str | os.PathLike, gguf_file: str | None = None):
    """A fast (Rust-backed) Hugging Face tokenizer with a chat template and a pad token, from a folder or hub
    id, or from the GGUF file ``gguf_file`` inside it.

    Prompt preparation tokenizes hundreds of millions of tokens, so the slow Python tokenizers are
    refused rather than silently used. A tokenizer that names no pad token pads with its EOS token, as verl
    and TRL do: padding only fills places that the attention mask and the loss leave out (the right end of a
    training batch, the left of a greedy one), so which id it is never reaches a loss, a sample or a reward.
    """
    from transformers import AutoTokenizer

    local = Path(os.path.expanduser(str(path)))
    if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
        raise TokenizerError(f"tokenizer path {path} does not exist")
    where = f"{path}/{gguf_file}" if gguf_file else str(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(local) if local.exists() else str(path), **({"gguf_file": gguf_file} if gguf_file else {})
        )
    except Exception as e:
        raise TokenizerError(f"cannot load a tokenizer from {where}: {type(e).__name__}: {e}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TokenizerError(f"the tokenizer at {where} has no fast (tokenizers) backend")
    if not tokenizer.chat_template:
        raise TokenizerError(f"the tokenizer at {where} has no chat template; prompts cannot be rendered")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise TokenizerError(
                f"the tokenizer at {where} has neither a pad nor an EOS token: add a pad token "
                f"to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of everything that decides a prompt's token ids: vocabulary, rules and chat template."""
    h = hashlib.blake2b(digest_size=16)
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


# Qwen's ChatML layout, without tool calls: the format longqa's own small models are trained in.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(texts, vocab_size: int = 2048):
    """A byte-level BPE tokenizer with ChatML specials and template, trained on ``texts``.

    longqa's embedded default model and the tests use it, so nothing has to be downloaded: any
    text can be encoded (byte level), and chat prompts render exactly as with Qwen's tokenizers.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        chat_template=CHATML_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
