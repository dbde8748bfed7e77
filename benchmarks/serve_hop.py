"""The ingress-to-replica hop alone: what Ray Serve's streamed handle call costs, with no engine behind it.

A FastAPI ingress (the same Serve mode as the cluster: `--proxy`) calls a trivial downstream deployment
behind the real `TenantAffinityRouter` with a real `ChatTask` (no facts, and `--facts` retrieved facts) and
reports, per request: the task's way to the replica (`to_replica`, the downstream's clock minus the
ingress's), the first event's way back, and the client's whole HTTP time; beside it, the same ingress
answering by itself (`direct`: HTTP without the hop). The hop goes over the transport of the Serve mode
(gRPC in high-throughput mode) and, beside it, over Ray actor calls (`via_actor`), the transport a handle
keeps when the driver that made it lacked the mode's switches, and over the downstream's own chat channel
(`via_channel`: `deployments/chat_channel.py`, a socket with no Serve code on either side); each with both
processes' CPU time a call (`ingress_cpu_ms`, `downstream_cpu_ms`). Runs in seconds (no model), so the hop can be
profiled apart from the serving benchmark (`serve_http.py`, whose `hop_ms` has the same legs under load).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import start_local_serve  # noqa: E402
from benchmarks._common import parser, target, timed_ms, write_report  # noqa: E402

ROUTER = "deployments.ray_serve.router.TenantAffinityRouter"


def build(facts_text: str):
    """(ingress app, downstream) bound for `serve.run`; imported late: Ray must read the mode first."""
    from fastapi import FastAPI
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.chat_channel import ChannelAddress, ChannelPool, ChannelServer
    from deployments.chat_task import ChatTask, RetrievedFact
    from deployments.ray_serve.transport import in_this_mode

    class Downstream:
        """A trivial downstream deployment: what the hop costs without any work behind it; beside Serve's handle,
        its own chat channel (`deployments/chat_channel.py`, `via=channel`)."""

        async def __init__(self) -> None:
            self._channel = ChannelServer(self.chat, "127.0.0.1")
            await self._channel.start()

        def channel(self) -> ChannelAddress:
            return self._channel.address

        def cpu_s(self) -> float:
            """This replica process's CPU time so far (all threads)."""
            return time.process_time()

        async def chat(self, task: ChatTask):
            yield {"arrived": time.time(), "facts": len(task.facts)}
            yield {"done": True}

    @serve.ingress()
    class Front:
        """A trivial ingress that calls the downstream deployment through a handle."""

        def __init__(self, down) -> None:
            self._down = in_this_mode(down)
            self._via = {
                "mode": self._down.options(stream=True),
                "actor": down.options(stream=True, _by_reference=True),
            }
            self._channels = ChannelPool()
            self._address: ChannelAddress | None = None

        async def _over_channel(self, task: ChatTask):
            if self._address is None:
                self._address = await self._down.channel.remote()
            async for event in self._channels.client(self._address).chat(task):
                yield event

        def __serve_build_asgi_app__(self):
            app = FastAPI()

            @app.get("/cpu")
            async def cpu() -> dict:
                """Both processes' CPU time so far (the ingress's, the downstream's): their cost a call."""
                return {"ingress": time.process_time(), "downstream": await self._down.cpu_s.remote()}

            @app.get("/direct")
            async def direct() -> dict:
                return {"ok": True}

            @app.get("/hop")
            async def hop(facts: int = 0, via: str = "mode") -> dict:
                task = ChatTask(
                    "tenant-1",
                    1,
                    (("user", "What does box 3 hold?"),),
                    tuple(RetrievedFact(f"f{i}", facts_text.format(i=i), f"r{i}", 0.5) for i in range(facts)),
                )
                sent = time.time()
                events = self._over_channel(task) if via == "channel" else self._via[via].chat.remote(task)
                first = await events.__anext__()
                back = time.time()
                async for _ in events:
                    pass
                return {
                    "to_replica_ms": (first["arrived"] - sent) * 1000,
                    "first_back_ms": (back - first["arrived"]) * 1000,
                }

            return app

    down = (
        serve.deployment(Downstream, name="Downstream")
        .options(request_router_config=RequestRouterConfig(request_router_class=ROUTER))
        .bind()
    )
    return serve.deployment(Front, name="Front").bind(down)


def measure(base: str, calls: int, facts: int, via: str = "mode") -> dict:
    session, rows = requests.Session(), []

    def hop() -> None:
        started = time.perf_counter()
        answer = session.get(f"{base}/hop", params={"facts": facts, "via": via}, timeout=60).json()
        rows.append({**answer, "http_ms": (time.perf_counter() - started) * 1000})

    cpu_before = session.get(f"{base}/cpu", timeout=60).json()
    timed_ms(hop, calls, warm=30)
    cpu_after = session.get(f"{base}/cpu", timeout=60).json()
    direct = timed_ms(lambda: session.get(f"{base}/direct", timeout=60).raise_for_status(), calls, warm=30)
    rows = rows[30:]  # the first ones open the connection and warm the router's caches
    p50 = {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}
    return {
        **p50,
        "direct_http_ms": round(statistics.median(direct), 3),
        "hop_http_extra_ms": round(p50["http_ms"] - statistics.median(direct), 3),
        # each process's CPU a call (HTTP in, the hop, HTTP out on the ingress; the call alone on the downstream)
        **{
            f"{side}_cpu_ms": round((cpu_after[side] - cpu_before[side]) * 1000 / (calls + 30), 3) for side in cpu_after
        },
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--proxy", choices=["haproxy", "python"], default="haproxy")
    p.add_argument("--facts", type=int, default=50)
    args = p.parse_args()
    port = start_local_serve(args.proxy, num_cpus=4)
    import ray
    from ray import serve

    calls = 200 if args.quick else 1000
    try:
        serve.run(build("Person 1 remembers detail {i}: the red box holds item {i}."), name="hop", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        report = {
            "proxy": args.proxy,
            "calls": calls,
            "no_facts": measure(base, calls, 0),
            f"facts_{args.facts}": measure(base, calls, args.facts),
            f"facts_{args.facts}_via_actor": measure(base, calls, args.facts, via="actor"),
            f"facts_{args.facts}_via_channel": measure(base, calls, args.facts, via="channel"),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
    with_facts, channel = report[f"facts_{args.facts}"], report[f"facts_{args.facts}_via_channel"]
    # the serving targets leave HTTP - engine <= 3 ms for floor, retrieval and the hop together: the hop's share
    # is what is left after the H200's floor (2.5 ms) and retrieval (1.3 ms): nothing, so any hop counts
    report["targets"] = [
        target(f"task to the replica p50, ms ({args.facts} facts)", with_facts["to_replica_ms"], "<= 1"),
        target("HTTP with the hop - HTTP without, p50 ms", with_facts["hop_http_extra_ms"], "<= 1"),
        target("HTTP with the hop over the chat channel - HTTP without, p50 ms", channel["hop_http_extra_ms"], "<= 1"),
        target(
            "chat channel / Serve's handle: the downstream's CPU a call",
            channel["downstream_cpu_ms"] / with_facts["downstream_cpu_ms"],
            "<= 0.5",
        ),
    ]
    write_report(args.out, report)


if __name__ == "__main__":
    main()
