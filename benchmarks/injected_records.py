"""TTFT of injecting the same tokens as many small records or as a few large ones, against injecting nothing.

History mode injects a question's chosen part of a history as ~126 chunk records of 16 tokens (a 2k-token budget),
where a fact set is ~50 records of 30: on the H200 (8B shape, 2026-12-04) the engine took 29.8 ms to the first
token of a history chat against 14.3 with no memory, ~15 ms for 2k injected tokens, where 50 facts (1.5k tokens)
cost ~1 ms. This tells a per-record cost from a per-token one: one engine (`--config` shape with dummy weights on
a GPU, the bundled model on the CPU), records of random K/V already resident in the device arena (a warm pass),
then one request at a time (`max_tokens=1`, the variants interleaved, median TTFT) injecting `--tokens` tokens as
records of each size in `--sizes`, a request with no memory (the same query, the same prefix record only), and the
ceiling injection is held to: the same number of tokens pasted as text and served by vLLM's own prefix cache (asked
once untimed, then again: `cached`). Every request begins with a prefix record of its own (all resident), so the
prefix cache never holds an injected request's blocks, however small its size's pool (two records of 2,016).
`inject_over_cached_ms`: what injecting costs the engine above a prefix hit on the same number of tokens, by
record size (history mode's 2k-token budget is ~128 records of 16). With `--profile`, each variant's requests run
again in a block of their own under vLLM's torch profiler (`device_profile`: device time a request by kernel, and
every variant against each before it), which tells the GPU's share of that cost from the host's.

    python benchmarks/injected_records.py --out PATH [--quick] [--config SHAPE] [--tokens N] [--sizes 16,32,...]
        [--profile]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, sampled, scratch_dir, target, write_report  # noqa: E402
from benchmarks._engine_profile import offline_blocks, profiler_config  # noqa: E402
from benchmarks.ttft_vs_k import model_source  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.record import EncodingParams, FactKV, dtype_name  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

PREFIX_TOKENS, QUERY_TOKENS = 24, 16
TENANT = "bench"
POOL_TOKENS = 2  # each size's pool holds this many requests' worth of tokens (requests draw different records)


def fill_pools(
    store: LocalFactStore,
    config: dict,
    fingerprint: str,
    dtype: torch.dtype,
    sizes: list[int],
    tokens: int,
    prefixes: int = 1,
) -> dict[str, list[int]]:
    """`prefixes` prefix records (`prefix-0` ...) and, for each size, a pool of records of that many random tokens
    with random K/V."""
    rope = RopeConfig.from_hf_config(config)
    layers, heads = config["num_hidden_layers"], config.get("num_key_value_heads") or config["num_attention_heads"]
    params = EncodingParams(window=0, model_fingerprint=fingerprint, rope=rope, dtype=dtype_name(dtype))
    rng = random.Random(0)
    ids: dict[str, list[int]] = {}
    wanted = [(f"prefix-{i}", PREFIX_TOKENS) for i in range(prefixes)]
    for size in sizes:
        wanted += [(f"s{size}-{i}", size) for i in range(POOL_TOKENS * tokens // size)]
    records = []
    for record_id, count in wanted:
        tokens_of = [rng.randrange(100, config["vocab_size"] - 1) for _ in range(count)]
        shape = (layers, heads, count, rope.head_dim)
        k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        records.append(FactKV(TENANT, record_id, tuple(tokens_of), k, v, params))
        ids[record_id] = tokens_of
        if len(records) == 64:
            store.put_many(records)
            records = []
    store.put_many(records)
    return ids


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to run with dummy weights")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="the engine's (default: bf16 on a GPU)"
    )
    p.add_argument("--record-dtype", choices=["float32", "bfloat16"], default=None, help="default: the engine's")
    p.add_argument("--tokens", type=int, help="injected tokens a request (default 2016; --quick 512)")
    p.add_argument("--sizes", help="record sizes in tokens, comma separated (default 16, 32, tokens / 16, tokens)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 31; --quick 7)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each variant's block of requests under vLLM's torch profiler: device time by kernel",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="with --profile: Python stacks in the trace too (host time by function; slows the profiled requests)",
    )
    args = p.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process may touch CUDA first
    gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    tokens = args.tokens or (512 if args.quick else 2016)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else sorted({16, 32, tokens // 16, tokens})
    if any(tokens % s for s in sizes):
        raise SystemExit(f"every size must divide --tokens {tokens}: {sizes}")
    repeats = args.repeats or (7 if args.quick else 31)

    from vllm import SamplingParams

    from config.connector import ConnectorConfig
    from deployments.vllm_adapter.engine import build_llm, memory_request

    path, config, fingerprint, engine_kwargs = model_source(args)
    store = LocalFactStore(Path(scratch_dir(prefix="records-")))
    record_dtype = getattr(torch, args.record_dtype or args.dtype)
    sampling = bool(os.environ.get("INFERSCALE_SAMPLE_DIR"))
    blocks_of = sampling + args.profile  # each variant's requests again in a block of their own, per use
    asks = (POOL_TOKENS + (repeats + 2 + blocks_of * repeats)) * (len(sizes) + 1)  # requests with a prefix record
    ids = fill_pools(store, config, fingerprint, record_dtype, sizes, tokens, prefixes=asks)
    prefix_ids = tuple(f"prefix-{i}" for i in range(asks))
    unused = iter(prefix_ids)  # one a request: no two share their first block
    version = store.version(TENANT)
    engine_kwargs |= (
        {"gpu_memory_utilization": 0.6} if gpu else {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
    )
    connector = ConnectorConfig(store_root=store.root, fingerprint=fingerprint, device_cache_bytes=8 << 30)
    engine_kwargs["enable_prefix_caching"] = True  # the `cached` reference; injected requests draw fresh orders
    if args.profile:
        engine_kwargs["profiler_config"] = profiler_config(
            Path(scratch_dir(prefix="profile-")), with_stack=args.profile_stack
        )
    llm = build_llm(path, connector, dtype=args.dtype, max_model_len=tokens + 1024, seed=0, **engine_kwargs)
    rng = random.Random(1)
    pools = {size: [r for r in ids if r.startswith(f"s{size}-")] for size in sizes}

    def request(size: int | None, records: list[str] | None = None, prefixes: tuple[str, ...] = ()):
        chosen = [] if size is None else records or rng.sample(pools[size], tokens // size)
        query = [rng.randrange(100, config["vocab_size"] - 1) for _ in range(QUERY_TOKENS)]
        head = prefixes or (next(unused),)
        prompt = [t for r in (*head, *chosen) for t in ids[r]] + query
        plan = MemoryPlan(TENANT, (*head, *chosen), version)
        return memory_request(prompt, plan, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))

    def pasted() -> tuple[list[int], SamplingParams]:
        """`tokens` random tokens as text after a prefix, then a query: no records, no plan."""
        text = [rng.randrange(100, config["vocab_size"] - 1) for _ in range(tokens + QUERY_TOKENS)]
        return memory_request(
            ids["prefix-0"] + text, None, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        )

    for first in range(0, asks, 32):  # warm: every prefix record resident in the arena, 32 a request
        llm.generate(*request(None, prefixes=prefix_ids[first : first + 32]), use_tqdm=False)
    for size in sizes:  # and every record of every pool
        pool = pools[size]
        for first in range(0, len(pool), tokens // size):
            llm.generate(*request(size, pool[first : first + tokens // size]), use_tqdm=False)

    variants: list[int | str | None] = [None, *sizes, "cached"]
    times: dict[int | str | None, list[float]] = {v: [] for v in variants}
    fallbacks, cached_tokens = 0, []
    for repeat in range(repeats + 2):
        for size in variants:
            if size == "cached":
                prompt, params = pasted()
                llm.generate([prompt], params, use_tqdm=False)  # fills vLLM's prefix cache with it
            else:
                prompt, params = request(size)
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            elapsed = (time.perf_counter() - start) * 1000
            report = (out.kv_transfer_params or {}).get("inferscale") or {}
            fallbacks += bool(report.get("fallback"))
            if repeat >= 2:
                times[size].append(elapsed)
                if size == "cached":
                    cached_tokens.append(out.num_cached_tokens or 0)
    names = {None: "none", "cached": "cached", **{s: f"{tokens // s}x{s}" for s in sizes}}

    def block_of(size: int | str | None) -> list:
        """`repeats` requests of a variant, the cached one's already in vLLM's prefix cache."""
        block = [pasted() if size == "cached" else request(size) for _ in range(repeats)]
        if size == "cached":
            llm.generate([b[0] for b in block], [b[1] for b in block], use_tqdm=False)
        return block

    if sampling:  # stacks per variant, a block each (the timing above interleaves)
        for size in variants:
            block = block_of(size)
            with sampled(names[size]):
                for prompt, params in block:
                    llm.generate([prompt], params, use_tqdm=False)
    profile: dict = {}
    if args.profile:  # device and host time per variant, a block each in one profiling window
        profiled = offline_blocks(llm, engine_kwargs["profiler_config"])
        with profiled.window():
            for size in variants:
                block = block_of(size)
                with profiled.block(names[size], len(block)):
                    for prompt, params in block:
                        llm.generate([prompt], params, use_tqdm=False)
        profile = profiled.reports()  # on a CPU: the engine's operators instead of kernels
    ttft = {names[v]: statistics.median(t) for v, t in times.items()}
    for name, ms in ttft.items():
        print(f"{name:>10}: {ms:8.2f} ms", flush=True)
    smallest, whole = f"{tokens // min(sizes)}x{min(sizes)}", f"{tokens // max(sizes)}x{max(sizes)}"
    extra = {name: ms - ttft["none"] for name, ms in ttft.items() if name != "none"}
    over_cached = {names[s]: ttft[names[s]] - ttft["cached"] for s in sizes}
    write_report(
        args.out,
        {
            "benchmark": "injected_records",
            "quick": args.quick,
            "gpu": gpu,
            "dtype": args.dtype,
            "record_dtype": dtype_name(record_dtype),
            "model": str(args.config) if args.config else path,
            "tokens": tokens,
            "ttft_ms": ttft,
            "extra_over_none_ms": extra,
            "inject_over_cached_ms": over_cached,
            "cached_tokens_mean": statistics.mean(cached_tokens) if cached_tokens else 0.0,
            "per_record_ms": (extra[smallest] - extra[whole]) / (tokens // min(sizes) - tokens // max(sizes))
            if smallest != whole
            else None,
            "fallbacks": fallbacks,
            **profile,
            "targets": [
                target(f"TTFT {smallest} / {whole} records (same tokens)", ttft[smallest] / ttft[whole], "<= 1.1"),
                target(
                    f"TTFT {smallest} records / the same tokens from vLLM's prefix cache",
                    ttft[smallest] / ttft["cached"],
                    "<= 1.1",
                ),
                target("injection fallbacks", float(fallbacks), "<= 0"),
            ],
        },
    )


if __name__ == "__main__":
    main()
