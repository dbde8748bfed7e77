"""A tenant's facts in Redis: metadata, embeddings, usage and quotas, the change log, and placements.

`FactRecords` reserves, commits, updates, deletes and rolls back facts (each change one script,
`tenants/redis_scripts.py`) and reads them; `ChangeLog` reads the log of committed changes that every process's
retrieval index replays; `PlacementRecords` keeps which replica holds which fact's K/V in which tier.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

import redis

from tenants.redis_scripts import LOG_MAXLEN, Scripts, as_json, commit_keys, error_of, reserve_keys, t_key


class FactRecords:
    """Fact metadata, committed and pending embeddings, usage and the tenant's version."""

    def __init__(self, client: "redis.Redis", scripts: Scripts) -> None:
        self._redis, self._scripts = client, scripts

    def next_index_ids(self, tenant_id: str, count: int) -> list[int]:
        last = int(self._redis.incrby(t_key(tenant_id, "seq"), count))
        return list(range(last - count + 1, last + 1))

    def reserve_many(self, tenant_id: str, items: list[tuple[str, dict, bytes, int]]) -> list[Exception | None]:
        """`reserve` for (fact id, meta, embedding, bytes) items in one round trip; per item its error or None."""
        keys = reserve_keys(tenant_id)
        pipe = self._redis.pipeline(transaction=False)
        for fact_id, meta, embedding, nbytes in items:
            self._scripts.queue(pipe, "reserve", keys, [fact_id, as_json(meta), embedding, nbytes])
        return [error_of(result) for result in pipe.execute(raise_on_error=False)]

    def commit_many(self, tenant_id: str, items: list[tuple[str, dict]], op: str) -> list[Exception | None]:
        """`commit` of pending version-1 facts (fact id, new meta) in one round trip; per item its error or None."""
        keys = commit_keys(tenant_id)
        pipe = self._redis.pipeline(transaction=False)
        for fact_id, meta in items:
            self._scripts.queue(
                pipe, "commit", keys, [fact_id, "pending", 1, as_json(meta), op, 0, meta["index_id"], "0", LOG_MAXLEN]
            )
        return [error_of(result) for result in pipe.execute(raise_on_error=False)]

    def charge_total(self, tenant_id: str, facts: int, nbytes: int) -> None:
        """Add to the tenant's total across its own memory and its scopes, within its quotas (a negative amount,
        a refund, always passes; a refund to a deleted tenant does nothing)."""
        self._scripts.run("charge", [t_key(tenant_id), t_key(tenant_id, "total")], [facts, nbytes])

    def total(self, tenant_id: str) -> dict[str, int]:
        raw = self._redis.hgetall(t_key(tenant_id, "total"))
        return {"facts": int(raw.get(b"facts", 0)), "bytes": int(raw.get(b"bytes", 0))}

    def reserve(self, tenant_id: str, fact_id: str, meta: dict, embedding: bytes, nbytes: int) -> None:
        keys = reserve_keys(tenant_id)
        self._scripts.run("reserve", keys, [fact_id, as_json(meta), embedding, nbytes])

    def begin_update(
        self, tenant_id: str, fact_id: str, version: int, meta: dict, embedding: bytes, nbytes: int
    ) -> None:
        keys = [t_key(tenant_id), t_key(tenant_id, "facts"), t_key(tenant_id, "pemb"), t_key(tenant_id, "usage")]
        self._scripts.run("begin_update", keys, [fact_id, version, as_json(meta), embedding, nbytes])

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
        keys = commit_keys(tenant_id)
        args = [
            fact_id,
            state,
            version,
            as_json(meta),
            op,
            bytes_delta,
            meta["index_id"],
            "1" if move_pending_embedding else "0",
            LOG_MAXLEN,
        ]
        return int(self._scripts.run("commit", keys, args))

    def delete(self, tenant_id: str, fact_id: str) -> dict:
        """Remove a visible fact in one step; return the metadata it had."""
        keys = [
            t_key(tenant_id, "facts"),
            t_key(tenant_id, "emb"),
            t_key(tenant_id, "pemb"),
            t_key(tenant_id, "usage"),
            t_key(tenant_id, "version"),
            t_key(tenant_id, "log"),
            t_key(tenant_id, "place"),
        ]
        return json.loads(self._scripts.run("delete", keys, [fact_id, LOG_MAXLEN]))

    def rollback(
        self, tenant_id: str, fact_id: str, state: str, version: int, restored: dict | None, facts: int, nbytes: int
    ) -> bool:
        """Undo a change still in (`state`, `version`): restore `restored` (or drop the fact) and release quota."""
        keys = [t_key(tenant_id, "facts"), t_key(tenant_id, "emb"), t_key(tenant_id, "pemb"), t_key(tenant_id, "usage")]
        args = [fact_id, state, version, as_json(restored) if restored else "", facts, nbytes]
        return bool(self._scripts.run("rollback", keys, args))

    def fact(self, tenant_id: str, fact_id: str) -> dict | None:
        raw = self._redis.hget(t_key(tenant_id, "facts"), fact_id)
        return json.loads(raw) if raw else None

    def facts(self, tenant_id: str, fact_ids: Iterable[str]) -> list[dict | None]:
        fact_ids = list(fact_ids)
        if not fact_ids:
            return []
        return [json.loads(raw) if raw else None for raw in self._redis.hmget(t_key(tenant_id, "facts"), fact_ids)]

    def all_facts(self, tenant_id: str) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self._redis.hgetall(t_key(tenant_id, "facts")).items()}

    def fact_ids(self, tenant_id: str) -> list[str]:
        return sorted(k.decode() for k in self._redis.hkeys(t_key(tenant_id, "facts")))

    def embeddings(self, tenant_id: str, fact_ids: list[str]) -> list[bytes | None]:
        return self._redis.hmget(t_key(tenant_id, "emb"), fact_ids) if fact_ids else []

    def all_embeddings(self, tenant_id: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self._redis.hgetall(t_key(tenant_id, "emb")).items()}

    def usage(self, tenant_id: str) -> dict[str, int]:
        raw = self._redis.hgetall(t_key(tenant_id, "usage"))
        return {"facts": int(raw.get(b"facts", 0)), "bytes": int(raw.get(b"bytes", 0))}

    def version(self, tenant_id: str) -> int:
        return int(self._redis.get(t_key(tenant_id, "version")) or 0)


class ChangeLog:
    """The stream of a tenant's committed changes, read by the retrieval indexes to catch up."""

    def __init__(self, client: "redis.Redis") -> None:
        self._redis = client

    def log_after(self, tenant_id: str, last_id: str, count: int = 10_000) -> list[tuple[str, dict[str, str]]]:
        """Committed changes after stream id `last_id` ("0" for all that are kept)."""
        entries = self._redis.xrange(t_key(tenant_id, "log"), min=f"({last_id}" if last_id != "0" else "-", count=count)
        return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in entries]

    def log_since(
        self, tenant_id: str, last_id: str, count: int = 10_000
    ) -> tuple[str | None, list[tuple[str, dict[str, str]]]]:
        """(the first id the log still keeps, the changes after `last_id`) in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xrange(t_key(tenant_id, "log"), count=1)
        pipe.xrange(t_key(tenant_id, "log"), min=f"({last_id}" if last_id != "0" else "-", count=count)
        first, entries = pipe.execute()
        return (
            first[0][0].decode() if first else None,
            [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in entries],
        )

    def log_last_id(self, tenant_id: str) -> str | None:
        last = self._redis.xrevrange(t_key(tenant_id, "log"), count=1)
        return last[0][0].decode() if last else None

    def facts_with_embeddings(self, tenant_id: str, fact_ids: list[str]) -> list[tuple[dict | None, bytes | None]]:
        """Metadata and committed embedding of each fact, in one round trip."""
        if not fact_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(t_key(tenant_id, "facts"), fact_ids)
        pipe.hmget(t_key(tenant_id, "emb"), fact_ids)
        metas, embeddings = pipe.execute()
        return [(json.loads(m) if m else None, e) for m, e in zip(metas, embeddings)]


class PlacementRecords:
    """Per fact, which replica holds its K/V, in which tier, at which version."""

    def __init__(self, client: "redis.Redis", scripts: Scripts, tenant_ids: Callable[[], list[str]]) -> None:
        self._redis, self._scripts, self._tenant_ids = client, scripts, tenant_ids

    def write_placements(self, replica: str, now: float, moves: dict[str, list[tuple[str, int, str | None]]]) -> None:
        """Per tenant, (fact id, version, tier or None for gone) as held by `replica`; one script per tenant."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant_id, items in moves.items():
            args = [replica, repr(now)] + [x for fid, version, tier in items for x in (fid, version, tier or "")]
            self._scripts.queue(pipe, "place", [t_key(tenant_id, "place"), t_key(tenant_id, "facts")], args)
        pipe.execute()

    def write_chunk_placements(self, replica: str, now: float, moves: dict[str, list[tuple[str, str | None]]]) -> None:
        """Per tenant, (history chunk record id, tier or None for gone) as held by `replica`; one script per tenant."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant_id, items in moves.items():
            args = [replica, repr(now)] + [x for record_id, tier in items for x in (record_id, tier or "")]
            self._scripts.queue(pipe, "place_chunks", [t_key(tenant_id, "hplace")], args)
        pipe.execute()

    def forget_replica(self, replica: str) -> None:
        """Drop `replica` from every placement (it restarted: what it holds now is reported again)."""
        for tenant_id in self._tenant_ids():
            self._scripts.run("unplace", [t_key(tenant_id, "place")], [replica])
            self._scripts.run("unplace", [t_key(tenant_id, "hplace")], [replica])

    def placements(self, tenant_id: str, fact_ids: list[str]) -> list[dict[str, dict]]:
        """`placement` of several facts in one round trip."""
        if not fact_ids:
            return []
        return [json.loads(raw) if raw else {} for raw in self._redis.hmget(t_key(tenant_id, "place"), fact_ids)]

    def chunk_placements(self, tenant_id: str, prefix: str) -> dict[str, dict[str, dict]]:
        """{chunk record id: {replica: {tier, at}}} of the tenant's history chunks whose ids start with `prefix`."""
        found = self._redis.hscan_iter(t_key(tenant_id, "hplace"), match=f"{_glob_escaped(prefix)}*", count=1000)
        return {record_id.decode(): json.loads(raw) for record_id, raw in found}

    def placement(self, tenant_id: str, fact_id: str) -> dict[str, dict]:
        """{replica: {tier, version, at}} of one fact ({} when no replica holds its K/V)."""
        raw = self._redis.hget(t_key(tenant_id, "place"), fact_id)
        return json.loads(raw) if raw else {}


def _glob_escaped(text: str) -> str:
    """`text` matched literally by Redis's glob patterns (HSCAN's MATCH)."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
