"""What one chat's lower-tier and store records cost the connector's worker, case by case, on the real code path.

`tenants_per_gpu.py` fits a chat's TTFT over where its records were found: on an H100 (int8 records, 2026-12-07)
a host-tier record cost ~0.8 ms more than an arena record and a record read from the fact store ~9 ms, while the
host tier's own profile (`profile_tiers.py`, whose evictions are free) put a host-tier record at ~0.16 ms. This
drives the real `InjectionScheduler` and `InjectionWorker` (a `TieredStore` page-locked at start, a
`LocalFactStore` of the Llama-3.1-8B shape's records, the Triton kernels on a GPU) through the cases a chat of
that run meets, each timed alone with the device waited for, then profiled:
  arena        every record resident in the device arena;
  host+spill   `--host` records from the pinned host tier, each evicting an arena record the tiers never held,
               so its spill is quantized, copied down and waited for (the tenants run's usual case);
  host+free    the same, the evicted records' tier copies already made (the evictions cost nothing);
  store        `--store` records read from the fact store into the arena, the rest resident (page cache warm, or
               not: `--cold-store`);
  store+host   the same beside `--host` host-tier records (the load goes through the tiers);
  landed+host  the same, the store records written just before the ask by another writer (the tenant's version
               bumped), as the tenants run's re-encodes land.
Not a benchmark with targets: a diagnostic. Needs torch only (no vLLM); `--device cpu` checks it runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import scratch_dir  # noqa: E402
from deployments.triton_adapter import optional_kernel  # noqa: E402
from kvcore.injection import InjectionWorker  # noqa: E402
from kvcore.injection_scheduler import InjectionScheduler  # noqa: E402
from kvcore.paged import PagedLayout  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.record import EncodingParams, FactKV  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402
from kvcore.tiers import TieredStore  # noqa: E402

SHAPE = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "llama31-8b-shape.json"
FINGERPRINT = "p" * 24
TENANT = "t"
BLOCK, FRAME_TOKENS, QUERY_TOKENS = 64, 40, 16


class Bench:
    """The worker, its scheduler, the store and the caches of one device, and the asks that drive them."""

    def __init__(self, args: argparse.Namespace) -> None:
        config = json.loads(SHAPE.read_text())
        self.rope = RopeConfig.from_hf_config(config)
        small = args.device == "cpu" and not args.full_shape  # a CPU check of the code path, not of its costs
        self.layers, self.heads = (2, 2) if small else (config["num_hidden_layers"], config["num_key_value_heads"])
        self.dim, self.k, self.tokens = self.rope.head_dim, args.k, args.fact_tokens
        self.device = torch.device(args.device)
        work = Path(scratch_dir(prefix="tier-loads-"))
        self.store = LocalFactStore(work / "store", precision=args.precision)
        # another writer of the same store, as the encoder is: its records land while the worker serves
        self.writer = LocalFactStore(work / "store", precision=args.precision)
        self._params = EncodingParams(window=0, model_fingerprint=FINGERPRINT, rope=self.rope, dtype="bfloat16")
        gen = torch.Generator().manual_seed(0)
        self._base = {  # one random K/V a length, shared: what is timed does not depend on the values
            n: tuple(torch.randn(self.layers, self.heads, n, self.dim, generator=gen).bfloat16() for _ in range(2))
            for n in (FRAME_TOKENS, self.tokens)
        }
        self.facts = [f"f{i}" for i in range(args.facts)]
        self.store.put(self._record("frame", FRAME_TOKENS, 10))
        for first in range(0, len(self.facts), 64):
            self.store.put_many(
                [
                    self._record(f, self.tokens, 1000 + i * self.tokens)
                    for i, f in enumerate(self.facts[first : first + 64], first)
                ]
            )
        self.version = self.store.version(TENANT)
        self.token_ids = {f: list(self.store.info(TENANT, f).token_ids) for f in ["frame", *self.facts]}
        self.landed = 0
        arena_record = self.layers * self.heads * self.dim * 2 * 2 * -(-self.tokens // 16) * 16  # bf16 pages
        cuda = self.device.type == "cuda"
        self.tiers = TieredStore(
            self.device, args.host_gib << 30, work / "tiers", compress_lower=True, write_behind=True
        )
        self.tiers.reserve_host()
        self.scheduler = InjectionScheduler(self.store, FINGERPRINT)
        self.worker = InjectionWorker(
            self.store,
            FINGERPRINT,
            self.rope,
            device_cache_bytes=(args.arena_records + 2) * arena_record,
            tiers=self.tiers,
            step_writer=optional_kernel("fused_inject", "fused_row_writer") if cuda else None,
            packed_inserter=optional_kernel("packed_insert", "insert_packed_kernel") if cuda else None,
            record_dtype=torch.bfloat16,
        )
        self.blocks = -(-(FRAME_TOKENS + self.k * self.tokens + QUERY_TOKENS) // BLOCK)
        shape = (2, self.blocks, BLOCK, self.heads, self.dim)  # vLLM's flash-attention layout, K and V split
        self.caches = {
            f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16, device=self.device) for i in range(self.layers)
        }
        self.worker.register(self.caches, PagedLayout("kv_split", BLOCK, self.heads, self.dim, kv_dim=0))
        self.asked = 0

    def ask(self, chosen: list[str]) -> float:
        """One chat's injection of the frame and `chosen` (scheduler, then the worker's step with every layer's
        write), the device waited for: ms of the worker's step."""
        self.asked += 1
        request = f"r{self.asked}"
        prompt = [t for f in ["frame", *chosen] for t in self.token_ids[f]] + [7] * QUERY_TOKENS
        params = MemoryPlan(TENANT, ("frame", *chosen), self.version).to_params()
        claimed = self.scheduler.match(request, prompt, params, 0)
        self.scheduler.allocated(request, list(range(self.blocks)), claimed)
        loads = self.scheduler.take_loads()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self.worker.start(loads)
        for name in self.caches:
            self.worker.load_layer(name)
        self.worker.finish_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - started) * 1000
        self.scheduler.finished(request)
        if not all(load.valid for load in loads) or self.worker.take_failed_blocks():
            raise RuntimeError(f"ask {request} failed")
        return ms

    def _record(self, fact_id: str, n: int, first: int) -> FactKV:
        return FactKV(TENANT, fact_id, tuple(range(first, first + n)), *self._base[n], self._params, version=1)

    def land(self, count: int) -> list[str]:
        """`count` new facts written by the other writer now (the tenant's version bumped), as a re-encode lands
        just before the chat that reads it in the tenants run."""
        ids = [f"n{self.landed + i}" for i in range(count)]
        first = 10_000_000 + self.landed * self.tokens
        self.writer.put_many([self._record(f, self.tokens, first + i * self.tokens) for i, f in enumerate(ids)])
        self.landed += count
        self.token_ids.update(
            {f: list(range(first + i * self.tokens, first + (i + 1) * self.tokens)) for i, f in enumerate(ids)}
        )
        self.version = self.writer.version(TENANT)
        return ids

    def evict_from_page_cache(self, fact: str) -> str:
        """Drop the fact's record file from the page cache, so the store reads it from disk."""
        with open(self.store.path(TENANT, fact), "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return fact

    def fill(self, facts: list[str]) -> None:
        for first in range(0, len(facts), self.k):
            part = facts[first : first + self.k]
            self.ask(part)


def run(args: argparse.Namespace) -> dict:
    bench = Bench(args)
    k, h, s, n = args.k, args.host, args.store, args.asks
    arena = args.arena_records
    facts = iter(bench.facts)

    def take(count: int) -> list[str]:  # fresh facts, never asked before
        return [next(facts) for _ in range(count)]

    tiered = take(tiered_count(args))  # asked once, then pushed down to the tiers by the arena's own facts
    resident = take(arena)  # in the arena, never in the tiers
    bench.worker.sources.switch(True)  # as in the tenants run: where each load found its records
    bench.fill(tiered)
    bench.fill(resident)
    hot = resident[-(k - h) :]  # asked in every case: kept most recently used
    cases: dict[str, list[float]] = {}
    profiles: dict[str, str] = {}

    moved: dict[str, dict[str, float]] = {}

    def counts() -> dict[str, int]:
        return {**bench.worker.sources.snapshot(), **bench.worker.tier_counters()}

    def case(name: str, make) -> None:
        before = counts()
        timed = [bench.ask(make()) for _ in range(n)]
        moved[name] = {key: (value - before[key]) / n for key, value in counts().items()}
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            bench.ask(make())
        profiler.disable()
        cases[name] = timed
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(28)
        profiles[name] = text.getvalue()
        print(f"{name:11s} median {statistics.median(timed):7.2f} ms  mean {statistics.mean(timed):7.2f}", flush=True)

    up, recent = iter(tiered), []

    def from_tiers(count: int) -> list[str]:  # facts down in the tiers, brought up by this ask
        recent[:] = [next(up) for _ in range(count)]
        return list(recent)

    case("arena", lambda: resident[-k:])
    case("host+spill", lambda: hot + from_tiers(h))  # victims: the oldest never-tiered facts
    # the victims now: first what is left of the never-tiered facts (an ask's worth of warm-up), then facts brought
    # up from the tiers (their copies kept)
    left = max(0, arena + 2 - len(hot) - 2 * n * h)
    for _ in range(-(-left // h) + 2):
        bench.ask(hot + from_tiers(h))
    case("host+free", lambda: hot + from_tiers(h))
    fresh = iter(bench.facts[len(tiered) + arena :])
    if args.cold_store:
        fresh = (bench.evict_from_page_cache(f) for f in fresh)
    last_up = list(recent)  # the last host ask's, in the arena since
    case("store", lambda: hot + last_up[: h - s] + [next(fresh) for _ in range(s)])
    case("store+host", lambda: hot[s:] + from_tiers(h) + [next(fresh) for _ in range(s)])
    case("landed+host", lambda: hot[s:] + from_tiers(h) + bench.land(s))
    medians = {name: statistics.median(ms) for name, ms in cases.items()}
    base = medians["arena"]
    return {
        "device": str(bench.device),
        "machine": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu",
        "k": k,
        "host_records": h,
        "store_records": s,
        "asks_per_case": n,
        "cold_store": args.cold_store,
        "median_ms": {name: round(m, 3) for name, m in medians.items()},
        "per_record_over_arena_ms": {
            "host+spill": round((medians["host+spill"] - base) / h, 3),
            "host+free": round((medians["host+free"] - base) / h, 3),
            "store": round((medians["store"] - base) / s, 3),
            "landed over store (both beside host records)": round(
                (medians["landed+host"] - medians["store+host"]) / s, 3
            ),
        },
        "per_ask": moved,  # records by where they were found, and evictions, tier entries put, host segments
        "profiles": profiles,
    }


def tiered_count(args: argparse.Namespace) -> int:
    """Facts pushed down to the tiers before the cases: four cases' host reads, and the warm-up between two."""
    return 8 * args.asks * args.host + args.arena_records + 4 * args.host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="int8", choices=["int8", "dense"])
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--host", type=int, default=6, help="host-tier records an ask (the tenants run's p95 chat)")
    p.add_argument("--store", type=int, default=1, help="store records an ask")
    p.add_argument("--asks", type=int, default=20, help="asks a case, timed (and as many profiled)")
    p.add_argument("--fact-tokens", type=int, default=30)
    p.add_argument("--arena-records", type=int, default=400)
    p.add_argument("--host-gib", type=int, default=4)
    p.add_argument("--full-shape", action="store_true", help="the 8B shape's layers and heads on a CPU too")
    p.add_argument("--cold-store", action="store_true", help="store records read from disk, not the page cache")
    p.add_argument("--out", default=None, help="JSON report (with each case's profile)")
    args = p.parse_args()
    args.facts = tiered_count(args) + args.arena_records + 4 * args.asks * args.store
    report = run(args)
    print(json.dumps({key: value for key, value in report.items() if key != "profiles"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
