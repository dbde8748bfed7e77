"""KV residency by use under a Zipf trace: how much K/V it keeps, how many retrieved facts still find theirs.

A replay of chats over tenants whose facts are retrieved by popularity (Zipf over tenants and over each tenant's
facts, k distinct facts a chat), on a simulated clock, through inferscale's own residency rules
(`tenants/residency_policy.py`: the budget's coldest-first drops every sweep, the chat-time re-encode rule and
the protection of fresh facts), with a re-encode landing one encode latency after it is asked for. Side by side
in one run: keeping every fact's K/V, the policy at its default (`reencode_after_uses` 2) and at 1 (re-encode on
every miss), and an oracle that keeps the truly most popular facts within the same budget (an upper bound no
online policy beats). Reported: the share of retrieved facts served from K/V (the rest are pasted as text),
the K/V bytes kept over all facts' K/V, and re-encodes per 1,000 retrievals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from benchmarks._common import parser, target, wilson, write_report
from benchmarks._node_residency import zipf
from config.settings import ResidencySettings
from tenants.residency_policy import ResidencyPolicy, ResidentFact, decayed


@dataclass(frozen=True)
class Trace:
    """Who asks for what, and when."""

    tenants: int
    facts: int
    k: int
    chats: int
    rate_per_s: float
    zipf: float
    drift: bool = False  # halfway, every tenant's popular facts change (a new topic)
    seed: int = 0

    def chats_of(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival times, tenant of each chat, its k distinct fact indices): a fixed draw per seed."""
        rng = np.random.default_rng(self.seed)
        times = np.cumsum(rng.exponential(1 / self.rate_per_s, self.chats))
        tenant_p = zipf(self.tenants, self.zipf)
        tenant_of = rng.choice(self.tenants, size=self.chats, p=tenant_p)
        fact_p = zipf(self.facts, self.zipf)
        ranks = [rng.permutation(self.facts) for _ in range(self.tenants)]  # each tenant's popular facts differ
        later = [rng.permutation(self.facts) for _ in range(self.tenants)] if self.drift else ranks
        picks = np.stack([rng.choice(self.facts, size=self.k, replace=False, p=fact_p) for _ in range(self.chats)])
        half = self.chats // 2
        facts = np.stack([(ranks if i < half else later)[t][p] for i, (t, p) in enumerate(zip(tenant_of, picks))])
        return times, tenant_of, facts


@dataclass
class Outcome:
    """What one replay counted after its warm-up."""

    hits: int = 0
    retrievals: int = 0
    reencodes: int = 0
    drops: int = 0
    kept_share_sum: float = 0.0  # K/V kept over all facts' K/V, summed at each sweep
    sweeps: int = 0

    def report(self) -> dict:
        low, high = wilson(self.hits, self.retrievals)
        return {
            "kv_hit_share": round(self.hits / self.retrievals, 4),
            "kv_hit_interval": [low, high],
            "kept_bytes_share": round(float(self.kept_share_sum) / max(self.sweeps, 1), 4),
            "reencodes_per_1000": round(1000 * self.reencodes / self.retrievals, 2),
            "drops": self.drops,
        }


def replay(trace: Trace, settings: ResidencySettings, budget_share: float, encode_s: float, warmup: int) -> Outcome:
    """The trace through the residency rules; counts after the first `warmup` chats."""
    times, tenant_of, facts_of = trace.chats_of()
    policy, n, kv_bytes = ResidencyPolicy(settings), trace.facts, 1
    budget = int(budget_share * n * kv_bytes)
    has_kv = np.ones((trace.tenants, n), dtype=bool)
    score = np.zeros((trace.tenants, n))
    at = np.zeros((trace.tenants, n))
    last = np.zeros((trace.tenants, n))
    encoded = np.zeros((trace.tenants, n))
    landing: list[tuple[float, int, int]] = []  # (when, tenant, fact) of re-encodes in flight
    asked = np.zeros((trace.tenants, n), dtype=bool)
    floor = np.zeros((trace.tenants, 2))  # per tenant: the use a dropped fact must beat, and as of when
    out, next_sweep = Outcome(), settings.sweep_interval_s
    for i, (now, tenant) in enumerate(zip(times, tenant_of)):
        while now >= next_sweep:  # the sweeps due before this chat
            landing = _land(landing, next_sweep, has_kv, encoded, asked)
            for tenant_ in range(trace.tenants):
                held = np.flatnonzero(has_kv[tenant_])
                if len(held) * kv_bytes < budget:
                    floor[tenant_] = 0.0, next_sweep
                    continue
                resident = [
                    ResidentFact(
                        str(f),
                        kv_bytes,
                        decayed(score[tenant_, f], at[tenant_, f], next_sweep, settings.half_life_s),
                        last[tenant_, f],
                        encoded[tenant_, f],
                    )
                    for f in held
                ]
                dropped = policy.drops(resident, budget, next_sweep)
                for fact in dropped:
                    has_kv[tenant_, int(fact.fact_id)] = False
                out.drops += len(dropped) if i >= warmup else 0
                gone = {f.fact_id for f in dropped}
                kept = [f for f in resident if f.fact_id not in gone]
                floor[tenant_] = policy.floor(kept, budget, next_sweep), next_sweep
            if i >= warmup:
                out.kept_share_sum += has_kv.mean()
                out.sweeps += 1
            next_sweep += settings.sweep_interval_s
        landing = _land(landing, now, has_kv, encoded, asked)
        for f in facts_of[i]:
            score[tenant, f] = decayed(score[tenant, f], at[tenant, f], now, settings.half_life_s) + 1
            at[tenant, f], last[tenant, f] = now, now
            if i >= warmup:
                out.retrievals += 1
                out.hits += bool(has_kv[tenant, f])
            bar = decayed(floor[tenant, 0], floor[tenant, 1], now, settings.half_life_s)
            if not has_kv[tenant, f] and not asked[tenant, f] and policy.wants_kv(score[tenant, f], bar):
                asked[tenant, f] = True
                landing.append((now + encode_s, tenant, f))
                if i >= warmup:
                    out.reencodes += 1
    return out


def _land(landing, now, has_kv, encoded, asked):
    """Re-encodes whose K/V has landed by `now`."""
    waiting = []
    for when, tenant, f in landing:
        if when <= now:
            has_kv[tenant, f], encoded[tenant, f], asked[tenant, f] = True, when, False
        else:
            waiting.append((when, tenant, f))
    return waiting


def oracle(trace: Trace, budget_share: float, warmup: int) -> float:
    """The hit share of keeping each tenant's truly most retrieved facts of each half of the trace (counted in
    hindsight, and switched at the midpoint the moment popularity drifts)."""
    _, tenant_of, facts_of = trace.chats_of()
    half, hits = trace.chats // 2, []
    for part in (slice(warmup, half), slice(half, trace.chats)):
        tenants, facts = np.repeat(tenant_of[part], trace.k), facts_of[part].ravel()
        counts = np.zeros((trace.tenants, trace.facts))
        np.add.at(counts, (tenants, facts), 1)
        kept = np.zeros_like(counts, dtype=bool)
        for t in range(trace.tenants):
            kept[t, np.argsort(-counts[t])[: int(budget_share * trace.facts)]] = True
        hits.append(kept[tenants, facts])
    return float(np.concatenate(hits).mean())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--budget-share", type=float, default=0.2, help="each memory's K/V budget, over all its facts' K/V")
    args = p.parse_args()
    if args.quick:
        trace = Trace(tenants=20, facts=300, k=10, chats=30_000, rate_per_s=20.0, zipf=1.0)
    else:
        trace = Trace(tenants=100, facts=1000, k=10, chats=150_000, rate_per_s=20.0, zipf=1.0)
    warmup = trace.chats // 5
    # a half-life of a quarter of the trace (~2 hours; quick ~25 minutes), the time scale on which popularity
    # drifts here; fresh facts protected for a minute
    duration_s = trace.chats / trace.rate_per_s
    base = {"half_life_s": duration_s / 4, "min_resident_s": 60.0, "sweep_interval_s": 30.0}
    started = time.perf_counter()
    report: dict = {"budget_share": args.budget_share, "settings": base, "traces": {}}
    for drift in (False, True):
        shown = Trace(**{**trace.__dict__, "drift": drift})
        report["traces"]["drift" if drift else "stable"] = run_trace(shown, base, args.budget_share, warmup)
    stable, drifting = report["traces"]["stable"], report["traces"]["drift"]
    report |= {
        "trace": trace.__dict__,
        "keep_all": {"kv_hit_share": 1.0, "kept_bytes_share": 1.0, "reencodes_per_1000": 0.0},
        "seconds": round(time.perf_counter() - started, 1),
        "targets": [
            target(
                "K/V kept over all facts' K/V (budget 0.2, stable popularity)",
                stable["runs"]["default"]["kept_bytes_share"],
                f"<= {args.budget_share * 1.1:.2f}",
            ),
            target("retrieved facts served from K/V over the oracle's, stable", stable["hit_over_oracle"], ">= 0.95"),
            target("the same when popularity drifts halfway", drifting["hit_over_oracle"], ">= 0.85"),
            target(
                "re-encodes per 1,000 retrievals, drifting", drifting["runs"]["default"]["reencodes_per_1000"], "<= 50"
            ),
        ],
    }
    write_report(args.out, report)
    for t in report["targets"]:
        print(t)


def run_trace(trace: Trace, base: dict, budget_share: float, warmup: int) -> dict:
    """Every variant of the policy over one trace, and the oracle."""
    runs = {}
    variants = {
        "default": {},
        "margin_1": {"reencode_margin": 1.0},
        "margin_2": {"reencode_margin": 2.0},
        "margin_3": {"reencode_margin": 3.0},
        "half_life_tenth": {"half_life_s": base["half_life_s"] / 10},
    }
    for name, change in variants.items():
        settings = ResidencySettings(**(base | change))
        runs[name] = replay(trace, settings, budget_share, encode_s=0.5, warmup=warmup).report()
        print("drift" if trace.drift else "stable", name, runs[name], flush=True)
    best = oracle(trace, budget_share, warmup)
    return {
        "runs": runs,
        "oracle_kv_hit_share": round(best, 4),
        "hit_over_oracle": runs["default"]["kv_hit_share"] / best,
    }


if __name__ == "__main__":
    main()
