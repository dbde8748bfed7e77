"""A serving replica's placement reports, written to Redis in batches off the forward path.

The connector's worker calls `PlacementWriter` (a `kvcore.placement.Sink`) from inside engine steps, so
the call only records the latest tier per fact version (and per history chunk record) in memory; a daemon
thread writes what changed every `flush_s` in one pipeline. If Redis is down the changes wait (latest wins)
and are written once it is back: placement is advisory, serving never blocks on it. `start()` first forgets
whatever this replica reported before a restart, then the tracker reports what the replica holds now.
"""

from __future__ import annotations

import logging
import threading
import time

from kvcore.history_index import is_chunk_record
from kvcore.store import Stamp
from tenants.facts import fact_of_record
from tenants.redis_meta import STORE_UNAVAILABLE, RedisMeta

log = logging.getLogger(__name__)


class PlacementWriter:
    """Batches a replica's placement changes and writes them to Redis every `flush_s`."""

    def __init__(self, meta: RedisMeta, replica: str, flush_s: float = 0.2) -> None:
        self.replica = replica
        self._meta, self._flush_s = meta, flush_s
        self._pending: dict[tuple[str, str, int], str | None] = {}  # (tenant, fact, version): tier or None
        self._chunks: dict[tuple[str, str], str | None] = {}  # (tenant, history chunk record): tier or None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> "PlacementWriter":
        """Forget this replica's old placements (retrying while Redis is unreachable) and begin writing."""
        self._thread = threading.Thread(target=self._run, name=f"placement-{self.replica}", daemon=True)
        self._thread.start()
        return self

    def __call__(self, tenant_id: str, record_id: str, stamp: Stamp, tier: str | None) -> None:
        fact = fact_of_record(record_id)
        with self._lock:
            if fact is not None:
                self._pending[(tenant_id, fact[0], fact[1])] = tier
            elif is_chunk_record(record_id):  # a history's chunk: placed by its record id
                self._chunks[(tenant_id, record_id)] = tier
            # the chat frame and the engine's other records are neither

    def flush(self) -> bool:
        """Write what is pending now; False (and kept for later) if Redis is unreachable."""
        with self._lock:
            batch, self._pending = self._pending, {}
            chunks, self._chunks = self._chunks, {}
        if not batch and not chunks:
            return True
        moves: dict[str, list[tuple[str, int, str | None]]] = {}
        for (tenant_id, fact_id, version), tier in batch.items():
            moves.setdefault(tenant_id, []).append((fact_id, version, tier))
        chunk_moves: dict[str, list[tuple[str, str | None]]] = {}
        for (tenant_id, record_id), tier in chunks.items():
            chunk_moves.setdefault(tenant_id, []).append((record_id, tier))
        try:
            now = time.time()
            if moves:
                self._meta.places.write_placements(self.replica, now, moves)
                batch = {}  # written: not again if the chunks' write fails
            if chunk_moves:
                self._meta.places.write_chunk_placements(self.replica, now, chunk_moves)
            return True
        except STORE_UNAVAILABLE as exc:
            log.warning("placements not written yet (%s); retrying", type(exc).__name__)
            with self._lock:
                self._pending = {**batch, **self._pending}  # newer reports win
                self._chunks = {**chunks, **self._chunks}
            return False

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._meta.places.forget_replica(self.replica)
                break
            except STORE_UNAVAILABLE:
                self._wake.wait(1.0)
        while not self._stopped:
            self._wake.wait(self._flush_s)
            self.flush()
