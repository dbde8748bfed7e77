"""Tenants per GPU at p95 TTFT <= 2x the HBM TTFT: a trace-driven model of the tiers under load, from measured figures.

Inputs: figures measured on the H200 (dated, each named by the benchmark that measured it): a request's TTFT
with its k facts in the device arena, the pinned host->device and cold disk rates the tiers reach, a pasted
fact token's prefill cost (idle, and in GPU time per request under a full batch), and the engine's GPU time
per injected request under a full batch; a model shape and record dtype (a fact's bytes in HBM at full
precision or as int8 codes with per-page scales (`--arena-precision`), and as int8 codes below it); a node type (per GPU: the HBM given to the arena, pinned host memory,
the disk tier, the record store's disk and its read rate); and a popularity trace (each chat's tenant by
Zipf(s) over the tenants, its k facts by Zipf within the tenant).

Which facts hold K/V is decided by inferscale's own residency rules (`_node_residency.py` runs
`tenants/residency_policy.py` on a simulated clock, the node's K/V budget being what its record store holds):
a fact without K/V is pasted, and its re-encode, once it has earned one, costs a prefill of its tokens. The
facts with K/V are replayed through the tiers as exclusive LRU caches by bytes (HBM -> host -> disk, then the
record store), a request's facts brought into HBM after it. A request's idle TTFT is the arena's, plus the bytes
it reads from each lower tier over that tier's rate, plus its pasted tokens' prefill; under load (`--load`: the
offered rate as a share of what the GPU serves with every fact in HBM) its GPU time is stretched as on a
processor-sharing server, TTFT = idle + demand x rho / (1 - rho), rho = rate x the mean demand (re-encodes
included); the reference is the same load with every fact in HBM. Beside it, every fact keeping K/V (its record
read from the store when no tier holds it; every record must fit the store). For each node type the tenant
count is raised until the p95 passes 2x that reference. A model, not a measurement: `--measured PATH` (a
`tenants_per_gpu.py` report) replays that run's own trace, budgets and reference figures at no load, and
compares its p95 per tenant count and its tenant count with what the engine measured (goal within 20 %).
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, target, write_report  # noqa: E402
from benchmarks._node_residency import NodeResidency, ZipfTrace, settings_for  # noqa: E402
from kvcore.record import PRECISIONS  # noqa: E402

GIB = 1 << 30


@dataclass(frozen=True)
class Measured:
    """Figures measured on the H200 (Llama-3.1-8B shape, bf16 engine, k = 50 facts of 30 tokens)."""

    arena_ttft_ms: float = 14.9  # tenants_per_gpu.py, 2026-12-03 (k = 50 in the arena, p50; 12.6 in offload_tiers.py)
    host_gbs: float = 52.0  # offload_tiers.py floor: 106 MiB pinned host->device in 2.03-2.17 ms
    disk_gbs: float = 1.0  # offload_tiers.py / profile_tiers.py: the tier reads cold files at 0.84x of a 1.0 GB/s floor
    paste_ms_per_token: float = 0.0168  # tenants_per_gpu.py, same run: all 50 pasted 40.1 ms, over 1,500 more tokens
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
    record_precision: str = "dense"  # how the record store holds them: values, or "int8" codes
    arena_precision: str = "dense"  # how HBM holds them: values, or "int8" codes with each 16-token page's scales

    @property
    def full_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.fact_tokens * self.record_bytes_per_value

    @property
    def arena_bytes(self) -> int:
        """A fact in the device arena: its values, or its codes and a float32 scale per channel for each page."""
        if self.arena_precision != "int8":
            return self.full_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * (self.fact_tokens + 4 * -(-self.fact_tokens // 16))

    @property
    def int8_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (self.fact_tokens + 4)

    @property
    def store_bytes(self) -> int:
        """A fact's record in the store: what the node's K/V budget counts and a read from the store moves."""
        return self.int8_bytes if self.record_precision == "int8" else self.full_bytes


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


class Tiers:
    """Exclusive LRU tiers by bytes (HBM, host, disk) of the facts that hold K/V; below them the record store.

    `touch` returns, per fact, the index of where it was: a tier or `STORE`."""

    STORE, TEXT = 3, 4

    def __init__(self, capacities: list[int], sizes: list[int]) -> None:
        self.capacity, self.size = capacities, sizes
        self.held: list[OrderedDict] = [OrderedDict() for _ in capacities]
        self.used = [0] * len(capacities)
        self.where: dict[object, int] = {}  # fact -> tier index (absent: the store)

    def touch(self, facts: list) -> list[int]:
        """Where each fact was before this request; then all of them into HBM."""
        before = [self.where.get(f, self.STORE) for f in facts]
        for fact in facts:  # where it is now: bringing an earlier fact up may have pushed this one down
            self.remove(fact)
            self._add(fact, 0)
        return before

    def remove(self, fact) -> None:
        """Out of every tier (its K/V dropped, or about to move up)."""
        tier = self.where.pop(fact, self.STORE)
        if tier < len(self.capacity):
            del self.held[tier][fact]
            self.used[tier] -= self.size[tier]

    def _add(self, fact, tier: int) -> None:
        while tier < len(self.capacity) and self.size[tier] > self.capacity[tier]:
            tier += 1
        if tier == len(self.capacity):
            return
        self.held[tier][fact] = None
        self.used[tier] += self.size[tier]
        self.where[fact] = tier
        while self.used[tier] > self.capacity[tier]:
            victim, _ = self.held[tier].popitem(last=False)
            self.used[tier] -= self.size[tier]
            del self.where[victim]
            self._add(victim, tier + 1)


@dataclass(frozen=True)
class Run:
    """One simulated run: the trace, whether the residency policy decides K/V, and the offered load."""

    trace: ZipfTrace
    residency: bool
    load: float
    timed: int  # chats counted: `timed` of them, ending `after` chats before the trace's end
    after: int = 0
    tiers_from: int = 0  # the chat from which facts go through the tiers (before it, only the residency replay)
    written_with_kv: bool = True  # every fact starts with K/V (as the encoder writes it); else none does

    def facts_with_kv(self, trace: ZipfTrace) -> int:
        return trace.tenants * trace.facts if self.written_with_kv else 0


def simulate(run: Run, node: Node, shape: Shape, measured: Measured) -> dict:
    """p50 / p95 TTFT (ms) under the run's load and where facts came from, for its tenants on one GPU of `node`."""
    trace = run.trace
    sizes = [shape.arena_bytes, shape.int8_bytes, shape.int8_bytes]
    capacities = [int(node.hbm_arena_gib * GIB), int(node.host_gib * GIB), int(node.disk_gib * GIB)]
    tiers = Tiers(capacities, sizes)
    rates = [math.inf, measured.host_gbs, node.disk_gbs or measured.disk_gbs]
    times, tenant_of, facts_of = trace.draw()
    settings = settings_for(trace, int(node.store_gib * GIB))
    state = NodeResidency(settings, shape.store_bytes, 0.5, run.facts_with_kv(trace)) if run.residency else None
    first, last = trace.chats - run.after - run.timed, trace.chats - run.after
    counts = [0, 0, 0, 0, 0]
    idle, demand = [], []
    reencodes = {}  # the policy's count of re-encodes asked for, as the counted chats begin and end
    for index, (now, tenant) in enumerate(zip(times.tolist(), tenant_of.tolist())):
        facts = facts_of[index]
        if state is not None and index in (first, last):
            reencodes[index] = state.reencodes
        if state is not None:
            for key in state.advance(now).dropped:
                tiers.remove(key)
            mask = state.chat(now, tenant, facts)
        else:
            mask = np.ones(len(facts), dtype=bool)
        if index < run.tiers_from:
            continue
        before = tiers.touch([(tenant, f) for f in facts[mask].tolist()])
        if not first <= index < last:
            continue
        ms, pasted = measured.arena_ttft_ms, int((~mask).sum()) * shape.fact_tokens
        counts[Tiers.TEXT] += int((~mask).sum())
        for tier in before:
            counts[tier] += 1
            if tier in (1, 2):
                ms += sizes[tier] / (rates[tier] * 1e9) * 1e3
            elif tier == Tiers.STORE:  # its record, read from the store's disk
                ms += shape.store_bytes / (rates[2] * 1e9) * 1e3
        idle.append(ms + pasted * measured.paste_ms_per_token)
        demand.append(measured.inject_gpu_ms + pasted * measured.paste_gpu_ms_per_token)
    if state is not None:
        reencodes[last] = reencodes.get(last, state.reencodes)
    asked = reencodes[last] - reencodes[first] if state is not None else 0
    # each re-encode prefills the fact's tokens once (w = 0), spread over the counted chats
    demand_mean = float(np.mean(demand)) + asked * shape.fact_tokens * measured.paste_gpu_ms_per_token / len(demand)
    rate = run.load / measured.inject_gpu_ms  # requests per ms
    rho = rate * demand_mean
    ttft = np.array(idle) + np.array(demand) * rho / max(1 - rho, 1e-9)
    total = sum(counts)
    saturated = rho >= 1  # the GPU cannot keep up: TTFT grows without bound
    return {
        "tenants": trace.tenants,
        "p50_ms": math.inf if saturated else float(np.percentile(ttft, 50)),
        "p95_ms": math.inf if saturated else float(np.percentile(ttft, 95)),
        "gpu_utilization": rho,
        "reencodes_per_1000": 1000 * asked / (run.timed * trace.k),
        "facts_from": {name: n / total for name, n in zip(("hbm", "host", "disk", "store", "text"), counts)},
    }


def reference_ms(measured: Measured, load: float) -> float:
    """TTFT with every fact in HBM at the same offered load (the same stretch of its GPU time)."""
    return measured.arena_ttft_ms + measured.inject_gpu_ms * load / (1 - load)


def capacity(
    node: Node, shape: Shape, measured: Measured, trace: ZipfTrace, residency: bool, load: float, timed: int
) -> dict:
    """The most tenants whose p95 stays within 2x the all-in-HBM TTFT at the same load (doubling, then bisection)."""
    goal = 2 * reference_ms(measured, load)
    hbm_alone = max(1, int(node.hbm_arena_gib * GIB // (shape.arena_bytes * trace.facts)))
    runs: dict[int, dict] = {}

    def at(tenants: int) -> dict:
        if tenants not in runs:
            runs[tenants] = simulate(
                Run(replace(trace, tenants=tenants), residency, load, timed), node, shape, measured
            )
        return runs[tenants]

    low, high = hbm_alone, None
    while high is None:
        if at(2 * low)["p95_ms"] > goal or 2 * low > 100_000:
            high = 2 * low
        else:
            low *= 2
    while high - low > max(1, low // 20):
        middle = (low + high) // 2
        low, high = (middle, high) if at(middle)["p95_ms"] <= goal else (low, middle)
    limited_by = "p95"
    if not residency:  # every fact's record must fit the fact store
        stored = int(node.store_gib * GIB // (shape.store_bytes * trace.facts))
        if stored < low:
            low, limited_by = max(stored, 1), "the fact store's disk"
    return {
        "node": asdict(node),
        "tenants_hbm_alone": hbm_alone,
        "tenants": low,
        "limited_by": limited_by,
        "over_hbm_alone": low / hbm_alone,
        "at_capacity": at(low),
        "goal_p95_ms": goal,
    }


def check_measured(path: Path, shape: Shape) -> dict:
    """The model over a `tenants_per_gpu.py` run: the same trace, budgets and reference figures, no load."""
    report = json.loads(path.read_text())
    budgets = report["budgets_gib"]
    node = Node("measured run", budgets["arena"], budgets["host"], budgets["disk_tier"], budgets["node_kv"])
    ref = report["reference"]
    measured = replace(
        Measured(),
        arena_ttft_ms=ref["hbm_ttft_ms"]["p50"],
        paste_ms_per_token=report["paste_ms_per_token"],
    )
    shape = replace(
        shape,
        record_bytes_per_value=2 if report["record_dtype"] == "bfloat16" else 4,
        record_precision=report.get("record_precision", "dense"),
        arena_precision=report.get("arena_precision", "dense"),
    )
    rows = []
    for row in report["runs"]:
        trace = ZipfTrace(
            tenants=row["tenants"],
            facts=report["facts_per_tenant"],
            k=report["k"],
            chats=report["chats"],
            rate_per_s=report["rate_per_s"],
        )
        # the chats the run timed one at a time (its batched ones follow them); the tiers empty where the
        # engine's part began (its first `warm` chats untimed), unless it loaded every fact holding K/V first
        engine_from = 0 if report.get("preloaded") else trace.chats - report["warm"] - 2 * report["timed"]
        run = simulate(
            Run(
                trace,
                True,
                0.0,
                report["timed"],
                after=report["timed"],
                tiers_from=engine_from,
                written_with_kv=report.get("written_with_kv", False),  # runs before 2026-12-03 13:00 started with none
            ),
            node,
            shape,
            measured,
        )
        within = run["p95_ms"] <= report["goal_p95_ms"]
        rows.append(
            {
                "tenants": row["tenants"],
                "measured_p95_ms": row["p95_ms"],
                "model_p95_ms": run["p95_ms"],
                "p95_relative_error": abs(run["p95_ms"] - row["p95_ms"]) / row["p95_ms"],
                "model_within_goal": within,
                "model": run,
                "excess_ms": excess_by_cause(row.get("samples", []), measured, report["k"], shape.fact_tokens),
            }
        )
    return {
        "report": str(path),
        "rows": rows,
        "measured_tenants": report["measured_tenants"],
        "model_tenants": rows_passed(rows),
    }


def excess_by_cause(samples: list, measured: "Measured", k: int, fact_tokens: int) -> dict:
    """How far each timed request of a `tenants_per_gpu` run lies above the arena's TTFT plus its pasted facts'
    prefill, grouped by what the run recorded of it (samples of five fields: TTFT, injected, facts first read
    from an old record, tenant's store changed, tenant's first request): count, share, p50 and p95 of the excess."""
    groups: dict[str, list[float]] = {}
    for sample in samples:
        if len(sample) < 5:
            return {}  # a run from before these fields
        ms, injected, fresh, changed, new_tenant = sample[:5]
        excess = ms - measured.arena_ttft_ms - (k - injected) * fact_tokens * measured.paste_ms_per_token
        cause = "new tenant" if new_tenant else "old record read" if fresh else "store changed" if changed else "none"
        groups.setdefault(cause, []).append(excess)
    return {
        cause: {
            "count": len(values),
            "share": round(len(values) / len(samples), 4),
            "p50": round(float(np.percentile(values, 50)), 2),
            "p95": round(float(np.percentile(values, 95)), 2),
        }
        for cause, values in sorted(groups.items())
    }


def rows_passed(rows: list[dict]) -> int:
    """The largest count of `rows` the model put within the goal, every smaller one too (0: none)."""
    passed = 0
    for row in rows:
        if not row["model_within_goal"]:
            break
        passed = row["tenants"]
    return passed


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tenant-s", type=float, default=1.0, help="Zipf exponent of tenant popularity")
    p.add_argument("--fact-s", type=float, default=1.0, help="Zipf exponent of fact popularity within a tenant")
    p.add_argument("--record-bytes", type=int, default=2, choices=[2, 4], help="bytes a record value takes")
    p.add_argument(
        "--record-precision", default="dense", choices=list(PRECISIONS), help="how the record store holds records"
    )
    p.add_argument(
        "--arena-precision", default="dense", choices=["dense", "int8"], help="how the device arena holds records"
    )
    p.add_argument("--load", type=float, default=0.5, help="offered rate / what the GPU serves with all in HBM")
    p.add_argument("--measured", type=Path, default=None, help="a tenants_per_gpu.py report to check the model against")
    args = p.parse_args()
    chats, timed = (3_000, 1_000) if args.quick else (12_000, 2_000)
    trace = ZipfTrace(tenants=1, chats=chats, rate_per_s=2.0, tenant_s=args.tenant_s, fact_s=args.fact_s)
    shape, measured = (
        Shape(
            record_bytes_per_value=args.record_bytes,
            record_precision=args.record_precision,
            arena_precision=args.arena_precision,
        ),
        Measured(),
    )
    rows = []
    for node in NODES:  # both policies side by side, each node
        for name, residency in (("residency", True), ("every fact keeps K/V", False)):
            row = capacity(node, shape, measured, trace, residency, args.load, timed) | {"policy": name}
            rows.append(row)
            print(
                f"{node.name}, {name}: {row['tenants']} tenants ({row['over_hbm_alone']:.1f}x the "
                f"{row['tenants_hbm_alone']} HBM alone holds), p95 {row['at_capacity']['p95_ms']:.1f} ms, "
                f"limited by {row['limited_by']}",
                flush=True,
            )
    box = max((r for r in rows if r["node"]["name"] == NODES[0].name), key=lambda r: r["tenants"])
    targets = [target("h200 box, best policy: tenants over HBM alone at p95 <= 2x", box["over_hbm_alone"], ">= 10")]
    check = None
    if args.measured:
        check = check_measured(args.measured, shape)
        for row in check["rows"]:
            print(
                f"measured run, {row['tenants']} tenants: p95 {row['measured_p95_ms']:.1f} ms measured, "
                f"{row['model_p95_ms']:.1f} modelled",
                flush=True,
            )
        worst = max(row["p95_relative_error"] for row in check["rows"])
        targets.append(target("model vs measured p95 per tenant count, worst relative error", worst, "<= 0.2"))
        error = abs(check["model_tenants"] - check["measured_tenants"]) / max(check["measured_tenants"], 1)
        targets.append(target("model vs measured tenants within 2x, relative error", error, "<= 0.2"))
    write_report(
        args.out,
        {
            "benchmark": "capacity_model",
            "quick": args.quick,
            "measured": asdict(measured),
            "shape": asdict(shape)
            | {
                "fact_full_bytes": shape.full_bytes,
                "fact_int8_bytes": shape.int8_bytes,
                "fact_store_bytes": shape.store_bytes,
            },
            "trace": asdict(trace) | {"timed": timed},
            "load": args.load,
            "reference_ms": reference_ms(measured, args.load),
            "nodes": rows,
            "measured_check": check,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
