"""Typed configuration of a run: one strict pydantic tree, YAML presets beside it.

Imports nothing of ours; engines receive small pieces of it, never the whole tree.
"""

from rlstages.configs.loader import ConfigError, config_hash, flatten, load_config, to_yaml
from rlstages.configs.run import RunConfig

__all__ = ["ConfigError", "RunConfig", "config_hash", "flatten", "load_config", "to_yaml"]
