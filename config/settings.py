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

    path: Path | None = Field(
        None, description="A local HF model directory; None means the bundled SmolLM2-135M-Instruct."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights and K/V dtype on CPU.")
    cache_dir: Path = Field(
        default_factory=lambda: _default_cache() / "models", description="Converted models live here."
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None leaves torch's default.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where transformers runs the model (encoding, demo).")


class EncodingSettings(BaseModel):
    """Context-window encoding of facts."""

    window: int = Field(
        5, ge=0, description="Preceding conversation turns each fact is encoded behind (0: independent)."
    )
    max_fact_chars: int = Field(2000, ge=1, description="Longest fact text accepted.")
    max_fact_tokens: int = Field(256, ge=1, description="Longest fact in tokens.")
    max_batch_tokens: int = Field(16384, ge=256, description="Padded tokens per encoding batch.")
    actors_per_gpu: int = Field(
        2,
        ge=1,
        le=8,
        description="Encoding actors sharing one GPU, so that one's store "
        "writes and embedding overlap another's forward passes.",
    )


class RedisSettings(BaseModel):
    """Where fact metadata lives; without `url` the project starts its own redis-server."""

    url: str | None = Field(None, description="redis://host:port/db of an existing server; None starts a local one.")
    port: int = Field(0, ge=0, le=65535, description="Port of the local server; 0 picks a free private port.")
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "everysec", description="AOF fsync policy of the local server."
    )


class TenantSettings(BaseModel):
    """Per-tenant limits and defaults."""

    max_facts: int = Field(100_000, ge=1, description="Default quota: facts per tenant.")
    max_bytes: int = Field(4 << 30, ge=1, description="Default quota: bytes of fact text and K/V per tenant.")
    max_fact_chars: int = Field(2000, ge=1, description="Longest fact text accepted.")
    reconcile_after_s: float = Field(60.0, ge=0, description="Half-done changes older than this are repaired.")


class ResidencySettings(BaseModel):
    """Which facts keep their K/V (KV residency by use): a fact's K/V stays while it is retrieved often enough to
    pay for its bytes and is dropped to text (served by pasting it) when its memory is over its K/V budget; a
    dropped fact retrieved again `reencode_after_uses` times (decayed) is encoded again in the background."""

    memory_kv_bytes: int | None = Field(
        None,
        ge=0,
        description="K/V bytes one memory (a tenant's own, or one end user's) keeps at most; None: all. A tenant "
        "may set its own (`kv_budget_bytes` when created).",
    )
    node_kv_bytes: int | None = Field(
        None, ge=0, description="K/V bytes all memories of the record store keep at most together; None: all."
    )
    half_life_s: float = Field(86_400.0, gt=0, description="A retrieval counts half as much after this long.")
    reencode_after_uses: float = Field(
        2.0,
        gt=0,
        description="The retrieval of a dropped fact at which it is encoded again, counting earlier ones within "
        "about a half-life (the re-encode cost, in retrievals served by its text).",
    )
    reencode_margin: float = Field(
        1.5,
        ge=1,
        description="Where a memory's budget is full, a dropped fact comes back only once its use is this many "
        "times the coldest kept fact's (hysteresis: facts at the margin do not trade places on every sweep).",
    )
    min_resident_s: float = Field(
        600.0, ge=0, description="A fact encoded or retrieved this recently keeps its K/V whatever the budget."
    )
    sweep_interval_s: float = Field(30.0, gt=0, description="How often one ingress replica applies the budgets.")
    flush_interval_s: float = Field(5.0, gt=0, description="How often each ingress replica adds its counts to Redis.")
    drop_grace_s: float = Field(
        60.0, ge=0, description="A dropped record's files stay this long (chats in flight may still read them)."
    )


class ServeSettings(BaseModel):
    """How Ray Serve carries requests (read by whatever starts Ray: `inferscale up`, tests, benchmarks)."""

    proxy: Literal["haproxy", "python"] = Field(
        "haproxy",
        description="haproxy: Ray Serve's high-throughput mode (HAProxy ingress, direct ingress, gRPC "
        "between replicas); python: Ray Serve's default Python proxy.",
    )
    haproxy_busy_polling: bool = Field(
        False,
        description="HAProxy's threads poll without sleeping (its `busy-polling`: a request is read by a core that "
        "kept running; each HAProxy thread a busy core). Clusters started on this machine (`inferscale up`, tests, "
        "benchmarks), whose HAProxy starts through inferscale's wrapper.",
    )
    recompute: int = Field(
        1,
        ge=0,
        description="Of the facts a chat injects, the best-scored this many are prefilled "
        "after the others instead (selective recomputation) when neither the "
        "chat nor its tenant says; chosen on the quality dev set (docs/quality.md).",
    )


class Settings(BaseSettings):
    """The root of the settings tree."""

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", env_nested_delimiter="__", protected_namespaces=())

    model: ModelSettings = Field(default_factory=ModelSettings)
    encoding: EncodingSettings = Field(default_factory=EncodingSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    tenants: TenantSettings = Field(default_factory=TenantSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    residency: ResidencySettings = Field(default_factory=ResidencySettings)
    state_dir: Path = Field(
        default_factory=lambda: Path.home() / ".local" / "share" / "inferscale",
        description="Records, indexes and the local redis-server's data live here.",
    )
    system_prompt: str = Field(
        "Remembered facts about the user:",
        description="System prompt placed before the memory region.",
    )
    log_level: str = Field("INFO", description="Root log level.")
    admin_key: str | None = Field(
        None, description="The admin key to install (INFERSCALE_ADMIN_KEY; a Secret on Kubernetes)."
    )


def load_settings(**overrides: object) -> Settings:
    """Read the environment once; keyword overrides win (used by the CLI flags)."""
    return Settings(**overrides)
