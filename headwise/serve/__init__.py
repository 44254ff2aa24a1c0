"""`headwise serve`: the OpenAI-compatible API and gateway (needs the [serve] extra).

from headwise.serve import create_app, load_config, default_config
"""

from .app import create_app
from .config import ConfigError, ServeConfig, default_config, load_config, parse_config

__all__ = ["create_app", "ConfigError", "ServeConfig", "default_config", "load_config", "parse_config"]
