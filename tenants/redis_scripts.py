"""The Lua scripts behind every multi-key change of the tenants' Redis keys, and the key names they use.

Every multi-key change is one script, so it is atomic and checks its preconditions (state and version of the
fact, quotas) in the same step that writes; a script's error reply comes back as the tenants layer's own
exception (`Scripts.run`). The key layout is described in `tenants/redis_meta.py`.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from tenants.errors import (
    ConflictError,
    FactExistsError,
    FactNotFoundError,
    QuotaExceededError,
    TenantExistsError,
    UnknownTenantError,
)

LOG_MAXLEN = 100_000
REGISTRY_CHANNEL = "is:registry"
FACTS_CHANNEL = "is:facts"

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

_SET_HISTORY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('UNKNOWN tenant') end
local before = redis.call('HGET', KEYS[1], 'history') or ''
redis.call('HSET', KEYS[1], 'history', ARGV[1], 'history_tokens', ARGV[2])
redis.call('PUBLISH', 'is:registry', ARGV[3])  -- REGISTRY_CHANNEL
return before
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

# A replica's reports of where history chunk records are held: one field a chunk record, {replica: {tier, at}}
# (a chunk has no fact and no version; a history's reader counts its own chunks by their id's prefix).
_PLACE_CHUNKS = """
local replica, now = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  local rid, tier = ARGV[i], ARGV[i + 1]
  local raw = redis.call('HGET', KEYS[1], rid)
  local cur = raw and cjson.decode(raw) or {}
  if tier == '' then cur[replica] = nil else cur[replica] = {tier = tier, at = now} end
  if next(cur) == nil then redis.call('HDEL', KEYS[1], rid) else redis.call('HSET', KEYS[1], rid, cjson.encode(cur)) end
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


class Scripts:
    """The scripts registered on one client: run now, or queued on a pipeline."""

    def __init__(self, client: "redis.Redis") -> None:
        self._registered = {
            name: client.register_script(body)
            for name, body in (
                ("create", _CREATE),
                ("create_scope", _CREATE_SCOPE),
                ("reserve", _RESERVE),
                ("charge", _CHARGE),
                ("set_history", _SET_HISTORY),
                ("begin_update", _BEGIN_UPDATE),
                ("commit", _COMMIT),
                ("delete", _DELETE),
                ("rollback", _ROLLBACK),
                ("place", _PLACE),
                ("place_chunks", _PLACE_CHUNKS),
                ("unplace", _UNPLACE),
            )
        }

    def run(self, name: str, keys: list, args: list) -> Any:
        try:
            return self._registered[name](keys=keys, args=args)
        except redis.ResponseError as exc:
            raise translate(str(exc)) from None

    def queue(self, pipe: Any, name: str, keys: list, args: list) -> None:
        """Add a call to `pipe`; its result (or error reply, `error_of`) comes with the pipeline's."""
        self._registered[name](keys=keys, args=args, client=pipe)


def t_key(tenant_id: str, part: str | None = None) -> str:
    return f"is:t:{{{tenant_id}}}" + (f":{part}" if part else "")


def reserve_keys(tenant_id: str) -> list[str]:
    """The keys the `reserve` script takes, in its order."""
    return [t_key(tenant_id)] + [t_key(tenant_id, part) for part in ("facts", "emb", "usage")]


def commit_keys(tenant_id: str) -> list[str]:
    """The keys the `commit` script takes, in its order."""
    return [t_key(tenant_id, part) for part in ("facts", "emb", "pemb", "usage", "version", "log")] + [t_key(tenant_id)]


def tenant_of(key: str) -> str:
    """The tenant id inside one of its keys (`t_key`'s inverse)."""
    return key[len("is:t:{") : key.rindex("}")]


def as_json(value: dict) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def error_of(result: Any) -> Exception | None:
    if isinstance(result, redis.ResponseError):
        return translate(str(result))
    return result if isinstance(result, Exception) else None


def translate(message: str) -> Exception:
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
