"""A tenant's history is named in its registry entry in one step with reading the one it replaces, so concurrent
writers each delete what they replaced, and a late write never brings a deleted tenant back."""

import time

import pytest

from tenants.errors import TenantError


def test_each_write_gets_the_history_it_replaced_and_readers_see_the_newest(service, admin):
    _, key = service.create_tenant(admin, "hist")
    first, second = service.open_tenant(key, "hist"), service.open_tenant(key, "hist")  # two writers
    assert first.set_history("history-a", 100) is None
    assert second.set_history("history-b", 50) == "history-a"  # its entry was read before a was named
    assert first.set_history("history-c", 70) == "history-b"
    entry = service.open_tenant(key, "hist").entry
    assert (entry.history, entry.history_tokens) == ("history-c", 70)


def test_a_deleted_tenant_is_not_brought_back_by_a_late_history(service, admin):
    _, key = service.create_tenant(admin, "gone")
    tenant = service.open_tenant(key, "gone")
    service.delete_tenant(admin, "gone")
    with pytest.raises(TenantError):
        tenant.set_history("history-late", 10)
    _, again = service.create_tenant(admin, "gone")  # the id is free: no stray entry was written
    assert service.open_tenant(again, "gone").entry.history is None


def test_replicas_report_where_the_history_chunks_are_held_and_a_reader_counts_its_own_historys(
    service, admin, redis_url
):
    """A history's chunk records are placed as facts are, per record and replica: its reader counts the current
    history's chunks by the highest tier any replica holds them in, and each replica's own; an eviction, a replaced
    history's chunks, a restarted replica and a deleted tenant leave no count behind."""
    from kvcore.history_index import chunk_record_id
    from tenants.placement import PlacementWriter
    from tenants.redis_meta import RedisMeta

    _, key = service.create_tenant(admin, "placed")
    tenant = service.open_tenant(key, "placed")
    assert tenant.history_placement() == {"tiers": {"gpu": 0, "cpu": 0, "disk": 0}, "replicas": {}}
    tenant.set_history("history-a1", 64)
    tenant = service.open_tenant(key, "placed")
    one, two = PlacementWriter(RedisMeta(redis_url), "h-slot0"), PlacementWriter(RedisMeta(redis_url), "h-slot1")
    for chunk, tier in enumerate(("gpu", "gpu", "cpu", "disk")):
        one(tenant.id, chunk_record_id("history-a1", chunk), (1, 2), tier)
    two(tenant.id, chunk_record_id("history-a1", 3), (1, 2), "cpu")  # chunk 3: disk on one, host memory on two
    one(tenant.id, chunk_record_id("history-a", 0), (1, 2), "gpu")  # another history whose id is a's prefix
    one(tenant.id, "chat-frame-abc", (1,), "gpu")  # neither a fact nor a chunk: ignored
    assert one.flush() and two.flush()
    placed = tenant.history_placement()
    assert placed["tiers"] == {"gpu": 2, "cpu": 2, "disk": 0}
    assert placed["replicas"] == {
        "h-slot0": {"gpu": 2, "cpu": 1, "disk": 1},
        "h-slot1": {"gpu": 0, "cpu": 1, "disk": 0},
    }
    one(tenant.id, chunk_record_id("history-a1", 0), (1, 2), None)  # evicted from h-slot0
    assert one.flush()
    assert tenant.history_placement()["tiers"] == {"gpu": 1, "cpu": 2, "disk": 0}
    tenant.set_history("history-b", 32)  # replaced: a's chunks are not b's
    assert service.open_tenant(key, "placed").history_placement()["tiers"] == {"gpu": 0, "cpu": 0, "disk": 0}
    tenant.set_history("history-a1", 64)
    restarted = PlacementWriter(RedisMeta(redis_url), "h-slot1").start()  # forgets what h-slot1 said before
    deadline = time.monotonic() + 5
    while "h-slot1" in service.open_tenant(key, "placed").history_placement()["replicas"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    restarted.close()
    service.delete_tenant(admin, "placed")
    assert not RedisMeta(redis_url)._redis.exists(f"is:t:{{{tenant.id}}}:hplace")
