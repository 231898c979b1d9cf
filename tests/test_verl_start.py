"""A verl line without a config file starts from longqa's defaults (not the demo): train says so when no data."""

import argparse

import pytest

from longqa.cli import _check_verl_data, run_config
from longqa.config import ConfigError


def args(*overrides: str) -> argparse.Namespace:
    return argparse.Namespace(config=None, overrides=list(overrides))


def test_a_verl_line_without_data_files_names_the_start_from_verls_defaults():
    given = args("actor_rollout_ref.rollout.n=2")
    with pytest.raises(
        ConfigError,
        match="no data files given: verl keys and no config file: starting from "
        "longqa's defaults .* not the embedded demo",
    ):
        _check_verl_data(given, run_config(given))


def test_longqa_keys_keep_the_demo_and_its_files():
    given = args("rollout.n=2")
    _check_verl_data(given, run_config(given))
