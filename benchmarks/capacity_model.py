"""Tenants per GPU at p95 TTFT <= 2x the HBM TTFT: a trace-driven model of the tiers under load, from measured figures.

Inputs: figures measured on the H200 (dated, each named by the benchmark that measured it): a request's TTFT
with its k facts in the device arena, the pinned host->device and cold disk rates the tiers reach, a pasted
fact token's prefill cost (idle, and in GPU time per request under a full batch), and the engine's GPU time
per injected request under a full batch; a model shape and record dtype (a fact's bytes in HBM at full
precision, and as int8 codes below it); a node type (per GPU: the HBM given to the arena, pinned host memory,
disk and its read rate); a residency policy (a fact leaving host memory after fewer than `keep_min_hits`
retrievals, or leaving the disk, drops to text only: its requests paste it, and its K/V is encoded again in
the background when it is next retrieved, at a pasted request's GPU cost); and a popularity trace (each
request's tenant by Zipf(s) over the tenants, its k facts by Zipf within the tenant).

The tiers are replayed as exclusive LRU caches by bytes (HBM -> host -> disk -> text), a request's facts
brought into HBM after it. A request's idle TTFT is the arena's, plus the bytes it reads from each lower tier
over that tier's rate, plus its pasted tokens' prefill; under load (`--load`: the offered rate as a share of
what the GPU serves with every fact in HBM) its GPU time is stretched as on a processor-sharing server,
TTFT = idle + demand x rho / (1 - rho), rho = rate x the mean demand (re-encodes included); the reference is
the same load with every fact in HBM. For each node type the tenant count is raised until the p95 passes 2x
that reference; the report gives it against the tenants HBM alone holds (their whole K/V resident). A model,
not a measurement: `--measured-tenants N` (an H200 run of the same trace) checks it within 20 %.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, target, write_report  # noqa: E402

GIB = 1 << 30


@dataclass(frozen=True)
class Measured:
    """Figures measured on the H200 (Llama-3.1-8B shape, bf16 engine, k = 50 facts of 30 tokens)."""

    arena_ttft_ms: float = 12.6  # offload_tiers.py, 2026-11-30 (arena p50, one-checksum run)
    host_gbs: float = 52.0  # offload_tiers.py floor: 106 MiB pinned host->device in 2.03-2.17 ms
    disk_gbs: float = 1.0  # offload_tiers.py / profile_tiers.py: the tier reads cold files at 0.84x of a 1.0 GB/s floor
    paste_ms_per_token: float = 0.0088  # serve_http.py engine TTFT, prompt 29.4 - inject 16.2 ms over 1,500 tokens
    inject_gpu_ms: float = 3.97  # ttft_vs_k.py, 100 concurrent k=50 requests: injection 252.0 req/s (2026-12-02)
    paste_gpu_ms_per_token: float = 0.0224  # same run: pasted 26.6 req/s = 37.6 ms each, over 1,500 more tokens


@dataclass(frozen=True)
class Shape:
    """Bytes of one fact's K/V: full precision in HBM, int8 codes (one float32 scale per channel) below."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    fact_tokens: int = 30
    record_bytes_per_value: int = 2  # bf16 records; 4 for float32

    @property
    def full_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.fact_tokens * self.record_bytes_per_value

    @property
    def int8_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (self.fact_tokens + 4)


@dataclass(frozen=True)
class Node:
    """One GPU's share of a node: bytes per tier and the disk's read rate."""

    name: str
    hbm_arena_gib: float
    host_gib: float
    disk_gib: float  # the disk tier (int8 copies)
    store_gib: float  # the fact store's share of the disk (full-precision records)
    disk_gbs: float | None = None  # None: the measured rate


NODES = (
    Node("h200-box (this machine: 128 GiB RAM, 64 GiB disk)", 40, 64, 32, 32),
    Node("8xH200, 2 TB DRAM, NVMe 7 GB/s x 8 (per GPU)", 40, 200, 3500, 3500, disk_gbs=7.0),
)


@dataclass(frozen=True)
class Trace:
    """Who asks: tenants by Zipf(tenant_s), a request's k facts by Zipf(fact_s) within its tenant."""

    facts_per_tenant: int = 1000
    k: int = 50
    tenant_s: float = 1.0
    fact_s: float = 1.0
    requests: int = 20_000
    warmup: int = 20_000
    seed: int = 0


@dataclass(frozen=True)
class Policy:
    """What keeps K/V. Without `residency` every fact keeps it forever: one that no tier holds is read from the
    fact store (its full-precision record on disk). With it, a fact leaving the disk tier, or leaving host memory
    after fewer than `keep_min_hits` retrievals, drops to text only, and so is a fact not retrieved yet (the
    policy's steady state: the rarely asked are cold)."""

    residency: bool = True
    keep_min_hits: int = 2


class Tiers:
    """Exclusive LRU tiers by bytes (HBM, host, disk); below them the fact store (unbounded) or text only.

    `touch` returns, per fact, the index of where it was: a tier, `STORE` or `TEXT`."""

    STORE, TEXT = 3, 4

    def __init__(self, capacities: list[int], sizes: list[int], policy: Policy) -> None:
        self.capacity, self.size, self.policy = capacities, sizes, policy
        self.held: list[OrderedDict] = [OrderedDict() for _ in capacities]
        self.used = [0] * len(capacities)
        self.below = self.TEXT if policy.residency else self.STORE  # where a fact no tier holds is
        self.where: dict[int, int] = {}  # fact -> tier index (absent: `below`, or TEXT once dropped)
        self.hits: dict[int, int] = {}

    def touch(self, facts: list[int]) -> list[int]:
        """Where each fact was before this request; then all of them into HBM."""
        before = [self.where.get(f, self.below) for f in facts]
        for fact in facts:  # where it is now: bringing an earlier fact up may have pushed this one down
            self.hits[fact] = self.hits.get(fact, 0) + 1
            tier = self.where.pop(fact, self.below)
            if tier < len(self.capacity):
                del self.held[tier][fact]
                self.used[tier] -= self.size[tier]
            self._add(fact, 0)
        return before

    def _add(self, fact: int, tier: int) -> None:
        self.where[fact] = self.below  # where it stays if no tier has room for it
        while tier < len(self.capacity):
            if self.size[tier] > self.capacity[tier]:
                tier += 1
                continue
            self.held[tier][fact] = None
            self.used[tier] += self.size[tier]
            self.where[fact] = tier
            while self.used[tier] > self.capacity[tier]:
                victim, _ = self.held[tier].popitem(last=False)
                self.used[tier] -= self.size[tier]
                below = tier + 1
                if self.policy.residency and tier == 1 and self.hits.get(victim, 0) < self.policy.keep_min_hits:
                    below = self.TEXT  # cold: dropped to text only
                if below < len(self.capacity):
                    self._add(victim, below)
                else:
                    self.where[victim] = self.below
            return


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def simulate(
    tenants: int, node: Node, shape: Shape, measured: Measured, trace: Trace, policy: Policy, load: float
) -> dict:
    """p50 / p95 TTFT (ms) under `load` and where facts came from, for `tenants` tenants on one GPU of `node`."""
    rng = np.random.default_rng(trace.seed)
    sizes = [shape.full_bytes, shape.int8_bytes, shape.int8_bytes]
    capacities = [int(node.hbm_arena_gib * GIB), int(node.host_gib * GIB), int(node.disk_gib * GIB)]
    tiers = Tiers(capacities, sizes, policy)
    rates = [math.inf, measured.host_gbs, node.disk_gbs or measured.disk_gbs]
    tenant_of = rng.choice(tenants, size=trace.warmup + trace.requests, p=zipf_weights(tenants, trace.tenant_s))
    fact_p = zipf_weights(trace.facts_per_tenant, trace.fact_s)
    counts = [0, 0, 0, 0, 0]
    idle, demand = [], []
    for index, tenant in enumerate(tenant_of):
        ranks = _distinct(rng, fact_p, trace.k)
        facts = [int(tenant) * trace.facts_per_tenant + int(r) for r in ranks]
        before = tiers.touch(facts)
        if index < trace.warmup:
            continue
        ms, pasted = measured.arena_ttft_ms, 0
        for tier in before:
            counts[tier] += 1
            if tier in (1, 2):
                ms += sizes[tier] / (rates[tier] * 1e9) * 1e3
            elif tier == Tiers.STORE:  # its full-precision record, read from the store's disk
                ms += shape.full_bytes / (rates[2] * 1e9) * 1e3
            elif tier == Tiers.TEXT:
                pasted += shape.fact_tokens
        idle.append(ms + pasted * measured.paste_ms_per_token)
        # its own GPU time, and the background re-encode of its pasted facts (a pasted prefill's cost again)
        demand.append(measured.inject_gpu_ms + 2 * pasted * measured.paste_gpu_ms_per_token)
    rate = load / measured.inject_gpu_ms  # requests per ms
    rho = rate * float(np.mean(demand))
    if rho >= 1:
        ttft = np.full(len(idle), math.inf)
    else:
        ttft = np.array(idle) + np.array(demand) * rho / (1 - rho)
    total = sum(counts)
    return {
        "tenants": tenants,
        "p50_ms": float(np.percentile(ttft, 50)),
        "p95_ms": float(np.percentile(ttft, 95)),
        "gpu_utilization": rho,
        "facts_from": {name: n / total for name, n in zip(("hbm", "host", "disk", "store", "text"), counts)},
    }


def reference_ms(measured: Measured, load: float) -> float:
    """TTFT with every fact in HBM at the same offered load (the same stretch of its GPU time)."""
    return measured.arena_ttft_ms + measured.inject_gpu_ms * load / (1 - load)


def _distinct(rng: np.random.Generator, p: np.ndarray, k: int) -> np.ndarray:
    """k distinct fact ranks drawn by popularity (what a retrieval of k facts from one tenant returns)."""
    return rng.choice(len(p), size=k, replace=False, p=p)


def capacity(node: Node, shape: Shape, measured: Measured, trace: Trace, policy: Policy, load: float) -> dict:
    """The most tenants whose p95 stays within 2x the all-in-HBM TTFT at the same load (doubling, then bisection)."""
    goal = 2 * reference_ms(measured, load)
    hbm_alone = max(1, int(node.hbm_arena_gib * GIB // (shape.full_bytes * trace.facts_per_tenant)))
    low, high, runs = hbm_alone, None, []
    while high is None:
        run = simulate(2 * low, node, shape, measured, trace, policy, load)
        runs.append(run)
        if run["p95_ms"] > goal or 2 * low > 100_000:
            high = 2 * low
        else:
            low *= 2
    while high - low > max(1, low // 20):
        middle = (low + high) // 2
        run = simulate(middle, node, shape, measured, trace, policy, load)
        runs.append(run)
        low, high = (middle, high) if run["p95_ms"] <= goal else (low, middle)
    limited_by = "p95"
    if not policy.residency:  # every fact's full-precision record must fit the fact store
        stored = int(node.store_gib * GIB // (shape.full_bytes * trace.facts_per_tenant))
        if stored < low:
            low, limited_by = max(stored, 1), "the fact store's disk"
    at = next(r for r in runs if r["tenants"] == low) if any(r["tenants"] == low for r in runs) else None
    return {
        "node": asdict(node),
        "tenants_hbm_alone": hbm_alone,
        "tenants": low,
        "limited_by": limited_by,
        "over_hbm_alone": low / hbm_alone,
        "at_capacity": at or simulate(low, node, shape, measured, trace, policy, load),
        "goal_p95_ms": goal,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tenant-s", type=float, default=1.0, help="Zipf exponent of tenant popularity")
    p.add_argument("--fact-s", type=float, default=1.0, help="Zipf exponent of fact popularity within a tenant")
    p.add_argument("--record-bytes", type=int, default=2, choices=[2, 4], help="bytes a record value takes")
    p.add_argument("--keep-min-hits", type=int, default=2, help="retrievals a fact needs to keep K/V on disk")
    p.add_argument("--load", type=float, default=0.5, help="offered rate / what the GPU serves with all in HBM")
    p.add_argument("--measured-tenants", type=int, default=None, help="an H200 run's tenants for the same trace")
    args = p.parse_args()
    requests = 3_000 if args.quick else 20_000
    trace = Trace(tenant_s=args.tenant_s, fact_s=args.fact_s, requests=requests, warmup=requests)
    shape, measured = Shape(record_bytes_per_value=args.record_bytes), Measured()
    policies = {"residency": Policy(True, args.keep_min_hits), "every fact keeps K/V": Policy(False)}
    rows = []
    for node in NODES:  # both policies side by side, each node
        for name, policy in policies.items():
            row = capacity(node, shape, measured, trace, policy, args.load) | {"policy": name}
            rows.append(row)
            print(
                f"{node.name}, {name}: {row['tenants']} tenants ({row['over_hbm_alone']:.1f}x the "
                f"{row['tenants_hbm_alone']} HBM alone holds), p95 {row['at_capacity']['p95_ms']:.1f} ms, "
                f"limited by {row['limited_by']}",
                flush=True,
            )
    box = max((r for r in rows if r["node"]["name"] == NODES[0].name), key=lambda r: r["tenants"])
    targets = [target("h200 box, best policy: tenants over HBM alone at p95 <= 2x", box["over_hbm_alone"], ">= 10")]
    if args.measured_tenants:
        error = abs(box["tenants"] - args.measured_tenants) / args.measured_tenants
        targets.append(target("model vs measured tenants on the H200 box, relative error", error, "<= 0.2"))
    write_report(
        args.out,
        {
            "benchmark": "capacity_model",
            "quick": args.quick,
            "measured": asdict(measured),
            "shape": asdict(shape) | {"fact_full_bytes": shape.full_bytes, "fact_int8_bytes": shape.int8_bytes},
            "trace": asdict(trace),
            "policies": {name: asdict(policy) for name, policy in policies.items()},
            "load": args.load,
            "reference_ms": reference_ms(measured, args.load),
            "nodes": rows,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
