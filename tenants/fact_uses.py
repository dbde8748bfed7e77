"""Retrievals counted in the process that serves them, added to Redis in batches (never a round trip per chat).

Each ingress replica counts the facts its chats retrieve and adds the counts to the shared scores every few
seconds; what Redis answers (every replica's retrievals, decayed) is what the process then knows of a fact's
use, plus what it counted since.
"""

from __future__ import annotations

import threading

from tenants.redis_uses import FactUses
from tenants.residency_policy import decayed

KNOWN_AT_MOST = 200_000  # facts whose shared score a process remembers; past it, it starts over


class UseCounter:
    """This process's retrieval counts since its last flush, and the shared scores it last heard."""

    def __init__(self, uses: FactUses, half_life_s: float) -> None:
        self._uses, self._half_life_s = uses, half_life_s
        self._pending: dict[str, dict[str, tuple[int, float]]] = {}  # memory -> fact -> (retrievals, last)
        self._known: dict[tuple[str, str], tuple[float, float]] = {}  # (memory, fact) -> (score, as of)
        self._floors: dict[str, tuple[float, float]] = {}  # memory -> (its floor, as of)
        self._lock = threading.Lock()

    def record(self, memory_id: str, fact_ids: list[str], now: float) -> None:
        with self._lock:
            counts = self._pending.setdefault(memory_id, {})
            for fact_id in fact_ids:
                count, _ = counts.get(fact_id, (0, 0.0))
                counts[fact_id] = (count + 1, now)

    def score(self, memory_id: str, fact_id: str, now: float) -> float:
        """The fact's decayed retrievals as far as this process knows: the shared score, plus its own since."""
        with self._lock:
            score, at = self._known.get((memory_id, fact_id), (0.0, now))
            pending, _ = self._pending.get(memory_id, {}).get(fact_id, (0, 0.0))
        return decayed(score, at, now, self._half_life_s) + pending

    def floor(self, memory_id: str, now: float) -> float:
        """The use a dropped fact of the memory must beat to be encoded again, as last heard (decayed)."""
        with self._lock:
            score, at = self._floors.get(memory_id, (0.0, now))
        return decayed(score, at, now, self._half_life_s)

    def flush(self, now: float) -> int:
        """Add the counts to Redis and learn the shared scores back; the retrievals flushed. Counts that could
        not be added are kept for the next flush."""
        with self._lock:
            pending, self._pending = self._pending, {}
        flushed = 0
        try:
            for memory_id in list(pending):
                scores, floor = self._uses.add(memory_id, pending[memory_id], now, self._half_life_s)
                flushed += sum(count for count, _ in pending.pop(memory_id).values())
                with self._lock:
                    if len(self._known) > KNOWN_AT_MOST:
                        self._known.clear()
                    self._known.update({(memory_id, fact_id): (score, now) for fact_id, score in scores.items()})
                    if floor is None:
                        self._floors.pop(memory_id, None)
                    else:
                        self._floors[memory_id] = floor
        finally:
            if pending:  # Redis failed part way: what was not added waits for the next flush
                with self._lock:
                    for memory_id, counts in pending.items():
                        mine = self._pending.setdefault(memory_id, {})
                        for fact_id, (count, last) in counts.items():
                            more, later = mine.get(fact_id, (0, 0.0))
                            mine[fact_id] = (count + more, max(last, later))
        return flushed
