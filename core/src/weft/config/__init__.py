"""``weft.toml``: the schema (:mod:`weft.config.schema`) and its loading and validation (:mod:`weft.config.load`).

Import the public names from here: ``from weft.config import WeftConfig, load_config, ConfigError``.
"""

from weft.config.load import (
    OVERRIDE_SOURCE,
    ConfigError,
    load_config,
    parse_override,
    plugin_entries_for_table,
    plugin_options,
    plugin_table,
    plugin_table_key,
    split_key,
    to_builtins,
    validate_plugin_options,
)
from weft.config.schema import (
    DEFAULT_MODEL,
    DERIVED,
    PLATFORM_SIZED,
    DistributedConfig,
    EngineConfig,
    PositiveInt,
    ServerConfig,
    UseConfig,
    WeftConfig,
    executor_name,
    with_platform_defaults,
    world_size,
)

__all__ = [
    "DEFAULT_MODEL",
    "DERIVED",
    "OVERRIDE_SOURCE",
    "PLATFORM_SIZED",
    "ConfigError",
    "DistributedConfig",
    "EngineConfig",
    "PositiveInt",
    "ServerConfig",
    "UseConfig",
    "WeftConfig",
    "executor_name",
    "load_config",
    "parse_override",
    "plugin_entries_for_table",
    "plugin_options",
    "plugin_table",
    "plugin_table_key",
    "split_key",
    "to_builtins",
    "validate_plugin_options",
    "with_platform_defaults",
    "world_size",
]
