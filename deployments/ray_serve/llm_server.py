"""`LLMServer`: one Serve replica hosting a vLLM async engine with the KV-injection connector.

The constructor builds and warms the engine before the replica reports ready, so no request waits for
a cold engine. Chats stream events from `MemoryEngine.chat`; a request the engine cannot take (too long
for the context) answers an error event with a 4xx status instead of failing the stream.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import ray
import torch

from config.connector import ConnectorConfig
from config.settings import load_settings
from deployments.app_args import AppArgs
from deployments.chat_channel import ChannelAddress, ChannelServer
from deployments.chat_task import ChatTask
from deployments.loop_lag import LoopLag
from deployments.ray_serve.channel_load import ReportsChannelLoad
from deployments.ray_serve.loopback import bind_replica_grpc_to_node
from deployments.vllm_adapter.async_engine import MemoryEngine
from kvcore.errors import KVCoreError
from models.loader import checkpoint_fingerprint, model_path
from models.minilm import MiniLMEmbedder
from tenants.connect import connect_service
from tenants.errors import TenantError

log = logging.getLogger(__name__)


def build_engine(args: AppArgs) -> MemoryEngine:
    """The replica's engine from the application's arguments (benchmarks build the same one without Serve)."""
    os.environ.update(args.llm.env)  # VLLM_* knobs, read by vLLM itself
    settings = load_settings(**args.settings)
    model_settings = settings.model.model_copy(update={"path": args.llm.model, "dtype": args.llm.dtype})
    path = model_path(model_settings)
    # the connector's worker records placements in the app's Redis (arena only, or tiers too); a URL with a password
    # stays out of the engine's config (vLLM may log it): the worker then reads the settings tree's
    placement_url = args.redis_url if args.redis_url and not urlsplit(args.redis_url).password else None
    connector = ConnectorConfig(
        store_root=args.state_dir / "records",
        fingerprint=args.llm.fingerprint or checkpoint_fingerprint(path),
        on_load_failure=args.llm.on_load_failure,
        device_cache_bytes=args.llm.device_cache_bytes,
        device_tenant_bytes=args.llm.device_tenant_bytes,
        tiers=args.llm.tiers,
        record_dtype=args.llm.record_dtype,
        record_precision=args.llm.record_precision,
        arena_precision=args.llm.arena_precision,
        report_placement=True,
        placement_redis_url=placement_url,
    )
    return MemoryEngine(
        path,
        connector,
        args.system_prompt,
        engine_kwargs=args.engine_kwargs(torch.cuda.is_available()),
        max_encodes_in_flight=args.llm.max_encodes_in_flight,
        history_scoring_layers=args.llm.history_scoring_layers,
    )


_OUT_OF_MEMORY = "the model replica is out of device memory for this request; retry later"
GRACEFUL_SHUTDOWN_S = 20  # Serve's wait for a stopping replica (`build_app`)
CHANNEL_DRAIN_S = GRACEFUL_SHUTDOWN_S - 5  # of it, what the channel's running chats get to end


class LLMServer(ReportsChannelLoad):
    """The Serve deployment hosting one vLLM engine with the memory connector."""

    async def __init__(self, args: dict[str, Any]) -> None:
        bind_replica_grpc_to_node()
        self.args = AppArgs(**args)
        self.engine = build_engine(self.args)
        settings = load_settings(**self.args.settings)
        self.service = connect_service(
            self.args.redis(settings), self.args.state_dir, MiniLMEmbedder(), settings.tenants
        )
        await self.engine.warm_up()
        # chats may come over this replica's own socket instead of Serve's handle (`ingress.chat_transport`)
        self._channel = ChannelServer(
            self.chat,
            ray.util.get_node_ip_address(),
            self.args.llm.max_ongoing_requests,
            ahead=self.engine.prepare,
            ahead_spin_s=self.args.llm.ahead_spin_ms / 1000,
        )
        await self._channel.start()
        self._loop_lag = LoopLag(self.args.llm.loop_lag_probe_ms / 1000) if self.args.llm.loop_lag_probe_ms else None
        if self._loop_lag is not None:
            self._loop_lag.start()
        log.info(
            "LLM server ready: %s (fingerprint %s, %s)",
            self.engine.model_name,
            self.engine.fingerprint,
            "cuda" if torch.cuda.is_available() else "cpu",
        )

    async def chat(self, task: ChatTask) -> AsyncIterator[dict[str, Any]]:
        try:
            async for event in self.engine.chat(task):
                yield event
        except ValueError as exc:  # the engine's own validation (context length, sampling values)
            yield {"error": {"status": 400, "message": str(exc)}}
        except torch.OutOfMemoryError:  # the device is shared (engine, arena, history indexes, embedders)
            log.warning("chat for tenant %s ran out of device memory", task.tenant_id)
            yield {"error": {"status": 503, "message": _OUT_OF_MEMORY}}

    def channel(self, tenant_id: str) -> ChannelAddress:
        """Where this replica's chat channel listens (asked through Serve, so the tenant-affinity router picks the
        replica that serves `tenant_id`, and the token travels on Ray's own connections)."""
        return self._channel.address

    def record_dtype(self) -> str:
        """The dtype this replica's captures store records in (`llm.record_dtype`, `engine` resolved)."""
        return self.engine.record_dtype

    async def encode(self, request: dict[str, Any]) -> dict[str, str]:
        """Encode a tenant's facts with this replica's engine and attach their K/V (the caller's key opens the tenant)."""
        try:
            tenant = self.service.open_tenant(request["api_key"], request["tenant_id"])
        except TenantError as exc:
            return {fact_id: f"refused: {exc}" for fact_id, _, _ in request["facts"]}
        facts = [(str(f), int(v), str(t)) for f, v, t in request["facts"]]
        return await self.engine.encode_facts(tenant.id, facts, tenant.attach_kv)

    async def encode_history(self, request: dict[str, Any]) -> dict[str, Any]:
        """Capture a tenant's conversation history in chunks with this replica's engine and make it the one history
        mode serves (the history it replaces is deleted); an `error` with a status when it cannot."""
        try:
            tenant = self.service.open_tenant(request["api_key"], request["tenant_id"])
        except TenantError as exc:
            return {"error": {"status": exc.http_status, "message": str(exc)}}
        history_id = f"history-{uuid.uuid4().hex[:12]}"
        try:
            counts = await self.engine.encode_history(tenant.id, history_id, str(request["text"]))
        except ValueError as exc:  # empty, or longer than the model's context
            self.engine.drop_history(tenant.id, history_id)
            return {"error": {"status": 422, "message": str(exc)}}
        except (KVCoreError, OSError) as exc:  # the capture left a chunk unwritten: nothing of it is kept
            log.warning("history capture for tenant %s failed: %s", tenant.id, exc)
            self.engine.drop_history(tenant.id, history_id)
            return {"error": {"status": 503, "message": f"the history could not be stored ({exc}); retry"}}
        except torch.OutOfMemoryError:  # its index did not fit beside the rest: nothing of it is kept
            log.warning("history of tenant %s: out of device memory", tenant.id)
            self.engine.drop_history(tenant.id, history_id)
            return {"error": {"status": 503, "message": _OUT_OF_MEMORY}}
        try:
            replaced = tenant.set_history(history_id, counts["tokens"])
        except TenantError as exc:  # deleted meanwhile: keep none of it
            self.engine.drop_history(tenant.id, history_id)
            return {"error": {"status": exc.http_status, "message": str(exc)}}
        if replaced is not None and replaced != history_id:
            self.engine.drop_history(tenant.id, replaced)
        return {"history_id": history_id, **counts}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def loop_lag(self) -> dict[str, float]:
        """How late this replica's event loop woke since the last call (`llm.loop_lag_probe_ms`; a benchmark's
        handle call, not on the HTTP API); `samples` 0 with the probe off. On the loop itself, as the probe."""
        return self._loop_lag.take() if self._loop_lag is not None else {"samples": 0}

    async def profile(self, on: bool) -> None:
        """Start or stop the engine's torch profiler (a benchmark's handle call; not on the HTTP API)."""
        await self.engine.profile(on)

    async def __del__(self) -> None:
        """Serve's shutdown of this replica (after the requests Serve routed have ended): the channel's chats are
        let finish first, new ones sent elsewhere, then the engine stops."""
        if getattr(self, "_loop_lag", None) is not None:
            self._loop_lag.stop()
        if self._channel is not None:
            await self._channel.drain(CHANNEL_DRAIN_S)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
