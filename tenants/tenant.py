"""One authenticated tenant's facts (or one of its end users' scopes'): the only handle on them.

Only `TenantService` opens a `Tenant`, after checking a key, and every key it touches (Redis, record files,
index) is derived from its id: there is no call that takes another tenant's id. It validates and embeds what
callers send; the ordered steps of each change are `FactWriter`'s (`tenants/fact_writes.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcore.history_index import chunk_prefix
from kvcore.record import FactKV
from tenants.errors import ConflictError, FactNotFoundError, InvalidInputError, JobNotFoundError
from tenants.fact_writes import FactWriter
from tenants.facts import VISIBLE, Fact, check_id, check_metadata, check_text, new_fact_id
from tenants.index_mirror import Found
from tenants.index_sync import Retrieved
from tenants.tenant_entry import TenantEntry

if TYPE_CHECKING:
    from tenants.service import TenantService

MAX_K = 1000
TIER_ORDER = ("gpu", "cpu", "disk")  # a replica's tiers, highest first (`kvcore.placement.Where`)


class Tenant:
    """One authenticated tenant's facts."""

    def __init__(self, service: TenantService, tenant_id: str, info: dict[str, str]) -> None:
        self._s, self.id = service, tenant_id
        self._info = info  # the entry as stored: a new scope copies its tenant's (`TenantService.open_scope`)
        self.entry = TenantEntry.parse(tenant_id, info)
        self._writes = FactWriter(service.meta.records, service.records, tenant_id, self.entry.root_id, service.fault)

    def usage(self) -> dict[str, int]:
        return self._s.meta.records.usage(self.id) | {
            "max_facts": self.entry.max_facts,
            "max_bytes": self.entry.max_bytes,
        }

    def version(self) -> int:
        """Bumped by every committed change (salts the engine's prefix cache)."""
        return self._s.meta.records.version(self.id)

    def set_history(self, history_id: str, tokens: int) -> str | None:
        """Name the history that history mode serves (its chunk records are written); returns the one it replaces."""
        return self._s.meta.swap_history(self.id, history_id, tokens)  # atomic: concurrent writers each delete
        # the history they replaced, and a deleted tenant is not brought back by a late write

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
        return self._writes.insert(list(zip(ids, texts, source_turns, kvs, vectors)), metadata)

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
        return self._writes.update(current, text, self._s.embedder.embed([text])[0], kv, metadata)

    def attach_kv(self, fact_id: str, version: int, kv: FactKV) -> Fact:
        """Store the K/V of one version of a fact (encoder jobs); refused if the fact moved on meanwhile."""
        current = self._visible_meta(check_id("fact id", fact_id))
        if current["state"] != "active" or current["version"] != version:
            raise ConflictError(f"fact {fact_id!r} is at version {current['version']}, not {version}")
        if current.get("record_id"):
            return Fact.from_meta(current)  # already encoded
        return self._writes.attach_kv(current, kv)

    def delete_fact(self, fact_id: str) -> None:
        """Gone from retrieval, listing and quota in one step; its records are removed after."""
        self._writes.delete(check_id("fact id", fact_id))

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

    def retrieve(self, vector: np.ndarray | torch.Tensor, k: int, found: Found | None = None) -> Retrieved:
        """The top-k facts for an embedded query (on any device) and the tenant version they were read at:
        the chat path, which embeds its queries in batches and reads no fact from Redis. `found`: what the
        search copy beside the embedding found (`TenantIndexes.resolve`)."""
        if not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise InvalidInputError(f"k must be within 1..{MAX_K}")
        return self._s.indexes.resolve(self.id, vector, k, found)

    def placement(self, fact_id: str) -> dict[str, dict]:
        """Where serving replicas hold this fact's K/V: {replica: {tier, version, at}} (reported by the replicas)."""
        self._visible_meta(check_id("fact id", fact_id))
        return self._s.meta.places.placement(self.id, fact_id)

    def history_placement(self) -> dict[str, dict[str, int]]:
        """Where serving replicas hold the K/V of this tenant's history chunks: `tiers`, its chunks by the highest
        tier any replica reported (`gpu`, `cpu`, `disk`; a chunk in none is read from the record store), and each
        replica's own counts (`replicas`)."""
        tiers = dict.fromkeys(TIER_ORDER, 0)
        replicas: dict[str, dict[str, int]] = {}
        if self.entry.history is None:
            return {"tiers": tiers, "replicas": replicas}
        placed = self._s.meta.places.chunk_placements(self.id, chunk_prefix(self.entry.history))
        for where in placed.values():
            held = {place.get("tier") for place in where.values()}
            best = next((tier for tier in TIER_ORDER if tier in held), None)
            if best is not None:
                tiers[best] += 1
            for replica, place in where.items():
                counts = replicas.setdefault(replica, dict.fromkeys(TIER_ORDER, 0))
                if place.get("tier") in counts:
                    counts[place["tier"]] += 1
        return {"tiers": tiers, "replicas": replicas}

    def best_tiers(self, fact_ids: list[str]) -> list[str]:
        """Per fact, the highest tier any replica reported holding its K/V in (`gpu`, `cpu`, `disk`), else
        `store` (the K/V is read from the fact store, or the fact has none yet)."""
        best = []
        for placed in self._s.meta.places.placements(self.id, fact_ids):
            tiers = [where.get("tier") for where in placed.values()]
            best.append(next((tier for tier in TIER_ORDER if tier in tiers), "store"))
        return best

    # ---- encoding jobs ----
    def record_job(self, job_id: str, status: dict) -> None:
        """Status of one of this tenant's encoding jobs (ids are the caller's: `check_id` applies)."""
        self._s.meta.set_job(self.id, check_id("job id", job_id), status)

    def job(self, job_id: str) -> dict:
        status = self._s.meta.job(self.id, check_id("job id", job_id))
        if status is None:
            raise JobNotFoundError(f"no job {job_id!r}")
        return status

    def _visible_meta(self, fact_id: str) -> dict:
        meta = self._s.meta.records.fact(self.id, fact_id)
        if meta is None or meta["state"] not in VISIBLE:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return meta
