"""A closed-loop HTTP load generator that is not itself the bottleneck: worker processes of asyncio + aiohttp
with keep-alive connections, each running its share of the users.

One Python process of `requests` threads (a new connection per call, the GIL shared by 100 threads) tops out at
a few hundred requests a second, the rate the serving benchmark is meant to measure the server at. Here each
worker process runs `users / processes` concurrent users pulling the next request from its share; all
workers start at one agreed wall-clock instant, and the rate is every request over the time from that instant
to the last answer (one host, one clock). Run as a script, a worker reads its job as JSON on stdin and writes
its result as JSON on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

START_DELAY_S = 3.0  # the workers' imports and connection pools are ready well within this


@dataclass(frozen=True)
class LoadResult:
    """Requests completed by a load run, its duration, every request's latency and, where asked for, the keys of
    each answer's `usage` that were kept (the server's own account of where each request's time went)."""

    requests: int
    seconds: float
    latencies_ms: list[float]
    usages: list[dict] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def closed_loop(
    base: str,
    path: str,
    calls: list[tuple[str, dict | None]],
    users: int,
    processes: int | None = None,
    timeout_s: float = 120.0,
    usage_keys: tuple[str, ...] = (),
) -> LoadResult:
    """Run `calls` ((API key, JSON body or None for a GET) each) against `base + path` from `users` concurrent
    users spread over `processes` workers; raises with the first error any call got (any status but 200, or no
    answer within `timeout_s`: a server that stops answering ends the run with that, not the caller's limit).
    `usage_keys`: keep these keys of each JSON answer's `usage`."""
    processes = max(1, min(processes or max(1, (os.cpu_count() or 2) // 4), users, len(calls)))
    start_at = time.time() + START_DELAY_S
    workers = []
    for p in range(processes):
        job = {
            "url": base.rstrip("/") + path,
            "calls": calls[p::processes],
            "start_at": start_at,
            "timeout_s": timeout_s,
            "users": users // processes + (1 if p < users % processes else 0),
            "usage_keys": list(usage_keys),
        }
        worker = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        worker.stdin.write(json.dumps(job))
        worker.stdin.close()
        workers.append(worker)
    results = []
    for worker in workers:
        out, err = worker.stdout.read(), worker.stderr.read()
        if worker.wait() != 0:
            raise RuntimeError(f"load worker failed: {err.strip()[-2000:]}")
        results.append(json.loads(out))
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(errors[0])
    return LoadResult(
        sum(r["done"] for r in results),
        max(r["finished"] for r in results) - start_at,
        [ms for r in results for ms in r["latencies_ms"]],
        [usage for r in results for usage in r["usages"]],
    )


async def _work(job: dict) -> dict:
    import aiohttp

    calls, latencies, errors, usages = list(reversed(job["calls"])), [], [], []
    keys = job.get("usage_keys") or []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=job["timeout_s"])
    ) as session:

        async def user() -> None:
            while calls and not errors:
                key, body = calls.pop()
                headers = {"Authorization": f"Bearer {key}"}
                began = time.perf_counter()
                request = (
                    session.post(job["url"], json=body, headers=headers)
                    if body is not None
                    else session.get(job["url"], headers=headers)
                )
                async with request as answer:
                    text = await answer.read()
                    if answer.status != 200:
                        errors.append(f"{job['url']} answered {answer.status}: {text[:2000]!r}")
                latencies.append((time.perf_counter() - began) * 1000)
                if keys and answer.status == 200:  # parsed after the clock: not the request's time
                    try:
                        usage = json.loads(text).get("usage") or {}
                    except (ValueError, AttributeError):
                        errors.append(f"{job['url']} answered 200 with no JSON object: {text[:2000]!r}")
                        continue
                    usages.append({key: usage[key] for key in keys if key in usage})

        await asyncio.sleep(max(0.0, job["start_at"] - time.time()))
        await asyncio.gather(*(user() for _ in range(job["users"])))
    return {
        "done": len(latencies),
        "finished": time.time(),
        "latencies_ms": latencies,
        "usages": usages,
        "error": errors[0] if errors else None,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_work(json.load(sys.stdin)))))
