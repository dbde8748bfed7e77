"""Settings, read once from `INFERSCALE_*` environment variables (nested with `__`) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    return Path.home() / ".cache" / "inferscale"


class ModelSettings(BaseModel):
    """Which model to load and where converted copies are kept."""

    path: Path | None = Field(None, description="A local HF model directory; None means the bundled SmolLM2-135M-Instruct.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights and K/V dtype on CPU.")
    cache_dir: Path = Field(default_factory=lambda: _default_cache() / "models", description="Converted models live here.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None leaves torch's default.")


class EncodingSettings(BaseModel):
    """Context-window encoding of facts."""

    window: int = Field(5, ge=0, description="Preceding conversation turns each fact is encoded behind (0: independent).")
    max_fact_chars: int = Field(2000, ge=1, description="Longest fact text accepted.")
    max_fact_tokens: int = Field(256, ge=1, description="Longest fact in tokens.")
    max_batch_tokens: int = Field(16384, ge=256, description="Padded tokens per encoding batch.")


class Settings(BaseSettings):
    """The root of the settings tree."""

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", env_nested_delimiter="__", protected_namespaces=())

    model: ModelSettings = Field(default_factory=ModelSettings)
    encoding: EncodingSettings = Field(default_factory=EncodingSettings)
    system_prompt: str = Field(
        "Remembered facts about the user:",
        description="System prompt placed before the memory region.",
    )
    log_level: str = Field("INFO", description="Root log level.")


def load_settings(**overrides: object) -> Settings:
    """Read the environment once; keyword overrides win (used by the CLI flags)."""
    return Settings(**overrides)
