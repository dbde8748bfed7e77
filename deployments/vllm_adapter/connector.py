"""`InferscaleConnector`: vLLM's KV connector interface, forwarding to the engine-agnostic injector.

Loaded by vLLM from `kv_connector_module_path`, in the scheduler and in every worker process. Each
method is a one-line forward to `InjectionScheduler` (scheduler role) or `InjectionWorker` (worker
role); version drift of vLLM stays in this file. Extra config (`kv_connector_extra_config`):
`store_root` (a LocalFactStore directory), `fingerprint` (of the served model), `on_load_failure`
(`recompute` or `fail`, mirrored in vLLM's `kv_load_failure_policy`), `device_cache_bytes` (the size of the
worker's device arena of records), `device_tenant_bytes` (one tenant's share of it; unset: no cap); with `disk_cache_dir` set, the worker claims a replica slot under it
(`kvcore.replica_slot`) and records evicted from the arena spill to pinned host memory (`host_cache_bytes`)
and that slot's disk folder (at most `disk_cache_bytes`, unset: no cap), int8 unless `compress_lower` is false, and come back whole before the forward
(loads up to `whole_load_bytes`, default 1 GiB) or layer by layer during it.
`fused_kernel` (default true) lets CUDA workers write arena-resident steps with the Triton kernel of
`deployments.triton_adapter` when the cache layout allows it. `report_placement` (default false) writes
where each fact's K/V is held (tier, this replica's slot name, version) to the Redis of the settings tree.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES
from kvcore.capture import CaptureSpec, CaptureTracker, CaptureWorker
from kvcore.errors import PlanError
from kvcore.injection import InjectionScheduler, InjectionWorker, LoadSpec
from kvcore.paged import detect_layout
from kvcore.plan import CapturePlan
from kvcore.replica_slot import claim_slot
from kvcore.rope import RopeConfig
from kvcore.store import LocalFactStore
from kvcore.tiers import TieredStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class InferscaleMetadata(KVConnectorMetadata):
    """Scheduler-to-worker data of one step: the loads to perform and the spans to capture."""

    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)


class InferscaleConnector(KVConnectorBase_V1):
    """Injects memory K/V into vLLM's paged cache, and captures the engine's own K/V as records."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        missing = [key for key in ("store_root", "fingerprint") if key not in extra]
        if missing:
            raise ValueError(f"InferscaleConnector needs kv_connector_extra_config keys {missing} "
                             "(use deployments.vllm_adapter.engine.kv_transfer_config)")
        store = LocalFactStore(Path(extra["store_root"]))
        fingerprint = str(extra["fingerprint"])
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: InjectionScheduler | None = None
        self._tracker = CaptureTracker()
        self._worker: InjectionWorker | None = None
        self._capture: CaptureWorker | None = None
        self._placement = None
        self._tiers: TieredStore | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = extra.get("on_load_failure", "recompute")
            self._scheduler = InjectionScheduler(store, fingerprint, policy)
        else:
            rope = RopeConfig.from_hf_config(vllm_config.model_config.hf_config.to_dict())
            tiers, replica = None, f"{socket.gethostname()}-pid{os.getpid()}"
            if extra.get("disk_cache_dir"):  # lower tiers below the device arena (pinned host, then disk)
                slot = claim_slot(Path(extra["disk_cache_dir"]))
                tiers = TieredStore(vllm_config.device_config.device, 0, int(extra.get("host_cache_bytes", 1 << 30)),
                                    slot.path, compress_lower=bool(extra.get("compress_lower", True)), write_behind=True,
                                    disk_bytes=_optional_int(extra.get("disk_cache_bytes")))
                replica = slot.name
            self._tiers = tiers
            self._placement = _placement_writer(replica) if extra.get("report_placement", False) else None
            kernels = bool(extra.get("fused_kernel", True))  # the Triton kernels, where they apply
            self._worker = InjectionWorker(store, fingerprint, rope, int(extra.get("device_cache_bytes", DEFAULT_DEVICE_CACHE_BYTES)),
                                           tiers=tiers, step_writer=_triton_kernel("fused_inject", "fused_row_writer") if kernels else None,
                                           placement=self._placement,
                                           whole_load_bytes=int(extra.get("whole_load_bytes", 1 << 30)),
                                           device_tenant_bytes=_optional_int(extra.get("device_tenant_bytes")),
                                           packed_inserter=_triton_kernel("packed_insert", "insert_packed_kernel") if kernels else None)
            self._capture = CaptureWorker(store, fingerprint, rope)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            capture = CapturePlan.from_params(request.kv_transfer_params)
        except PlanError as exc:
            log.warning("request %s: %s", request.request_id, exc)
            return 0, False
        if capture is not None:
            self._tracker.add(request.request_id, capture, request.prompt_token_ids or [])
            return 0, False
        tokens = self._scheduler.match(request.request_id, request.prompt_token_ids or [],
                                       request.kv_transfer_params, num_computed_tokens)
        return tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        counts = scheduler_output.num_scheduled_tokens
        steps = [(r.req_id, r.block_ids[0], r.num_computed_tokens, counts.get(r.req_id, 0))
                 for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            steps.append((req_id, blocks[0] if blocks else None, cached.num_computed_tokens[i], counts.get(req_id, 0)))
        return InferscaleMetadata(loads=self._scheduler.take_loads(), captures=self._tracker.step(steps))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracker.drop(request.request_id)
        return False, self._scheduler.finished(request.request_id)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        name, cache = next(iter(kv_caches.items()))
        model = self._vllm_config.model_config
        layout = detect_layout(cache, self._block_size, model.get_total_num_kv_heads(), model.get_head_size(),
                               engine_write=self._engine_writer(name))
        log.info("paged KV layout: %s", layout)
        self._worker.register(kv_caches, layout)
        self._capture.register(self._worker.layer_index, layout)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, InferscaleMetadata):
            metadata = InferscaleMetadata()
        self._worker.start(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.load_layer(layer_name)

    def shutdown(self) -> None:
        if self._tiers is not None:
            self._tiers.close()  # disk files still being written are finished
        if self._placement is not None:
            self._placement.close()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Only requests with a capture plan are read back; serving traffic is never stored."""
        metadata = self._get_connector_metadata()
        if isinstance(metadata, InferscaleMetadata) and metadata.captures:
            self._capture.save_layer(layer_name, kv_layer, metadata.captures)

    def wait_for_save(self) -> None:
        self._capture.end_step()
        self._worker.finish_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def _engine_writer(self, layer_name: str):
        """The attention backend's own cache-write path, used to probe the layout on a scratch cache."""
        layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
        impl = layer.impl
        if not hasattr(layer, "isa") and type(impl).__module__.endswith("cpu_attn"):
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            layer.isa = _get_attn_isa(self._vllm_config.model_config.dtype, self._block_size,
                                      self._vllm_config.model_config.get_head_size())

        def write(scratch: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
            impl.do_kv_cache_update(layer, k, v, scratch, slots)

        return write


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _placement_writer(replica: str):
    """A writer of this worker's placements to the settings tree's Redis, or None without one."""
    from config.settings import load_settings
    from tenants.placement import PlacementWriter
    from tenants.redis_meta import RedisMeta

    url = load_settings().redis.url
    if not url:
        log.warning("report_placement is set but INFERSCALE_REDIS__URL is not: placements are not recorded")
        return None
    return PlacementWriter(RedisMeta(url), replica).start()


def _triton_kernel(module: str, name: str):
    """`name` from `deployments.triton_adapter.<module>` (a kernel or its factory), or None where Triton is not
    installed (the torch paths then)."""
    try:
        return getattr(importlib.import_module(f"deployments.triton_adapter.{module}"), name)
    except ImportError as exc:
        log.info("Triton kernel %s unavailable: %s", name, exc)
        return None
