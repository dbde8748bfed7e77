"""Tenant registry, fact metadata, usage, placement and change log in Redis (the only module importing redis).

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
    is:registry                   pub/sub channel: the id of a tenant whose registry entry changed
    is:facts                      pub/sub channel: the change-log key of a tenant whose facts changed

Every write of a registry entry, and every change-log entry, is announced on its channel in the same atomic
step, so a process that holds state in memory (`RegistryCache`, and the retrieval indexes that replay the
change log: the ingress, which authenticates and retrieves on every request) knows it is stale as soon as
the message arrives, and asks Redis nothing while nothing has changed (`ChangeFeed`).

Every multi-key change is one Lua script, so it is atomic and checks its preconditions (state and
version of the fact, quotas) in the same step that writes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Iterable

import redis

from tenants.errors import (
    ConflictError,
    FactExistsError,
    FactNotFoundError,
    QuotaExceededError,
    TenantExistsError,
    UnknownTenantError,
)

log = logging.getLogger(__name__)
LOG_MAXLEN = 100_000
REGISTRY_CHANNEL = "is:registry"
FACTS_CHANNEL = "is:facts"
ANY = "*"  # a change feed's word for "anything may have changed" (a new or lost subscription)

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.error_reply('EXISTS tenant') end
redis.call('HSET', KEYS[1], unpack(ARGV))
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('PUBLISH', 'is:registry', ARGV[2])  -- REGISTRY_CHANNEL
return 1
"""

_CREATE_SCOPE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.error_reply('EXISTS tenant') end
redis.call('HSET', KEYS[1], unpack(ARGV))
redis.call('PUBLISH', 'is:registry', ARGV[2])  -- REGISTRY_CHANNEL
return 1
"""

_RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('UNKNOWN tenant') end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return redis.error_reply('EXISTS fact') end
local facts = tonumber(redis.call('HGET', KEYS[4], 'facts') or '0')
local bytes = tonumber(redis.call('HGET', KEYS[4], 'bytes') or '0')
if facts + 1 > tonumber(redis.call('HGET', KEYS[1], 'max_facts')) then return redis.error_reply('QUOTA facts') end
if bytes + tonumber(ARGV[4]) > tonumber(redis.call('HGET', KEYS[1], 'max_bytes')) then return redis.error_reply('QUOTA bytes') end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[4], 'facts', 1)
redis.call('HINCRBY', KEYS[4], 'bytes', ARGV[4])
return 1
"""

_CHARGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if tonumber(ARGV[1]) > 0 or tonumber(ARGV[2]) > 0 then return redis.error_reply('UNKNOWN tenant') end
  return 0
end
local facts = tonumber(redis.call('HGET', KEYS[2], 'facts') or '0') + tonumber(ARGV[1])
local bytes = tonumber(redis.call('HGET', KEYS[2], 'bytes') or '0') + tonumber(ARGV[2])
if tonumber(ARGV[1]) > 0 and facts > tonumber(redis.call('HGET', KEYS[1], 'max_facts')) then
  return redis.error_reply('QUOTA facts (the tenant and its end users together)')
end
if tonumber(ARGV[2]) > 0 and bytes > tonumber(redis.call('HGET', KEYS[1], 'max_bytes')) then
  return redis.error_reply('QUOTA bytes (the tenant and its end users together)')
end
redis.call('HINCRBY', KEYS[2], 'facts', ARGV[1])
redis.call('HINCRBY', KEYS[2], 'bytes', ARGV[2])
return 1
"""

_BEGIN_UPDATE = """
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if not cur then return redis.error_reply('GONE') end
local m = cjson.decode(cur)
if m['state'] ~= 'active' or tostring(m['version']) ~= ARGV[2] then return redis.error_reply('CONFLICT') end
local bytes = tonumber(redis.call('HGET', KEYS[4], 'bytes') or '0')
if bytes + tonumber(ARGV[5]) > tonumber(redis.call('HGET', KEYS[1], 'max_bytes')) then return redis.error_reply('QUOTA bytes') end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('HINCRBY', KEYS[4], 'bytes', ARGV[5])
return 1
"""

_COMMIT = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return redis.error_reply('GONE') end
local m = cjson.decode(cur)
if m['state'] ~= ARGV[2] or tostring(m['version']) ~= ARGV[3] then return redis.error_reply('CONFLICT') end
local delta = tonumber(ARGV[6])
if delta > 0 then
  local bytes = tonumber(redis.call('HGET', KEYS[4], 'bytes') or '0')
  if bytes + delta > tonumber(redis.call('HGET', KEYS[7], 'max_bytes')) then return redis.error_reply('QUOTA bytes') end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
if ARGV[8] == '1' then
  local e = redis.call('HGET', KEYS[3], ARGV[1])
  if e then redis.call('HSET', KEYS[2], ARGV[1], e) end
  redis.call('HDEL', KEYS[3], ARGV[1])
end
if delta ~= 0 then redis.call('HINCRBY', KEYS[4], 'bytes', delta) end
local v = redis.call('INCR', KEYS[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[9], '*', 'op', ARGV[5], 'fid', ARGV[1], 'iid', ARGV[7], 'v', v)
redis.call('PUBLISH', 'is:facts', KEYS[6])  -- FACTS_CHANNEL
return v
"""

_DELETE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return redis.error_reply('GONE') end
local m = cjson.decode(cur)
if m['state'] == 'pending' then return redis.error_reply('GONE') end
local release = tonumber(m['bytes'])
if type(m['pending']) == 'table' then release = release + tonumber(m['pending']['bytes']) end
for i = 1, 3 do redis.call('HDEL', KEYS[i], ARGV[1]) end
redis.call('HDEL', KEYS[7], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'facts', -1)
if release ~= 0 then redis.call('HINCRBY', KEYS[4], 'bytes', 0 - release) end
local v = redis.call('INCR', KEYS[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[2], '*', 'op', 'remove', 'fid', ARGV[1], 'iid', tostring(m['index_id']), 'v', v)
redis.call('PUBLISH', 'is:facts', KEYS[6])  -- FACTS_CHANNEL
return cur
"""

_ROLLBACK = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local m = cjson.decode(cur)
if m['state'] ~= ARGV[2] or tostring(m['version']) ~= ARGV[3] then return 0 end
if ARGV[4] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
end
redis.call('HDEL', KEYS[3], ARGV[1])
if tonumber(ARGV[5]) ~= 0 then redis.call('HINCRBY', KEYS[4], 'facts', 0 - tonumber(ARGV[5])) end
if tonumber(ARGV[6]) ~= 0 then redis.call('HINCRBY', KEYS[4], 'bytes', 0 - tonumber(ARGV[6])) end
return 1
"""

# Placements of one replica: ARGV = replica, now, then (fact id, version, tier or '' for gone) triples.
# A fact that no longer exists gets no placement, so a late report cannot resurrect a deleted fact.
_PLACE = """
local replica, now = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 3 do
  local fid, version, tier = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  if redis.call('HEXISTS', KEYS[2], fid) == 1 then
    local raw = redis.call('HGET', KEYS[1], fid)
    local cur = raw and cjson.decode(raw) or {}
    if tier == '' then cur[replica] = nil else cur[replica] = {tier = tier, version = version, at = now} end
    if next(cur) == nil then redis.call('HDEL', KEYS[1], fid) else redis.call('HSET', KEYS[1], fid, cjson.encode(cur)) end
  end
end
return 1
"""

# Forget every placement of one replica in one tenant (a restarted replica reports afresh).
_UNPLACE = """
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local cur = cjson.decode(all[i + 1])
  if cur[ARGV[1]] ~= nil then
    cur[ARGV[1]] = nil
    if next(cur) == nil then redis.call('HDEL', KEYS[1], all[i]) else redis.call('HSET', KEYS[1], all[i], cjson.encode(cur)) end
  end
end
return 1
"""

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
        self._scripts = {
            name: self._redis.register_script(body)
            for name, body in (
                ("create", _CREATE),
                ("create_scope", _CREATE_SCOPE),
                ("reserve", _RESERVE),
                ("charge", _CHARGE),
                ("begin_update", _BEGIN_UPDATE),
                ("commit", _COMMIT),
                ("delete", _DELETE),
                ("rollback", _ROLLBACK),
                ("place", _PLACE),
                ("unplace", _UNPLACE),
            )
        }

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
        return self._feed.live, {n if n == ANY else _tenant_of(n) for n in named}

    # ---- tenants and the admin key ----
    def create_tenant(self, tenant_id: str, fields: dict[str, Any]) -> None:
        flat = [str(x) for kv in {"id": tenant_id, **fields}.items() for x in kv]
        self._run("create", [_t(tenant_id), b"is:tenants"], flat)

    def create_scope(self, tenant_id: str, scoped_id: str, fields: dict[str, Any]) -> None:
        """A scope's registry entry, listed under its tenant (`is:t:{tid}:scopes`), not among the tenants."""
        flat = [str(x) for kv in {"id": scoped_id, **fields}.items() for x in kv]
        self._redis.sadd(_t(tenant_id, "scopes"), scoped_id)  # first: a scope is never made that deletion misses
        self._run("create_scope", [_t(scoped_id)], flat)  # one key: its own slot in a Redis Cluster

    def remove_scope(self, tenant_id: str, scoped_id: str) -> None:
        self._redis.srem(_t(tenant_id, "scopes"), scoped_id)

    def scope_ids(self, tenant_id: str) -> list[str]:
        return sorted(x.decode() for x in self._redis.smembers(_t(tenant_id, "scopes")))

    def tenant(self, tenant_id: str) -> dict[str, str] | None:
        """The registry entry (None for an unknown tenant); from memory when this process caches the registry."""
        if self._registry is not None:
            return self._registry.get(tenant_id, self._read_tenant)
        return self._read_tenant(tenant_id)

    def _read_tenant(self, tenant_id: str) -> dict[str, str] | None:
        raw = self._redis.hgetall(_t(tenant_id))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    def update_tenant(self, tenant_id: str, fields: dict[str, Any]) -> None:
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(_t(tenant_id), mapping={k: str(v) for k, v in fields.items()})
            pipe.publish(REGISTRY_CHANNEL, tenant_id)
            pipe.execute()
        self._forget_tenant(tenant_id)

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
        parts = ("facts", "emb", "pemb", "usage", "place", "version", "seq", "log", "jobs", "scopes", "total")
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.srem("is:tenants", tenant_id)
            pipe.delete(_t(tenant_id), *(_t(tenant_id, part) for part in parts))
            pipe.publish(REGISTRY_CHANNEL, tenant_id)
            pipe.publish(FACTS_CHANNEL, _t(tenant_id, "log"))  # its facts (and its log) are gone too
            listed, keys, *_ = pipe.execute()
        self._forget_tenant(tenant_id)
        return bool(listed or keys)  # a scope is not listed among the tenants; its keys show it existed

    # ---- encoding jobs ----
    def set_job(self, tenant_id: str, job_id: str, status: dict) -> None:
        self._redis.hset(_t(tenant_id, "jobs"), job_id, _json(status))

    def job(self, tenant_id: str, job_id: str) -> dict | None:
        raw = self._redis.hget(_t(tenant_id, "jobs"), job_id)
        return json.loads(raw) if raw else None

    # ---- facts ----
    def next_index_ids(self, tenant_id: str, count: int) -> list[int]:
        last = int(self._redis.incrby(_t(tenant_id, "seq"), count))
        return list(range(last - count + 1, last + 1))

    def reserve_many(self, tenant_id: str, items: list[tuple[str, dict, bytes, int]]) -> list[Exception | None]:
        """`reserve` for (fact id, meta, embedding, bytes) items in one round trip; per item its error or None."""
        keys = [_t(tenant_id), _t(tenant_id, "facts"), _t(tenant_id, "emb"), _t(tenant_id, "usage")]
        pipe = self._redis.pipeline(transaction=False)
        for fact_id, meta, embedding, nbytes in items:
            self._scripts["reserve"](keys=keys, args=[fact_id, _json(meta), embedding, nbytes], client=pipe)
        return [_error_of(result) for result in pipe.execute(raise_on_error=False)]

    def commit_many(self, tenant_id: str, items: list[tuple[str, dict]], op: str) -> list[Exception | None]:
        """`commit` of pending version-1 facts (fact id, new meta) in one round trip; per item its error or None."""
        keys = _commit_keys(tenant_id)
        pipe = self._redis.pipeline(transaction=False)
        for fact_id, meta in items:
            self._scripts["commit"](
                keys=keys,
                args=[fact_id, "pending", 1, _json(meta), op, 0, meta["index_id"], "0", LOG_MAXLEN],
                client=pipe,
            )
        return [_error_of(result) for result in pipe.execute(raise_on_error=False)]

    def charge_total(self, tenant_id: str, facts: int, nbytes: int) -> None:
        """Add to the tenant's total across its own memory and its scopes, within its quotas (a negative amount,
        a refund, always passes; a refund to a deleted tenant does nothing)."""
        self._run("charge", [_t(tenant_id), _t(tenant_id, "total")], [facts, nbytes])

    def total(self, tenant_id: str) -> dict[str, int]:
        raw = self._redis.hgetall(_t(tenant_id, "total"))
        return {"facts": int(raw.get(b"facts", 0)), "bytes": int(raw.get(b"bytes", 0))}

    def reserve(self, tenant_id: str, fact_id: str, meta: dict, embedding: bytes, nbytes: int) -> None:
        keys = [_t(tenant_id), _t(tenant_id, "facts"), _t(tenant_id, "emb"), _t(tenant_id, "usage")]
        self._run("reserve", keys, [fact_id, _json(meta), embedding, nbytes])

    def begin_update(
        self, tenant_id: str, fact_id: str, version: int, meta: dict, embedding: bytes, nbytes: int
    ) -> None:
        keys = [_t(tenant_id), _t(tenant_id, "facts"), _t(tenant_id, "pemb"), _t(tenant_id, "usage")]
        self._run("begin_update", keys, [fact_id, version, _json(meta), embedding, nbytes])

    def commit(
        self,
        tenant_id: str,
        fact_id: str,
        state: str,
        version: int,
        meta: dict,
        op: str,
        bytes_delta: int = 0,
        move_pending_embedding: bool = False,
    ) -> int:
        """Replace the fact's metadata if it is still in (`state`, `version`), add `bytes_delta` to its usage
        (within quota), log `op`; return the tenant's new version."""
        keys = _commit_keys(tenant_id)
        args = [
            fact_id,
            state,
            version,
            _json(meta),
            op,
            bytes_delta,
            meta["index_id"],
            "1" if move_pending_embedding else "0",
            LOG_MAXLEN,
        ]
        return int(self._run("commit", keys, args))

    def delete(self, tenant_id: str, fact_id: str) -> dict:
        """Remove a visible fact in one step; return the metadata it had."""
        keys = [
            _t(tenant_id, "facts"),
            _t(tenant_id, "emb"),
            _t(tenant_id, "pemb"),
            _t(tenant_id, "usage"),
            _t(tenant_id, "version"),
            _t(tenant_id, "log"),
            _t(tenant_id, "place"),
        ]
        return json.loads(self._run("delete", keys, [fact_id, LOG_MAXLEN]))

    def rollback(
        self, tenant_id: str, fact_id: str, state: str, version: int, restored: dict | None, facts: int, nbytes: int
    ) -> bool:
        """Undo a change still in (`state`, `version`): restore `restored` (or drop the fact) and release quota."""
        keys = [_t(tenant_id, "facts"), _t(tenant_id, "emb"), _t(tenant_id, "pemb"), _t(tenant_id, "usage")]
        args = [fact_id, state, version, _json(restored) if restored else "", facts, nbytes]
        return bool(self._run("rollback", keys, args))

    def fact(self, tenant_id: str, fact_id: str) -> dict | None:
        raw = self._redis.hget(_t(tenant_id, "facts"), fact_id)
        return json.loads(raw) if raw else None

    def facts(self, tenant_id: str, fact_ids: Iterable[str]) -> list[dict | None]:
        fact_ids = list(fact_ids)
        if not fact_ids:
            return []
        return [json.loads(raw) if raw else None for raw in self._redis.hmget(_t(tenant_id, "facts"), fact_ids)]

    def all_facts(self, tenant_id: str) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self._redis.hgetall(_t(tenant_id, "facts")).items()}

    def fact_ids(self, tenant_id: str) -> list[str]:
        return sorted(k.decode() for k in self._redis.hkeys(_t(tenant_id, "facts")))

    def embeddings(self, tenant_id: str, fact_ids: list[str]) -> list[bytes | None]:
        return self._redis.hmget(_t(tenant_id, "emb"), fact_ids) if fact_ids else []

    def all_embeddings(self, tenant_id: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self._redis.hgetall(_t(tenant_id, "emb")).items()}

    def usage(self, tenant_id: str) -> dict[str, int]:
        raw = self._redis.hgetall(_t(tenant_id, "usage"))
        return {"facts": int(raw.get(b"facts", 0)), "bytes": int(raw.get(b"bytes", 0))}

    def version(self, tenant_id: str) -> int:
        return int(self._redis.get(_t(tenant_id, "version")) or 0)

    # ---- the change log ----
    def log_after(self, tenant_id: str, last_id: str, count: int = 10_000) -> list[tuple[str, dict[str, str]]]:
        """Committed changes after stream id `last_id` ("0" for all that are kept)."""
        entries = self._redis.xrange(_t(tenant_id, "log"), min=f"({last_id}" if last_id != "0" else "-", count=count)
        return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in entries]

    def log_since(
        self, tenant_id: str, last_id: str, count: int = 10_000
    ) -> tuple[str | None, list[tuple[str, dict[str, str]]]]:
        """(the first id the log still keeps, the changes after `last_id`) in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xrange(_t(tenant_id, "log"), count=1)
        pipe.xrange(_t(tenant_id, "log"), min=f"({last_id}" if last_id != "0" else "-", count=count)
        first, entries = pipe.execute()
        return (
            first[0][0].decode() if first else None,
            [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in entries],
        )

    def facts_with_embeddings(self, tenant_id: str, fact_ids: list[str]) -> list[tuple[dict | None, bytes | None]]:
        """Metadata and committed embedding of each fact, in one round trip."""
        if not fact_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(_t(tenant_id, "facts"), fact_ids)
        pipe.hmget(_t(tenant_id, "emb"), fact_ids)
        metas, embeddings = pipe.execute()
        return [(json.loads(m) if m else None, e) for m, e in zip(metas, embeddings)]

    def log_last_id(self, tenant_id: str) -> str | None:
        last = self._redis.xrevrange(_t(tenant_id, "log"), count=1)
        return last[0][0].decode() if last else None

    # ---- placement ----
    def write_placements(self, replica: str, now: float, moves: dict[str, list[tuple[str, int, str | None]]]) -> None:
        """Per tenant, (fact id, version, tier or None for gone) as held by `replica`; one script per tenant."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant_id, items in moves.items():
            args = [replica, repr(now)] + [x for fid, version, tier in items for x in (fid, version, tier or "")]
            self._scripts["place"](keys=[_t(tenant_id, "place"), _t(tenant_id, "facts")], args=args, client=pipe)
        pipe.execute()

    def forget_replica(self, replica: str) -> None:
        """Drop `replica` from every placement (it restarted: what it holds now is reported again)."""
        for tenant_id in self.tenant_ids():
            self._scripts["unplace"](keys=[_t(tenant_id, "place")], args=[replica])

    def placements(self, tenant_id: str, fact_ids: list[str]) -> list[dict[str, dict]]:
        """`placement` of several facts in one round trip."""
        if not fact_ids:
            return []
        return [json.loads(raw) if raw else {} for raw in self._redis.hmget(_t(tenant_id, "place"), fact_ids)]

    def placement(self, tenant_id: str, fact_id: str) -> dict[str, dict]:
        """{replica: {tier, version, at}} of one fact ({} when no replica holds its K/V)."""
        raw = self._redis.hget(_t(tenant_id, "place"), fact_id)
        return json.loads(raw) if raw else {}

    def _run(self, name: str, keys: list, args: list):
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.ResponseError as exc:
            raise _translate(str(exc)) from None


class ChangeFeed:
    """This process's one Pub/Sub subscription to the change channels, polled by its readers (no thread).

    `take(channel)` first applies the messages that have reached the subscription's socket (a poll, no round
    trip), as Redis's own client-side caching does, then hands over and forgets the ids announced on that
    channel. A new subscription, or a lost one, announces `ANY` on every channel (what was missed is
    unknown); after a loss readers go to Redis until a new subscription is confirmed (`live`).
    """

    RESUBSCRIBE_S = 1.0

    def __init__(self, client: "redis.Redis", channels: tuple[str, ...]) -> None:
        self._client, self._channels = client, channels
        self._pending: dict[str, set[str]] = {c: set() for c in channels}
        self._confirmed: set[str] = set()
        self._pubsub: Any = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        """Every channel's subscription is confirmed: every change since has reached us or will."""
        return len(self._confirmed) == len(self._channels)

    def take(self, channel: str) -> set[str]:
        with self._lock:
            self._poll()
            named, self._pending[channel] = self._pending[channel], set()
            return named

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _poll(self) -> None:
        if self._pubsub is None:
            now = time.monotonic()
            if now < self._retry_at:
                return
            self._retry_at = now + self.RESUBSCRIBE_S
            try:
                self._pubsub = self._client.pubsub()
                self._pubsub.subscribe(*self._channels)
            except (redis.RedisError, OSError) as exc:
                log.warning("change subscription failed (%s); state is read from Redis", type(exc).__name__)
                self._drop()
                return
        try:
            while (message := self._pubsub.get_message(timeout=0)) is not None:
                channel = message["channel"].decode()
                if message["type"] == "subscribe":  # also after a reconnect, when what was missed is unknown
                    self._confirmed.add(channel)
                    self._pending[channel].add(ANY)
                elif message["type"] == "message":
                    self._pending[channel].add(message["data"].decode())
        except (redis.RedisError, OSError) as exc:
            log.warning("change subscription lost (%s); state is read from Redis until it is back", type(exc).__name__)
            self._drop()

    def _drop(self) -> None:
        self._confirmed.clear()
        for named in self._pending.values():
            named.add(ANY)
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except (redis.RedisError, OSError):
                pass
        self._pubsub = None


class RegistryCache:
    """Tenant registry entries held in memory, dropped as writers announce changes on `REGISTRY_CHANNEL`.

    Authentication reads a tenant's entry on every request; from Redis that was a round trip on the ingress's
    event loop each time (398 -> 122 µs of ingress work per request on 2 CPU cores). Every read first applies
    the announcements of the `ChangeFeed`, so a key deleted or rotated anywhere stops working here as soon as
    Redis has told us. Unknown tenants are never cached (a key works as soon as its tenant is created); while
    the feed is not live reads go to Redis; `ttl_s` bounds an entry's age whatever happens.
    """

    def __init__(self, feed: ChangeFeed, ttl_s: float = 30.0) -> None:
        self._feed, self._ttl_s = feed, ttl_s
        self._entries: dict[str, tuple[float, dict[str, str]]] = {}
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        return self._feed.live

    def get(self, tenant_id: str, read: Callable[[str], dict[str, str] | None]) -> dict[str, str] | None:
        """The entry from memory when held and fresh, else `read(tenant_id)` (kept when the feed is live)."""
        with self._lock:
            now = time.monotonic()
            self._apply(self._feed.take(REGISTRY_CHANNEL))
            held = self._entries.get(tenant_id)
            if held is not None and now - held[0] < self._ttl_s:
                return held[1]
            entry = read(tenant_id)
            if entry is not None and self._feed.live:
                # a change announced during the read may or may not be in it: then it is not kept
                named = self._feed.take(REGISTRY_CHANNEL)
                self._apply(named)
                if not {tenant_id, ANY} & named and self._feed.live:
                    self._entries[tenant_id] = (now, entry)
            return entry

    def forget(self, tenant_id: str) -> None:
        """Drop one entry now (this process changed it; its own message may still be on the way)."""
        with self._lock:
            self._entries.pop(tenant_id, None)

    def _apply(self, named: set[str]) -> None:
        if ANY in named:
            self._entries.clear()
        for tenant_id in named:
            self._entries.pop(tenant_id, None)


def _t(tenant_id: str, part: str | None = None) -> str:
    return f"is:t:{{{tenant_id}}}" + (f":{part}" if part else "")


def _commit_keys(tenant_id: str) -> list[str]:
    """The keys the `commit` script takes, in its order."""
    return [_t(tenant_id, part) for part in ("facts", "emb", "pemb", "usage", "version", "log")] + [_t(tenant_id)]


def _tenant_of(key: str) -> str:
    """The tenant id inside one of its keys (`_t`'s inverse)."""
    return key[len("is:t:{") : key.rindex("}")]


def _json(value: dict) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _error_of(result: Any) -> Exception | None:
    if isinstance(result, redis.ResponseError):
        return _translate(str(result))
    return result if isinstance(result, Exception) else None


def _translate(message: str) -> Exception:
    if message.startswith("EXISTS tenant"):
        return TenantExistsError("a tenant with this id exists already")
    if message.startswith("EXISTS fact"):
        return FactExistsError("the tenant already has a fact with this id")
    if message.startswith("UNKNOWN"):
        return UnknownTenantError("unknown tenant")
    if message.startswith("QUOTA"):
        return QuotaExceededError(f"quota of {message[len('QUOTA ') :]} exceeded")
    if message.startswith("GONE"):
        return FactNotFoundError("no such fact")
    if message.startswith("CONFLICT"):
        return ConflictError("the fact changed concurrently; read it again and retry")
    return RuntimeError(f"redis: {message}")
