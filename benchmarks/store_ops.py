"""Latency of the tenant store: insert, search (k=50) and delete, for one big tenant and for many small ones.

Real redis-server (started here), real MiniLM embeddings, FAISS. Two layouts side by side in one
process: one tenant with 10k facts, and 1,000 tenants with 100 facts each (`--quick`: 2,000 facts,
and 100 tenants x 20). Bulk loading uses batched inserts; the measured operations are single calls
as the API makes them, on random tenants and facts. Percentiles in milliseconds.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402
from cluster.redis_server import LocalRedis  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402
from models.minilm import MiniLMEmbedder  # noqa: E402
from tenants.index_sync import TenantIndexes  # noqa: E402
from tenants.redis_meta import RedisMeta  # noqa: E402
from tenants.service import TenantService  # noqa: E402

TOPICS = ["cooking", "travel", "music", "health", "work", "family", "sports", "books", "pets", "money"]


def fact_text(rng: random.Random, i: int) -> str:
    return f"The user said their {rng.choice(TOPICS)} note number {i} is about {rng.choice(TOPICS)} and {rng.randrange(10**6)}."


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(v * 1e3 for v in values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(ordered), "n": len(ordered)}


def measure(service: TenantService, keys: list[str], samples: int, rng: random.Random) -> dict[str, dict]:
    tenants = [service.authenticate(k) for k in keys]
    for tenant in tenants[: min(len(tenants), 50)]:
        tenant.search("warm up the index", k=5)  # first search loads the tenant's index
    times = {"insert": [], "search_k50": [], "delete": []}
    for i in range(samples):
        tenant = rng.choice(tenants)
        start = time.perf_counter()
        fact = tenant.add_fact(fact_text(rng, 10**7 + i))
        times["insert"].append(time.perf_counter() - start)
        start = time.perf_counter()
        hits = tenant.search(f"what did the user say about {rng.choice(TOPICS)}", k=50)
        times["search_k50"].append(time.perf_counter() - start)
        assert len(hits) == min(50, tenant.usage()["facts"])
        start = time.perf_counter()
        tenant.delete_fact(fact.id)
        times["delete"].append(time.perf_counter() - start)
    return {name: percentiles(values) for name, values in times.items()}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    big, many, each, samples = (2_000, 100, 20, 100) if args.quick else (10_000, 1_000, 100, 300)
    rng = random.Random(0)
    folder = Path(scratch_dir(prefix="store-ops-"))
    server = LocalRedis(folder / "redis").start()
    try:
        meta = RedisMeta(server.url)
        embedder = MiniLMEmbedder(batch_size=128)
        service = TenantService(
            meta, LocalFactStore(folder / "records"), embedder, TenantIndexes(meta, embedder.dim, folder / "indexes")
        )
        admin = service.ensure_admin_key()
        start = time.perf_counter()
        big_key = service.create_tenant(admin, "big")[1]
        big_tenant = service.authenticate(big_key)
        for first in range(0, big, 1000):
            big_tenant.add_facts([fact_text(rng, i) for i in range(first, min(big, first + 1000))])
        small_keys = [service.create_tenant(admin, f"t{i:04d}")[1] for i in range(many)]
        for key in small_keys:
            service.authenticate(key).add_facts([fact_text(rng, i) for i in range(each)])
        load_s = time.perf_counter() - start
        print(f"loaded {big} + {many}x{each} facts in {load_s:.0f} s", flush=True)
        one = measure(service, [big_key], samples, rng)
        spread = measure(service, small_keys, samples, rng)
    finally:
        server.stop()
    for label, result in (("1 tenant", one), (f"{many} tenants", spread)):
        print(
            label,
            {k: round(v["p50"], 2) for k, v in result.items()},
            "p99",
            {k: round(v["p99"], 2) for k, v in result.items()},
        )
    targets = [
        target("search_k50_p99_ms_one_tenant", one["search_k50"]["p99"], "<= 50"),
        target("insert_p99_ms_one_tenant", one["insert"]["p99"], "<= 50"),
        target("delete_p99_ms_one_tenant", one["delete"]["p99"], "<= 10"),
        target("search_p50_many_over_one_tenant", spread["search_k50"]["p50"] / one["search_k50"]["p50"], "<= 1.5"),
    ]
    write_report(
        args.out,
        {
            "benchmark": "store_ops",
            "quick": args.quick,
            "facts_one_tenant": big,
            "tenants": many,
            "facts_each": each,
            "samples": samples,
            "load_s": load_s,
            "one_tenant": one,
            "many_tenants": spread,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
