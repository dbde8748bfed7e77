"""Tenants of 1,000 facts one GPU serves at p95 TTFT <= 2x the HBM TTFT, with KV residency by use and bf16 records.

One process, one real vLLM engine with the inferscale connector (device arena, pinned host tier, disk tier;
prefix caching off, so every request injects). For each tenant count N (10x, 20x, ... what HBM alone holds:
the arena over one tenant's K/V, as that arena holds it: values, or int8 codes with `--arena-precision int8`), a Zipf trace of chats (tenants by Zipf(1.0), each chat's k facts by Zipf(1.0)
within its tenant) runs through inferscale's own residency rules (`_node_residency.py`: the node's K/V budget
is what the record store's disk holds; a fact keeps K/V while it is used enough, dropped facts are pasted as
text and encoded again once warm). The chats before the engine's part are only replayed; then the records of
every fact holding K/V are written (and evicted from the page cache, as records written long ago are) and each
injected once (the tiers as on a node that has served them), and the last chats go through the engine in order,
each injecting its facts that hold K/V and pasting the rest, the re-encodes that land and the drops applied to
the store between chats (every record carries the same K/V: the bytes matter here, the tests prove values). The first
part of them warms the tiers, the rest is timed. The reference, same engine, same run: a request with its k
facts in the arena (asked twice, the second timed), and beside it one with all k pasted.

Reported per N: p50 / p95 TTFT, the share of retrieved facts served from K/V, re-encodes; and the largest N measured within 2x. `capacity_model.py --measured PATH` checks its
model against this report. Records hold random K/V; `--config` picks the model shape (dummy weights).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import engine_shape_defaults, parser, scratch_dir, shape_folder, target, write_report  # noqa: E402
from benchmarks._node_residency import NodeResidency, ZipfTrace, settings_for  # noqa: E402
from kvcore.arena import record_bytes  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.record import PRECISIONS, EncodingParams, FactKV, dtype_name  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

FACT_TOKENS, FRAME_TOKENS, QUERY_TOKENS = 30, 24, 16
RATE_PER_S = 2.0  # chats a simulated second: with a half-life of a quarter of the trace, it sets how many sweeps run
CONFIGS = Path(__file__).resolve().parent / "configs"
GIB = 1 << 30


class Records:
    """Fact records of N tenants in one store: token ids for every fact (pasted or injected), K/V files only
    for the facts that hold K/V. Every record carries the same K/V tensors (bytes, not values, are measured)."""

    def __init__(
        self,
        root: Path,
        config: dict,
        fingerprint: str,
        dtype: torch.dtype,
        tenants: int,
        facts: int,
        precision: str = "dense",
    ) -> None:
        """`precision`: how the store holds records ("int8": codes of the `dtype` values, decoded on the device as a
        dense arena takes them, kept as they are by an int8 arena)."""
        rope = RopeConfig.from_hf_config(config)
        layers, heads = config["num_hidden_layers"], config.get("num_key_value_heads") or config["num_attention_heads"]
        self.store = LocalFactStore(root, precision=precision)
        self.params = EncodingParams(window=0, model_fingerprint=fingerprint, rope=rope, dtype=dtype_name(dtype))
        k = torch.randn(layers, heads, FACT_TOKENS, rope.head_dim).to(dtype)
        v = torch.randn(layers, heads, FACT_TOKENS, rope.head_dim).to(dtype)
        frame = FactKV(
            "probe", "frame", tuple(range(FRAME_TOKENS)), *(x[:, :, :FRAME_TOKENS].clone() for x in (k, v)), self.params
        )
        fact = FactKV("probe", "fact", tuple(range(FACT_TOKENS)), k, v, self.params)
        self.arena_fact_bytes = {  # what a fact takes in the arena: its whole pages, of values or of codes
            arena: record_bytes(layers, heads, rope.head_dim, FACT_TOKENS, dtype, arena) for arena in ("dense", "int8")
        }
        frame, fact = self.store.stored(frame), self.store.stored(fact)  # quantized once: every record holds the same
        self.k, self.v, self.frame_kv = fact.k, fact.v, (frame.k, frame.v)
        rng = np.random.default_rng(0)
        vocab = config["vocab_size"]
        self.tokens = rng.integers(100, vocab - 1, size=(tenants, facts, FACT_TOKENS)).tolist()
        self.frames = rng.integers(100, vocab - 1, size=(tenants, FRAME_TOKENS)).tolist()
        self.queries = rng.integers(100, vocab - 1, size=(64, QUERY_TOKENS)).tolist()
        self.fact_bytes = fact.nbytes  # what a fact's record takes in the store (the node's K/V budget counts these)
        self.written = 0
        self.present: set[tuple[int, int]] = set()
        self.run = "ref"  # named in every tenant id: no run reads another's records or cached headers

    def tenant_id(self, tenant: int) -> str:
        return f"{self.run}-t{tenant}"

    def write(self, pairs: list[tuple[int, int]], cold: bool = False) -> None:
        """Records of these (tenant, fact) pairs, grouped by tenant (one version bump each); a tenant's frame first.
        `cold`: then out of the page cache, as records written long ago are (the first read goes to the disk)."""
        by_tenant: dict[int, list[int]] = {}
        for tenant, fact in pairs:
            by_tenant.setdefault(tenant, []).append(fact)
        for tenant, facts in by_tenant.items():
            name = self.tenant_id(tenant)
            records = [FactKV(name, f"f{f}", tuple(self.tokens[tenant][f]), self.k, self.v, self.params) for f in facts]
            if not (self.store.root / name / "frame.safetensors").exists():
                records.append(FactKV(name, "frame", tuple(self.frames[tenant]), *self.frame_kv, self.params))
            self.store.put_many(records)
            self.written += len(facts)
            self.present.update((tenant, f) for f in facts)
            if cold:
                for f in facts:
                    evict_from_page_cache(self.store.path(name, f"f{f}"))

    def write_frames(self, tenants: int) -> None:
        """Every tenant's frame record (a request injects it even when all its facts are pasted)."""
        for tenant in range(tenants):
            self.store.put(
                FactKV(self.tenant_id(tenant), "frame", tuple(self.frames[tenant]), *self.frame_kv, self.params)
            )

    def drop(self, pairs: list[tuple[int, int]]) -> None:
        for tenant, fact in pairs:
            self.store.delete(self.tenant_id(tenant), f"f{fact}")
            self.present.discard((tenant, fact))

    def request(self, tenant: int, injected: list[int], pasted: list[int], query: int):
        """(prompt ids, plan): the frame and the injected facts' records, then the pasted facts' text, then a query."""
        tokens = self.frames[tenant] + [t for f in injected for t in self.tokens[tenant][f]]
        tokens += [t for f in pasted for t in self.tokens[tenant][f]] + self.queries[query % len(self.queries)]
        name = self.tenant_id(tenant)
        plan = MemoryPlan(name, ("frame", *(f"f{f}" for f in injected)), self.store.version(name))
        return tokens, plan


def evict_from_page_cache(path: Path) -> None:
    """Write the file back and drop its pages (clean pages: no privilege needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Engine:
    """The engine under test and a timed single request."""

    def __init__(self, args, path: str, store_root: Path, fingerprint: str, work: Path) -> None:
        from config.connector import ConnectorConfig, TierConfig
        from deployments.vllm_adapter.engine import build_llm

        gpu = torch.cuda.is_available()
        connector = ConnectorConfig(
            store_root=store_root,
            fingerprint=fingerprint,
            device_cache_bytes=int(args.arena_gib * GIB),
            arena_precision=args.arena_precision,
            tiers=TierConfig(
                disk_cache_dir=work / "tiers",
                host_cache_bytes=int(args.host_gib * GIB),
                disk_cache_bytes=int(args.disk_tier_gib * GIB),
                compress_lower=True,
                pin_host_at_start=not args.pin_host_lazily,
            ),
        )
        kwargs = {"gpu_memory_utilization": 0.3} if gpu else {"enforce_eager": True, "kv_cache_memory_bytes": 512 << 20}
        self.llm = build_llm(
            path,
            connector,
            dtype=args.dtype,
            seed=0,
            max_model_len=4096,
            enable_prefix_caching=False,
            load_format="dummy",
            skip_tokenizer_init=True,
            **kwargs,
        )
        self.fallbacks = 0

    def counts(self, enabled: bool = True) -> dict[str, int]:
        """Records loads found in the arena, host tier, disk tier or only the store, summed over the workers since
        counting was turned on (`kvcore.load_sources`; off again with `enabled=False`), and the running counts of
        arena evictions, tier entries put and host segments page-locked (a request's are the difference)."""
        counts: dict[str, int] = {}
        found = self.llm.collective_rpc("inferscale_count_sources", args=(enabled,))
        for worker in [*found, *self.llm.collective_rpc("inferscale_tier_counters")]:
            for source, n in worker.items():
                counts[source] = counts.get(source, 0) + n
        return counts

    def ask(self, tokens: list[int], plan: MemoryPlan | None) -> float:
        """TTFT (ms) of one request alone."""
        return self.ask_many([(tokens, plan)])

    def ask_many(self, requests: list[tuple[list[int], MemoryPlan | None]]) -> float:
        """ms until every one of `requests`, sent together, has its first token (one token each); counts
        fallbacks (a planned record not injected)."""
        from vllm import SamplingParams

        from deployments.vllm_adapter.engine import memory_request

        built = [memory_request(t, plan, SamplingParams(max_tokens=1, detokenize=False)) for t, plan in requests]
        start = time.perf_counter()
        outs = self.llm.generate([b[0] for b in built], [b[1] for b in built], use_tqdm=False)
        elapsed = (time.perf_counter() - start) * 1e3
        for out, (_, plan) in zip(outs, requests):
            if plan is None:
                continue
            report = (out.kv_transfer_params or {}).get("inferscale") or {}
            planned = FRAME_TOKENS + FACT_TOKENS * (len(plan.record_ids) - 1)
            if report.get("fallback") or report.get("injected_tokens", 0) < planned:
                self.fallbacks += 1
        return elapsed


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def reference(engine: Engine, records: Records, k: int, repeats: int, batch: int) -> dict:
    """The HBM TTFT (k facts found in the arena: each set asked twice, the second timed) and the all-pasted one,
    for one request alone and for `batch` requests sent together (each injecting, or pasting, the same set)."""
    sets = [list(range(i * k, (i + 1) * k)) for i in range(2)]
    records.write([(0, f) for s in sets for f in s])
    times: dict[str, list[float]] = {"hbm": [], "pasted": [], "hbm_batch": [], "pasted_batch": []}
    for i in range(repeats + 2):
        chosen = sets[i % 2]
        engine.ask(*records.request(0, chosen, [], i))
        timed = {
            "hbm": engine.ask(*records.request(0, chosen, [], i + 1)),
            "pasted": engine.ask(*records.request(0, [], chosen, i + 2)),
            "hbm_batch": engine.ask_many([records.request(0, chosen, [], i + j) for j in range(batch)]),
            "pasted_batch": engine.ask_many([records.request(0, [], chosen, i + j) for j in range(batch)]),
        }
        for name, ms in timed.items():
            times[name] += [ms] if i >= 2 else []
    records.drop([(0, f) for s in sets for f in s])
    return {f"{name}_ttft_ms": {"p50": statistics.median(v), "p95": p95(v)} for name, v in times.items()}


def run_tenants(engine: Engine, records: Records, trace: ZipfTrace, args, ref: dict) -> dict:
    """The trace through the policy; its last `warm + 2 timed` chats through the engine: `warm` untimed, `timed`
    one at a time, `timed` in batches of `args.batch` sent together (a loaded engine's TTFT)."""
    warm, timed, batch = args.warm, args.timed, args.batch
    times, tenant_of, facts_of = trace.draw()
    settings = settings_for(trace, int(args.node_kv_gib * GIB))
    residency = NodeResidency(settings, records.fact_bytes, 0.5, trace.tenants * trace.facts)
    first = trace.chats - warm - 2 * timed
    started = time.perf_counter()
    for i in range(first):
        residency.advance(times[i])
        residency.chat(times[i], int(tenant_of[i]), facts_of[i])
    replay_s = time.perf_counter() - started
    started = time.perf_counter()
    records.write_frames(trace.tenants)
    records.write(sorted(residency.held), cold=True)
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    preload(engine, records, sorted(residency.held), trace.k)
    preload_s = time.perf_counter() - started
    samples, batches, served, reencodes_before = [], [], [], residency.reencodes
    versions: dict[int, int] = {}  # each tenant's store version at its last request through the engine
    seen = {tenant for tenant, _ in residency.held}  # tenants whose frame the preload injected

    def next_request(i: int) -> tuple[tuple, int, bool, bool]:
        """(the request, how many of its injected facts were first read now from an old record, whether its
        tenant's store changed since the tenant's last request, whether it is the tenant's first request through
        the engine, its frame read from the store): what a request's excess over the model comes from."""
        events = residency.advance(times[i])
        records.drop(events.dropped)
        records.write(events.landed)
        tenant, facts = int(tenant_of[i]), facts_of[i]
        mask = residency.chat(times[i], tenant, facts)
        injected, pasted = facts[mask].tolist(), facts[~mask].tolist()
        # a fact retrieved for the first time still holding the K/V it was written with: its record, old
        fresh = [(tenant, f) for f in injected if (tenant, f) not in records.present]
        records.write(fresh, cold=True)
        version = records.store.version(records.tenant_id(tenant))
        changed = versions.get(tenant, version) != version
        versions[tenant] = version
        new_tenant = tenant not in seen
        seen.add(tenant)
        if i >= first + warm:
            served.append(len(injected))
        return records.request(tenant, injected, pasted, i), len(fresh), changed, new_tenant

    sources: list[dict[str, int]] = []  # each timed request's records by where its load found them
    engine.counts()
    for i in range(first, first + warm + timed):
        request, fresh, changed, new_tenant = next_request(i)
        before = engine.counts()  # outside the timed call: a round trip to the workers
        ms = engine.ask(*request)
        if i >= first + warm:
            samples.append((round(ms, 2), len(request[1].record_ids) - 1, fresh, int(changed), int(new_tenant)))
            sources.append({source: n - before[source] for source, n in engine.counts().items()})
    engine.counts(False)
    ttft = [sample[0] for sample in samples]
    for start in range(first + warm + timed, trace.chats, batch):
        batches.append(engine.ask_many([next_request(i)[0] for i in range(start, min(start + batch, trace.chats))]))
    return {
        "tenants": trace.tenants,
        "p50_ms": statistics.median(ttft),
        "p95_ms": p95(ttft),
        "within_goal": p95(ttft) <= 2 * ref["hbm_ttft_ms"]["p95"],
        "batch_p50_ms": statistics.median(batches),
        "batch_p95_ms": p95(batches),
        "batch_within_goal": p95(batches) <= 2 * ref["hbm_batch_ttft_ms"]["p95"],
        "kv_served_share": float(np.mean(served)) / trace.k,
        "kv_facts_p5": float(np.percentile(served, 5)),
        "kept_kv_gib": residency.kept_bytes / GIB,
        "reencodes_per_1000": 1000 * (residency.reencodes - reencodes_before) / ((warm + 2 * timed) * trace.k),
        "replay_s": round(replay_s, 1),
        "records_write_s": round(write_s, 1),
        "preload_s": round(preload_s, 1),
        # each request timed alone: (TTFT ms, facts injected, of them first read from an old record, its tenant's
        # store changed since the tenant's last request: 1, its tenant's first request through the engine: 1)
        "samples": samples,
        # the same requests' records by where the load found them (arena, cpu: the pinned host tier, disk, store),
        # and what moved meanwhile: records evicted from the arena, tier entries put, host segments page-locked
        "sample_sources": sources,
        "slow_sources": slow_sources(ttft, sources, 2 * ref["hbm_ttft_ms"]["p95"]),
    }


def slow_sources(ttft: list[float], sources: list[dict[str, int]], goal_ms: float) -> dict:
    """Records a request found in each place, averaged over the requests slower than the goal and over the rest:
    which read the slow ones have in common."""
    slow = [row for ms, row in zip(ttft, sources) if ms > goal_ms]
    rest = [row for ms, row in zip(ttft, sources) if ms <= goal_ms]
    return {"slow": len(slow), "slow_mean": mean_counts(slow), "rest_mean": mean_counts(rest)}


def mean_counts(rows: list[dict[str, int]]) -> dict[str, float]:
    """Each source's mean count over `rows` (empty for none)."""
    return {s: round(float(np.mean([row.get(s, 0) for row in rows])), 2) for s in sorted(set().union(*rows))}


def preload(engine: Engine, records: Records, held: list[tuple[int, int]], k: int) -> None:
    """Inject every fact holding K/V once, k at a time (untimed): the tiers as on a node that has served them."""
    by_tenant: dict[int, list[int]] = {}
    for tenant, fact in held:
        by_tenant.setdefault(tenant, []).append(fact)
    for tenant, facts in by_tenant.items():
        for first in range(0, len(facts), k):
            engine.ask(*records.request(tenant, facts[first : first + k], [], first))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        type=Path,
        help="HF config.json of the model shape (default: Llama-3.1-8B shape on a GPU, a tiny Llama on CPU)",
    )
    p.add_argument(
        "--multiples", default=None, help="tenant counts as multiples of what HBM alone holds (default 10,20,40)"
    )
    p.add_argument("--facts", type=int, help="facts per tenant (default 1000; 100 with --quick)")
    p.add_argument("--k", type=int, help="facts per chat (default 50; 10 with --quick)")
    p.add_argument("--arena-gib", type=float, help="device arena (default 40; quick: two tenants' K/V)")
    p.add_argument("--host-gib", type=float, help="pinned host tier (default 48)")
    p.add_argument("--disk-tier-gib", type=float, help="disk tier (default 8)")
    p.add_argument("--node-kv-gib", type=float, help="the node's K/V budget: records on disk (default 32)")
    p.add_argument("--chats", type=int, help="chats replayed per tenant count (default 12,000)")
    p.add_argument("--warm", type=int, help="chats through the engine before timing (default 400)")
    p.add_argument("--timed", type=int, help="timed chats, alone and again in batches (default 600)")
    p.add_argument("--batch", type=int, help="requests sent together in the batched part (default 16; 4 with --quick)")
    p.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--pin-host-lazily",
        action="store_true",
        help="page-lock the host tier 256 MiB at a time as spills need it (as before 2026-12-07), not all as the "
        "engine starts (`tiers.pin_host_at_start`)",
    )
    p.add_argument(
        "--arena-precision",
        default="dense",
        choices=["dense", "int8"],
        help="how the device arena holds records: values, or int8 codes with each page's scales (~1.6x the facts; "
        "'HBM alone' then counts the tenants such an arena holds)",
    )
    p.add_argument(
        "--record-precision",
        default="dense",
        choices=list(PRECISIONS),
        help="how the record store holds records: values in --record-dtype, or int8 codes of them (half the "
        "bytes of bf16: the node's disk budget holds twice the facts with K/V; the arena still holds values)",
    )
    args = p.parse_args()
    engine_shape_defaults(args, CONFIGS)
    quick = args.quick
    facts, k = args.facts or (100 if quick else 1000), args.k or (10 if quick else 50)
    multiples = [int(m) for m in (args.multiples or ("10,20" if quick else "10,20,40")).split(",")]
    args.chats = args.chats or (3000 if quick else 12_000)
    args.warm, args.timed = args.warm or (20 if quick else 400), args.timed or (60 if quick else 600)
    args.batch = args.batch or (4 if quick else 16)
    path, config, fingerprint = shape_folder(args.config)
    record_dtype = getattr(torch, args.record_dtype)
    work = Path(scratch_dir(prefix="tenants-gpu-"))
    probe = Records(work / "probe", config, fingerprint, record_dtype, 1, 1, args.record_precision)
    tenant_bytes = facts * probe.arena_fact_bytes[args.arena_precision]  # HBM alone: tenants the arena holds
    if quick:  # HBM alone holds two tenants; the disk budget four tenants' K/V; the host tier half of that
        args.arena_gib = args.arena_gib or 2 * tenant_bytes / GIB
        args.node_kv_gib = args.node_kv_gib or 4 * tenant_bytes / GIB
    args.arena_gib, args.host_gib = args.arena_gib or 40.0, args.host_gib or (2 * tenant_bytes / GIB if quick else 48.0)
    args.disk_tier_gib, args.node_kv_gib = (
        args.disk_tier_gib or (tenant_bytes / GIB if quick else 8.0),
        args.node_kv_gib or 32.0,
    )
    hbm_alone = max(1, int(args.arena_gib * GIB // tenant_bytes))
    most = max(multiples) * hbm_alone
    store_root = work / "facts"
    records = Records(store_root, config, fingerprint, record_dtype, most, facts, args.record_precision)
    engine = Engine(args, path, store_root, fingerprint, work)
    ref = reference(engine, records, k, 6 if quick else 20, args.batch)
    goal = 2 * ref["hbm_ttft_ms"]["p95"]
    print(f"HBM alone holds {hbm_alone} tenants; HBM TTFT {ref}", flush=True)
    rows: list[dict] = []
    for multiple in multiples:
        shutil.rmtree(store_root, ignore_errors=True)
        records.run = f"n{multiple}"
        trace = ZipfTrace(tenants=multiple * hbm_alone, facts=facts, k=k, chats=args.chats, rate_per_s=RATE_PER_S)
        row = run_tenants(engine, records, trace, args, ref) | {"over_hbm_alone": multiple}
        rows.append(row)
        print(row, flush=True)
        report(args, rows, ref, goal, hbm_alone, probe.fact_bytes, records, engine, facts, k)  # each count as it ends


def passing(rows: list[dict], key: str) -> int:
    """The largest tenant count measured within the goal (`key`), every smaller one too (0: none)."""
    measured = 0
    for row in rows:
        if not row[key]:
            break
        measured = row["tenants"]
    return measured


def report(args, rows, ref, goal, hbm_alone, fact_bytes, records, engine, facts, k) -> None:
    measured, loaded = passing(rows, "within_goal"), passing(rows, "batch_within_goal")
    hbm, pasted = ref["hbm_ttft_ms"]["p50"], ref["pasted_ttft_ms"]["p50"]
    write_report(
        args.out,
        {
            "benchmark": "tenants_per_gpu",
            "quick": args.quick,
            "gpu": torch.cuda.is_available(),
            "model": str(args.config),
            "engine_dtype": args.dtype,
            "record_dtype": args.record_dtype,
            "record_precision": args.record_precision,
            "arena_precision": args.arena_precision,
            "host_pinned_at_start": not args.pin_host_lazily,
            "facts_per_tenant": facts,
            "k": k,
            "fact_tokens": FACT_TOKENS,
            "fact_bytes": fact_bytes,
            "chats": args.chats,
            "rate_per_s": RATE_PER_S,
            "timed": args.timed,
            "warm": args.warm,
            "budgets_gib": {
                "arena": args.arena_gib,
                "host": args.host_gib,
                "disk_tier": args.disk_tier_gib,
                "node_kv": args.node_kv_gib,
            },
            "tenants_hbm_alone": hbm_alone,
            "reference": ref,
            "paste_ms_per_token": (pasted - hbm) / (k * FACT_TOKENS),
            "goal_p95_ms": goal,
            "runs": rows,
            "preloaded": True,
            "written_with_kv": True,
            "measured_tenants": measured,
            "measured_tenants_batched": loaded,
            "batch": args.batch,
            "records_written": records.written,
            "fallbacks": engine.fallbacks,
            "targets": [
                target("tenants served at p95 <= 2x the HBM TTFT, over HBM alone", measured / hbm_alone, ">= 10"),
                target(
                    f"the same, {args.batch} requests sent together (p95 <= 2x theirs with all in HBM)",
                    loaded / hbm_alone,
                    ">= 10",
                ),
                target("injection fallbacks", float(engine.fallbacks), "<= 0"),
            ],
        },
    )


if __name__ == "__main__":
    main()
