"""TTFT with a request's facts held in each offload tier (device arena, pinned host, disk) against copy floors.

One process, real vLLM engines with the inferscale connector, prefix caching off (every request injects).
Each engine's device arena holds the frame and exactly one set of k facts, so asking sets A, A, B, B, ...
alternates: the first ask of a set streams it from the lower tier (the other set's promotion pushed it
there), the second finds it in the arena. Engine "host" keeps spills in (pinned) host memory, engine
"disk" in its replica slot's files, whose page cache is dropped before every cold ask. Floors, in the same
run: one host->device copy of the set's bytes as the host tier stores them (int8 + scales), and one cold
read of the set's tier files. Targets: the extra TTFT of a tier over the arena within 1.3x its floor.
Capacity: a measured p95 of random traffic over tenants whose facts exceed the arena 10x (host tier on),
and tenants (1,000 facts each) per device derived from the measured per-tier p95 and the stated budgets.
Records hold random K/V (the tests prove values); `--config` picks the model shape (dummy weights).
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import engine_shape_defaults, parser, scratch_dir, shape_folder, sync, target, write_report  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.quantize import quantize  # noqa: E402
from kvcore.record import EncodingParams, FactKV, dtype_name  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

FACT_TOKENS, PREFIX_TOKENS, QUERY_TOKENS, PAGE = 30, 24, 16, 16
CONFIGS = Path(__file__).resolve().parent / "configs"


class Facts:
    """Records of random tokens and K/V: a frame ("prefix") and `count` facts per tenant."""

    def __init__(self, store: LocalFactStore, config: dict, fingerprint: str, dtype: torch.dtype) -> None:
        self.store, self.config, self.dtype = store, config, dtype
        rope = RopeConfig.from_hf_config(config)
        self.layers = config["num_hidden_layers"]
        self.heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        self.head_dim = rope.head_dim
        self.params = EncodingParams(window=0, model_fingerprint=fingerprint, rope=rope, dtype=dtype_name(dtype))
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.rng = random.Random(0)

    def add_tenant(self, tenant: str, count: int) -> list[str]:
        ids = []
        for i in range(count + 1):
            fact_id, n = ("prefix", PREFIX_TOKENS) if i == 0 else (f"f{i}", FACT_TOKENS)
            token_ids = tuple(self.rng.randrange(100, self.config["vocab_size"] - 1) for _ in range(n))
            shape = (self.layers, self.heads, n, self.head_dim)
            self.store.put(
                FactKV(
                    tenant,
                    fact_id,
                    token_ids,
                    torch.randn(shape).to(self.dtype),
                    torch.randn(shape).to(self.dtype),
                    self.params,
                )
            )
            self.tokens[tenant, fact_id] = list(token_ids)
            ids += [fact_id] if i else []
        return ids

    @property
    def token_bytes(self) -> int:
        return self.layers * self.heads * self.head_dim * 2 * torch.empty((), dtype=self.dtype).element_size()

    def lower_tier_bytes(self) -> int:
        """One fact's K and V as the host tier and disk keep them (int8 codes and float32 scales)."""
        k = torch.randn(self.layers, self.heads, FACT_TOKENS, self.head_dim)
        return 2 * quantize(k).nbytes


def drop_page_cache(root: Path) -> int:
    """Evict every tier file under `root` from the page cache (clean pages: no privilege needed)."""
    total = 0
    for path in root.rglob("*.kv"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def read_floor(root: Path, repeats: int, records: set[str]) -> tuple[float, int]:
    """Median seconds to read the tier files of `records` under `root` cold (one after another), and their bytes."""
    paths = sorted(p for p in root.rglob("*.kv") if p.name.split("__", 1)[-1].rsplit(".", 2)[0] in records)
    times, size = [], 0
    for _ in range(repeats):
        drop_page_cache(root)
        start = time.perf_counter()
        size = 0
        for path in paths:
            with open(path, "rb", buffering=0) as handle:
                size += len(handle.read())
        times.append(time.perf_counter() - start)
    return statistics.median(times), size


def copy_floor(nbytes: int, repeats: int) -> float:
    """Median seconds of one host->device copy of `nbytes` from pinned memory (a memcpy on a CPU-only run)."""
    gpu = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8)
    src = src.pin_memory() if gpu else src
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if gpu else "cpu")
    times = []
    for _ in range(repeats + 2):
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


class Bench:
    """One engine per tier configuration, timed on the same facts and requests."""

    def __init__(self, args, path: str, facts: Facts, fingerprint: str, engine_kwargs: dict) -> None:
        self.args, self.path, self.facts, self.fingerprint, self.engine_kwargs = (
            args,
            path,
            facts,
            fingerprint,
            engine_kwargs,
        )
        self.rng = random.Random(1)
        self.fallbacks = 0

    def engine(self, arena_bytes: int, host_bytes: int, disk_root: Path):
        from config.connector import ConnectorConfig, TierConfig
        from deployments.vllm_adapter.engine import build_llm

        connector = ConnectorConfig(
            store_root=self.facts.store.root,
            fingerprint=self.fingerprint,
            device_cache_bytes=arena_bytes,
            tiers=TierConfig(disk_cache_dir=disk_root, host_cache_bytes=host_bytes, compress_lower=True),
        )
        return build_llm(
            self.path,
            connector,
            dtype=self.args.dtype,
            seed=0,
            max_model_len=4096,
            enable_prefix_caching=False,
            **self.engine_kwargs,
        )

    def ask(self, llm, tenant: str, chosen: list[str]) -> float:
        """TTFT (seconds) of one request injecting `chosen` (the frame first)."""
        from vllm import SamplingParams

        from deployments.vllm_adapter.engine import memory_request

        tokens, vocab = self.facts.tokens, self.facts.config["vocab_size"]
        query = [self.rng.randrange(100, vocab - 1) for _ in range(QUERY_TOKENS)]
        prompt_ids = tokens[tenant, "prefix"] + [t for f in chosen for t in tokens[tenant, f]] + query
        plan = MemoryPlan(tenant, ("prefix", *chosen), self.facts.store.version(tenant))
        prompt, params = memory_request(prompt_ids, plan, SamplingParams(max_tokens=1, detokenize=False))
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        report = (out.kv_transfer_params or {}).get("inferscale") or {}
        if report.get("fallback") or report.get("injected_tokens", 0) < len(prompt_ids) - QUERY_TOKENS:
            self.fallbacks += 1
        return elapsed

    def alternate(
        self, llm, tenant: str, sets: list[list[str]], repeats: int, before_lower=None
    ) -> tuple[list[float], list[float]]:
        """Ask each set twice in turn: the first ask streams from the lower tier, the second hits the arena."""
        for _ in range(2):  # warm-up: the sets reach their places
            for chosen in sets:
                self.ask(llm, tenant, chosen)
        lower, arena = [], []
        for _ in range(repeats):
            for chosen in sets:
                if before_lower is not None:
                    before_lower()
                lower.append(self.ask(llm, tenant, chosen))
                arena.append(self.ask(llm, tenant, chosen))
        return lower, arena

    def random_traffic(self, llm, tenants: dict[str, list[str]], k: int, requests: int) -> list[float]:
        names = sorted(tenants)
        for name in names:  # every tenant's facts have been served once (and spilled since)
            for first in range(0, len(tenants[name]), k):
                self.ask(llm, name, tenants[name][first : first + k])
        return [
            self.ask(llm, name, self.rng.sample(tenants[name], k))
            for name in (self.rng.choice(names) for _ in range(requests))
        ]


def release(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def prepare(args, k: int, work: Path) -> tuple[Bench, list[list[str]], int]:
    """The bench (engines of `args.config` with dummy weights), two sets of k facts of tenant "bench", and an
    arena that holds the frame and exactly one set."""
    path, config, fingerprint = shape_folder(args.config)
    facts = Facts(LocalFactStore(work / "facts"), config, fingerprint, getattr(torch, args.dtype))
    fact_ids = facts.add_tenant("bench", 2 * k)
    pages = -(-PREFIX_TOKENS // PAGE) + k * -(-FACT_TOKENS // PAGE) + 1  # the frame and one set, one spare page
    arena_bytes = pages * PAGE * facts.token_bytes
    engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True}
    engine_kwargs.update(
        {"gpu_memory_utilization": 0.35}
        if torch.cuda.is_available()
        else {"enforce_eager": True, "kv_cache_memory_bytes": max(256 << 20, 4 * arena_bytes)}
    )
    return Bench(args, path, facts, fingerprint, engine_kwargs), [fact_ids[:k], fact_ids[k:]], arena_bytes


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        type=Path,
        help="HF config.json of the model shape (default: Llama-3.1-8B on a GPU, a tiny Llama on CPU)",
    )
    p.add_argument("--k", type=int, help="facts per request (default 50; 20 with --quick)")
    p.add_argument(
        "--hbm-budget-gib", type=float, default=40.0, help="device memory given to the arena (capacity model)"
    )
    p.add_argument("--host-budget-gib", type=float, default=64.0, help="pinned host memory for the host tier")
    p.add_argument("--disk-budget-gib", type=float, default=48.0, help="disk for the disk tier")
    p.add_argument("--repeats", type=int, help="asks of each set per tier (default 15; 4 with --quick)")
    p.add_argument("--traffic", type=int, help="requests of the random traffic (default 200; 24 with --quick)")
    args = p.parse_args()
    gpu = engine_shape_defaults(args, CONFIGS)
    k = args.k or (20 if args.quick else 50)
    repeats, traffic, overflow = (4, 24, 10) if args.quick else (15, 200, 10)
    repeats, traffic = args.repeats or repeats, args.traffic or traffic
    work = Path(scratch_dir(prefix="offload-"))
    bench, sets, arena_bytes = prepare(args, k, work)
    facts = bench.facts
    set_lower_bytes = k * facts.lower_tier_bytes()

    # ---- host tier (and the arena) ----
    host_root = work / "tiers-host"
    llm = bench.engine(arena_bytes, 8 << 30, host_root)
    host, arena = bench.alternate(llm, "bench", sets, repeats)
    host_files = len(list(host_root.rglob("*.kv")))
    overflow_tenants = {f"o{i}": facts.add_tenant(f"o{i}", k) for i in range(overflow)}  # overflow x the arena's sets
    mixed = bench.random_traffic(llm, overflow_tenants, k, traffic)
    release(llm)

    # ---- disk tier, cold page cache ----
    disk_root = work / "tiers-disk"
    llm = bench.engine(arena_bytes, 0, disk_root)
    disk, arena_2 = bench.alternate(llm, "bench", sets, repeats, before_lower=lambda: drop_page_cache(disk_root))
    release(llm)
    disk_floor, disk_bytes = read_floor(disk_root, 5, set(sets[0]))  # a set, as one cold ask reads it
    pcie_floor = copy_floor(set_lower_bytes, 20)

    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    hbm_ms, host_ms, disk_ms = ms(arena + arena_2), ms(host), ms(disk)
    hbm_p95 = p95(arena + arena_2) * 1e3
    tiers = {
        "hbm": {"ttft_ms": hbm_ms, "p95_ms": hbm_p95},
        "host": {"ttft_ms": host_ms, "p95_ms": p95(host) * 1e3, "floor_ms": pcie_floor * 1e3, "bytes": set_lower_bytes},
        "disk": {"ttft_ms": disk_ms, "p95_ms": p95(disk) * 1e3, "floor_ms": disk_floor * 1e3, "bytes": disk_bytes},
    }
    for name, row in tiers.items():
        print(
            f"{name:>4}: TTFT {row['ttft_ms']:8.2f} ms (p95 {row['p95_ms']:8.2f})"
            + (f"   floor {row['floor_ms']:7.2f} ms for {row['bytes'] / 2**20:.1f} MiB" if "floor_ms" in row else ""),
            flush=True,
        )

    # capacity: tenants of 1,000 facts per device; a lower tier counts where its measured p95 is within 2x the arena's
    tenant_full = 1000 * FACT_TOKENS * facts.token_bytes
    tenant_lower = 1000 * facts.lower_tier_bytes()
    gib = 2**30
    without = int(args.hbm_budget_gib * gib // tenant_full)
    counted = {name: tiers[name]["p95_ms"] <= 2 * hbm_p95 for name in ("host", "disk")}
    with_tier = without + sum(
        int(budget * gib // tenant_lower)
        for name, budget in (("host", args.host_budget_gib), ("disk", args.disk_budget_gib))
        if counted[name]
    )
    mixed_p95 = p95(mixed) * 1e3
    print(
        f"random traffic over {overflow}x the arena: p95 {mixed_p95:.2f} ms (arena p95 {hbm_p95:.2f} ms); "
        f"tenants per device: {without} without the tier, {with_tier} with it",
        flush=True,
    )

    targets = [
        target("host_extra_ttft_over_pcie_floor", (host_ms - hbm_ms) / max(pcie_floor * 1e3, 1e-6), "<= 1.3"),
        target("disk_extra_ttft_over_disk_floor", (disk_ms - hbm_ms) / max(disk_floor * 1e3, 1e-6), "<= 1.3"),
        target(f"p95_ttft_at_{overflow}x_arena_over_arena_p95", mixed_p95 / hbm_p95, "<= 2"),
        target("tenants_per_device_with_over_without_tier", with_tier / max(without, 1), ">= 10"),
        target("injection_fallbacks", float(bench.fallbacks), "<= 0"),
    ]
    write_report(
        args.out,
        {
            "benchmark": "offload_tiers",
            "quick": args.quick,
            "gpu": gpu,
            "dtype": args.dtype,
            "model": str(args.config),
            "k": k,
            "fact_tokens": FACT_TOKENS,
            "arena_bytes": arena_bytes,
            "repeats": repeats,
            "tiers": tiers,
            "host_tier_files_on_disk": host_files,
            "random_traffic": {"tenants": overflow, "requests": traffic, "p50_ms": ms(mixed), "p95_ms": mixed_p95},
            "capacity": {
                "model": "derived: per-device budgets / tenant bytes, a lower tier counted where its measured p95 "
                "TTFT is within 2x the arena's",
                "facts_per_tenant": 1000,
                "tenant_bytes_full": tenant_full,
                "tenant_bytes_lower": tenant_lower,
                "budgets_gib": {"hbm": args.hbm_budget_gib, "host": args.host_budget_gib, "disk": args.disk_budget_gib},
                "tiers_counted": counted,
                "tenants_without_tier": without,
                "tenants_with_tier": with_tier,
            },
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
