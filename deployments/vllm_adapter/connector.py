"""`InferscaleConnector`: vLLM's KV connector interface, forwarding to the engine-agnostic injector.

Loaded by vLLM from `kv_connector_module_path`, in the scheduler and in every worker process. The extra
config (`kv_connector_extra_config`) is a `config.connector.ConnectorConfig`, parsed once here; each
method is a one-line forward to `InjectionScheduler` (scheduler role) or to the worker side
(`InjectionWorker` and `CaptureWorker`, with the tiers, replica slot, placement writer and kernels that
`deployments.connector_worker` builds from the config); version drift of vLLM stays in this file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from config.connector import ConnectorConfig
from deployments.connector_worker import ConnectorWorker
from kvcore.capture import CaptureSpec, CaptureTracker
from kvcore.errors import PlanError
from kvcore.injection_scheduler import InjectionScheduler, LoadSpec
from kvcore.load_sources import LoadSources
from kvcore.paged import detect_layout
from kvcore.plan import CapturePlan
from kvcore.rope import RopeConfig
from kvcore.store import LocalFactStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
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
        config = ConnectorConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        store = LocalFactStore(config.store_root)
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: InjectionScheduler | None = None
        self._tracker = CaptureTracker()
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = InjectionScheduler(store, config.fingerprint, config.on_load_failure, self._block_size)
        else:
            rope = RopeConfig.from_hf_config(vllm_config.model_config.hf_config.to_dict())
            self._worker = ConnectorWorker.build(config, store, rope, vllm_config.device_config.device)

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
        tokens = self._scheduler.match(
            request.request_id, request.prompt_token_ids or [], request.kv_transfer_params, num_computed_tokens
        )
        return tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        loads = self._scheduler.take_loads()
        if not self._tracker:  # no capture waits: the step's requests need not be walked (every step, ~100 of them)
            return InferscaleMetadata(loads=loads)
        counts = scheduler_output.num_scheduled_tokens
        steps = [
            (r.req_id, r.block_ids[0], r.num_computed_tokens, counts.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            steps.append((req_id, blocks[0] if blocks else None, cached.num_computed_tokens[i], counts.get(req_id, 0)))
        return InferscaleMetadata(loads=loads, captures=self._tracker.step(steps))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if connector_output.invalid_block_ids:  # loads the workers failed: the engine recomputes their tokens
            self._scheduler.loads_failed(connector_output.invalid_block_ids)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracker.drop(request.request_id)
        return False, self._scheduler.finished(request.request_id)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        name, cache = next(iter(kv_caches.items()))
        model = self._vllm_config.model_config
        layout = detect_layout(
            cache,
            self._block_size,
            model.get_total_num_kv_heads(),
            model.get_head_size(),
            engine_write=self._engine_writer(name),
        )
        log.info("paged KV layout: %s", layout)
        self._worker.injection.register(kv_caches, layout)
        self._worker.capture.register(self._worker.injection.layer_index, layout)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, InferscaleMetadata):
            metadata = InferscaleMetadata()
        self._worker.injection.start(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.injection.load_layer(layer_name)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Only requests with a capture plan are read back; serving traffic is never stored."""
        metadata = self._get_connector_metadata()
        if isinstance(metadata, InferscaleMetadata) and metadata.captures:
            self._worker.capture.save_layer(layer_name, kv_layer, metadata.captures)

    def wait_for_save(self) -> None:
        self._worker.capture.end_step()
        self._worker.injection.finish_step()

    def load_sources(self) -> LoadSources:
        """Where this worker's loads found their records (counted while a benchmark has it on)."""
        return self._worker.injection.sources

    def tier_counters(self) -> dict[str, int]:
        """Running counts of arena evictions, tier entries put and host segments page-locked (`InjectionWorker`)."""
        return self._worker.injection.tier_counters()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.injection.take_failed_blocks()

    def _engine_writer(self, layer_name: str):
        """The attention backend's own cache-write path, used to probe the layout on a scratch cache."""
        layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
        impl = layer.impl
        if not hasattr(layer, "isa") and type(impl).__module__.endswith("cpu_attn"):
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            layer.isa = _get_attn_isa(
                self._vllm_config.model_config.dtype, self._block_size, self._vllm_config.model_config.get_head_size()
            )

        def write(scratch: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
            impl.do_kv_cache_update(layer, k, v, scratch, slots)

        return write
