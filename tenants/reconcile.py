"""Repair what a crash left half done: roll back changes that never committed, remove orphan records.

Safe to run while the service runs: only changes older than `older_than_s` are touched, and every
rollback re-checks the fact's state and version atomically, so a change that commits meanwhile wins.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from kvcore.store import LocalFactStore
from tenants.facts import is_fact_record
from tenants.redis_meta import RedisMeta

log = logging.getLogger(__name__)


@dataclass
class Repairs:
    """What one reconciliation pass repaired, by kind."""

    inserts_rolled_back: int = 0
    updates_rolled_back: int = 0
    orphan_records_removed: int = 0


def reconcile(meta: RedisMeta, records: LocalFactStore, older_than_s: float = 60.0) -> Repairs:
    repairs, now = Repairs(), time.time()
    for tenant_id in meta.tenant_ids():
        for fact_id, fact in meta.records.all_facts(tenant_id).items():
            if fact["state"] == "pending" and now - fact["started"] >= older_than_s:
                if meta.records.rollback(tenant_id, fact_id, "pending", fact["version"], None, 1, fact["bytes"]):
                    repairs.inserts_rolled_back += 1
            elif fact["state"] == "updating" and now - fact["pending"]["started"] >= older_than_s:
                restored = {**fact, "state": "active", "pending": None}
                if meta.records.rollback(
                    tenant_id, fact_id, "updating", fact["version"], restored, 0, fact["pending"]["bytes"]
                ):
                    repairs.updates_rolled_back += 1
        referenced = set()
        for fact in meta.records.all_facts(tenant_id).values():
            referenced.add(fact.get("record_id"))
            referenced.add((fact.get("pending") or {}).get("record_id"))
        for record_id in records.record_ids(tenant_id):
            path = records.path(tenant_id, record_id)
            if (
                is_fact_record(record_id)
                and record_id not in referenced
                and now - os.path.getmtime(path) >= older_than_s
            ):
                records.delete(tenant_id, record_id)
                repairs.orphan_records_removed += 1
    if repairs != Repairs():
        log.warning("reconciler repaired %s", repairs)
    return repairs
