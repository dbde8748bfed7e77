"""The connector's host work per injected request under a full batch, apart from any device work.

Under 100 concurrent k=50 requests the engine serves injection at ~0.73 of the rate of the same facts from
vLLM's own prefix cache (`ttft_vs_k.py`, H200): ~1.2 ms more per request, and the engine core's stack samples
put much of it in the connector's Python (the scheduler half checking each plan, the worker half indexing every
token of the step). This measures exactly that code, the real `InjectionScheduler` and `InjectionWorker` over a
real `LocalFactStore`, with records of a tiny shape and a writer that does nothing, so what is left is host
work (on a CPU, also the step index's expansion, ~0.04 ms a request, which a GPU runs asynchronously):
per request, the scheduler half (`match` + `allocated`) and the worker half (`start` of one step holding every
request). The plans, prompts and block tables are built before the clock starts, as the frontend builds them.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402
from kvcore.injection import InjectionWorker  # noqa: E402
from kvcore.injection_scheduler import InjectionScheduler  # noqa: E402
from kvcore.paged import PagedLayout  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.record import EncodingParams, FactKV  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

ROPE = RopeConfig(head_dim=8, theta=10000.0)
FINGERPRINT = "f" * 24
BLOCK, LAYERS, HEADS, DIM = 16, 2, 1, 8
PREFIX_TOKENS, QUERY_TOKENS = 24, 16
TENANT = "bench"


def record(fact_id: str, tokens: int, seed: int) -> FactKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, tokens, DIM)
    return FactKV(
        TENANT,
        fact_id,
        tuple(range(100 + seed * 64, 100 + seed * 64 + tokens)),
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen),
        EncodingParams(window=0, model_fingerprint=FINGERPRINT, rope=ROPE, dtype="float32"),
        version=1,
    )


def idle_writer(rows, rope):
    """A fused step writer that writes nothing: the worker takes its fused path, minus the device work."""
    return lambda *tensors: None


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--k", type=int, default=50)
    p.add_argument(
        "--fact-tokens",
        type=int,
        default=30,
        help="tokens a record (a history chat: --requests 1 --k 128 --fact-tokens 16, its chunk records)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the caches and the arena live (cuda: the host's work "
        "beside asynchronous device work, as in the engine)",
    )
    args = p.parse_args()
    steps = 5 if args.quick else max(30, 3000 // args.requests)  # a one-request step is short: more of them
    store = LocalFactStore(Path(scratch_dir(prefix="connector-host-")))
    fact_ids = [f"fact-{i}" for i in range(max(300, 2 * args.k))]
    store.put_many(
        [record("prefix", PREFIX_TOKENS, 999)] + [record(f, args.fact_tokens, i) for i, f in enumerate(fact_ids)]
    )
    version = store.version(TENANT)
    tokens = {r: list(store.info(TENANT, r).token_ids) for r in ["prefix", *fact_ids]}
    scheduler = InjectionScheduler(store, FINGERPRINT)
    worker = InjectionWorker(store, FINGERPRINT, ROPE, device_cache_bytes=64 << 20, step_writer=idle_writer)
    blocks_per_request = -(-(PREFIX_TOKENS + args.k * args.fact_tokens + QUERY_TOKENS) // BLOCK)
    caches = {
        f"layer.{i}": torch.zeros(
            args.requests * blocks_per_request, BLOCK, HEADS, 2 * DIM, device=args.device
        ).permute(0, 2, 1, 3)
        for i in range(LAYERS)
    }
    worker.register(caches, PagedLayout("channels", BLOCK, HEADS, DIM))
    rng = random.Random(0)

    def batch() -> list[tuple[str, list[int], dict, list[int]]]:
        out = []
        for r in range(args.requests):
            chosen = rng.sample(fact_ids, args.k)
            prompt = tokens["prefix"] + [t for f in chosen for t in tokens[f]] + [7] * QUERY_TOKENS
            blocks = list(range(r * blocks_per_request, (r + 1) * blocks_per_request))
            out.append((f"req-{r}", prompt, MemoryPlan(TENANT, ("prefix", *chosen), version).to_params(), blocks))
        return out

    def step() -> tuple[float, float]:
        requests = batch()
        started = time.perf_counter()
        for request_id, prompt, params, blocks in requests:
            claimed = scheduler.match(request_id, prompt, params, 0)
            scheduler.allocated(request_id, blocks, claimed)
        loads = scheduler.take_loads()
        scheduled = time.perf_counter()
        worker.start(loads)
        worker.finish_step()
        done = time.perf_counter()
        for request_id, *_ in requests:
            scheduler.finished(request_id)
        assert len(loads) == args.requests and all(load.valid for load in loads)
        return (scheduled - started) * 1000 / args.requests, (done - scheduled) * 1000 / args.requests

    for _ in range(3):  # warm: every record resident in the arena, headers cached
        step()
    timed = [step() for _ in range(steps)]
    sched_ms = statistics.median(t[0] for t in timed)
    worker_ms = statistics.median(t[1] for t in timed)
    print(f"per request: scheduler half {sched_ms:.3f} ms, worker half {worker_ms:.3f} ms", flush=True)
    write_report(
        args.out,
        {
            "requests_per_step": args.requests,
            "k": args.k,
            "fact_tokens": args.fact_tokens,
            "steps": steps,
            "scheduler_ms_per_request": round(sched_ms, 4),
            "worker_ms_per_request": round(worker_ms, 4),
            "targets": [
                target(
                    "connector host work per injected request, ms (scheduler + worker halves, "
                    f"{args.requests} requests a step, k={args.k})",
                    sched_ms + worker_ms,
                    "<= 0.15",
                )
            ],
        },
    )


if __name__ == "__main__":
    main()
