"""Settings: the typed config tree and each key's rule (``schema``), loading a file and ``key=value`` overrides
(``load``), verl's launch-line keys (``verl_keys``), the rules between settings (``checks``), what a machine
supports (``support``), the supervised warm-up's options (``sft_options``) and the rules of command-line options
that are no config key (``command_options``).

The names users and the rest of the package import (``Config``, ``ConfigError``, ``load_config``, ...) are
re-exported here, so ``from longqa.config import load_config`` reads as it always has.
"""

from longqa.config.load import (
    environment_reward_mode,
    key_help,
    load_config,
    load_config_dict,
    read_config_file,
    to_dict,
    to_yaml,
)
from longqa.config.schema import Config, ConfigError, all_keys, checked, parse_override, path_keys

__all__ = [
    "Config",
    "ConfigError",
    "all_keys",
    "checked",
    "environment_reward_mode",
    "key_help",
    "load_config",
    "load_config_dict",
    "parse_override",
    "path_keys",
    "read_config_file",
    "to_dict",
    "to_yaml",
]
