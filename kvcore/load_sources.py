"""Where a worker's loads found their records: the device arena, the pinned host tier, the disk tier, or only the
fact store (read at load time). A benchmark reads the counts around one request to tell which read made it slow.

Off by default: counting looks each record up once more before the load, host work a serving step should not pay.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from kvcore.store import Stamp

SOURCES = ("arena", "cpu", "disk", "store")  # "cpu": the pinned host tier (the tiers' own name for it)

Span = tuple[str, Stamp, int, int]  # (record id, stamp, first token, end token)


class LoadSources:
    """Record counts by source, summed over every load since counting was turned on."""

    def __init__(self) -> None:
        self.enabled = False
        self._counts: Counter[str] = Counter()

    def count(
        self,
        tenant_id: str,
        spans: Iterable[Span],
        in_arena: Callable[[tuple[str, str], Stamp], bool],
        tier_of: Callable[[str, str, Stamp], str | None],
    ) -> None:
        """Count one load's records: in the arena first, else the tier holding them, else the store."""
        for record_id, stamp, _, _ in spans:
            if in_arena((tenant_id, record_id), stamp):
                self._counts["arena"] += 1
            else:
                self._counts[tier_of(tenant_id, record_id, stamp) or "store"] += 1

    def snapshot(self) -> dict[str, int]:
        return {source: self._counts[source] for source in SOURCES}

    def switch(self, enabled: bool) -> dict[str, int]:
        """Turn counting on (from zero) or off; the counts so far."""
        counts = self.snapshot()
        if enabled and not self.enabled:
            self._counts.clear()
        self.enabled = enabled
        return counts
