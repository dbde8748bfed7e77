"""Build a `TenantService` on a given Redis and state folder (the one wiring, shared by every entry point)."""

from __future__ import annotations

from pathlib import Path

from config.settings import TenantSettings
from kvcore.store import LocalFactStore
from tenants.embedding import Embedder
from tenants.index_sync import TenantIndexes
from tenants.redis_meta import RedisMeta
from tenants.service import TenantService


def connect_service(
    redis_url: str,
    state_dir: Path,
    embedder: Embedder,
    limits: TenantSettings | None = None,
    cache_registry: bool = False,
) -> TenantService:
    """`cache_registry`: hold tenant registry entries in memory (the ingress authenticates every request)."""
    limits = limits or TenantSettings()
    meta = RedisMeta(redis_url, cache_registry=cache_registry)
    return TenantService(
        meta,
        LocalFactStore(Path(state_dir) / "records"),
        embedder,
        TenantIndexes(meta, embedder.dim, Path(state_dir) / "indexes"),
        max_facts=limits.max_facts,
        max_bytes=limits.max_bytes,
        max_fact_chars=limits.max_fact_chars,
    )
