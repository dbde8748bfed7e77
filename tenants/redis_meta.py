"""Tenant registry, fact metadata, usage, placement and change log in Redis (the `tenants/redis_*` modules
are the only ones importing redis).

Keys, all under one tenant's hash tag so a cluster keeps a tenant on one shard:

    is:tenants                    set of tenant ids
    is:admin                      hash of the admin key
    is:t:{tid}                    registry: key hash, quotas, window, model fingerprint, created
    is:t:{tid}:facts              fact id -> metadata JSON (state pending | active | updating)
    is:t:{tid}:emb / :pemb        fact id -> embedding bytes (committed / of an update in flight)
    is:t:{tid}:usage              facts, bytes (committed plus reserved)
    is:t:{tid}:place              fact id -> placement JSON {replica: {tier, version, at}}
    is:t:{tid}:version            bumped by every committed change (the prefix-cache salt uses it)
    is:t:{tid}:seq                retrieval-index ids
    is:t:{tid}:log                stream of committed changes, which every process's index replays
    is:t:{tid}:jobs               job id -> status JSON of the tenant's encoding jobs
    is:t:{tid}:scopes             ids of the tenant's end-user scopes (each a tenant entry of its own, `scopes.py`)
    is:t:{tid}:total              facts, bytes of the tenant's own memory and all its scopes' (its total quota)
    is:t:{tid}:uses               fact id -> decayed retrievals (`tenants/redis_uses.py`, KV residency)
    is:registry                   pub/sub channel: the id of a tenant whose registry entry changed
    is:facts                      pub/sub channel: the change-log key of a tenant whose facts changed

`RedisMeta` holds the connection and the registry (tenants, scopes, the admin key, jobs); its `records`,
`log` and `places` are the facts, the change log and the placements (`tenants/redis_records.py`), its `uses`
the retrieval counts (`tenants/redis_uses.py`). Every
multi-key change is one Lua script (`tenants/redis_scripts.py`); every registry write and change-log entry is
announced on its channel in the same step, for the processes that hold state in memory (`tenants/redis_feed.py`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from tenants.redis_feed import ANY, ChangeFeed, RegistryCache
from tenants.redis_records import ChangeLog, FactRecords, PlacementRecords
from tenants.redis_scripts import FACTS_CHANNEL, REGISTRY_CHANNEL, Scripts, as_json, t_key, tenant_of
from tenants.redis_uses import FactUses

log = logging.getLogger(__name__)

# Redis down or unreachable: callers answer "unavailable, retry" (HTTP 503) rather than a server fault.
STORE_UNAVAILABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)


class RedisMeta:
    """Typed access to the keys above; errors come back as the tenants layer's own exceptions."""

    def __init__(self, url: str, cache_registry: bool = False) -> None:
        """`cache_registry`: hold tenant registry entries in this process (`RegistryCache`), for a process that
        reads them on every request."""
        self.url = url
        self._redis = redis.Redis.from_url(url, decode_responses=False, health_check_interval=30)
        self._feed = ChangeFeed(self._redis, (REGISTRY_CHANNEL, FACTS_CHANNEL)) if cache_registry else None
        self._registry = RegistryCache(self._feed) if self._feed is not None else None
        self._scripts = Scripts(self._redis)
        self.records = FactRecords(self._redis, self._scripts)
        self.log = ChangeLog(self._redis)
        self.uses = FactUses(self._redis)
        self.places = PlacementRecords(self._redis, self._scripts, self.tenant_ids)

    def ping(self) -> bool:
        return bool(self._redis.ping())

    def info_memory(self) -> dict[str, Any]:
        """Redis' `INFO memory` section (soak tests watch `used_memory`)."""
        return self._redis.info("memory")

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
        self._redis.close()

    def fact_changes(self) -> tuple[bool, set[str]]:
        """(whether this process's change feed is live, the tenants whose facts changed since the last call, or
        `ANY`); (False, {ANY}) without a feed: every caller must then ask Redis."""
        if self._feed is None:
            return False, {ANY}
        named = self._feed.take(FACTS_CHANNEL)
        return self._feed.live, {n if n == ANY else tenant_of(n) for n in named}

    # ---- tenants and the admin key ----
    def create_tenant(self, tenant_id: str, fields: dict[str, Any]) -> None:
        flat = [str(x) for kv in {"id": tenant_id, **fields}.items() for x in kv]
        self._scripts.run("create", [t_key(tenant_id), b"is:tenants"], flat)

    def create_scope(self, tenant_id: str, scoped_id: str, fields: dict[str, Any]) -> None:
        """A scope's registry entry, listed under its tenant (`is:t:{tid}:scopes`), not among the tenants."""
        flat = [str(x) for kv in {"id": scoped_id, **fields}.items() for x in kv]
        self._redis.sadd(t_key(tenant_id, "scopes"), scoped_id)  # first: a scope is never made that deletion misses
        self._scripts.run("create_scope", [t_key(scoped_id)], flat)  # one key: its own slot in a Redis Cluster

    def remove_scope(self, tenant_id: str, scoped_id: str) -> None:
        self._redis.srem(t_key(tenant_id, "scopes"), scoped_id)

    def scope_ids(self, tenant_id: str) -> list[str]:
        return sorted(x.decode() for x in self._redis.smembers(t_key(tenant_id, "scopes")))

    def tenant(self, tenant_id: str) -> dict[str, str] | None:
        """The registry entry (None for an unknown tenant); from memory when this process caches the registry."""
        if self._registry is not None:
            return self._registry.get(tenant_id, self._read_tenant)
        return self._read_tenant(tenant_id)

    def _read_tenant(self, tenant_id: str) -> dict[str, str] | None:
        raw = self._redis.hgetall(t_key(tenant_id))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    def update_tenant(self, tenant_id: str, fields: dict[str, Any]) -> None:
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(t_key(tenant_id), mapping={k: str(v) for k, v in fields.items()})
            pipe.publish(REGISTRY_CHANNEL, tenant_id)
            pipe.execute()
        self._forget_tenant(tenant_id)

    def swap_history(self, tenant_id: str, history_id: str, tokens: int) -> str | None:
        """Name the tenant's history in one step with reading the one it replaces (None: none); `UnknownTenantError`
        once the tenant is deleted (nothing is written then)."""
        before = self._scripts.run("set_history", [t_key(tenant_id)], [history_id, str(tokens), tenant_id])
        self._forget_tenant(tenant_id)
        before = before.decode() if isinstance(before, bytes) else before
        return before or None

    def _forget_tenant(self, tenant_id: str) -> None:
        if self._registry is not None:
            self._registry.forget(tenant_id)

    def tenant_ids(self) -> list[str]:
        return sorted(x.decode() for x in self._redis.smembers("is:tenants"))

    def admin_hash(self) -> str | None:
        raw = self._redis.get("is:admin")
        return raw.decode() if raw else None

    def set_admin_hash(self, digest: str, replace: bool = False) -> bool:
        return bool(self._redis.set("is:admin", digest, nx=not replace))

    def replace_admin_hash(self, digest: str) -> str | None:
        """Store `digest` as the admin hash in one step; the hash it replaced (None when there was none)."""
        raw = self._redis.set("is:admin", digest, get=True)
        return raw.decode() if raw else None

    def delete_tenant(self, tenant_id: str) -> bool:
        """Drop the tenant and every key under its hash tag in one transaction (True if it existed)."""
        parts = (
            "facts",
            "emb",
            "pemb",
            "usage",
            "place",
            "hplace",
            "version",
            "seq",
            "log",
            "jobs",
            "scopes",
            "total",
            "uses",
            "usefloor",
        )
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.srem("is:tenants", tenant_id)
            pipe.delete(t_key(tenant_id), *(t_key(tenant_id, part) for part in parts))
            pipe.publish(REGISTRY_CHANNEL, tenant_id)
            pipe.publish(FACTS_CHANNEL, t_key(tenant_id, "log"))  # its facts (and its log) are gone too
            listed, keys, *_ = pipe.execute()
        self._forget_tenant(tenant_id)
        return bool(listed or keys)  # a scope is not listed among the tenants; its keys show it existed

    # ---- encoding jobs ----
    def set_job(self, tenant_id: str, job_id: str, status: dict) -> None:
        self._redis.hset(t_key(tenant_id, "jobs"), job_id, as_json(status))

    def job(self, tenant_id: str, job_id: str) -> dict | None:
        raw = self._redis.hget(t_key(tenant_id, "jobs"), job_id)
        return json.loads(raw) if raw else None
