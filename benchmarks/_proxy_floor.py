"""The ingress floor of one Ray Serve proxy mode, in a process of its own (Ray reads the mode at start).

Deploys the real `Ingress` (with a stand-in for the LLM servers, which an authenticated `GET /v1/models`
never reaches) on a fresh local Ray in `--proxy` mode, against an existing Redis and tenant key, and prints
the latency of that request as JSON: the HTTP path, the proxy, the ingress replica and the key lookup.
`serve_http.py` runs it for both modes, so the two floors are measured in one run on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from starlette.requests import Request  # at module level: FastAPI resolves the routes' string annotations here
from starlette.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import start_local_serve  # noqa: E402
from benchmarks._common import timed_ms  # noqa: E402
from deployments.event_stream import EventStream  # noqa: E402


def measure(base: str, key: str, calls: int, path: str = "/v1/models", body: dict | None = None) -> list[float]:
    """ms of `calls` authenticated GETs of `path` (POSTs of `body`) on one connection, after 20 that open it and
    warm caches; a streamed answer is read to its end."""
    import requests

    session, headers = requests.Session(), {"Authorization": f"Bearer {key}"}
    method = "GET" if body is None else "POST"
    return timed_ms(
        lambda: session.request(method, f"{base}{path}", json=body, headers=headers, timeout=60).raise_for_status(),
        calls,
    )


class _AwakeProbe:
    """A plain ASGI middleware that keeps the replica's event loop polling instead of sleeping for `window_s` after
    each request (a no-op with a zero window): a loop that never waits in its poll for the next request."""

    def __init__(self, app, window_s: float) -> None:
        self._app, self._window_s, self._until, self._spinning = app, window_s, 0.0, False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._window_s > 0:
            self._until = time.perf_counter() + self._window_s
            if not self._spinning:
                self._spinning = True
                asyncio.get_running_loop().call_soon(self._spin)
        await self._app(scope, receive, send)

    def _spin(self) -> None:
        if time.perf_counter() < self._until:
            asyncio.get_running_loop().call_soon(self._spin)
        else:
            self._spinning = False


STREAMS = ("starlette", "event_stream")  # the probe's one-event streams: Starlette's response, the ingress's own


def deploy_probe(num_replicas: int, name: str = "probe", keep_warm_ms: float | None = None) -> str:
    """The mode's own floor beside ours: a trivial FastAPI ingress (no auth, no work) deployed as an app of its
    own in the running cluster, with as many replicas as the real ingress; returns its path (`/<name>/`). `GET /`
    answers at once; `POST /<stream>` (`STREAMS`) reads a JSON body and streams one event, with Starlette's
    `StreamingResponse` (which watches for the client leaving in tasks of its own) or the ingress's `EventStream`
    (which leaves that to Serve). With `keep_warm_ms` (0 included, for a like-for-like probe that sleeps), a plain
    ASGI middleware keeps each replica's loop polling instead of sleeping for that long after each request."""
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()
    if keep_warm_ms is not None:
        app.add_middleware(_AwakeProbe, window_s=keep_warm_ms / 1000)

    @app.get("/")
    async def ok() -> dict:
        return {"ok": True}

    async def one_event():
        yield b"data: {}\n\n"

    @app.post("/starlette")
    async def starlette(request: Request) -> StreamingResponse:
        await request.json()
        return StreamingResponse(one_event(), media_type="text/event-stream")

    @app.post("/event_stream")
    async def event_stream(request: Request) -> EventStream:
        await request.json()
        return EventStream(one_event())

    @serve.deployment(name="Probe", num_replicas=num_replicas, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Probe:
        """Answers at once: what is measured is the proxy, the replica's HTTP server and FastAPI."""

    serve.run(Probe.bind(), name=name, route_prefix=f"/{name}")
    return f"/{name}/"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proxy", choices=["haproxy", "python"], required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--admin-key", required=True)
    p.add_argument("--tenant-key", required=True)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()

    port = start_local_serve(args.proxy, num_cpus=4)  # before anything imports ray: Ray reads the mode at import
    import ray
    from ray import serve

    from deployments.ray_serve.ingress import Ingress

    @serve.deployment
    class NoModel:
        """Stands in for the LLM servers: the measured route never calls them."""

        async def chat(self, task):
            raise RuntimeError("not part of this measurement")

    app_args = {
        "redis_url": args.redis_url,
        "state_dir": str(args.state_dir),
        "admin_key": args.admin_key,
        "ingress": {"rate_per_s": 100_000, "burst": 100_000},
    }  # the floor, not the tenant's rate limit
    serve.run(serve.deployment(Ingress, name="Ingress").bind(NoModel.bind(), app_args), name="floor", route_prefix="/")
    try:
        times = sorted(measure(f"http://127.0.0.1:{port}", args.tenant_key, args.calls))
        print(
            json.dumps(
                {
                    "proxy": args.proxy,
                    "p50_ms": statistics.median(times),
                    "p99_ms": times[int(0.99 * (len(times) - 1))],
                    "calls": len(times),
                }
            )
        )
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
