"""Which reward scores a run: the mode the recipe's environment variable ``REWARD_CALC_TYPE`` names, the one rule
between it and a config's ``reward.mode``, and the line that says what scores.

The recipe picks its reward mode with ``REWARD_CALC_TYPE``; longqa's config picks it with ``reward.mode``. Two
places for one choice is how a run ends up scoring with a mode nobody asked for, so there is one rule: the variable
is the mode's default, and a config that names another mode (in its file or on the command line) is refused, not
quietly preferred. With ``reward.path`` set a function of the user's own scores, reads the variable itself if it
wants it, and ``reward.mode`` scores nothing.
"""

from __future__ import annotations

import os
import typing

from longqa.config.schema import Config, ConfigError, RewardConfig, declared_types


def environment_reward_mode() -> str | None:
    """The reward mode the recipe's environment variable ``REWARD_CALC_TYPE`` names, None when it is unset.
    verl runs of the recipe pick their mode with it, so longqa takes it as the default of ``reward.mode`` and
    of ``longqa eval --mode``; a value that is no mode is refused here rather than scoring every answer 0."""
    from longqa.reward import MODE_ENV

    value = os.environ.get(MODE_ENV)
    if not value:
        return None
    modes = typing.get_args(declared_types(RewardConfig)["mode"])
    if value not in modes:
        raise ConfigError(
            f"the environment variable {MODE_ENV}={value!r} names no reward mode: set it to one of "
            f"{', '.join(modes)}, or unset it"
        )
    return value


def check_environment_mode(cfg: Config, mode_from: str | None) -> None:
    """Refuse a ``reward.mode`` that differs from ``REWARD_CALC_TYPE``'s mode where ``reward.mode`` scores (no
    ``reward.path``). ``mode_from`` says where the config's mode was set (a file, the command line), for the
    message; without it the mode is the variable's own default."""
    from longqa.reward import MODE_ENV

    environment = environment_reward_mode()
    if environment is None or cfg.reward.path is not None or cfg.reward.mode == environment:
        return
    raise ConfigError(
        f"{MODE_ENV}={environment} but reward.mode={cfg.reward.mode} (from {mode_from or 'the settings'}): a run "
        f"scores with one mode; set reward.mode={environment}, or unset {MODE_ENV}"
    )


def what_scores(cfg: Config) -> str:
    """One line saying what scores each response of ``cfg``'s run: ``reward.mode``, or the function of
    ``reward.path``, beside which ``reward.mode`` is unused."""
    reward = cfg.reward
    if reward.path is None:
        return f"each response is scored by longqa.reward in reward.mode={reward.mode}"
    return (
        f"each response is scored by {reward.name} (reward.name) of reward.path={reward.path}; "
        f"reward.mode={reward.mode} is unused"
    )
