"""Per-process retrieval indexes, one per tenant, kept in step with Redis by replaying its change log.

Redis holds every committed embedding, so an index is derived data: it is loaded from its last saved
snapshot (or rebuilt from Redis when there is none, or when the log was trimmed past it) and then
catches up with the change log before each search. Any number of processes can serve one tenant.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tenants.facts import VISIBLE
from tenants.faiss_index import VectorIndex
from tenants.redis_meta import RedisMeta

log = logging.getLogger(__name__)


@dataclass
class _TenantIndex:
    index: VectorIndex
    fact_of: dict[int, str] = field(default_factory=dict)  # index id -> fact id
    last_id: str = "0"  # the last change-log entry applied
    lock: threading.Lock = field(default_factory=threading.Lock)


class TenantIndexes:
    """Search the facts of one tenant at a time; never mixes tenants (one index each)."""

    def __init__(self, meta: RedisMeta, dim: int, directory: Path, use_gpu: bool | None = None) -> None:
        self._meta, self._dim, self._dir, self._use_gpu = meta, dim, Path(directory), use_gpu
        self._tenants: dict[str, _TenantIndex] = {}
        self._lock = threading.Lock()

    def search(self, tenant_id: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """(fact id, score) of up to `k` nearest facts, best first, as of the latest committed change."""
        state = self.sync(tenant_id)
        with state.lock:
            scores, ids = state.index.search(vector, k)
            return [(state.fact_of[int(i)], float(s)) for s, i in zip(scores, ids) if int(i) in state.fact_of]

    def sync(self, tenant_id: str) -> _TenantIndex:
        state = self._state(tenant_id)
        with state.lock:
            first = self._meta.log_first_id(tenant_id)
            if state.last_id != "0" and first is not None and _older(state.last_id, first):
                self._rebuild(tenant_id, state)  # the log was trimmed past this index: changes may be missed
                return state
            entries = self._meta.log_after(tenant_id, state.last_id)
            while entries:
                self._apply(tenant_id, state, entries)
                entries = self._meta.log_after(tenant_id, state.last_id)
        return state

    def save(self, tenant_id: str) -> None:
        """Write the tenant's index and how far it got, so a restart only replays what came after."""
        state = self.sync(tenant_id)
        with state.lock:
            folder = self._dir / tenant_id
            folder.mkdir(parents=True, exist_ok=True)
            state.index.save(folder / "index.faiss")
            side = {"last_id": state.last_id, "dim": self._dim, "fact_of": {str(i): f for i, f in state.fact_of.items()}}
            tmp = folder / "index.json.tmp"
            tmp.write_text(json.dumps(side))
            tmp.replace(folder / "index.json")

    def save_all(self) -> None:
        for tenant_id in list(self._tenants):
            self.save(tenant_id)

    def forget(self, tenant_id: str, remove_snapshot: bool = False) -> None:
        with self._lock:
            self._tenants.pop(tenant_id, None)
        if remove_snapshot:
            shutil.rmtree(self._dir / tenant_id, ignore_errors=True)

    def _state(self, tenant_id: str) -> _TenantIndex:
        with self._lock:
            state = self._tenants.get(tenant_id)
            if state is None:
                state = self._load(tenant_id)
                self._tenants[tenant_id] = state
            return state

    def _load(self, tenant_id: str) -> _TenantIndex:
        folder = self._dir / tenant_id
        try:
            side = json.loads((folder / "index.json").read_text())
            index = VectorIndex.load(folder / "index.faiss", self._dim, self._use_gpu)
            return _TenantIndex(index, {int(i): f for i, f in side["fact_of"].items()}, side["last_id"])
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            if folder.exists():
                log.warning("tenant %s: index snapshot unusable (%s); rebuilding from redis", tenant_id, exc)
        state = _TenantIndex(VectorIndex(self._dim, self._use_gpu))
        self._rebuild(tenant_id, state)
        return state

    def _rebuild(self, tenant_id: str, state: _TenantIndex) -> None:
        """Everything committed, from Redis; changes committed meanwhile are replayed after."""
        last_id = self._meta.log_last_id(tenant_id) or "0"
        facts = self._meta.all_facts(tenant_id)
        embeddings = self._meta.all_embeddings(tenant_id)
        index = VectorIndex(self._dim, self._use_gpu)
        visible = [(m["index_id"], fid) for fid, m in facts.items() if m["state"] in VISIBLE and fid in embeddings]
        if visible:
            ids = np.array([i for i, _ in visible], dtype=np.int64)
            vectors = np.stack([np.frombuffer(embeddings[fid], dtype=np.float32) for _, fid in visible])
            index.upsert(ids, vectors)
        state.index, state.fact_of, state.last_id = index, {int(i): f for i, f in visible}, last_id
        log.info("tenant %s: index rebuilt with %d facts", tenant_id, len(visible))

    def _apply(self, tenant_id: str, state: _TenantIndex, entries: list[tuple[str, dict[str, str]]]) -> None:
        latest: dict[str, tuple[str, int]] = {}
        for _, fields in entries:
            latest[fields["fid"]] = (fields["op"], int(fields["iid"]))
        upserts = [(fid, iid) for fid, (op, iid) in latest.items() if op in ("add", "update")]
        removes = [iid for op, iid in latest.values() if op == "remove"]
        embeddings = self._meta.embeddings(tenant_id, [fid for fid, _ in upserts])
        found = [(fid, iid, raw) for (fid, iid), raw in zip(upserts, embeddings) if raw is not None]
        removes += [iid for (fid, iid), raw in zip(upserts, embeddings) if raw is None]  # deleted since
        if removes:
            state.index.remove(np.array(removes, dtype=np.int64))
            for iid in removes:
                state.fact_of.pop(iid, None)
        if found:
            state.index.upsert(np.array([i for _, i, _ in found], dtype=np.int64),
                               np.stack([np.frombuffer(raw, dtype=np.float32) for _, _, raw in found]))
            state.fact_of.update({iid: fid for fid, iid, _ in found})
        state.last_id = entries[-1][0]


def _older(a: str, b: str) -> bool:
    """Whether stream id `a` comes before stream id `b`."""
    ta, tb = tuple(int(x) for x in a.split("-")), tuple(int(x) for x in b.split("-"))
    return ta < tb
