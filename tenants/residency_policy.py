"""KV residency by use, as arithmetic: which facts' K/V to drop to text when a budget binds, and when a dropped
fact has been retrieved often enough again to pay for its encoding.

A fact's use is a retrieval count that halves every `half_life_s`, kept as (score, the time it was last
brought up to date), so adding and comparing needs no history. No Redis and no clock here: callers pass `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.settings import ResidencySettings


def decayed(score: float, at: float, now: float, half_life_s: float) -> float:
    """`score` as it stood at `at`, decayed to `now`."""
    return score * 0.5 ** (max(0.0, now - at) / half_life_s)


@dataclass(frozen=True)
class ResidentFact:
    """One fact whose K/V is stored: its bytes, its use and when it was encoded."""

    fact_id: str
    kv_bytes: int
    score: float  # decayed retrievals, as of `now` of the call that compares
    last_used: float  # wall clock of its latest retrieval (0: never)
    encoded_at: float


class ResidencyPolicy:
    """The budgets' decisions; one instance per settings."""

    def __init__(self, settings: ResidencySettings) -> None:
        self.settings = settings

    def protected(self, fact: ResidentFact, now: float) -> bool:
        """Encoded within `min_resident_s`: never dropped yet (a new fact has had no chance to be used)."""
        return now - fact.encoded_at < self.settings.min_resident_s

    def drops(self, resident: list[ResidentFact], budget: int | None, now: float) -> list[ResidentFact]:
        """The coldest unprotected facts whose K/V, dropped, brings `resident` within `budget` (as near as the
        protected ones allow); none when there is no budget or it holds."""
        total = sum(f.kv_bytes for f in resident)
        if budget is None or total <= budget:
            return []
        chosen = []
        for fact in sorted(resident, key=self.coldness):
            if total <= budget:
                break
            if not self.protected(fact, now):
                chosen.append(fact)
                total -= fact.kv_bytes
        return chosen

    def node_drops(
        self, memories: dict[str, list[ResidentFact]], budget: int | None, now: float
    ) -> list[tuple[str, ResidentFact]]:
        """Across every memory of a node, (memory id, fact) pairs to drop, coldest first, until all of them
        together are within `budget`."""
        flat = [(memory_id, fact) for memory_id, facts in memories.items() for fact in facts]
        chosen = self.drops([fact for _, fact in flat], budget, now)
        picked = {id(fact) for fact in chosen}
        order = {id(fact): rank for rank, fact in enumerate(chosen)}
        return sorted(((m, f) for m, f in flat if id(f) in picked), key=lambda pair: order[id(pair[1])])

    def plan(
        self, memories: dict[str, list[ResidentFact]], budgets: dict[str, int | None], now: float
    ) -> tuple[list[tuple[str, ResidentFact]], dict[str, float]]:
        """One sweep's decisions: the (memory id, fact) pairs to drop, each memory's budget first, then the node's
        (`node_kv_bytes`) over what is left; and per memory the use a dropped fact must beat to come back (the
        larger of its memory's floor and the node's)."""
        drops = [(m, f) for m, facts in memories.items() for f in self.drops(facts, budgets.get(m), now)]
        gone = {(m, f.fact_id) for m, f in drops}
        left = {m: [f for f in facts if (m, f.fact_id) not in gone] for m, facts in memories.items()}
        node_drops = self.node_drops(left, self.settings.node_kv_bytes, now)
        drops += node_drops
        gone |= {(m, f.fact_id) for m, f in node_drops}
        kept = {m: [f for f in facts if (m, f.fact_id) not in gone] for m, facts in memories.items()}
        node_floor = self.floor([f for facts in kept.values() for f in facts], self.settings.node_kv_bytes, now)
        floors = {m: max(self.floor(kept[m], budgets.get(m), now), node_floor) for m in memories}
        return drops, floors

    def floor(self, kept: list[ResidentFact], budget: int | None, now: float) -> float:
        """The use a dropped fact must beat to be encoded again: the coldest kept (unprotected) fact's, once the
        budget has no room for one more fact; 0 while it has. Without it a fact at the margin would be dropped
        and encoded again in turns."""
        if budget is None or not kept:
            return 0.0
        total, largest = sum(f.kv_bytes for f in kept), max(f.kv_bytes for f in kept)
        if total + largest <= budget:
            return 0.0
        return min((f.score for f in kept if not self.protected(f, now)), default=0.0)

    def wants_kv(self, score: float, floor: float = 0.0) -> bool:
        """Whether a dropped fact's use (decayed retrievals, this one included) pays for encoding it again: this
        retrieval is its `reencode_after_uses`-th, counting earlier ones made within about a half-life (each
        then weighs at least half), so two uses a minute apart count although 2 decayed is just under 2; and,
        where its memory's budget is full, `reencode_margin` times as used as the coldest fact kept (`floor`)."""
        return (
            score >= 1 + (self.settings.reencode_after_uses - 1) / 2 and score > floor * self.settings.reencode_margin
        )

    @staticmethod
    def coldness(fact: ResidentFact) -> tuple[float, float, float]:
        """Sort key, coldest first: least used, then longest unused, then oldest encoding."""
        return (fact.score, fact.last_used, fact.encoded_at)
