"""Where each record's K/V is held on this replica, as one answer per record: `gpu`, `cpu`, `disk` or gone.

The device arena and the lower tiers each report their own moves, and a record can briefly be in both
(promotion inserts into the arena before the tier copy is dropped). `PlacementTracker` keeps both facts
per record version and tells its sink only when the combined answer changes (the arena wins), so the
sink (the serving layer writes Redis) never records a transient or out-of-order state.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Iterable, Literal

from kvcore.store import Stamp
from kvcore.tier_disk import Key
from kvcore.tier_policy import Tier

log = logging.getLogger(__name__)

Where = Literal["gpu", "cpu", "disk"]  # the device arena, or a lower tier

Ident = tuple[str, str, Stamp]  # tenant id, record id, stamp
Sink = Callable[[str, str, Stamp, "Where | None"], None]  # tenant, record, stamp, where it is now (None: gone)


def tier_label(record_id: str, stamp: Stamp) -> str:
    """The name a tier entry keeps for its record version, so placements can be reported after a restart."""
    return f"{record_id}@{'.'.join(str(x) for x in stamp)}"


def parse_label(label: str) -> tuple[str, Stamp] | None:
    record_id, sep, stamp = label.rpartition("@")
    try:
        return (record_id, tuple(int(x) for x in stamp.split("."))) if sep and record_id else None
    except ValueError:
        return None


class PlacementTracker:
    """One placement per record version from the arena's and the tiers' reports, passed on only when it changes."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._in_arena: set[Ident] = set()
        self._in_tier: dict[Ident, Tier] = {}
        self._tier_ident: dict[Key, Ident] = {}
        self._reported: dict[Ident, Where] = {}

    def arena_changed(self, key: Hashable, stamp: Stamp, resident: bool) -> None:
        tenant_id, record_id = key
        ident = (tenant_id, record_id, stamp)
        (self._in_arena.add if resident else self._in_arena.discard)(ident)
        self._settle(ident)

    def tier_moved(self, key: Key, tier: Tier | None, label: str) -> None:
        """A tier entry moved (`label` is its `tier_label`; unknown for removals, which look it up)."""
        ident = self._tier_ident.pop(key, None) if tier is None else self._ident(key, label)
        if ident is None:
            return
        if tier is None:
            self._in_tier.pop(ident, None)
        else:
            self._tier_ident[key] = ident
            self._in_tier[ident] = tier
        self._settle(ident)

    def recovered(self, entries: Iterable[tuple[Key, Tier, str]]) -> None:
        """Entries a restarted tier store found again: reported as placed."""
        for key, tier, label in entries:
            self.tier_moved(key, tier, label)

    def _ident(self, key: Key, label: str) -> Ident | None:
        parsed = parse_label(label)
        if parsed is None:
            log.debug("tier entry %s has no record label; its placement is not reported", key)
            return None
        return key[0], parsed[0], parsed[1]

    def _settle(self, ident: Ident) -> None:
        now = "gpu" if ident in self._in_arena else self._in_tier.get(ident)
        if self._reported.get(ident) == now:
            return
        if now is None:
            self._reported.pop(ident, None)
        else:
            self._reported[ident] = now
        try:
            self._sink(ident[0], ident[1], ident[2], now)
        except Exception:  # a placement report must never fail a forward pass
            log.exception("placement sink failed for %s", ident[:2])
