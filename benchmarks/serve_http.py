"""Serving through HTTP against the engine alone: what the HTTP path (proxy, ingress, retrieval, the hop to the
LLM replica) adds to time-to-first-token and takes from requests per second.

Starts its own cluster in this process (local Ray in Serve's `--proxy` mode, redis-server; SmolLM2 on CPU or
CUDA vLLM), with `--tenants` tenants of `--facts` facts each: `k` of them are about boxes and get their K/V
(the ones the questions retrieve), the rest are other notes that retrieval searches but does not return.
Measured in one run: TTFT of streamed chats, inject and prompt interleaved, with the engine's own TTFT of
each request; retrieval time; the ingress floor (an authenticated `GET /v1/models`); QPS with one user per
tenant; then, after the cluster is stopped, the same requests (tasks built by the same retrieval) served by
the same engine class with no HTTP, as the reference; and (`--quick`) the floor of both proxy modes in
processes of their own. `--config` serves a model shape with dummy weights (SmolLM2's tokenizer); `--locust-s N` instead makes
the tenants, waits until their facts are encoded (`encode_burst_s`), then runs N seconds of Locust on them
(one user per tenant) and reports errors, the streamed chats' time to first token and their whole time.
`--ab-ingress JSON` deploys a second ingress app with those ingress args changed over the same LLM replicas and
interleaves its injected chats with the first's in the timed rounds (`ab`: both sides' legs, B over A);
`--ab-only` ends the run there.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import deploy_second_ingress, served_block_size, start_cluster  # noqa: E402
from benchmarks._common import (  # noqa: E402
    load_failures_target,
    parser,
    phase_medians,
    sampled,
    scratch_dir,
    target,
    write_report,
)
from benchmarks._http_load import LoadResult, closed_loop  # noqa: E402
from benchmarks._process_cpu import PhaseCpu  # noqa: E402
from benchmarks._proxy_floor import STREAMS, deploy_probe  # noqa: E402
from benchmarks._proxy_floor import measure as floor_ms

MODEL = "inferscale-smollm2"
SESSION = requests.Session()  # keep-alive, as the clients users run (openai's) keep their connections
COLORS = ["red", "blue", "green"]


def box_fact(t: int, i: int) -> str:
    return f"Person {t} remembers detail {i}: the {COLORS[i % 3]} box holds item {i * 7 + t}."


def question(i: int) -> str:
    return f"What does box {i} hold, and where is it?"


def make_tenants(base: str, admin: str, count: int, hot: int) -> list[tuple[str, str]]:
    """`count` tenants with `hot` box facts each (over HTTP); returns (tenant id, key) once all have K/V."""

    def one(t: int) -> tuple[str, str]:
        created = requests.post(
            f"{base}/v1/tenants",
            json={"id": f"bench-{t}", "window": 0},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=60,
        ).json()
        auth = {"Authorization": f"Bearer {created['api_key']}"}
        requests.post(
            f"{base}/v1/memories", json={"facts": [box_fact(t, i) for i in range(hot)]}, headers=auth, timeout=300
        ).raise_for_status()
        return f"bench-{t}", created["api_key"]

    with ThreadPoolExecutor(16) as pool:
        tenants = list(pool.map(one, range(count)))
    deadline = time.monotonic() + 900
    for _, key in tenants:
        auth = {"Authorization": f"Bearer {key}"}
        while not all(
            m["kv_ready"]
            for m in requests.get(f"{base}/v1/memories?limit=1000", headers=auth, timeout=60).json()["results"]
        ):
            assert time.monotonic() < deadline, "encoding did not finish"
            time.sleep(0.5)
    return tenants


def add_cold_facts(service, tenants: list[tuple[str, str]], count: int) -> None:
    """`count` more facts per tenant, text only (never retrieved by the box questions): retrieval searches them all."""
    for t, (_, key) in enumerate(tenants):
        tenant = service.authenticate(key)
        for first in range(0, count, 500):
            tenant.add_facts(
                [
                    f"Weather note {i} of person {t}: a {['calm', 'windy', 'rainy'][i % 3]} morning by the sea."
                    for i in range(first, min(count, first + 500))
                ]
            )


def streamed(base: str, key: str, k: int, mode: str, text: str) -> tuple[float, dict]:
    """(client-side TTFT in ms, the request's usage) of one streamed chat, read with `http.client` on one kept-alive
    connection: the time to the first event that holds text, as close to the wire as a client gets (`requests`'
    line iteration added ~0.8 ms a streamed chat on a 2-core CPU, 2026-12-05: the client's, not the server's)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "memory": {"k": k, "mode": mode},
    }
    payload = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        started, answer = _post(base, "/v1/chat/completions", payload, headers)
        first, usage = _read_events(answer, mode, started)
    except BaseException:  # a response left half read would break the connection's next request
        conn = _CONNECTIONS.pop(base, None)
        if conn is not None:
            conn.close()
        raise
    if "engine_ttft_ms" not in usage:
        raise RuntimeError(f"{mode} chat ended without usage")
    return (first or time.perf_counter() - started) * 1000, usage


_CONNECTIONS: dict[str, http.client.HTTPConnection] = {}
_CLOSED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def _post(base: str, path: str, payload: bytes, headers: dict) -> tuple[float, http.client.HTTPResponse]:
    """(send time, response) of a POST on the kept-alive connection to `base`; a connection the server closed while
    idle (Serve's keep-alive ends after 90 s) is opened again once, and the request sent again."""

    def send() -> tuple[float, http.client.HTTPResponse]:
        if base not in _CONNECTIONS:
            where = urlsplit(base)
            _CONNECTIONS[base] = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        conn = _CONNECTIONS[base]
        if conn.sock is None:
            conn.connect()  # not part of the chat's time
        started = time.perf_counter()
        conn.request("POST", urlsplit(base).path.rstrip("/") + path, body=payload, headers=headers)
        return started, conn.getresponse()

    try:
        return send()
    except _CLOSED:
        _CONNECTIONS.pop(base).close()
        return send()


def _read_events(answer: http.client.HTTPResponse, mode: str, started: float) -> tuple[float | None, dict]:
    """(seconds to the first event with text, the last usage) of a streamed chat, its events read as they come."""
    if answer.status != 200:
        raise RuntimeError(f"{mode} chat answered {answer.status}: {answer.read()[:2000]!r}")
    first, usage, pending = None, {}, b""
    while piece := answer.read1(65536):
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            chunk = json.loads(event[6:])
            if "error" in chunk:
                raise RuntimeError(f"{mode} chat streamed an error: {chunk['error']}")
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    answer.read()  # the end of a sized body is only noticed by a read past it: the connection is free again
    return first, usage


def sample_rounds(
    base: str,
    tenants: list[tuple[str, str]],
    k: int,
    rounds: int,
    samples: dict[str, list[dict]],
    alternate: str | None = None,
) -> None:
    """`rounds` streamed chats of each mode, interleaved, a new question each round, into `samples`; a key
    `inject@b` samples injected chats through `alternate` (the second ingress app's base URL)."""
    for r in range(rounds):
        for key in samples:
            mode, _, through = key.partition("@")
            url = alternate if through else base
            assert url is not None, f"{key} needs the second ingress"
            ms, usage = streamed(url, tenants[r % len(tenants)][1], k, mode, f"What does box {r} hold? ({key} {r})")
            samples[key].append(
                {
                    "ttft_ms": ms,
                    "server_ttft_ms": usage["ttft_ms"],  # from the ingress handler's start to its first token
                    "hop_ms": usage.get("hop_ms", {}),
                    "ingress_ms": usage.get("ingress_ms", {}),
                    "embed_legs_ms": usage.get("retrieval_embed_legs_ms", {}),
                    "retrieval_legs_ms": usage.get("retrieval_legs_ms", {}),
                    "launch_legs_ms": usage.get("retrieval_launch_legs_ms", {}),
                    "retrieval_in_copy": bool(usage.get("retrieval_in_copy")),
                    "cpu_ms": usage.get("cpu_ms", {}),
                    "engine_phases_ms": usage.get("engine_phases_ms", {}),
                    **{
                        key: usage[key]
                        for key in (
                            "engine_ttft_ms",
                            "retrieval_ms",
                            "retrieval_ahead_ms",
                            "retrieval_embed_ms",
                            "prefilled_tokens",
                            "injected_tokens",
                            "load_failed_tokens",
                            "prompt_tokens",
                        )
                    },
                }
            )


LOAD_USAGE = ("ttft_ms", "engine_ttft_ms", "engine_phases_ms", "retrieval_ms", "retrieval_embed_legs_ms", "hop_ms")


def http_qps(
    base: str, tenants: list[tuple[str, str]], k: int, mode: str, total: int, first: int = 0, usage: bool = False
) -> LoadResult:
    """`total` chats from one concurrent user per tenant, each question new (worker processes with keep-alive
    connections: one process of threads would measure its own ceiling); with `usage`, each answer's account of
    its time (`LOAD_USAGE`)."""
    calls = [
        (
            tenants[i % len(tenants)][1],
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": question(first + i)}],
                "max_tokens": 1,
                "memory": {"k": k, "mode": mode},
            },
        )
        for i in range(total)
    ]
    return closed_loop(base, "/v1/chat/completions", calls, users=len(tenants), usage_keys=LOAD_USAGE if usage else ())


def load_legs(result: LoadResult) -> dict[str, float]:
    """p50 (ms) of where a chat's time went under load: the client's whole request, the handler's time to the first
    token, the engine's, retrieval and the embedding's legs, the hop's legs and the engine's phases (what the
    closed loop loses against the engine alone shows up in one of them)."""
    usages = result.usages
    if not usages:
        return {}
    legs: dict[str, list[float]] = {"client": result.latencies_ms}
    for key in ("ttft_ms", "engine_ttft_ms", "retrieval_ms"):
        legs[key] = [u[key] for u in usages if key in u]
    for group, prefix in (("retrieval_embed_legs_ms", "embed_"), ("hop_ms", "hop_"), ("engine_phases_ms", "engine_")):
        for u in usages:
            for leg, value in (u.get(group) or {}).items():
                legs.setdefault(prefix + leg, []).append(value)
    return {leg: round(statistics.median(values), 3) for leg, values in legs.items() if values}


def replica_loop_lag() -> dict[str, float]:
    """The LLM replica's loop lag since the last call (its probe: `--loop-lag-ms`)."""
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name="inferscale").loop_lag.remote().result()


def http_ceiling(base: str, tenants: list[tuple[str, str]], total: int) -> float:
    """Requests per second of the authenticated `GET /v1/models` from the same users and load generator: the
    most the HTTP path (client, proxy, ingress, auth) carries with no engine behind it."""
    calls = [(tenants[i % len(tenants)][1], None) for i in range(total)]
    return closed_loop(base, "/v1/models", calls, users=len(tenants)).rate


def locust_run(base: str, admin: str, users: int, seconds: int, k: int, out: Path) -> dict:
    """p50/p99 of each entry (a streamed chat's whole time, its first token, memory writes) and the failures of a
    headless Locust run (one user per tenant), over tenants
    made first and waited for until their facts are encoded (`encode_burst_s`: the write burst, apart from
    the steady load Locust measures)."""
    started = time.perf_counter()
    made = make_tenants(base, admin, users, k)
    burst_s = time.perf_counter() - started
    tenants_file = out.with_name("locust-tenants.json")
    tenants_file.write_text(
        json.dumps([{"id": t, "key": key, "person": f"Person {i}"} for i, (t, key) in enumerate(made)])
    )
    prefix = out.with_suffix("")
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        "loadtest/locustfile.py",
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{seconds}s",
        "--host",
        base,
        "--tenants-file",
        str(tenants_file),
        "--k",
        str(k),
        "--max-tokens",
        "16",
        "--csv",
        str(prefix),
        "--only-summary",
    ]
    done = subprocess.run(
        cmd,
        env={**os.environ, "INFERSCALE_ADMIN_KEY": admin},
        capture_output=True,
        text=True,
        timeout=seconds + 600,
        cwd=Path(__file__).resolve().parents[1],
    )
    tenants_file.unlink()  # it holds API keys
    rows = {}
    stats = Path(f"{prefix}_stats.csv")
    if stats.exists():
        import csv

        for row in csv.DictReader(stats.open()):
            rows[row["Name"]] = {
                "requests": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "p50_ms": float(row["50%"] or 0),
                "p99_ms": float(row["99%"] or 0),
                "rps": float(row["Requests/s"] or 0),
            }
    return {
        "exit": done.returncode,
        "encode_burst_s": round(burst_s, 1),
        "rows": rows,
        "tail": done.stderr[-1500:] if done.returncode else "",
    }


ALONE_SPACING_S = 0.03  # the HTTP run's chats arrive about this far apart (one at a time)


def engine_alone(app_args: dict, tasks: list, rounds: list, spaced_rounds: list, concurrency: int) -> dict:
    """The same tasks on the same engine class, no HTTP: TTFT of `rounds` (one at a time, back to back) and of
    `spaced_rounds` (other questions, spaced as the HTTP run's chats come, so an idle engine's and device's wake-up
    shows apart), and QPS of `tasks`."""
    from deployments.app_args import AppArgs
    from deployments.ray_serve.llm_server import build_engine

    engine = build_engine(AppArgs(**app_args))

    async def serve(task) -> dict:
        usage = {}
        async for event in engine.chat(task):
            usage = event.get("usage", usage)
        return usage

    async def run() -> dict:
        await engine.warm_up()
        for first in range(0, len(tasks), concurrency):  # warm: every tenant's frame and records resident
            await asyncio.gather(*(serve(t) for t in tasks[first : first + concurrency]))
        single = [await serve(task) for task in rounds]
        ttft = [usage["engine_ttft_ms"] for usage in single]
        spaced = []  # as the HTTP run's chats come: one at a time, ~30 ms apart, the engine idle in between
        for task in spaced_rounds:
            await asyncio.sleep(ALONE_SPACING_S)
            spaced.append((await serve(task))["engine_ttft_ms"])
        gate = asyncio.Semaphore(concurrency)

        async def gated(task):
            async with gate:
                return await serve(task)

        with sampled("alone-qps-inject"), PhaseCpu(own_role="engine_alone") as phase:
            started = time.perf_counter()
            loaded = await asyncio.gather(*(gated(t) for t in tasks))
            qps = len(tasks) / (time.perf_counter() - started)
        return {
            "ttft_ms_p50": statistics.median(ttft),
            "ttft_ms_p50_spaced": statistics.median(spaced),
            # the same phases as the replica's (`engine_phases_ms_p50`): what the replica's loop adds is there
            "engine_phases_ms_p50": phase_medians([usage["engine_phases_ms"] for usage in single]),
            "qps": qps,
            # under that load, as the HTTP run's `qps_legs_ms_p50` reports the replica's engine
            "qps_engine_ttft_ms_p50": statistics.median(usage["engine_ttft_ms"] for usage in loaded),
            "qps_engine_phases_ms_p50": phase_medians([usage["engine_phases_ms"] for usage in loaded]),
            "process_cpu": phase.report(len(tasks)),
        }

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def chat_tasks(service, tenants: list[tuple[str, str]], k: int, mode: str, batches: list[list[str]]) -> list[list]:
    """The `ChatTask`s the ingress builds for each batch of questions (its own code path, without HTTP), by one
    gateway: its query batcher keeps the one search copy that the service's indexes allow."""
    from deployments.app_args import IngressArgs
    from deployments.gateway import Gateway
    from deployments.metrics import Metrics
    from deployments.schemas import ChatRequest

    gateway = Gateway(service, None, IngressArgs(max_k=max(k, 1)), MODEL, Metrics(), Path(scratch_dir(prefix="jobs-")))  # type: ignore[arg-type]

    async def build(questions: list[str]) -> list:
        out = []
        for i, text in enumerate(questions):
            tenant = service.authenticate(tenants[i % len(tenants)][1])
            body = ChatRequest(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1, memory={"k": k, "mode": mode}
            )
            out.append((await gateway.prepare_chat(tenant, body)).task)
        return out

    async def build_all() -> list[list]:
        return [await build(questions) for questions in batches]

    return asyncio.run(build_all())


def proxy_floors(redis_url: str, state: Path, admin: str, key: str) -> dict:
    floors = {}
    for proxy in ("python", "haproxy"):
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("_proxy_floor.py")),
                "--proxy",
                proxy,
                "--redis-url",
                redis_url,
                "--state-dir",
                str(state),
                "--admin-key",
                admin,
                "--tenant-key",
                key,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        floors[proxy] = json.loads(lines[-1]) if lines else {"error": done.stderr[-1500:]}
    return floors


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to serve with dummy weights")
    p.add_argument("--tenants", type=int, help="tenants (= concurrent users); default 8 quick, 100 full")
    p.add_argument("--facts", type=int, help="facts per tenant; default 100 quick, 1000 full")
    p.add_argument("--proxy", choices=["haproxy", "python"], default="haproxy")
    p.add_argument(
        "--embed-device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="on a GPU, where the ingress embeds queries (cpu: two threads a replica, no GPU time-slicing)",
    )
    p.add_argument(
        "--query-embedding",
        choices=["auto", "process", "thread", "inline"],
        default="auto",
        help="the ingress embeds questions launched from its event loop (`InlineForwarder`), in a process of its "
        "own or in a thread of the replica (auto, the app's default: inline on a GPU, a process on the CPU)",
    )
    p.add_argument(
        "--ingress-replicas",
        type=int,
        default=4,
        help="on a GPU, the ingress replicas (each one event loop, with its own query embedder)",
    )
    p.add_argument(
        "--spin-ms",
        type=float,
        default=0.0,
        help="ms the query embedder's process, woken as a chat arrives, and the ingress's loop poll instead of "
        "sleeping around a question, and the LLM replica's loop after a note until its chat (ingress.embed_spin_ms, "
        "llm.ahead_spin_ms; 0: they sleep)",
    )
    p.add_argument(
        "--chat-transport",
        choices=["auto", "channel", "serve"],
        default="auto",
        help="how chats reach the LLM replica: its own chat channel (auto, here) or Serve's handle (gRPC)",
    )
    p.add_argument(
        "--engine-sm-percent",
        type=int,
        choices=range(1, 101),
        metavar="1..100",
        help="under CUDA's multi-process service (gpu_suite.sh mps-on): the engine's share of the SMs "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the LLM replica's environment), the reference's too",
    )
    p.add_argument(
        "--loop-lag-ms",
        type=float,
        default=2.0,
        help="the LLM replica's loop-lag probe interval (`llm.loop_lag_probe_ms`), read over each QPS phase; 0: off",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the engine's KV block size (`llm.engine_kwargs.block_size`, the reference engine's too; default: the app's)",
    )
    p.add_argument(
        "--ab-ingress",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="a second ingress application over the same LLM replicas with these ingress args changed (e.g. "
        '\'{"query_embedding": "process"}\'); its injected chats are interleaved with the first\'s in the timed '
        "rounds and reported as `ab` (one engine, one host: an A/B of ingress settings in one run)",
    )
    p.add_argument(
        "--ab-only",
        action="store_true",
        help="with --ab-ingress: end the run after the A/B's rounds (no floors, QPS or engine-alone reference), "
        "for a device call that has time for the comparison only",
    )
    p.add_argument(
        "--locust-s",
        type=int,
        default=0,
        help="seconds of Locust load (one user per tenant, over "
        "tenants made and encoded first); with it, only that is measured",
    )
    args = p.parse_args()
    if args.ab_only and not args.ab_ingress:
        p.error("--ab-only compares two ingress apps: give --ab-ingress")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the reference engine starts after CUDA is up
    cuda = torch.cuda.is_available()
    k, tenants_n, rounds_n = (20, 8, 8) if args.quick else (50, 100, 100)  # 100: a p99 is not the maximum of 24
    tenants_n, facts_n = args.tenants or tenants_n, args.facts or (100 if args.quick else 1000)
    clock = Phases()
    state = Path(scratch_dir(prefix="serve-bench-"))
    base, admin, redis, app_args = start_cluster(
        state,
        cuda,
        args.config,
        args.proxy,
        args.embed_device,
        args.engine_sm_percent,
        args.query_embedding,
        ingress_replicas=args.ingress_replicas,
        chat_transport=args.chat_transport,
        spin_ms=args.spin_ms,
        engine_kwargs={"block_size": args.block_size} if args.block_size else None,
        llm_args={"loop_lag_probe_ms": args.loop_lag_ms},
        ingress_apps=2 if args.ab_ingress else 1,
    )
    probe = deploy_probe(app_args["ingress"].get("num_replicas", 1))
    alternate = base + deploy_second_ingress(app_args, args.ab_ingress) if args.ab_ingress else None
    clock.done("deploy")
    from deployments.app_args import IngressArgs
    from models.minilm import MiniLMEmbedder
    from tenants.connect import connect_service

    ingress = IngressArgs(**app_args["ingress"])

    service = connect_service(redis.url, state, MiniLMEmbedder(device="cuda" if cuda else "cpu"))
    report: dict = {
        "k": k,
        "tenants": tenants_n,
        "facts_per_tenant": facts_n,
        "proxy": args.proxy,
        "cuda": cuda,
        "embed_device": app_args["ingress"].get("embed_device", "cpu"),
        "query_embedding": ingress.query_embedding_way,
        "retrieval_ahead": ingress.retrieval_ahead_on,
        "ingress_replicas": app_args["ingress"].get("num_replicas", 1),
        "chat_transport": app_args["ingress"]["chat_transport"],
        "spin_ms": app_args["ingress"]["embed_spin_ms"],
        "block_size": served_block_size(app_args, cuda),
        "engine_sm_percent": args.engine_sm_percent,
        "model": str(args.config) if args.config else "SmolLM2-135M",
        "phase_s": clock.seconds,
    }
    if args.locust_s:
        try:
            report["locust"] = locust_run(base, admin, tenants_n, args.locust_s, k, args.out.with_name("locust.csv"))
            clock.done("locust")
            rows = report["locust"]["rows"]
            chats = [row for name, row in rows.items() if name.startswith("/v1/chat")]
            first = rows.get("/v1/chat/completions [inject] first token")
            if first is not None:
                report["locust"]["ttft_ms"] = {"p50": first["p50_ms"], "p99": first["p99_ms"]}
            report["targets"] = [
                target("Locust chat errors", sum(r["failures"] for r in chats) if chats else 1, "<= 0")
            ]
            write_report(args.out, report)  # before the slow shutdown
        finally:
            stop_cluster()
            redis.stop()
        return
    measured = False
    try:
        tenants = make_tenants(base, admin, tenants_n, k)
        clock.done("tenants")
        add_cold_facts(service, tenants, facts_n - k)
        clock.done("cold_facts")
        report["ttft_ms_cold_tenant"] = {
            mode: streamed(base, tenants[-1][1], k, mode, f"What does box 1 hold? (cold {mode})")[0]
            for mode in ("inject", "prompt")
        }
        # untimed: every record resident and every ingress replica's indexes and search copy loaded (inject requests
        # per tenant, as HAProxy deals them over the replicas: at 8 a tenant, a tenant missed one of 4 replicas with
        # a chance of (3/4)^8 = 10 %, and its first measured question there shipped its 1.5 MB of vectors to the
        # copy; at 24, 0.1 %), then one prompt request per tenant
        http_qps(base, tenants, k, "inject", tenants_n * (2 if args.quick else 24), first=10_000)
        http_qps(base, tenants, k, "prompt", tenants_n, first=20_000)
        if alternate is not None:  # the second ingress's replicas load their indexes and search copies too
            http_qps(alternate, tenants, k, "inject", tenants_n * (2 if args.quick else 24), first=30_000)
        clock.done("warm_up")
        samples: dict[str, list[dict]] = {"inject": [], "prompt": []} | ({"inject@b": []} if alternate else {})
        with sampled("http-rounds"):
            sample_rounds(base, tenants, k, rounds_n, samples, alternate)
        if alternate is not None:  # the rest of the report is the first ingress's, as without it
            report["ab"] = ab_figures(args.ab_ingress, samples["inject"], samples.pop("inject@b"))
            if args.ab_only:
                report["targets"] = ab_targets(report["ab"], k)
            write_report(args.out, report)  # the A/B kept if a later phase runs out of the call's time
            if args.ab_only:
                return  # the cluster and the Redis server are stopped below
        floor, mode_floor, stream_floor = [], [], {name: [] for name in STREAMS}
        for _ in range(3):  # interleaved, so drift of the machine falls on both
            floor += floor_ms(base, tenants[0][1], calls=100)
            mode_floor += floor_ms(base, tenants[0][1], calls=100, path=probe)
            for name in STREAMS:  # a one-event stream, with and without Starlette's own watch for the client leaving
                stream_floor[name] += floor_ms(base, "", calls=100, path=f"{probe}{name}", body={"q": "box 1"})
        report["stream_floor_ms"] = stream_floors(stream_floor)
        total = 2 * tenants_n if args.quick else 20 * tenants_n  # inject's; prompt's: a fifth (5x slower)
        qps, cpu, lag = {"ceiling": http_ceiling(base, tenants, 20 * tenants_n)}, {}, {}
        for mode, count in (("prompt", max(total // 5, tenants_n)), ("inject", total)):
            replica_loop_lag()  # from here on
            with sampled(f"http-qps-{mode}"), PhaseCpu() as phase:
                loaded = http_qps(base, tenants, k, mode, count, usage=mode == "inject")
            lag[mode] = replica_loop_lag()
            qps[mode] = loaded.rate
            cpu[mode] = phase.report(count, seconds=count / qps[mode])  # not the load generator's start
            if mode == "inject":
                report["qps_legs_ms_p50"] = load_legs(loaded)
        # how late the LLM replica's loop ran what was due, under each load (what a chat arriving mid-burst waits)
        report["qps_replica_loop_lag_ms"] = lag
        clock.done("http_measured")
        report["arena_warnings"] = arena_warnings()
        report |= http_figures(samples, floor, mode_floor, qps, rounds_n)
        report["qps_process_cpu"] = cpu  # per part of the cluster: CPU ms a request, cores, the busiest thread
        finish(report, args.out, k, tenants_n, facts_n)  # written now too: the reference below may run out of time
        measured = True
    finally:
        stop_cluster()
        if not measured:  # failed: the reference below does not run, and the Redis server is left to nobody
            redis.stop()
    clock.done("cluster_stopped")
    try:
        qps_questions = [question(i) for i in range(total)]
        inject_tasks, round_tasks, spaced_tasks = chat_tasks(
            service,
            tenants,
            k,
            "inject",
            [qps_questions]
            + [  # new questions for each pass: no prefix-cache hit between them
                [f"What does box {r} hold? ({name} {r})" for r in range(rounds_n)]
                for name in ("inject", "inject spaced")
            ],
        )
        report["engine_alone"] = engine_alone(app_args, inject_tasks, round_tasks, spaced_tasks, tenants_n)
        clock.done("engine_alone")
        if args.quick:  # the default proxy's floor beside the new mode's (the GPU run reports the new mode's only)
            report["proxy_floors"] = proxy_floors(redis.url, state, admin, tenants[0][1])
            clock.done("proxy_floors")
    finally:
        redis.stop()
    finish(report, args.out, k, tenants_n, facts_n)


class Phases:
    """Seconds each phase of the run took (a GPU call has ten minutes: the report says where they went)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 1)
        self._last = now
        print(f"phase {phase}: {self.seconds[phase]} s", flush=True)


def stop_cluster() -> None:
    from ray import serve

    serve.shutdown()
    import ray

    ray.shutdown()


def _in_handler(sample: dict) -> float:
    """Of a chat's retrieval, the part inside the handler's time (the rest ran before it, from the middleware)."""
    return sample["retrieval_ms"] - sample.get("retrieval_ahead_ms", 0.0)


def gap_legs(inject: list[dict]) -> dict[str, float]:
    """HTTP TTFT - engine TTFT, p50 of each leg: outside the ingress's handler (the proxy, HTTP, the client), cut
    into the ingress's way from its middleware to the handler (routing, auth, the body's validation), the first
    token's from the handler to the transport, and what is outside the ingress's app (HAProxy, the replica's HTTP
    server, the client); retrieval (its part inside the handler: it may begin in the middleware), the rest of the
    handler's work before the task leaves (the task), the way to the replica, its layout, the first token's way back
    (the legs of one request sum to its gap)."""
    timed = [
        s
        for s in inject
        if all(leg in s["hop_ms"] for leg in ("to_replica", "layout", "first_token_back"))
        and all(leg in s.get("ingress_ms", {}) for leg in ("to_handler", "to_transport"))
    ]
    if not timed:
        return {}
    legs = {
        "outside_ingress_app": [
            s["ttft_ms"] - s["server_ttft_ms"] - s["ingress_ms"]["to_handler"] - s["ingress_ms"]["to_transport"]
            for s in timed
        ],
        **{leg: [s["ingress_ms"][leg] for s in timed] for leg in ("to_handler", "to_transport")},
        "retrieval": [_in_handler(s) for s in timed],
        "handler_other": [
            s["server_ttft_ms"] - s["engine_ttft_ms"] - _in_handler(s) - sum(s["hop_ms"].values()) for s in timed
        ],
        **{leg: [s["hop_ms"][leg] for s in timed] for leg in ("to_replica", "layout", "first_token_back")},
    }
    return {leg: round(statistics.median(values), 3) for leg, values in legs.items()}


def inject_figures(inject: list[dict]) -> dict:
    """What the injected chats' samples say of the path: HTTP TTFT over the engine's, retrieval and its legs, the
    gap leg by leg, the hop, and the CPU time of the layout and the embedding's forward."""
    over = [s["ttft_ms"] - s["engine_ttft_ms"] for s in inject]
    retrieval = [s["retrieval_ms"] for s in inject]
    embed = [s["retrieval_embed_ms"] for s in inject]
    return {
        "http_minus_engine_ttft_ms": {"p50": statistics.median(over), "p99": pct(over, 0.99)},
        "retrieval_ms": {
            "p50": statistics.median(retrieval),
            "p99": pct(retrieval, 0.99),
            "embed_p50": statistics.median(embed),
            "embed_p99": pct(embed, 0.99),
            **{  # the embedding's legs: waiting for the thread, the forward, the way back through the event loop
                f"embed_{leg}_{name}": at([s["embed_legs_ms"][leg] for s in inject])
                for leg in ("wait", "forward", "resume")
                for name, at in (("p50", statistics.median), ("p99", lambda v: pct(v, 0.99)))
                if all(leg in s["embed_legs_ms"] for s in inject)
            },
            # of retrieval, the part done before the ingress's handler started (begun in its middleware)
            "ahead_p50": statistics.median(s.get("retrieval_ahead_ms", 0.0) for s in inject),
            **{  # retrieval's steps: the question handed over (launched), the note to the replica, the way on to
                # the handler's wait (FastAPI's work when begun ahead), the embedding (with the copy's search beside
                # its forward) as awaited, the search's answer taken (or, where the copy's was stale, searched
                # again), the facts
                f"step_{leg}_p50": statistics.median(s["retrieval_legs_ms"][leg] for s in inject)
                for leg in ("launch", "note", "to_wait", "embed", "search", "facts")
                if all(leg in s.get("retrieval_legs_ms", {}) for s in inject)
            },
            **{  # the launch's host time by piece: the copy's updates chosen, the tokenizer, the launches
                f"step_launch_{leg}_p50": statistics.median(s["launch_legs_ms"][leg] for s in inject)
                for leg in ("prepare", "tokenize", "forward", "search", "read_back")
                if all(leg in s.get("launch_legs_ms", {}) for s in inject)
            },
            "searched_in_copy_share": round(sum(s.get("retrieval_in_copy", False) for s in inject) / len(inject), 3),
        },
        "gap_ms_p50": gap_legs(inject),
        "hop_ms_p50": {
            leg: statistics.median(s["hop_ms"][leg] for s in inject if leg in s["hop_ms"])
            for leg in ("to_replica", "layout", "first_token_back")
            if any(leg in s["hop_ms"] for s in inject)
        },
        # of the layout's and the embedding forward's wall time, their threads' own CPU time (the rest: waiting)
        "cpu_ms_p50": {
            leg: statistics.median(s["cpu_ms"][leg] for s in inject)
            for leg in ("layout", "embed_forward")
            if all(leg in s["cpu_ms"] for s in inject)
        },
    }


def stream_floors(samples: dict[str, list[float]]) -> dict[str, float]:
    """The probe's one-event streams, p50 ms each, and the ingress's `EventStream` over Starlette's response."""
    p50 = {name: round(statistics.median(values), 3) for name, values in samples.items()}
    return p50 | {"event_stream_over_starlette": round(p50["event_stream"] / p50["starlette"], 4)}


def ab_targets(ab: dict, k: int) -> list[dict]:
    """An A/B run's targets: each side's HTTP TTFT - engine TTFT against the serving path's goal."""
    return [
        target(
            f"HTTP TTFT - engine TTFT, p50 ms (inject, k={k}, retrieval included; ingress {side})",
            ab[side]["http_minus_engine_ttft_ms"]["p50"],
            "<= 3",
        )
        for side in ("a", "b")
    ]


def ab_figures(overrides: dict, first: list[dict], second: list[dict]) -> dict:
    """The injected chats of both ingress apps, interleaved round by round on one engine: each one's figures, and the
    second's HTTP - engine and retrieval p50 over the first's."""
    a, b = inject_figures(first), inject_figures(second)
    return {
        "ingress_b": overrides,
        "a": a,
        "b": b,
        "b_over_a": {
            "http_minus_engine_p50": round(
                b["http_minus_engine_ttft_ms"]["p50"] / a["http_minus_engine_ttft_ms"]["p50"], 4
            ),
            "retrieval_p50": round(b["retrieval_ms"]["p50"] / a["retrieval_ms"]["p50"], 4),
        },
    }


def http_figures(
    samples: dict[str, list[dict]], floor: list[float], mode_floor: list[float], qps: dict[str, float], rounds: int
) -> dict:
    inject = samples["inject"]
    return {
        "ttft_ms_p50": {mode: statistics.median(s["ttft_ms"] for s in v) for mode, v in samples.items()},
        "engine_ttft_ms_p50": {mode: statistics.median(s["engine_ttft_ms"] for s in v) for mode, v in samples.items()},
        "engine_phases_ms_p50": {
            mode: phase_medians([s["engine_phases_ms"] for s in v]) for mode, v in samples.items()
        },
        **inject_figures(inject),
        "ingress_floor_ms": {"p50": statistics.median(floor), "p99": pct(floor, 0.99)},
        "mode_floor_ms": {
            "p50": statistics.median(mode_floor),
            "p99": pct(mode_floor, 0.99),
        },  # a trivial ingress, same cluster
        "prefilled_tokens_p50": {
            mode: statistics.median(s["prefilled_tokens"] for s in v) for mode, v in samples.items()
        },
        "qps_http": qps,
        "rounds": rounds,
        "load_failed_chats": sum(1 for s in inject if s["load_failed_tokens"]),
    }


def finish(report: dict, out: Path, k: int, tenants_n: int, facts_n: int) -> None:
    """The report with the targets its figures allow so far."""
    qps, alone, floors = report["qps_http"], report.get("engine_alone"), report.get("proxy_floors", {})
    targets = [
        target("ingress floor p50, ms (authenticated GET /v1/models)", report["ingress_floor_ms"]["p50"], "<= 2"),
        target(
            f"HTTP TTFT - engine TTFT, p50 ms (inject, k={k}, retrieval included)",
            report["http_minus_engine_ttft_ms"]["p50"],
            "<= 3",
        ),
    ]
    if alone is not None:
        targets.append(
            target("HTTP QPS inject / engine-alone QPS of the same requests", qps["inject"] / alone["qps"], ">= 0.9")
        )
    targets += [
        target(
            f"HTTP QPS inject / prompt, {tenants_n} users over {tenants_n} tenants",
            qps["inject"] / qps["prompt"],
            ">= 8",
        ),
        target(f"retrieval p50, ms ({facts_n} facts a tenant)", report["retrieval_ms"]["p50"], "<= 1.5"),
        load_failures_target(report["load_failed_chats"]),
    ]
    if "p50_ms" in floors.get("haproxy", {}) and "p50_ms" in floors.get("python", {}):
        targets.append(
            target(
                "ingress floor: high-throughput mode / default proxy (same app, same run)",
                floors["haproxy"]["p50_ms"] / floors["python"]["p50_ms"],
                "<= 0.4",
            )
        )
    report["targets"] = targets
    write_report(out, report)


def arena_warnings() -> list[str]:
    """The engine's device-arena warnings in this run's Ray logs (a working set larger than the arena re-reads
    records on every request, which is then what the TTFT measures)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # no public API names the session's logs
    found = []
    for path in logs.rglob("*.err"):
        found += [
            line.strip()[-300:] for line in path.read_text(errors="replace").splitlines() if "device arena" in line
        ]
    return found[-5:]


if __name__ == "__main__":
    main()
