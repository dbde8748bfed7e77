"""The one typed settings tree of inferscale (pydantic-settings); the only reader of environment variables.

May import: pydantic, pydantic-settings, the standard library.
"""

from config.settings import EncodingSettings, ModelSettings, Settings, load_settings

__all__ = ["EncodingSettings", "ModelSettings", "Settings", "load_settings"]
