"""`ConnectorWorker`: the worker side of the KV connector, built from its typed config, engine-agnostic.

It owns what a worker process needs beside the engine: the injector (`kvcore.injection.InjectionWorker`)
with its device arena, the lower tiers in this engine's replica slot, the writer of placements to Redis,
the Triton kernels where they load, and the capture of encoded facts. The vLLM connector only forwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from config.connector import ConnectorConfig
from deployments.triton_adapter import optional_kernel
from kvcore.capture import CaptureWorker
from kvcore.injection import InjectionWorker
from kvcore.record import dtype_by_name
from kvcore.replica_slot import claim_slot
from kvcore.rope import RopeConfig
from kvcore.store import LocalFactStore
from kvcore.tiers import TieredStore

log = logging.getLogger(__name__)
REPLICA_SLOTS = "replica-slots"  # beside the record store: the names of replicas that report placements without tiers


@dataclass
class ConnectorWorker:
    """One worker process's injection, capture and what they hold open (tiers, placement writer)."""

    injection: InjectionWorker
    capture: CaptureWorker
    tiers: TieredStore | None = None
    placement: Any = None  # tenants.placement.PlacementWriter

    @classmethod
    def build(cls, config: ConnectorConfig, store: LocalFactStore, rope: RopeConfig, device: Any) -> "ConnectorWorker":
        tiers, slot = None, None
        if config.tiers is not None:  # lower tiers below the device arena (pinned host, then disk)
            slot = claim_slot(config.tiers.disk_cache_dir)
            tiers = TieredStore(
                device,
                config.tiers.host_cache_bytes,
                slot.path,
                compress_lower=config.tiers.compress_lower,
                write_behind=True,
                disk_bytes=config.tiers.disk_cache_bytes,
            )
            if config.tiers.pin_host_at_start:  # the worker is built before the engine captures its CUDA graphs
                tiers.reserve_host()
        placement = None
        if config.report_placement:
            # a slot's name outlives the process, so a restarted replica takes back (and first clears) its own
            # placements; without tiers the slot is claimed beside the record store, for its name alone
            slot = slot or claim_slot(Path(config.store_root).parent / REPLICA_SLOTS)
            placement = _placement_writer(slot.name, config.placement_redis_url)
        kernels, record_dtype = config.fused_kernel, _record_dtype(config.record_dtype)
        injection = InjectionWorker(
            store,
            config.fingerprint,
            rope,
            config.device_cache_bytes,
            tiers=tiers,
            step_writer=optional_kernel("fused_inject", "fused_row_writer") if kernels else None,
            placement=placement,
            whole_load_bytes=config.whole_load_bytes,
            device_tenant_bytes=config.device_tenant_bytes,
            packed_inserter=optional_kernel("packed_insert", "insert_packed_kernel") if kernels else None,
            record_dtype=record_dtype,
            arena_precision=config.arena_precision,
        )
        return cls(
            injection,
            CaptureWorker(store, config.fingerprint, rope, record_dtype, on_stored=injection.admit_captured),
            tiers,
            placement,
        )

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()  # disk files still being written are finished
        if self.placement is not None:
            self.placement.close()


def _placement_writer(replica: str, url: str | None):
    """A writer of this worker's placements to Redis (`url`, else the settings tree's), or None without one."""
    from config.settings import load_settings
    from tenants.placement import PlacementWriter
    from tenants.redis_meta import RedisMeta

    url = url or load_settings().redis.url
    if not url:
        log.warning(
            "report_placement is set but no Redis URL is known (INFERSCALE_REDIS__URL): placements are not recorded"
        )
        return None
    return PlacementWriter(RedisMeta(url), replica).start()


def _record_dtype(name: str) -> torch.dtype | None:
    """The configured record dtype as torch's; None for the engine's own."""
    return None if name == "engine" else dtype_by_name(name)
