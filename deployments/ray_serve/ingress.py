"""`Ingress`: the HTTP front (FastAPI) of the cluster; auth, validation, retrieval, routing, metrics.

Retrieval runs here, next to authentication: queries that arrive together are embedded in one forward
(on the GPU where there is one), each tenant's vectors and fact metadata live in this process, kept
current from Redis's change log, and a search is one matrix product. The chat then crosses to an LLM
server replica once, as one `ChatTask`, through the tenant-affinity router, streamed back event by event.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from config.settings import load_settings
from deployments.app_args import AppArgs
from deployments.chat_channel import ChannelAddress, ChannelClosed, ChannelPool
from deployments.chat_task import ChatAhead, ChatTask
from deployments.embed_forwarders import Forwarder, InlineForwarder, ProcessForwarder, ThreadForwarder
from deployments.gateway import Gateway
from deployments.http_api import create_app
from deployments.job_queue import JobRunner
from deployments.metrics import Metrics
from deployments.query_batcher import QueryBatcher
from deployments.ray_serve.loopback import bind_replica_grpc_to_node
from deployments.ray_serve.transport import in_this_mode, uses_grpc
from models.minilm import MiniLMEmbedder, query_embedder
from tenants.connect import connect_service
from tenants.residency import Residency

log = logging.getLogger(__name__)
QUERY_BATCH = 32  # most questions embedded in one forward
# A replica killed, restarting or overloaded: the request can be retried against its replacement.
REPLICA_GONE = (RayActorError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)


class ChannelRoutes:
    """Which LLM replica's channel a tenant's chats go to: asked of Serve (its tenant-affinity router picks the
    replica, as for a handle call). Only a tenant's first chat waits for the answer: one older than `ttl_s` is still
    used while a new one is asked for beside it (a tenant chatting every few seconds never waits), so a replica
    added takes its tenants from their first chat after `ttl_s`; a route to a replica whose connection broke is
    forgotten at once."""

    def __init__(self, handle: DeploymentHandle, ttl_s: float) -> None:
        self._handle, self._ttl_s = handle, ttl_s
        self._routes: dict[str, tuple[ChannelAddress, float]] = {}
        self._refreshing: dict[str, asyncio.Task] = {}

    async def address(self, tenant_id: str) -> ChannelAddress:
        known = self._routes.get(tenant_id)
        if known is None:
            return await self._ask(tenant_id)
        if known[1] <= time.monotonic() and tenant_id not in self._refreshing:
            refresh = asyncio.ensure_future(self._ask(tenant_id))
            self._refreshing[tenant_id] = refresh
            refresh.add_done_callback(lambda done: self._refreshed(tenant_id, done))
        return known[0]

    def known(self, tenant_id: str) -> ChannelAddress | None:
        """The tenant's replica if one is known now (no asking)."""
        known = self._routes.get(tenant_id)
        return known[0] if known is not None else None

    def forget(self, address: ChannelAddress) -> None:
        self._routes = {tenant: route for tenant, route in self._routes.items() if route[0] != address}

    async def _ask(self, tenant_id: str) -> ChannelAddress:
        address = await self._handle.channel.remote(tenant_id=tenant_id)
        self._routes[tenant_id] = (address, time.monotonic() + self._ttl_s)
        return address

    def _refreshed(self, tenant_id: str, done: asyncio.Task) -> None:
        self._refreshing.pop(tenant_id, None)
        if not done.cancelled() and done.exception() is not None:  # the route in hand stays; the next chat asks again
            log.warning("asking for tenant %s's LLM replica failed: %s", tenant_id, type(done.exception()).__name__)


class ServeLLMBackend:
    """The LLM server deployment seen through its handle (encodings; chats too, unless they go over the replicas'
    own channels)."""

    def __init__(
        self,
        handle: DeploymentHandle,
        first_event_timeout_s: float = 30.0,
        channel_ttl_s: float | None = None,
        record_dtype: str = "engine",
    ) -> None:
        """`channel_ttl_s`: chats over the replicas' channels, each tenant's replica kept that long (None: Serve's
        handle); `record_dtype`: the LLM replicas' `llm.record_dtype` (`engine` is asked of one, once)."""
        self._record_dtype = record_dtype
        self._asking_record_dtype: asyncio.Future | None = None
        self._handle = in_this_mode(handle)
        self._stream = self._handle.options(stream=True)
        self._routes = ChannelRoutes(self._handle, channel_ttl_s) if channel_ttl_s is not None else None
        self._channels = ChannelPool()
        self.transports = ["grpc" if uses_grpc(self._handle) else "actor"] + (["channel"] if self._routes else [])
        log.info("calls to the LLM servers go over %s", " and ".join(self.transports))
        self._first_event_timeout_s = first_event_timeout_s

    async def chat(self, task: ChatTask, sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The replica's events; a replica that dies or is unavailable mid-request ends them with a retryable 503,
        and so does a chat that no replica starts within `first_event_timeout_s` (none is running: the only one
        is being replaced), rather than waiting for the replacement. `sent` is called once the task is on its way."""
        address: ChannelAddress | None = None
        events: AsyncIterator[dict[str, Any]] | None = None

        async def first_event() -> dict[str, Any]:  # the replica's choice and its first event, under one deadline
            nonlocal address, events
            if self._routes is not None:
                address = await self._routes.address(task.tenant_id)  # waits while no replica runs
                events = self._channels.client(address).chat(task, sent)
            else:
                events = self._stream.chat.remote(task)
                if sent is not None:
                    sent()
            return await events.__anext__()

        try:
            try:
                first = await asyncio.wait_for(first_event(), self._first_event_timeout_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if hasattr(events, "cancel"):  # Serve's response generator; the channel's is closed below
                    events.cancel()
                log.warning("no model replica started a chat within %.0f s", self._first_event_timeout_s)
                yield {
                    "error": {
                        "status": 503,
                        "message": f"no model replica answered within "
                        f"{self._first_event_timeout_s:g} s; retry the request",
                    }
                }
                return
            yield first
            async for event in events:
                yield event
        except (*REPLICA_GONE, ChannelClosed) as exc:
            if address is not None and isinstance(exc, ChannelClosed):
                self._routes.forget(address)  # type: ignore[union-attr]
            log.warning("chat ended by an unavailable model replica: %s", type(exc).__name__)
            yield {"error": {"status": 503, "message": "the model replica became unavailable; retry the request"}}
        finally:
            if events is not None and hasattr(events, "aclose"):  # the channel's: a chat left early is cancelled there
                await events.aclose()

    def ahead(self, note: ChatAhead) -> None:
        """Tell the tenant's replica a chat is coming, where its channel is known and open (else nothing)."""
        address = self._routes.known(note.tenant_id) if self._routes is not None else None
        if address is not None:
            self._channels.client(address).ahead(note)

    def close(self) -> None:
        """Close the connections to the replicas' channels (the ingress replica stops)."""
        self._channels.close()

    async def record_dtype(self) -> str:
        if self._record_dtype != "engine":
            return self._record_dtype
        if self._asking_record_dtype is None:  # the served dtype, which only a replica's engine knows for sure
            self._asking_record_dtype = asyncio.ensure_future(self._ask_record_dtype())
        return await asyncio.shield(self._asking_record_dtype)

    async def _ask_record_dtype(self) -> str:
        try:
            answer = await asyncio.wait_for(self._handle.record_dtype.remote(), self._first_event_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"no model replica named its record dtype within {self._first_event_timeout_s:g} s; resubmit the job"
            ) from None
        finally:
            self._asking_record_dtype = None  # asked again next time, unless this answer is kept below
        self._record_dtype = answer
        return answer

    async def encode(self, api_key: str, tenant_id: str, facts: list[tuple[str, int, str]]) -> dict[str, str]:
        return await self._handle.encode.remote({"api_key": api_key, "tenant_id": tenant_id, "facts": facts})

    async def encode_history(self, api_key: str, tenant_id: str, text: str) -> dict[str, Any]:
        try:
            return await self._handle.encode_history.remote({"api_key": api_key, "tenant_id": tenant_id, "text": text})
        except REPLICA_GONE as exc:
            log.warning("history encoding ended by an unavailable model replica: %s", type(exc).__name__)
            return {"error": {"status": 503, "message": "the model replica became unavailable; retry the request"}}


def _job_runner(args: AppArgs) -> JobRunner:
    """An encoding job (explicit facts, or extraction from a conversation) on this Ray cluster."""
    from encoder_jobs.job import run_job

    # the job writes records where the LLM servers read them: the application's state folder
    settings = load_settings(**{**args.settings, "state_dir": args.state_dir})

    def run(
        job_id: str,
        key: str,
        tenant_id: str,
        path: Path,
        window: int | None,
        neighbours: int | None,
        record_dtype: str | None,
        progress: Callable[[dict], None],
    ) -> dict:
        report = run_job(
            settings,
            redis_url=args.redis(settings),
            key=key,
            tenant_id=tenant_id,
            input_path=path,
            window=window,
            neighbours=neighbours,
            record_dtype=record_dtype,
            progress=lambda r: progress(r.to_dict()),
        )
        return report.to_dict()

    return run


@serve.ingress()
class Ingress:
    """The Serve deployment that answers HTTP: the gateway's routes over this replica's tenant service."""

    def __init__(self, llm: DeploymentHandle, args: dict[str, Any]) -> None:
        bind_replica_grpc_to_node()
        self.args = AppArgs(**args)
        settings = load_settings(**self.args.settings)
        device, way = self.args.ingress.embed_device, self.args.ingress.query_embedding_way
        graphs = self.args.ingress.search_graphs
        if way == "process":  # it starts while this replica does the rest
            forwarder: Forwarder = ProcessForwarder(
                partial(query_embedder, device, QUERY_BATCH),
                spin_s=self.args.ingress.embed_spin_ms / 1000,
                search_graphs=graphs,
            )
        embedder = MiniLMEmbedder(device=device)  # facts written through this replica
        if way == "thread":
            embedder.prepare(QUERY_BATCH)
            forwarder = ThreadForwarder(embedder, graphs)
        elif way == "inline":  # an embedder of its own: no lock shared with the writes' forwards
            forwarder = InlineForwarder(query_embedder(device, QUERY_BATCH), search_graphs=graphs)
        queries = QueryBatcher(forwarder, QUERY_BATCH, copy_bytes=self.args.ingress.search_copy_bytes)
        service = connect_service(
            self.args.redis(settings),
            self.args.state_dir,
            embedder,
            settings.tenants,
            cache_registry=True,
        )
        if admin_key := self.args.admin_key or settings.admin_key:
            service.install_admin_key(admin_key)
        elif (created := service.ensure_admin_key()) is not None:
            log.warning("admin key created (shown once; keep it, set INFERSCALE_ADMIN_KEY): %s", created)
        channel_ttl_s = self.args.ingress.channel_route_ttl_s if self.args.chat_over_channel else None
        timeout_s, record_dtype = self.args.ingress.first_event_timeout_s, self.args.llm.record_dtype
        backend, metrics = ServeLLMBackend(llm, timeout_s, channel_ttl_s, record_dtype), Metrics()
        self._llm_backend = backend
        for transport in backend.transports:
            metrics.llm_transport.labels(transport=transport).set(1)
        metrics.query_embedder_restarts.set_function(lambda: getattr(forwarder, "restarts", 0))
        metrics.search_copy_bytes.set_function(lambda: queries.copy_bytes)
        self.gateway = Gateway(
            service,
            backend,
            self.args.ingress,
            self.args.llm.served_name,
            metrics,
            self.args.state_dir / "jobs",
            _job_runner(self.args),
            extraction_window=self.args.encoding_window,
            queries=queries,
            residency=Residency(service, settings.residency, owner=f"ingress-{uuid.uuid4().hex[:12]}"),
        )
        self._stop = threading.Event()
        interval = settings.residency.flush_interval_s
        threading.Thread(target=self._residency_loop, args=(interval,), name="kv-residency", daemon=True).start()
        if isinstance(forwarder, ProcessForwarder):
            forwarder.wait_ready()  # serve no chat before questions can be embedded

    def _residency_loop(self, interval_s: float) -> None:
        """Retrieval counts to Redis and the K/V budgets applied, off the event loop."""
        while not self._stop.wait(interval_s):
            self.gateway.residency_tick()

    async def check_health(self) -> None:
        """Serve replaces a replica whose query embedder gave up (it failed to start, or its process died
        several times in a row; a single death is answered by a new process). Runs on the loop that serves the
        chats, every few seconds: from the first check on, an embedder's death is answered at once, also in a
        replica no question has reached yet."""
        self.gateway.queries.watch()
        if not self.gateway.queries.alive:
            raise RuntimeError("the query embedder's process cannot be started")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        gateway = getattr(self, "gateway", None)
        if gateway is not None:
            gateway.queries.close()
        backend = getattr(self, "_llm_backend", None)
        if backend is not None:
            backend.close()

    def __serve_build_asgi_app__(self):
        return create_app(self.gateway)
