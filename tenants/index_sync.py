"""Per-process retrieval state, one per tenant, kept in step with Redis by replaying its change log.

Redis holds every committed fact and embedding, so what a process keeps is derived data: the tenant's
vectors (an `ExactIndex` on the process's device), the metadata of its visible facts (text, record id,
version) and the tenant's version. It is loaded from its last saved snapshot (or rebuilt from Redis when
there is none, or when the log was trimmed past it) and catches up with the change log before each
search, and a chat's retrieval reads no fact from Redis. Where the process has a live change feed (the
ingress: `RedisMeta(cache_registry=True)`), a tenant whose facts nobody announced a change of since its last
catch-up is searched with no round trip at all; otherwise the catch-up is one round trip when nothing
changed. Any number of processes can serve one tenant, and a fact committed before a search is found by it
once its announcement has arrived (before the writer's own answer, in practice).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tenants.facts import VISIBLE, Fact
from tenants.index_mirror import Found, IndexUpdate, MirrorLedger, copy_bytes
from tenants.redis_feed import ANY
from tenants.redis_meta import RedisMeta
from tenants.vector_index import ExactIndex

log = logging.getLogger(__name__)
SNAPSHOT, SIDE = "index.npz", "index.json"


@dataclass
class _TenantIndex:
    index: ExactIndex
    facts: dict[int, Fact] = field(default_factory=dict)  # index id -> the visible fact
    last_id: str = "0"  # the last change-log entry applied
    version: int = 0  # the tenant's version as of last_id
    lock: threading.Lock = field(default_factory=threading.Lock)
    generation: int = 0  # changes to `index` so far (unique across tenants and reloads): what a copy searched
    journal: list[IndexUpdate] | None = None  # changes a copy has not been sent; None: it needs the whole tenant

    def record(self, update: IndexUpdate) -> None:
        """Keep a change for the copy, or give up on changes once they outgrow what the whole tenant costs."""
        if self.journal is None:
            return
        self.journal.append(update)
        if sum(len(u.ids) for u in self.journal) > max(64, len(self.index) // 4):
            self.journal = None


@dataclass(frozen=True)
class Retrieved:
    """A search's facts with their scores, best first, and the tenant version they were read at."""

    hits: list[tuple[Fact, float]]
    version: int
    from_copy: bool = False  # the search copy beside the query embedder found them (`resolve`)


class TenantIndexes:
    """Search the facts of one tenant at a time; never mixes tenants (one index each)."""

    def __init__(self, meta: RedisMeta, dim: int, directory: Path, device: str | torch.device = "cpu") -> None:
        self._meta, self._dim, self._dir, self._device = meta, dim, Path(directory), torch.device(device)
        self._tenants: dict[str, _TenantIndex] = {}
        self._quiet: set[str] = set()  # caught up, and no change announced since (only while the feed is live)
        self._heard: dict[str, int] = {}  # announcements per tenant, and of "anything" (ANY), so far
        self._lock = threading.Lock()
        self._generations = itertools.count(1)
        self._follower: MirrorLedger | None = None  # the one copy's ledger: journals are kept for one copy

    def search(self, tenant_id: str, vector: np.ndarray | torch.Tensor, k: int) -> Retrieved:
        """Up to `k` nearest visible facts, best first, as of the latest committed change."""
        state = self.sync(tenant_id)
        with state.lock:
            scores, ids = state.index.search(vector, k)
            hits = [(state.facts[int(i)], float(s)) for s, i in zip(scores, ids) if int(i) in state.facts]
            return Retrieved(hits, state.version)

    def claim(self, ledger: MirrorLedger) -> None:
        """Make `ledger`'s copy the one these indexes keep change journals for (again a no-op); a second copy is
        refused, since the changes kept for a copy are handed out once and the other would miss them."""
        if self._follower is None:
            self._follower = ledger
        elif ledger is not self._follower:
            raise ValueError("these indexes already keep one search copy current; a second would miss changes")

    def release(self, ledger: MirrorLedger) -> None:
        """`ledger`'s copy is gone (its batcher closed): keep no more changes for it, and let another copy claim."""
        if self._follower is ledger:
            self._follower = None
            with self._lock:
                tenant_ids = list(self._tenants)
            self._stop_journals(tenant_ids)

    def mirror_updates(self, tenant_ids: list[str], ledger: MirrorLedger) -> tuple[list[IndexUpdate], dict[str, int]]:
        """What a copy of these tenants' vectors needs before it searches them (each caught up with the change log
        first): their changes since it last saw them, or each whole; and the generation each will be at. A tenant
        missing from the generations is not searched there (it did not fit `ledger`'s budget, or its catch-up
        failed: its questions are searched here, where the failure is raised)."""
        self.claim(ledger)
        updates: list[IndexUpdate] = []
        generations: dict[str, int] = {}
        wanted = set(tenant_ids)
        for tenant_id in dict.fromkeys(tenant_ids):
            try:
                state = self.sync(tenant_id)
            except Exception:  # noqa: BLE001 - the search here meets it again and answers the request with it
                log.debug("tenant %s: not caught up for the search copy", tenant_id, exc_info=True)
                continue
            with state.lock:
                whole = state.journal is None or not ledger.holds(tenant_id)
                fits, drops = ledger.admit(tenant_id, copy_bytes(len(state.index), state.index.dim), keep=wanted)
                updates += drops
                if fits:
                    if whole:
                        ids, vectors = state.index.export()
                        updates.append(IndexUpdate(tenant_id, "snapshot", ids, vectors))
                    else:
                        updates += state.journal  # type: ignore[operator]
                    generations[tenant_id] = state.generation
                state.journal = [] if fits else None
            self._stop_journals([d.tenant_id for d in drops if d.tenant_id != tenant_id])
        return updates, generations

    def _stop_journals(self, tenant_ids: list[str]) -> None:
        """Tenants dropped from the copy go back whole: their changes are no longer kept for it."""
        for tenant_id in tenant_ids:
            with self._lock:
                state = self._tenants.get(tenant_id)
            if state is not None:
                with state.lock:
                    state.journal = None

    def resolve(self, tenant_id: str, vector: np.ndarray | torch.Tensor, k: int, found: Found | None) -> Retrieved:
        """`search`, answered by what a copy found where the tenant is still at the generation it searched (else,
        or with nothing found there, searched here)."""
        if found is None:
            return self.search(tenant_id, vector, k)
        state = self._state(tenant_id)
        with state.lock:
            if state.generation == found.generation:
                facts = state.facts
                hits = [(facts[int(i)], float(s)) for s, i in zip(found.scores, found.ids) if int(i) in facts]
                return Retrieved(hits, state.version, from_copy=True)
        return self.search(tenant_id, vector, k)

    def sync(self, tenant_id: str) -> _TenantIndex:
        live = self._announced()
        state = self._state(tenant_id)
        if live and tenant_id in self._quiet:
            return state
        with state.lock:
            heard = self._heard_of(tenant_id)
            first, entries = self._meta.log.log_since(tenant_id, state.last_id)
            if state.last_id != "0" and (first is None or _older(state.last_id, first)):
                # the log was trimmed past this index (changes may be missed), or it is gone with its tenant
                self._rebuild(tenant_id, state)
            else:
                while entries:
                    self._apply(tenant_id, state, entries)
                    entries = self._meta.log.log_after(tenant_id, state.last_id)
            # quiet from now on unless a change was announced while we read (it may or may not be in what we
            # read), whichever thread took the announcement
            if live and self._announced():
                with self._lock:
                    if self._heard_of(tenant_id) == heard:
                        self._quiet.add(tenant_id)
        return state

    def _announced(self) -> bool:
        """Apply the feed's announcements (counted, and dropped from the quiet set); whether the feed is live."""
        live, named = self._meta.fact_changes()
        if named:
            with self._lock:
                for tenant_id in named:
                    self._heard[tenant_id] = self._heard.get(tenant_id, 0) + 1
                if ANY in named:
                    self._quiet.clear()
                else:
                    self._quiet -= named
        return live

    def _heard_of(self, tenant_id: str) -> tuple[int, int]:
        return self._heard.get(ANY, 0), self._heard.get(tenant_id, 0)

    def save(self, tenant_id: str) -> None:
        """Write the tenant's vectors and how far they got, so a restart only replays what came after."""
        state = self.sync(tenant_id)
        with state.lock:
            folder = self._dir / tenant_id
            folder.mkdir(parents=True, exist_ok=True)
            state.index.save(folder / SNAPSHOT)
            side = {
                "last_id": state.last_id,
                "version": state.version,
                "dim": self._dim,
                "fact_of": {str(i): f.id for i, f in state.facts.items()},
            }
            tmp = folder / f"{SIDE}.tmp"
            tmp.write_text(json.dumps(side))
            tmp.replace(folder / SIDE)

    def save_all(self) -> None:
        for tenant_id in list(self._tenants):
            self.save(tenant_id)

    def forget(self, tenant_id: str, remove_snapshot: bool = False) -> None:
        with self._lock:
            self._tenants.pop(tenant_id, None)
            self._quiet.discard(tenant_id)
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
            side = json.loads((folder / SIDE).read_text())
            index = ExactIndex.load(folder / SNAPSHOT, self._dim, self._device)
            fact_of = {int(i): f for i, f in side["fact_of"].items()}
            metas = self._meta.records.facts(tenant_id, list(fact_of.values()))
            facts = {i: Fact.from_meta(m) for i, m in zip(fact_of, metas) if m and m["state"] in VISIBLE}
            index.remove(np.array([i for i in fact_of if i not in facts], dtype=np.int64))  # gone since the snapshot
            return _TenantIndex(index, facts, side["last_id"], int(side["version"]), generation=next(self._generations))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if folder.exists():
                log.warning("tenant %s: index snapshot unusable (%s); rebuilding from redis", tenant_id, exc)
        state = _TenantIndex(ExactIndex(self._dim, self._device))
        self._rebuild(tenant_id, state)
        return state

    def _rebuild(self, tenant_id: str, state: _TenantIndex) -> None:
        """Everything committed, from Redis; changes committed meanwhile are replayed after."""
        state.generation, state.journal = next(self._generations), None
        last_id = self._meta.log.log_last_id(tenant_id) or "0"
        version = self._meta.records.version(tenant_id)
        facts = self._meta.records.all_facts(tenant_id)
        embeddings = self._meta.records.all_embeddings(tenant_id)
        index = ExactIndex(self._dim, self._device)
        visible = [
            (m["index_id"], Fact.from_meta(m))
            for fid, m in facts.items()
            if m["state"] in VISIBLE and fid in embeddings
        ]
        if visible:
            index.upsert(
                np.array([i for i, _ in visible], dtype=np.int64),
                np.stack([np.frombuffer(embeddings[f.id], dtype=np.float32) for _, f in visible]),
            )
        state.index, state.facts, state.last_id, state.version = (
            index,
            {int(i): f for i, f in visible},
            last_id,
            version,
        )
        log.info("tenant %s: index rebuilt with %d facts", tenant_id, len(visible))

    def _apply(self, tenant_id: str, state: _TenantIndex, entries: list[tuple[str, dict[str, str]]]) -> None:
        state.generation = next(self._generations)  # first: a change that fails halfway still voids copies' answers
        latest: dict[str, tuple[str, int]] = {}
        for _, fields in entries:
            latest[fields["fid"]] = (fields["op"], int(fields["iid"]))
        changed = [(fid, iid) for fid, (op, iid) in latest.items() if op != "remove"]
        removes = [iid for op, iid in latest.values() if op == "remove"]
        found = []
        for (fid, iid), (meta, raw) in zip(
            changed, self._meta.log.facts_with_embeddings(tenant_id, [f for f, _ in changed])
        ):
            if meta is None or raw is None or meta["state"] not in VISIBLE:
                removes.append(iid)  # deleted (or rolled back) since
            else:
                found.append((iid, Fact.from_meta(meta), raw))
        if removes:
            ids = np.array(removes, dtype=np.int64)
            state.index.remove(ids)
            state.record(IndexUpdate(tenant_id, "remove", ids))
            for iid in removes:
                state.facts.pop(iid, None)
        if found:
            ids = np.array([i for i, _, _ in found], dtype=np.int64)
            vectors = np.stack([np.frombuffer(raw, dtype=np.float32) for _, _, raw in found])
            state.index.upsert(ids, vectors)
            state.record(IndexUpdate(tenant_id, "upsert", ids, vectors))
            state.facts.update({iid: fact for iid, fact, _ in found})
        state.last_id = entries[-1][0]
        state.version = max(state.version, *(int(fields.get("v", 0)) for _, fields in entries))


def _older(a: str, b: str) -> bool:
    """Whether stream id `a` comes before stream id `b`."""
    ta, tb = tuple(int(x) for x in a.split("-")), tuple(int(x) for x in b.split("-"))
    return ta < tb
