"""The tenants layer: admin operations, authentication, and one tenant's facts behind its API key.

Every fact operation is a method of `Tenant`, which only `TenantService.authenticate` hands out, and
every key it touches (Redis, record files, index) is derived from that tenant's id: there is no call
that takes another tenant's id. Changes are ordered so a crash between any two steps leaves nothing
visible that was not acknowledged and loses nothing that was:

- insert: reserve (metadata `pending`, invisible; quota counted) -> write the K/V record, if given ->
  commit (`active`, logged for the indexes). Acknowledged after the commit.
- update: begin (`updating`: the committed version stays visible) -> write the new version's record ->
  commit (swap, logged) -> remove the old version's record.
- delete: one atomic step (gone from metadata, quota and retrieval at once) -> remove its records.

`reconcile` rolls back changes that never committed and removes record files nothing refers to.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

import numpy as np
import torch

from kvcore.record import FactKV
from kvcore.store import LocalFactStore
from tenants.auth import TENANT_PREFIX, check_admin_key, hash_key, matches, new_admin_key, new_tenant_key, tenant_of
from tenants.embedding import Embedder
from tenants.errors import (
    AuthError,
    ConflictError,
    FactNotFoundError,
    InvalidInputError,
    JobNotFoundError,
    TenantExistsError,
    UnknownTenantError,
)
from tenants.facts import HISTORY_KEPT, VISIBLE, Fact, check_id, check_metadata, check_text, new_fact_id, record_id_for
from tenants.index_sync import Retrieved, TenantIndexes
from tenants.redis_meta import RedisMeta
from tenants.scopes import NO_KEY, SEPARATOR, Scope, is_scoped, scoped_id

log = logging.getLogger(__name__)
MAX_K = 1000
Fault = Callable[[str], None]  # called at each step boundary; tests raise there to simulate a crash


def _no_fault(step: str) -> None:
    return None


class TenantService:
    """Admin operations and authentication over one Redis, one record store and one index directory."""

    def __init__(
        self,
        meta: RedisMeta,
        records: LocalFactStore,
        embedder: Embedder,
        indexes: TenantIndexes,
        *,
        max_facts: int = 100_000,
        max_bytes: int = 4 << 30,
        max_fact_chars: int = 2000,
        fault: Fault = _no_fault,
    ) -> None:
        self.meta, self.records, self.embedder, self.indexes = meta, records, embedder, indexes
        self.defaults = {"max_facts": max_facts, "max_bytes": max_bytes}
        self.max_fact_chars = max_fact_chars
        self.fault = fault

    # ---- admin ----
    def ensure_admin_key(self) -> str | None:
        """Create the admin key if there is none; the key is returned (and shown) only this once."""
        key = new_admin_key()
        return key if self.meta.set_admin_hash(hash_key(key)) else None

    def install_admin_key(self, key: str) -> bool:
        """Install a configured admin key (app args or INFERSCALE_ADMIN_KEY), replacing any stored one.

        A configured key is authoritative: the key it replaces stops working at once. True when the stored
        key changed; `InvalidInputError` (naming the rule) for a key that cannot be an admin key.
        """
        digest = hash_key(check_admin_key(key))
        previous = self.meta.replace_admin_hash(digest)
        if previous is not None and previous != digest:
            log.warning("the configured admin key replaced the stored one; the previous admin key no longer works")
        return previous != digest

    def check_admin(self, key: object) -> None:
        if not isinstance(key, str) or not matches(key, self.meta.admin_hash()):
            raise AuthError("missing or wrong admin key")

    def create_tenant(
        self,
        admin_key: str,
        tenant_id: str,
        *,
        max_facts: int | None = None,
        max_bytes: int | None = None,
        window: int = 5,
        model_fingerprint: str = "",
        recompute: int | None = None,
        neighbours: int = 0,
        scope_max_facts: int | None = None,
        scope_max_bytes: int | None = None,
    ) -> tuple[dict, str]:
        """Register a tenant; returns its registry entry and its API key (shown only this once). `max_facts` and
        `max_bytes` bound its own memory and all its end users' together; `scope_max_*` bound each end user's
        (None: the same as the tenant's). `recompute`:
        the facts its chats prefill after the injected ones when a chat does not say (None: the cluster's);
        `window` turns and `neighbours` nearest facts: the context its facts are encoded behind."""
        self.check_admin(admin_key)
        tenant_id = check_id("tenant id", tenant_id)
        if is_scoped(tenant_id):
            raise InvalidInputError(f"tenant id {tenant_id!r} holds {SEPARATOR!r}, which is kept for end users' scopes")
        limits = {
            "max_facts": max_facts or self.defaults["max_facts"],
            "max_bytes": max_bytes or self.defaults["max_bytes"],
        }
        limits |= {
            "scope_max_facts": scope_max_facts or limits["max_facts"],
            "scope_max_bytes": scope_max_bytes or limits["max_bytes"],
        }
        if any(not isinstance(v, int) or v < 1 for v in limits.values()) or not isinstance(window, int) or window < 0:
            raise InvalidInputError("quotas must be positive integers and the window a non-negative integer")
        if recompute is not None and (not isinstance(recompute, int) or recompute < 0):
            raise InvalidInputError("recompute must be a non-negative integer")
        if not isinstance(neighbours, int) or neighbours < 0:
            raise InvalidInputError("neighbours must be a non-negative integer")
        key = new_tenant_key(tenant_id)
        fields = {
            "key_hash": hash_key(key),
            **limits,
            "window": window,
            "model_fingerprint": model_fingerprint,
            "created": time.time(),
        } | ({} if recompute is None else {"recompute": recompute})
        fields |= {"neighbours": neighbours} if neighbours else {}
        self.meta.create_tenant(tenant_id, fields)
        return self.tenant_info(admin_key, tenant_id), key

    def tenant_info(self, admin_key: str, tenant_id: str) -> dict:
        self.check_admin(admin_key)
        info = self.meta.tenant(check_id("tenant id", tenant_id))
        if info is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        return _public(info) | {
            "usage": self.meta.records.usage(tenant_id),
            "total": self.meta.records.total(tenant_id),
        }

    def list_tenants(self, admin_key: str) -> list[str]:
        self.check_admin(admin_key)
        return self.meta.tenant_ids()

    def rotate_key(self, admin_key: str, tenant_id: str) -> str:
        """A new API key for the tenant; the old one stops working at once."""
        self.check_admin(admin_key)
        if is_scoped(check_id("tenant id", tenant_id)) or self.meta.tenant(tenant_id) is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")  # a scope has no key of its own
        key = new_tenant_key(tenant_id)
        self.meta.update_tenant(tenant_id, {"key_hash": hash_key(key)})
        return key

    def delete_tenant(self, admin_key: str, tenant_id: str) -> None:
        """Remove a tenant: its key stops working at once, then its records and index are removed, and so are
        those of its end users' scopes."""
        self.check_admin(admin_key)
        scopes = self.meta.scope_ids(check_id("tenant id", tenant_id))
        if not self.meta.delete_tenant(tenant_id):
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        self._drop_stored(tenant_id)
        for scoped in scopes:
            self.meta.delete_tenant(scoped)
            self._drop_stored(scoped)

    def _drop_stored(self, tenant_id: str) -> None:
        """What a deleted tenant or scope left beside Redis: its records and its retrieval index."""
        self.records.drop_tenant(tenant_id)
        self.indexes.forget(tenant_id, remove_snapshot=True)

    def tenant_for_admin(self, admin_key: str, tenant_id: str) -> "Tenant":
        """A tenant's facts opened with the admin key (encoder jobs write on a tenant's behalf)."""
        self.check_admin(admin_key)
        info = self.meta.tenant(check_id("tenant id", tenant_id))
        if info is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        return Tenant(self, tenant_id, info)

    def open_tenant(self, key: str, tenant_id: str) -> "Tenant":
        """A tenant's facts (or one of its scopes') opened with the admin key or the tenant's own key (jobs and
        encodings act with either)."""
        if isinstance(key, str) and key.startswith(f"{TENANT_PREFIX}."):
            tenant = self.authenticate(key)
            if tenant.id == tenant_id:
                return tenant
            info = self.meta.tenant(check_id("tenant id", tenant_id)) if is_scoped(tenant_id) else None
            if info is None or info.get("parent") != tenant.id:
                raise AuthError("missing or wrong API key")
            return Tenant(self, tenant_id, info)
        return self.tenant_for_admin(key, tenant_id)

    def open_scope(self, tenant: "Tenant", scope: Scope, create: bool = True) -> "Tenant":
        """An end user's memory inside `tenant`, made on first use with the tenant's settings and quotas; with
        `create` False (reads) one not made yet is opened empty and nothing is stored."""
        if tenant.scope is not None:
            raise InvalidInputError("a scope has no scopes of its own")
        scoped = scoped_id(tenant.id, scope)
        info = self.meta.tenant(scoped)
        if info is None:
            fields = {k: v for k, v in tenant._info.items() if k not in ("id", "key_hash", "created")}
            fields |= {
                "max_facts": fields.get("scope_max_facts", fields["max_facts"]),
                "max_bytes": fields.get("scope_max_bytes", fields["max_bytes"]),
            }
            fields |= {
                "key_hash": NO_KEY,
                "parent": tenant.id,
                "scope": json.dumps(scope.as_dict()),
                "created": time.time(),
            }
            if not create:
                return Tenant(self, scoped, {k: str(v) for k, v in fields.items()} | {"id": scoped})
            try:
                self.meta.create_scope(tenant.id, scoped, fields)
            except TenantExistsError:
                pass  # made meanwhile by another request
            info = self.meta.tenant(scoped)
            if info is None:
                raise UnknownTenantError(f"unknown tenant {tenant.id!r}")
        return Tenant(self, scoped, info)

    def open_holder(self, tenant: "Tenant", holder_id: str, fact_id: str) -> "Tenant":
        """The scope of `tenant` stored under `holder_id` (which a located memory id names); a scope that does
        not exist, or is not this tenant's, answers as the fact not found."""
        try:
            info = self.meta.tenant(check_id("scope id", holder_id)) if tenant.scope is None else None
        except InvalidInputError:
            info = None
        if info is None or info.get("parent") != tenant.id:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return Tenant(self, holder_id, info)

    def delete_scope(self, tenant: "Tenant", scope: Scope) -> bool:
        """Remove an end user's scope of `tenant` and everything in it (True if it existed)."""
        if tenant.scope is not None:
            raise InvalidInputError("a scope has no scopes of its own")
        scoped = scoped_id(tenant.id, scope)
        held = self.meta.records.usage(scoped)
        existed = self.meta.delete_tenant(scoped)
        if existed:  # its facts leave the tenant's total
            self.meta.records.charge_total(tenant.id, -held["facts"], -held["bytes"])
        self.meta.remove_scope(tenant.id, scoped)  # after: a crash between leaves an id `scopes` skips
        self._drop_stored(scoped)
        return existed

    def scopes(self, tenant: "Tenant") -> list[dict[str, str]]:
        """The end users' scopes a tenant holds memories for."""
        entries = [self.meta.tenant(s) for s in self.meta.scope_ids(tenant.id)]
        return [json.loads(e["scope"]) for e in entries if e and e.get("parent") == tenant.id]

    # ---- tenants ----
    def authenticate(self, api_key: object) -> "Tenant":
        tenant_id = tenant_of(api_key)
        info = self.meta.tenant(tenant_id)
        if info is None or "parent" in info or not matches(api_key, info.get("key_hash")):  # type: ignore[arg-type]
            raise AuthError("missing or wrong API key")  # the same answer for an unknown tenant
        return Tenant(self, tenant_id, info)


class Tenant:
    """One authenticated tenant's facts."""

    def __init__(self, service: TenantService, tenant_id: str, info: dict[str, str]) -> None:
        self._s, self.id, self._info = service, tenant_id, info

    @property
    def window(self) -> int:
        return int(self._info.get("window", 0))

    @property
    def scope(self) -> Scope | None:
        """The end user this memory belongs to, when it is a scope of a tenant; None for the tenant's own."""
        return Scope(**json.loads(self._info["scope"])) if "scope" in self._info else None

    @property
    def root_id(self) -> str:
        """The tenant whose quotas bound this memory's total: its own id, or a scope's tenant."""
        return self._info.get("parent", self.id)

    @property
    def neighbours(self) -> int:
        """Nearest facts each fact is encoded behind (after its window turns)."""
        return int(self._info.get("neighbours", 0))

    @property
    def recompute(self) -> int | None:
        """Facts a chat prefills after the injected ones when it does not say; None: the cluster's default."""
        return int(self._info["recompute"]) if "recompute" in self._info else None

    @property
    def model_fingerprint(self) -> str:
        return self._info.get("model_fingerprint", "")

    def usage(self) -> dict[str, int]:
        return self._s.meta.records.usage(self.id) | {
            "max_facts": int(self._info["max_facts"]),
            "max_bytes": int(self._info["max_bytes"]),
        }

    def version(self) -> int:
        """Bumped by every committed change (salts the engine's prefix cache)."""
        return self._s.meta.records.version(self.id)

    # ---- writes ----
    def add_fact(
        self,
        text: str,
        *,
        fact_id: str | None = None,
        source_turn: int | None = None,
        kv: FactKV | None = None,
        metadata: dict | None = None,
    ) -> Fact:
        return self.add_facts([text], fact_ids=[fact_id], source_turns=[source_turn], kvs=[kv], metadata=metadata)[0]

    def add_facts(
        self,
        texts: list[str],
        *,
        fact_ids: list[str | None] | None = None,
        source_turns: list[int | None] | None = None,
        kvs: list[FactKV | None] | None = None,
        metadata: dict | None = None,
    ) -> list[Fact]:
        """Insert facts (embedded in one batch), each with the same `metadata`; each is acknowledged only once
        committed."""
        count = len(texts)
        fact_ids, source_turns, kvs = fact_ids or [None] * count, source_turns or [None] * count, kvs or [None] * count
        if not (len(fact_ids) == len(source_turns) == len(kvs) == count):
            raise InvalidInputError("texts, ids, turns and K/V records must line up")
        metadata = check_metadata(metadata)
        texts = [check_text(t, self._s.max_fact_chars) for t in texts]
        ids = [check_id("fact id", f) if f is not None else new_fact_id() for f in fact_ids]
        for turn in source_turns:
            if turn is not None and (not isinstance(turn, int) or turn < 0):
                raise InvalidInputError("source_turn must be a non-negative integer")
        if len(set(ids)) != len(ids):
            raise InvalidInputError("fact ids must be distinct")
        if not texts:
            return []
        vectors = self._s.embedder.embed(texts)
        return self._insert(list(zip(ids, texts, source_turns, kvs, vectors)), metadata)

    def update_fact(
        self,
        fact_id: str,
        text: str | None,
        *,
        kv: FactKV | None = None,
        version: int | None = None,
        metadata: dict | None = None,
    ) -> Fact:
        """A new version of the fact's text (None: the same text) and K/V, if given, and metadata, if given;
        `version` guards against lost updates. The version it replaces joins the fact's history."""
        fact_id, metadata = check_id("fact id", fact_id), check_metadata(metadata)
        current = self._visible_meta(fact_id)
        text = check_text(current["text"] if text is None else text, self._s.max_fact_chars)
        if version is not None and version != current["version"]:
            raise ConflictError(f"fact {fact_id!r} is at version {current['version']}, not {version}")
        vector = self._s.embedder.embed([text])[0]
        new_version = current["version"] + 1
        record_id = record_id_for(fact_id, new_version) if kv is not None else None
        nbytes = _size(text, kv)
        now = time.time()
        pending = {"text": text, "version": new_version, "record_id": record_id, "bytes": nbytes, "started": now}
        meta = self._s.meta
        self._charge(0, nbytes)  # both versions count until the commit
        try:
            meta.records.begin_update(
                self.id,
                fact_id,
                current["version"],
                {**current, "state": "updating", "pending": pending},
                vector.astype(np.float32).tobytes(),
                nbytes,
            )
        except Exception:
            self._refund(0, nbytes)
            raise
        self._s.fault("update:begun")
        try:
            if kv is not None:
                self._write_record(record_id, kv, new_version)
            self._s.fault("update:record-written")
            earlier = [
                *(current.get("previous") or ()),
                {"version": current["version"], "text": current["text"], "at": current["updated"]},
            ][-HISTORY_KEPT:]
            committed = {
                **current,
                "text": text,
                "version": new_version,
                "record_id": record_id,
                "bytes": nbytes,
                "encoding": _encoding(kv),
                "state": "active",
                "pending": None,
                "updated": now,
                "previous": earlier,
            } | ({} if metadata is None else {"metadata": metadata})
            meta.records.commit(
                self.id,
                fact_id,
                "updating",
                current["version"],
                committed,
                "update",
                bytes_delta=-current["bytes"],
                move_pending_embedding=True,
            )
        except Exception:
            meta.records.rollback(self.id, fact_id, "updating", current["version"], current, 0, nbytes)
            self._refund(0, nbytes)
            if record_id:
                self._s.records.delete(self.id, record_id)
            raise
        self._refund(0, current["bytes"])  # the replaced version's
        self._s.fault("update:committed")
        if current.get("record_id"):
            self._s.records.delete(self.id, current["record_id"])
        return Fact.from_meta(committed)

    def attach_kv(self, fact_id: str, version: int, kv: FactKV) -> Fact:
        """Store the K/V of one version of a fact (encoder jobs); refused if the fact moved on meanwhile."""
        current = self._visible_meta(check_id("fact id", fact_id))
        if current["state"] != "active" or current["version"] != version:
            raise ConflictError(f"fact {fact_id!r} is at version {current['version']}, not {version}")
        if current.get("record_id"):
            return Fact.from_meta(current)  # already encoded
        record_id = record_id_for(fact_id, version)
        updated = {**current, "record_id": record_id, "encoding": _encoding(kv), "bytes": current["bytes"] + kv.nbytes}
        self._charge(0, kv.nbytes)
        try:
            self._write_record(record_id, kv, version)  # an orphan until committed; the reconciler removes it then
            self._s.meta.records.commit(self.id, fact_id, "active", version, updated, "kv", bytes_delta=kv.nbytes)
        except Exception:
            self._refund(0, kv.nbytes)
            self._s.records.delete(self.id, record_id)
            raise
        return Fact.from_meta(updated)

    def delete_fact(self, fact_id: str) -> None:
        """Gone from retrieval, listing and quota in one step; its records are removed after."""
        old = self._s.meta.records.delete(self.id, check_id("fact id", fact_id))
        self._refund(1, old["bytes"] + ((old.get("pending") or {}).get("bytes") or 0))
        self._s.fault("delete:committed")
        for record_id in (old.get("record_id"), (old.get("pending") or {}).get("record_id")):
            if record_id:
                self._s.records.delete(self.id, record_id)

    # ---- reads ----
    def get_fact(self, fact_id: str) -> Fact:
        return Fact.from_meta(self._visible_meta(check_id("fact id", fact_id)))

    def list_facts(self, offset: int = 0, limit: int = 100) -> list[Fact]:
        if not isinstance(offset, int) or not isinstance(limit, int) or offset < 0 or not 1 <= limit <= 10_000:
            raise InvalidInputError("offset must be >= 0 and limit within 1..10000")
        ids = self._s.meta.records.fact_ids(self.id)[offset : offset + limit]
        return [Fact.from_meta(m) for m in self._s.meta.records.facts(self.id, ids) if m and m["state"] in VISIBLE]

    def search(self, query: str, k: int = 10) -> list[tuple[Fact, float]]:
        """The top-k facts of this tenant for `query`, with cosine scores, best first."""
        query = check_text(query, self._s.max_fact_chars)
        return self.retrieve(self._s.embedder.embed([query])[0], k).hits

    def retrieve(self, vector: np.ndarray | torch.Tensor, k: int) -> Retrieved:
        """The top-k facts for an embedded query (on any device) and the tenant version they were read at:
        the chat path, which embeds its queries in batches and reads no fact from Redis."""
        if not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise InvalidInputError(f"k must be within 1..{MAX_K}")
        return self._s.indexes.search(self.id, vector, k)

    def placement(self, fact_id: str) -> dict[str, dict]:
        """Where serving replicas hold this fact's K/V: {replica: {tier, version, at}} (reported by the replicas)."""
        self._visible_meta(check_id("fact id", fact_id))
        return self._s.meta.places.placement(self.id, fact_id)

    def best_tiers(self, fact_ids: list[str]) -> list[str]:
        """Per fact, the highest tier any replica reported holding its K/V in (`gpu`, `cpu`, `disk`), else
        `store` (the K/V is read from the fact store, or the fact has none yet)."""
        order = ("gpu", "cpu", "disk")
        best = []
        for placed in self._s.meta.places.placements(self.id, fact_ids):
            tiers = [where.get("tier") for where in placed.values()]
            best.append(next((tier for tier in order if tier in tiers), "store"))
        return best

    def record_job(self, job_id: str, status: dict) -> None:
        """Status of one of this tenant's encoding jobs (ids are the caller's: `check_id` applies)."""
        self._s.meta.set_job(self.id, check_id("job id", job_id), status)

    def job(self, job_id: str) -> dict:
        status = self._s.meta.job(self.id, check_id("job id", job_id))
        if status is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return status

    # ---- internals ----
    def _insert(
        self, items: list[tuple[str, str, int | None, FactKV | None, np.ndarray]], metadata: dict | None = None
    ) -> list[Fact]:
        """Reserve every fact (pending) in Redis, write their K/V records as one group, then commit them: the
        order of a single insert, with one round trip per phase. Nothing is acknowledged unless all commit;
        whatever did not commit is rolled back (a crash in between is the reconciler's to undo)."""
        meta = self._s.meta
        now = time.time()
        pendings = []
        for (fact_id, text, source_turn, kv, _), index_id in zip(
            items, meta.records.next_index_ids(self.id, len(items))
        ):
            pendings.append(
                {
                    "id": fact_id,
                    "text": text,
                    "version": 1,
                    "state": "pending",
                    "index_id": index_id,
                    "record_id": record_id_for(fact_id, 1) if kv is not None else None,
                    "encoding": _encoding(kv),
                    "bytes": _size(text, kv),
                    "source_turn": source_turn,
                    "created": now,
                    "updated": now,
                    "started": now,
                    "pending": None,
                }
                | ({} if metadata is None else {"metadata": metadata})
            )
        self._charge(len(pendings), sum(p["bytes"] for p in pendings))  # the tenant's total first: all or none
        try:
            errors = meta.records.reserve_many(
                self.id,
                [
                    (p["id"], p, vector.astype(np.float32).tobytes(), p["bytes"])
                    for p, (*_, vector) in zip(pendings, items)
                ],
            )
        except Exception:
            self._refund(len(pendings), sum(p["bytes"] for p in pendings))
            raise
        reserved = [p for p, error in zip(pendings, errors) if error is None]
        if len(reserved) != len(pendings):
            self._roll_back(reserved)
            refused = [p for p, error in zip(pendings, errors) if error is not None]
            self._refund(len(refused), sum(p["bytes"] for p in refused))
            raise next(error for error in errors if error is not None)
        self._s.fault("insert:reserved")
        committed: set[str] = set()
        try:
            self._write_records(
                [(p["record_id"], kv, 1) for p, (_, _, _, kv, _) in zip(pendings, items) if kv is not None]
            )
            self._s.fault("insert:record-written")
            actives = [{**p, "state": "active"} for p in pendings]
            errors = meta.records.commit_many(self.id, [(a["id"], a) for a in actives], "add")
            committed = {a["id"] for a, error in zip(actives, errors) if error is None}
            if len(committed) != len(actives):
                raise next(error for error in errors if error is not None)
        except Exception:
            self._roll_back([p for p in pendings if p["id"] not in committed])
            raise
        return [Fact.from_meta(a) for a in actives]

    def _roll_back(self, pendings: list[dict]) -> None:
        """Undo inserts that did not commit; `pendings`: the reserved ones (every one was charged to the total)."""
        for p in pendings:
            self._s.meta.records.rollback(self.id, p["id"], "pending", 1, None, 1, p["bytes"])
            if p["record_id"]:
                self._s.records.delete(self.id, p["record_id"])
        self._refund(len(pendings), sum(p["bytes"] for p in pendings))

    def _charge(self, facts: int, nbytes: int) -> None:
        """Count facts and bytes against the tenant's total across its own memory and its end users' (a scope
        charges its tenant); refused past its quotas. A crash after a charge and before its write leaves the
        total above what is stored: it then refuses early, never lets a tenant past its quota."""
        self._s.meta.records.charge_total(self.root_id, facts, nbytes)

    def _refund(self, facts: int, nbytes: int) -> None:
        if facts or nbytes:
            self._s.meta.records.charge_total(self.root_id, -facts, -nbytes)

    def _write_record(self, record_id: str, kv: FactKV, version: int) -> None:
        self._write_records([(record_id, kv, version)])

    def _write_records(self, items: list[tuple[str, FactKV, int]]) -> None:
        if items:
            self._s.records.put_many(
                [
                    FactKV(self.id, record_id, kv.token_ids, kv.k, kv.v, kv.params, version, kv.meta)
                    for record_id, kv, version in items
                ]
            )

    def _visible_meta(self, fact_id: str) -> dict:
        meta = self._s.meta.records.fact(self.id, fact_id)
        if meta is None or meta["state"] not in VISIBLE:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return meta


def _encoding(kv: FactKV | None) -> dict | None:
    """How the fact's K/V was made (window, neighbour facts, model fingerprint, rope, dtype), as metadata."""
    if kv is None:
        return None
    return json.loads(kv.params.to_json()) | {"neighbours": int(kv.meta.get("neighbours", 0))}


def _size(text: str, kv: FactKV | None) -> int:
    return len(text.encode()) + (kv.nbytes if kv is not None else 0)


def _public(info: dict[str, str]) -> dict:
    return {
        "id": info["id"],
        "max_facts": int(info["max_facts"]),
        "max_bytes": int(info["max_bytes"]),
        "window": int(info["window"]),
        "model_fingerprint": info.get("model_fingerprint", ""),
        "neighbours": int(info.get("neighbours", 0)),
        "created": float(info["created"]),
    } | ({"recompute": int(info["recompute"])} if "recompute" in info else {})
