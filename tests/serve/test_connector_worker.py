"""The connector's worker as the LLM replica builds it: placements reported in Redis with or without lower tiers."""

import time

import pytest
import redis
import torch

from config.connector import ConnectorConfig
from config.settings import TenantSettings
from deployments.connector_worker import REPLICA_SLOTS, ConnectorWorker
from kvcore.history_index import chunk_record_id
from kvcore.paged import PagedLayout
from kvcore.replica_slot import ReplicaSlot, release_slot
from kvcore.store import LocalFactStore
from tenants.connect import connect_service
from tests.core.factories import ROPE
from tests.tenants.conftest import WordEmbedder

FP = "f" * 24


@pytest.fixture()
def redis_url(redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


def built(tmp_path, redis_url) -> ConnectorWorker:
    """A worker with a device arena and no lower tiers, its arena registered over small CPU caches."""
    config = ConnectorConfig(
        store_root=tmp_path / "records",
        fingerprint=FP,
        device_cache_bytes=1 << 20,
        report_placement=True,
        placement_redis_url=redis_url,
    )
    worker = ConnectorWorker.build(config, LocalFactStore(config.store_root), ROPE, torch.device("cpu"))
    worker.injection.register({f"l{i}": torch.zeros(16, 2, 4, 16) for i in range(3)}, PagedLayout("rows", 4, 2, 8))
    return worker


def placed_when(tenant, until, timeout_s: float = 10.0) -> dict:
    """The tenant's history placement (what `GET /v1/history` shows) once `until(it)` holds: the writer flushes
    every 200 ms."""
    deadline = time.monotonic() + timeout_s
    while not until(placed := tenant.history_placement()):
        assert time.monotonic() < deadline, placed
        time.sleep(0.05)
    return placed


def test_a_worker_without_tiers_reports_its_arena_under_a_slot_that_a_restart_takes_back(tmp_path, redis_url):
    """No tiers: the arena's records are still placed in Redis, under a slot claimed beside the record store. The
    slot's name outlives the process: a replica started after it ends takes the name back and clears what the
    old one reported, so a restart leaves no stale placement behind (a per-process name would)."""
    service = connect_service(redis_url, tmp_path / "tenants", WordEmbedder(), TenantSettings())
    _, key = service.create_tenant(service.ensure_admin_key(), "placed")
    tenant = service.open_tenant(key, "placed")
    tenant.set_history("history-a1", 32)
    tenant = service.open_tenant(key, "placed")
    worker = built(tmp_path, redis_url)
    first = worker.placement.replica
    assert worker.tiers is None and first.endswith("-slot0")
    assert (tmp_path / REPLICA_SLOTS / first).is_dir()
    k = torch.randn(3, 2, 16, 8)
    worker.injection.admit_captured(
        tenant.id, [(chunk_record_id("history-a1", chunk), (1, chunk), k, k.neg()) for chunk in range(2)]
    )
    held = {"gpu": 2, "cpu": 0, "disk": 0}
    assert placed_when(tenant, lambda p: p["tiers"]["gpu"] == 2) == {"tiers": held, "replicas": {first: held}}

    beside = built(tmp_path, redis_url)  # another replica while the first lives: a slot of its own
    assert beside.placement.replica.endswith("-slot1")
    beside.close()

    worker.close()
    release_slot(ReplicaSlot(first, tmp_path / REPLICA_SLOTS / first))  # what the process's exit would do
    restarted = built(tmp_path, redis_url)
    try:
        assert restarted.placement.replica == first
        assert placed_when(tenant, lambda p: not p["replicas"])["tiers"] == {"gpu": 0, "cpu": 0, "disk": 0}
    finally:
        restarted.close()


@pytest.mark.parametrize("pin", [True, False])
def test_a_worker_with_tiers_page_locks_its_host_tier_as_it_is_built_unless_told_not_to(tmp_path, monkeypatch, pin):
    """The host tier is page-locked while the worker is built (before the engine captures its graphs), so no
    serving step pays for it; `pin_host_at_start: false` leaves it to the steps."""
    from config.connector import TierConfig
    from kvcore.tiers import TieredStore

    reserved = []
    monkeypatch.setattr(TieredStore, "reserve_host", lambda self: reserved.append(self) or 0.0)
    config = ConnectorConfig(
        store_root=tmp_path / "records",
        fingerprint=FP,
        tiers=TierConfig(disk_cache_dir=tmp_path / "tiers", host_cache_bytes=1 << 20, pin_host_at_start=pin),
    )
    worker = ConnectorWorker.build(config, LocalFactStore(config.store_root), ROPE, torch.device("cpu"))
    try:
        assert reserved == ([worker.tiers] if pin else [])
    finally:
        worker.close()
