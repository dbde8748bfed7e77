"""Soak: steady chat and write load over many tenants for a fixed time, watching for drift.

Samples per window (one minute, or shorter with --window-s): requests, errors, p99 TTFT, the resident memory of
every process of the local Ray session (replicas, engine), Redis' used memory. Targets: no errors, memory flat
(last window within 10 % of the first after warm-up), p99 TTFT stable (last window within 1.5x the first).

    python benchmarks/soak.py --out out/soak.json [--minutes 30] [--quick]   (--quick: 2 minutes, 8 tenants)
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402
from benchmarks.timing_isolation import Api, Who  # noqa: E402

MODEL = "inferscale-smollm2"


def ray_rss_bytes() -> int:
    """Resident memory of this machine's Ray processes (workers, raylet, engine cores)."""
    total = 0
    for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "ray::" in line or "raylet" in line or "EngineCore" in (proc.info["name"] or "") or "VLLM" in line:
            total += proc.info["memory_info"].rss if proc.info["memory_info"] else 0
    return total


def soak(
    base: str,
    admin_key: str,
    redis_url: str,
    *,
    minutes: float,
    tenants: int,
    users: int,
    window_s: float,
    prefix: str = "soak",
) -> list[dict]:
    """Drive chats (90 %) and memory writes (10 %) from `users` threads over `tenants` tenants of a running
    cluster for `minutes`; return one sample per window."""
    from tenants.redis_meta import RedisMeta

    api = Api(base, admin_key)
    meta = RedisMeta(redis_url)  # one client for the run's memory samples
    keys = []
    for t in range(tenants):
        key = api.tenant(f"{prefix}-{t}")
        api.remember(Who(key), [f"Soak tenant {t} keeps item {i} in box {i * 3 + t}." for i in range(6)])
        keys.append(key)
    lock, events, stop = threading.Lock(), [], time.monotonic() + minutes * 60

    def user(seed: int) -> None:
        rng, session = random.Random(seed), requests.Session()
        while time.monotonic() < stop:
            key = rng.choice(keys)
            auth = {"Authorization": f"Bearer {key}"}
            started = time.monotonic()
            if rng.random() < 0.1:
                answer = session.post(
                    f"{base}/v1/memories",
                    json={"facts": [f"Note {rng.randrange(10**9)} was taken."]},
                    headers=auth,
                    timeout=300,
                )
                ttft = None
            else:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"What is in box {rng.randrange(30)}?"}],
                    "max_tokens": 8,
                    "memory": {"k": 4, "mode": "inject"},
                }
                answer = session.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=300)
                ttft = answer.json()["usage"]["ttft_ms"] if answer.status_code == 200 else None
            with lock:
                events.append((started, answer.status_code, ttft))

    windows, began = [], time.monotonic()
    with ThreadPoolExecutor(users) as pool:
        futures = [pool.submit(user, s) for s in range(users)]
        while time.monotonic() < stop:
            time.sleep(min(window_s, max(0.0, stop - time.monotonic())))
            now = time.monotonic()
            with lock:
                recent = [e for e in events if e[0] >= now - window_s]
            ttfts = sorted(e[2] for e in recent if e[2] is not None)
            windows.append(
                {
                    "t_s": round(now - began, 1),
                    "requests": len(recent),
                    "errors": sum(e[1] != 200 for e in recent),
                    "p99_ttft_ms": ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else None,
                    "ray_rss_mb": ray_rss_bytes() / 2**20,
                    "redis_used_mb": int(meta.info_memory()["used_memory"]) / 2**20,
                }
            )
        for future in futures:
            future.result()
    meta.close()
    return windows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--window-s", type=float, default=60.0)
    args = p.parse_args()
    minutes, tenants, users, window_s = (2.0, 8, 4, 20.0) if args.quick else (args.minutes, 50, 16, args.window_s)
    from benchmarks._cluster import start_cluster

    base, admin, redis, _ = start_cluster(Path(scratch_dir(prefix="soak-")), cuda=False, shape=None)
    windows = soak(base, admin, redis.url, minutes=minutes, tenants=tenants, users=users, window_s=window_s)
    from ray import serve

    serve.shutdown()
    redis.stop()
    first, last = windows[min(1, len(windows) - 1)], windows[-1]  # the first window warms up
    errors = sum(w["errors"] for w in windows)
    report = {
        "minutes": minutes,
        "tenants": tenants,
        "users": users,
        "windows": windows,
        "requests": sum(w["requests"] for w in windows),
        "targets": [
            target("errors", errors, "<= 0"),
            target("Ray RSS, last / first window", last["ray_rss_mb"] / first["ray_rss_mb"], "<= 1.1"),
            target("p99 TTFT, last / first window", (last["p99_ttft_ms"] or 0) / (first["p99_ttft_ms"] or 1), "<= 1.5"),
        ],
    }
    print(
        f"median p99 TTFT {statistics.median(w['p99_ttft_ms'] for w in windows if w['p99_ttft_ms']):.0f} ms", flush=True
    )
    write_report(args.out, report)


if __name__ == "__main__":
    main()
