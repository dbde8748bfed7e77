"""What goes where in the lower tiers: every entry's score, and which entry leaves a full tier first.

An entry scores its importance (the retrieval score its record last had) plus log(1 + hits) minus its age
over `age_scale_s`: a record retrieved often and strongly stays in host memory, a cold one goes to disk
first, and past the disk's budget the lowest-scoring files are dropped (every record stays canonical in
the fact store). An entry being loaded, or still finding its place, never moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from kvcore.tier_disk import Key
from kvcore.tier_media import Held

Tier = Literal["cpu", "disk"]


@dataclass
class TierEntry:
    """One entry's place, bytes and the use that scores it."""

    tier: Tier
    held: Held | None  # None while the entry is still being placed
    nbytes: int
    layers: int
    dtype: torch.dtype
    importance: float = 0.0
    hits: int = 0
    last_use: float = 0.0
    loading: int = 0  # pins: a pinned entry never moves nor leaves
    label: str = ""  # the caller's name for the entry (kept in its disk file, so it survives a restart)


class ScorePolicy:
    """Scores entries by importance, frequency and recency, and picks the one to move out of a full tier."""

    def __init__(self, age_scale_s: float, clock: Callable[[], float]) -> None:
        self.age_scale_s, self.clock = age_scale_s, clock

    def touch(self, entry: TierEntry, importance: float | None = None) -> None:
        """A retrieval hit: raises the entry's recency and frequency (and importance, if higher)."""
        entry.hits += 1
        entry.last_use = self.clock()
        if importance is not None:
            entry.importance = max(entry.importance, importance)

    def score(self, entry: TierEntry) -> float:
        return entry.importance + math.log1p(entry.hits) - (self.clock() - entry.last_use) / self.age_scale_s

    def victim(self, entries: dict[Key, TierEntry], tier: Tier, keep: Key) -> Key | None:
        """The lowest-scoring movable entry of `tier` (never a pinned one, nor `keep`), or None."""
        movable = [
            (self.score(e), key)
            for key, e in entries.items()
            if e.tier == tier and not e.loading and key != keep and e.held is not None
        ]
        return min(movable)[1] if movable else None
