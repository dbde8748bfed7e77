"""Records leaving the device arena on their way down to the lower tiers, and the placements they report.

A record evicted from the arena (or just captured: `copy_down`) is queued under its exact version (`tier_key`)
and stored with the rest of the step's evictions at its end (`flush`: quantized together on the device, one wait
for their copies). The tiers keep a copy of what they hand back up, and of what a capture put in the arena, so
such a record leaves for free. Its retrieval score (the plan's importance) travels with it into the tiers' choice
of what to move down first. The arena's placement reports of a record in transit wait until its tier entry
exists, so a placement never reads "gone" while the record is on its way down.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from kvcore.arena import EvictedKV
from kvcore.placement import tier_label
from kvcore.store import Stamp
from kvcore.tiers import KV, TieredStore

RecordKey = tuple[str, str]  # tenant id, record id
ArenaChange = Callable[[RecordKey, Stamp, bool], None]  # (record, stamp, resident?)


def tier_key(tenant_id: str, record_id: str, stamp: Stamp) -> tuple[str, str]:
    """A tier entry names the exact record version (its stamp), so a rewritten fact is never served stale."""
    digest = hashlib.sha1(repr(stamp).encode()).hexdigest()[:12]
    return tenant_id, f"{record_id[:100]}.{digest}"


class SpillQueue:
    """A step's arena evictions, stored in the tiers together at its end, and the placements they defer."""

    def __init__(
        self, tiers: TieredStore, on_arena_change: ArenaChange | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """`dtype`: what an int8 arena's evicted codes decode to."""
        self._tiers, self._on_arena_change, self._dtype = tiers, on_arena_change, dtype
        self._queued: list[tuple[KV, float]] = []  # (item, importance)
        self._queued_entries: set[tuple[str, str]] = set()  # their tier keys
        self._importance: dict[RecordKey, float] = {}  # (tenant, record) -> its last retrieval score
        self._in_transit: set[tuple[RecordKey, Stamp]] = set()
        self._deferred: list[tuple[RecordKey, Stamp, bool]] = []

    def weigh(self, plan) -> dict[str, float]:
        """The plan's records' importance (retrieval scores), remembered until each record leaves the arena so
        that its spill carries it into the tiers' choice of what to move down first."""
        if not plan.importance:
            return {}
        if len(self._importance) > 100_000:  # records that never reached the arena would otherwise pile up
            self._importance.clear()
        weights = dict(zip(plan.record_ids, plan.importance))
        for record_id, weight in weights.items():
            self._importance[plan.tenant_id, record_id] = weight
        return weights

    def spill(self, key: RecordKey, stamp: Stamp, read: Callable[[], EvictedKV]) -> None:
        """A record leaving the arena: queued for the tiers unless they hold this version already."""
        if self._queue(key, stamp, read, self._importance.pop(key, 0.0)):
            self._in_transit.add((key, stamp))  # its "gone" report waits for its tier entry

    def copy_down(self, key: RecordKey, stamp: Stamp, read: Callable[[], EvictedKV]) -> None:
        """A record staying in the arena gets its tier copy now (a capture), so that leaving it later costs nothing."""
        self._queue(key, stamp, read, self._importance.get(key, 0.0))

    def _queue(self, key: RecordKey, stamp: Stamp, read: Callable[[], EvictedKV], weight: float) -> bool:
        """Queue the record's K/V for the tiers (read once): True while its entry is on its way, False if the
        tiers hold this version already."""
        entry = tier_key(key[0], key[1], stamp)
        if entry in self._queued_entries:
            return True
        if entry in self._tiers:
            return False
        k, v = read()
        self._queued.append(((entry, k, v, tier_label(key[1], stamp)), weight))
        self._queued_entries.add(entry)
        return True

    def flush(self) -> None:
        """Store the queued records in the tiers, then report the placements that waited for them."""
        queued, self._queued = self._queued, []
        self._queued_entries = set()
        try:
            self._tiers.put_many([item for item, _ in queued], [weight for _, weight in queued], self._dtype)
        finally:
            deferred, self._deferred, self._in_transit = self._deferred, [], set()
            for change in deferred:
                self._on_arena_change(*change)

    def arena_changed(self, key: RecordKey, stamp: Stamp, resident: bool) -> None:
        """The arena's placement report: passed on, or held until `flush` for a record in transit."""
        if not resident and (key, stamp) in self._in_transit:
            self._deferred.append((key, stamp, resident))
        elif self._on_arena_change is not None:
            self._on_arena_change(key, stamp, resident)
