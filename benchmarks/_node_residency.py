"""KV residency over every tenant of one node, replayed on a simulated clock through inferscale's own rules.

`tenants/residency_policy.py` decides: each sweep drops the node's coldest unprotected facts until their K/V
fits `node_kv_bytes` (`node_drops`), and a chat asks for a dropped fact's re-encode when `wants_kv` says its use
pays for it against the node's floor (the coldest kept fact's use, as `tenants/residency.py` sets it). A re-encode
lands `encode_s` after it is asked for. Used by `tenants_per_gpu.py` (which facts a measured request injects
and which it pastes) and `capacity_model.py` (the same, modelled), so both follow the policy's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from config.settings import ResidencySettings
from tenants.residency_policy import ResidencyPolicy, ResidentFact, decayed


def zipf(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


@dataclass(frozen=True)
class ZipfTrace:
    """Chats over `tenants` tenants by Zipf(tenant_s), each retrieving k distinct facts of its tenant by
    Zipf(fact_s) over a popularity order of its own, arriving as a Poisson stream."""

    tenants: int
    facts: int = 1000
    k: int = 50
    chats: int = 20_000
    rate_per_s: float = 20.0
    tenant_s: float = 1.0
    fact_s: float = 1.0
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.chats / self.rate_per_s

    def draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival times, tenant of each chat, its k fact indices): a fixed draw per seed. A tenant's popularity
        order is a bijection of its own (a stride coprime to the fact count, from an offset), so a trace over
        100,000 tenants costs no per-tenant table."""
        rng = np.random.default_rng(self.seed)
        times = np.cumsum(rng.exponential(1 / self.rate_per_s, self.chats))
        tenant_of = rng.choice(self.tenants, size=self.chats, p=zipf(self.tenants, self.tenant_s))
        ranks = np.stack(
            [
                rng.choice(self.facts, size=self.k, replace=False, p=zipf(self.facts, self.fact_s))
                for _ in range(self.chats)
            ]
        )
        stride = _coprime_stride(self.facts)
        offset = (tenant_of.astype(np.int64) * 7_919 + self.seed) % self.facts
        return times, tenant_of, (ranks * stride + offset[:, None]) % self.facts


def _coprime_stride(n: int) -> int:
    stride = max(1, int(n * 0.618))
    while np.gcd(stride, n) != 1:
        stride += 1
    return stride


def settings_for(trace: ZipfTrace, node_kv_bytes: int) -> ResidencySettings:
    """The policy's defaults scaled to the trace: a half-life of a quarter of its span (the time scale on which
    popularity is judged here; a day in production), fresh facts protected a minute, a sweep every 30 s."""
    return ResidencySettings(
        node_kv_bytes=node_kv_bytes,
        half_life_s=trace.duration_s / 4,
        min_resident_s=60.0,
        sweep_interval_s=30.0,
    )


@dataclass
class Events:
    """What changed since the previous chat: re-encodes that landed and facts dropped, as (tenant, fact)."""

    landed: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Use:
    score: float = 0.0
    at: float = 0.0
    last: float = 0.0
    encoded: float = 0.0
    asked: bool = False


class NodeResidency:
    """The node's K/V state under the policy: which (tenant, fact) pairs hold K/V. Every fact starts with K/V (the
    encoder encodes a fact when it is written) and unused (the coldest there is), so the first sweep over budget
    drops never-retrieved facts first. Those are alike, so they are kept as a count, not one by one: a fact's first
    retrieval finds K/V with the share of never-retrieved facts still holding it, and from then on it is tracked
    (a node of 100,000 tenants costs no per-fact state for facts nobody asks for)."""

    def __init__(
        self, settings: ResidencySettings, fact_bytes: int, encode_s: float, facts_total: int, seed: int = 0
    ) -> None:
        self.settings, self.policy = settings, ResidencyPolicy(settings)
        self.fact_bytes, self.encode_s = fact_bytes, encode_s
        self.uses: dict[tuple[int, int], _Use] = {}
        self.held: set[tuple[int, int]] = set()  # retrieved facts holding K/V
        self.unseen, self.unseen_held = facts_total, facts_total  # never-retrieved facts, and those holding K/V
        self.rng = np.random.default_rng(seed)
        self.floor, self.floor_at = 0.0, 0.0
        self.landing: list[tuple[float, int, int]] = []
        self.next_sweep = settings.sweep_interval_s
        self.reencodes = 0
        self.drops = 0

    @property
    def kept_bytes(self) -> int:
        return (len(self.held) + self.unseen_held) * self.fact_bytes

    def advance(self, now: float) -> Events:
        """Apply the landings and sweeps due by `now`, in time order."""
        events = Events()
        while now >= self.next_sweep:
            self._land(self.next_sweep, events)
            self._sweep(self.next_sweep, events)
            self.next_sweep += self.settings.sweep_interval_s
        self._land(now, events)
        return events

    def chat(self, now: float, tenant: int, facts: np.ndarray) -> np.ndarray:
        """Whether each retrieved fact has K/V now; counts the retrieval and asks for the re-encodes it earns."""
        for f in facts.tolist():
            if (tenant, f) not in self.uses:
                self._first_retrieval((tenant, f))
        served = np.array([(tenant, int(f)) in self.held for f in facts], dtype=bool)
        half_life = self.settings.half_life_s
        bar = decayed(self.floor, self.floor_at, now, half_life)
        for f in facts.tolist():
            key = (tenant, f)
            use = self.uses[key]
            use.score = decayed(use.score, use.at, now, half_life) + 1
            use.at = use.last = now
            if key not in self.held and not use.asked and self.policy.wants_kv(use.score, bar):
                use.asked = True
                self.landing.append((now + self.encode_s, tenant, f))
                self.reencodes += 1
        return served

    def _first_retrieval(self, key: tuple[int, int]) -> None:
        """Track a fact from its first retrieval: it holds the K/V it was written with unless a sweep dropped it
        (one of the never-retrieved facts, which are alike, drawn by the share still holding K/V)."""
        holds = self.unseen_held > 0 and self.rng.random() * self.unseen < self.unseen_held
        self.unseen = max(0, self.unseen - 1)
        self.uses[key] = _Use(encoded=-math.inf)
        if holds:
            self.unseen_held -= 1
            self.held.add(key)

    def _land(self, now: float, events: Events) -> None:
        waiting = []
        for when, tenant, f in self.landing:
            if when <= now:
                use = self.uses[tenant, f]
                use.encoded, use.asked = when, False
                self.held.add((tenant, f))
                events.landed.append((tenant, f))
            else:
                waiting.append((when, tenant, f))
        self.landing = waiting

    def _sweep(self, now: float, events: Events) -> None:
        """As `tenants/residency.py` sweeps with only a node budget: the policy's own `plan` over every fact of
        the node. Never-retrieved facts are the coldest (no use at
        all), so they go first, and while one is kept nothing is colder: no floor."""
        budget = self.settings.node_kv_bytes
        if budget is None or (len(self.held) + self.unseen_held + 1) * self.fact_bytes <= budget:
            self.floor, self.floor_at = 0.0, now  # room for one more: nothing to drop, no floor (the policy's rule)
            return
        over = (len(self.held) + self.unseen_held) * self.fact_bytes - budget
        cut = min(self.unseen_held, max(0, -(-over // self.fact_bytes)))
        self.unseen_held -= cut
        self.drops += cut
        if self.unseen_held:
            self.floor, self.floor_at = 0.0, now
            return
        half_life, held = self.settings.half_life_s, list(self.held)
        resident = []
        for index, key in enumerate(held):
            use = self.uses[key]
            resident.append(
                ResidentFact(
                    str(index), self.fact_bytes, decayed(use.score, use.at, now, half_life), use.last, use.encoded
                )
            )
        dropped, floors = self.policy.plan({"node": resident}, {"node": None}, now)  # only the node's budget
        for _, fact in dropped:
            key = held[int(fact.fact_id)]
            self.held.discard(key)
            events.dropped.append(key)
        self.drops += len(dropped)
        self.floor, self.floor_at = floors["node"], now
