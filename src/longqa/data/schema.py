"""The verl row schema that every longqa data file uses.

A row is what verl's RL datasets read: ``data_source`` (str), ``prompt`` (a list of chat messages),
``ability`` (str), ``reward_model`` (``{"style": "rule", "ground_truth": str | list[str]}``) and
``extra_info`` (a dict). Keeping exactly this shape is what lets files move between longqa and verl
unchanged, so validation here accepts what verl writes and rejects only what would break training.
"""

from __future__ import annotations

from typing import Any

VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")

# The reference recipe's system message: reasoning in <think>, the answer in \boxed{}.
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
    "\\boxed{} tags, respectively, i.e., <think> reasoning process here </think> \\boxed{answer here}."
)

CHAT_ROLES = ("system", "user", "assistant", "tool")

# The recipe's user message for plain multi-hop QA: the passages under this line, then the question.
QA_PREFIX = "The following are given passages.\n"


def with_system_prompt(messages: list[dict], system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Prepend the system message, as the recipe does to every LoongRL row; messages that open with a system
    message of their own keep it alone (a local copy already prepared, say), not two of them."""
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def question_suffix(question: str) -> str:
    """What follows the passages in a QA user message; kept apart so generators can count its tokens."""
    return f"\n\nQuestion: {question}"


def qa_user_message(passages: str, question: str) -> str:
    """The user message of a plain QA row, as the recipe's rows have it: a model trained on them reads
    any other source's passages and question best in this same shape."""
    return QA_PREFIX + passages + question_suffix(question)


def make_row(
    data_source: str,
    messages: list[dict],
    ground_truth: str | list[str],
    ability: str = "longcontext_qa",
    extra_info: dict | None = None,
) -> dict:
    """One row in verl's schema, with the column order verl recipes write."""
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": dict(extra_info or {}),
    }


def row_problem(row: Any) -> str | None:
    """Why a row cannot be trained on, or None when it can.

    Accepts everything verl itself writes: ground truth as a string or a non-empty list of strings,
    a missing ``ability`` or ``extra_info``, and extra columns (which are ignored).
    """
    if not isinstance(row, dict):
        return f"a row must be a mapping, got {type(row).__name__}"
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        return "'data_source' must be a non-empty string"
    prompt = row.get("prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return "'prompt' must be a non-empty list of chat messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"'prompt[{i}]' must be a mapping with 'role' and 'content'"
        if message.get("role") not in CHAT_ROLES:
            return f"'prompt[{i}].role' is {message.get('role')!r}; allowed: {', '.join(CHAT_ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"'prompt[{i}].content' must be a string"
    if not any(m["role"] == "user" for m in prompt):
        return "'prompt' has no user message"
    reward = row.get("reward_model")
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        return "'reward_model' must be a mapping with a 'ground_truth'"
    truth = reward["ground_truth"]
    if isinstance(truth, str):
        if not truth.strip():
            return "'reward_model.ground_truth' is empty"
    elif isinstance(truth, (list, tuple)):
        if not truth or not all(isinstance(t, str) and t.strip() for t in truth):
            return "'reward_model.ground_truth' must be a non-empty list of non-empty strings"
    else:
        return f"'reward_model.ground_truth' must be a string or a list of strings, got {type(truth).__name__}"
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        return "'ability' must be a string"
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        return "'extra_info' must be a mapping"
    return None


def verl_columns_only(row: dict) -> dict:
    """Keep only verl's columns (the recipe drops every other column of the source subsets)."""
    return {k: row[k] for k in VERL_COLUMNS if k in row}
