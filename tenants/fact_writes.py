"""One memory's changes, in the order that lets a crash between any two steps leave nothing visible that was not
acknowledged and lose nothing that was:

- insert: reserve (metadata `pending`, invisible; quota counted) -> write the K/V record, if given ->
  commit (`active`, logged for the indexes). Acknowledged after the commit.
- update: begin (`updating`: the committed version stays visible) -> write the new version's record ->
  commit (swap, logged) -> remove the old version's record.
- delete: one atomic step (gone from metadata, quota and retrieval at once) -> remove its records.
- K/V drop (residency): one atomic step (text only, bytes refunded) -> its records removed later by the caller.

`Tenant` validates and embeds; `FactWriter` only orders the steps, so the ordering is read in one place.
`tenants/reconcile.py` rolls back changes that never committed and removes record files nothing refers to.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

from kvcore.record import FactKV
from kvcore.store import LocalFactStore
from tenants.facts import HISTORY_KEPT, Fact, record_id_for
from tenants.redis_records import FactRecords

Fault = Callable[[str], None]  # called at each step boundary; tests raise there to simulate a crash
NewFact = tuple[str, str, "int | None", "FactKV | None", np.ndarray]  # (id, text, source turn, K/V, embedding)


def no_fault(step: str) -> None:
    return None


class FactWriter:
    """The ordered insert, update, K/V attach and delete of one memory's facts, and their quota charges."""

    def __init__(self, facts: FactRecords, records: LocalFactStore, tenant_id: str, root_id: str, fault: Fault) -> None:
        self._facts, self._records, self._id, self._root_id, self._fault = facts, records, tenant_id, root_id, fault

    def insert(self, items: list[NewFact], metadata: dict | None = None) -> list[Fact]:
        """Reserve every fact (pending) in Redis, write their K/V records as one group, then commit them: the
        order of a single insert, with one round trip per phase. Nothing is acknowledged unless all commit;
        whatever did not commit is rolled back (a crash in between is the reconciler's to undo)."""
        now = time.time()
        pendings = []
        items = [(fact_id, text, turn, self._stored(kv), rest) for fact_id, text, turn, kv, rest in items]
        for (fact_id, text, source_turn, kv, _), index_id in zip(
            items, self._facts.next_index_ids(self._id, len(items))
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
                    "kv_at": now if kv is not None else None,
                    "started": now,
                    "pending": None,
                }
                | ({} if metadata is None else {"metadata": metadata})
            )
        self._charge(len(pendings), sum(p["bytes"] for p in pendings))  # the tenant's total first: all or none
        try:
            errors = self._facts.reserve_many(
                self._id,
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
        self._fault("insert:reserved")
        committed: set[str] = set()
        try:
            self._write_records(
                [(p["record_id"], kv, 1) for p, (_, _, _, kv, _) in zip(pendings, items) if kv is not None]
            )
            self._fault("insert:record-written")
            actives = [{**p, "state": "active"} for p in pendings]
            errors = self._facts.commit_many(self._id, [(a["id"], a) for a in actives], "add")
            committed = {a["id"] for a, error in zip(actives, errors) if error is None}
            if len(committed) != len(actives):
                raise next(error for error in errors if error is not None)
        except Exception:
            self._roll_back([p for p in pendings if p["id"] not in committed])
            raise
        return [Fact.from_meta(a) for a in actives]

    def update(self, current: dict, text: str, vector: np.ndarray, kv: FactKV | None, metadata: dict | None) -> Fact:
        """Replace the visible version `current` with `text` (embedded as `vector`), its K/V if given and its
        metadata if given; the replaced version joins the fact's history."""
        fact_id, kv = current["id"], self._stored(kv)
        new_version = current["version"] + 1
        record_id = record_id_for(fact_id, new_version) if kv is not None else None
        nbytes = _size(text, kv)
        now = time.time()
        pending = {"text": text, "version": new_version, "record_id": record_id, "bytes": nbytes, "started": now}
        self._charge(0, nbytes)  # both versions count until the commit
        try:
            self._facts.begin_update(
                self._id,
                fact_id,
                current["version"],
                {**current, "state": "updating", "pending": pending},
                vector.astype(np.float32).tobytes(),
                nbytes,
            )
        except Exception:
            self._refund(0, nbytes)
            raise
        self._fault("update:begun")
        try:
            if kv is not None:
                self._write_records([(record_id, kv, new_version)])
            self._fault("update:record-written")
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
                "kv_at": now if kv is not None else None,
                "kv_dropped": False,
                "previous": earlier,
            } | ({} if metadata is None else {"metadata": metadata})
            self._facts.commit(
                self._id,
                fact_id,
                "updating",
                current["version"],
                committed,
                "update",
                bytes_delta=-current["bytes"],
                move_pending_embedding=True,
            )
        except Exception:
            self._facts.rollback(self._id, fact_id, "updating", current["version"], current, 0, nbytes)
            self._refund(0, nbytes)
            if record_id:
                self._records.delete(self._id, record_id)
            raise
        self._refund(0, current["bytes"])  # the replaced version's
        self._fault("update:committed")
        if current.get("record_id"):
            self._records.delete(self._id, current["record_id"])
        return Fact.from_meta(committed)

    def attach_kv(self, current: dict, kv: FactKV) -> Fact:
        """Store the K/V of the active, not yet encoded version `current`; refused if it moved on meanwhile."""
        fact_id, version, kv = current["id"], current["version"], self._stored(kv)
        record_id = record_id_for(fact_id, version, int(current.get("kv_gen") or 0))
        updated = {
            **current,
            "record_id": record_id,
            "encoding": _encoding(kv),
            "bytes": current["bytes"] + kv.nbytes,
            "kv_at": time.time(),
            "kv_dropped": False,
        }
        self._charge(0, kv.nbytes)
        try:
            self._write_records([(record_id, kv, version)])  # an orphan until committed; the reconciler removes it
            self._facts.commit(self._id, fact_id, "active", version, updated, "kv", bytes_delta=kv.nbytes)
        except Exception:
            self._refund(0, kv.nbytes)
            self._records.delete(self._id, record_id)
            raise
        return Fact.from_meta(updated)

    def _stored(self, kv: FactKV | None) -> FactKV | None:
        """The K/V as the record store will hold it (int8 codes where the store says so), so that quotas and
        residency count the bytes stored, not the bytes encoded."""
        return self._records.stored(kv) if kv is not None else None

    def drop_kv(self, current: dict) -> str:
        """Drop the K/V of the active, encoded version `current` (KV residency: the fact is served by its text
        until encoded again); refused if it moved on meanwhile. Returns the record id, whose files the caller
        removes once no chat in flight can still read them (an orphan left by a crash is the reconciler's)."""
        record_id = current["record_id"]
        kv_bytes = current["bytes"] - len(current["text"].encode())
        dropped = {**current, "record_id": None, "encoding": None, "bytes": current["bytes"] - kv_bytes}
        dropped |= {"kv_dropped": True, "kv_at": None, "kv_gen": int(current.get("kv_gen") or 0) + 1}
        self._facts.commit(self._id, current["id"], "active", current["version"], dropped, "kv-drop", -kv_bytes)
        self._refund(0, kv_bytes)
        return record_id

    def delete(self, fact_id: str) -> None:
        """Gone from retrieval, listing and quota in one step; its records are removed after."""
        old = self._facts.delete(self._id, fact_id)
        self._refund(1, old["bytes"] + ((old.get("pending") or {}).get("bytes") or 0))
        self._fault("delete:committed")
        for record_id in (old.get("record_id"), (old.get("pending") or {}).get("record_id")):
            if record_id:
                self._records.delete(self._id, record_id)

    def _roll_back(self, pendings: list[dict]) -> None:
        """Undo inserts that did not commit; `pendings`: the reserved ones (every one was charged to the total)."""
        for p in pendings:
            self._facts.rollback(self._id, p["id"], "pending", 1, None, 1, p["bytes"])
            if p["record_id"]:
                self._records.delete(self._id, p["record_id"])
        self._refund(len(pendings), sum(p["bytes"] for p in pendings))

    def _charge(self, facts: int, nbytes: int) -> None:
        """Count facts and bytes against the tenant's total across its own memory and its end users' (a scope
        charges its tenant); refused past its quotas. A crash after a charge and before its write leaves the
        total above what is stored: it then refuses early, never lets a tenant past its quota."""
        self._facts.charge_total(self._root_id, facts, nbytes)

    def _refund(self, facts: int, nbytes: int) -> None:
        if facts or nbytes:
            self._facts.charge_total(self._root_id, -facts, -nbytes)

    def _write_records(self, items: list[tuple[str, FactKV, int]]) -> None:
        """K/V records under this memory's id: (record id, K/V, the fact version it encodes)."""
        if items:
            self._records.put_many(
                [
                    FactKV(self._id, record_id, kv.token_ids, kv.k, kv.v, kv.params, version, kv.meta)
                    for record_id, kv, version in items
                ]
            )


def _encoding(kv: FactKV | None) -> dict | None:
    """How the fact's K/V was made (window, neighbour facts, model fingerprint, rope, dtype), as metadata."""
    if kv is None:
        return None
    return json.loads(kv.params.to_json()) | {"neighbours": int(kv.meta.get("neighbours", 0))}


def _size(text: str, kv: FactKV | None) -> int:
    return len(text.encode()) + (kv.nbytes if kv is not None else 0)
