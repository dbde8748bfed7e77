"""KV residency over every tenant of one node, replayed on a simulated clock through inferscale's own rules.

`tenants/residency_policy.py` decides: each sweep drops the node's coldest unprotected facts until their K/V
fits `node_kv_bytes` (`node_drops`), and a chat asks for a dropped fact's re-encode when `wants_kv` says its use
pays for it against the node's floor (the coldest kept fact's use, as `tenants/residency.py` sets it). A re-encode
lands `encode_s` after it is asked for. Used by `tenants_per_gpu.py` (which facts a measured request injects
and which it pastes) and `capacity_model.py` (the same, modelled), so both follow the policy's code.
"""

from __future__ import annotations

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
        """(arrival times, tenant of each chat, its k fact indices): a fixed draw per seed."""
        rng = np.random.default_rng(self.seed)
        times = np.cumsum(rng.exponential(1 / self.rate_per_s, self.chats))
        tenant_of = rng.choice(self.tenants, size=self.chats, p=zipf(self.tenants, self.tenant_s))
        order = np.argsort(rng.random((self.tenants, self.facts)), axis=1)  # each tenant's own popular facts
        fact_p = zipf(self.facts, self.fact_s)
        ranks = np.stack([rng.choice(self.facts, size=self.k, replace=False, p=fact_p) for _ in range(self.chats)])
        return times, tenant_of, order[tenant_of[:, None], ranks]


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


class NodeResidency:
    """The node's K/V state under the policy: which facts hold K/V, starting from none (every fact's K/V is
    earned by use, the policy's steady state for a node that has been up longer than a half-life)."""

    def __init__(self, trace: ZipfTrace, settings: ResidencySettings, fact_bytes: int, encode_s: float) -> None:
        self.settings, self.policy, self.fact_bytes, self.encode_s = (
            settings,
            ResidencyPolicy(settings),
            fact_bytes,
            encode_s,
        )
        shape = (trace.tenants, trace.facts)
        self.has_kv = np.zeros(shape, dtype=bool)
        self.score, self.at, self.last, self.encoded = (np.zeros(shape) for _ in range(4))
        self.asked = np.zeros(shape, dtype=bool)
        self.floor, self.floor_at = 0.0, 0.0
        self.landing: list[tuple[float, int, int]] = []
        self.next_sweep = settings.sweep_interval_s
        self.reencodes = 0
        self.drops = 0

    @property
    def kept_bytes(self) -> int:
        return int(self.has_kv.sum()) * self.fact_bytes

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
        served = self.has_kv[tenant, facts].copy()
        half_life = self.settings.half_life_s
        bar = decayed(self.floor, self.floor_at, now, half_life)
        for f in facts:
            self.score[tenant, f] = decayed(self.score[tenant, f], self.at[tenant, f], now, half_life) + 1
            self.at[tenant, f] = self.last[tenant, f] = now
            if (
                not self.has_kv[tenant, f]
                and not self.asked[tenant, f]
                and self.policy.wants_kv(self.score[tenant, f], bar)
            ):
                self.asked[tenant, f] = True
                self.landing.append((now + self.encode_s, tenant, int(f)))
                self.reencodes += 1
        return served

    def _land(self, now: float, events: Events) -> None:
        waiting = []
        for when, tenant, f in self.landing:
            if when <= now:
                self.has_kv[tenant, f], self.encoded[tenant, f], self.asked[tenant, f] = True, when, False
                events.landed.append((tenant, f))
            else:
                waiting.append((when, tenant, f))
        self.landing = waiting

    def _sweep(self, now: float, events: Events) -> None:
        tenants, facts = np.nonzero(self.has_kv)
        resident = [
            ResidentFact(
                f"{t}:{f}",
                self.fact_bytes,
                decayed(self.score[t, f], self.at[t, f], now, self.settings.half_life_s),
                self.last[t, f],
                self.encoded[t, f],
            )
            for t, f in zip(tenants.tolist(), facts.tolist())
        ]
        dropped = self.policy.drops(resident, self.settings.node_kv_bytes, now)
        for fact in dropped:
            t, f = map(int, fact.fact_id.split(":"))
            self.has_kv[t, f] = False
            events.dropped.append((t, f))
        self.drops += len(dropped)
        gone = {fact.fact_id for fact in dropped}
        kept = [fact for fact in resident if fact.fact_id not in gone]
        self.floor, self.floor_at = self.policy.floor(kept, self.settings.node_kv_bytes, now), now
