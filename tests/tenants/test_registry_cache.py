"""The ingress's in-memory tenant registry: served without Redis, never stale past a change Redis announced."""

from __future__ import annotations

import time

import pytest
import redis

from tenants.errors import AuthError
from tenants.redis_meta import RedisMeta


def _raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _settle(cache_meta: RedisMeta, tenant_id: str, field: str, want: str, timeout_s: float) -> str | None:
    """The field as the caching process reads it, once it reads `want` or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        entry = cache_meta.tenant(tenant_id)
        value = None if entry is None else entry.get(field)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


def test_a_cached_entry_is_read_from_memory(redis_url):
    writer, cached = RedisMeta(redis_url), RedisMeta(redis_url, cache_registry=True)
    writer.create_tenant("acme", {"window": 5})
    assert cached.tenant("acme")["window"] == "5"  # subscribes, reads Redis
    assert cached.tenant("acme")["window"] == "5"  # the subscription is confirmed now: kept
    _raw(redis_url).hset("is:t:{acme}", "window", "9")  # behind the cache's back: no announcement
    assert cached.tenant("acme")["window"] == "5"  # so it came from memory
    assert writer.tenant("acme")["window"] == "9"  # a process without the cache reads Redis every time


def test_changes_by_another_process_are_seen_at_once(redis_url):
    writer, cached = RedisMeta(redis_url), RedisMeta(redis_url, cache_registry=True)
    writer.create_tenant("acme", {"key_hash": "old"})
    for _ in range(2):
        cached.tenant("acme")
    writer.update_tenant("acme", {"key_hash": "new"})
    # Redis sends the message before it answers the writer: the next read applies it
    assert cached.tenant("acme")["key_hash"] == "new"
    assert writer.delete_tenant("acme")
    assert cached.tenant("acme") is None


def test_unknown_tenants_are_not_cached(redis_url):
    writer, cached = RedisMeta(redis_url), RedisMeta(redis_url, cache_registry=True)
    for _ in range(2):
        assert cached.tenant("late") is None
    writer.create_tenant("late", {"window": 1})
    assert cached.tenant("late")["window"] == "1"


def test_a_lost_subscription_clears_the_cache_and_recovers(redis_url):
    writer, cached = RedisMeta(redis_url), RedisMeta(redis_url, cache_registry=True)
    writer.create_tenant("acme", {"window": 5})
    for _ in range(2):
        cached.tenant("acme")
    assert cached._registry.live
    _raw(redis_url).execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    _raw(redis_url).hset("is:t:{acme}", "window", "7")  # a change the dead subscription cannot announce
    # the loss is noticed at the next read, which drops every entry and reads Redis
    assert cached.tenant("acme")["window"] == "7"
    assert not cached._registry.live
    deadline = time.monotonic() + 5  # a new subscription is tried a second later, and confirmed
    while not cached._registry.live and time.monotonic() < deadline:
        cached.tenant("acme")
        time.sleep(0.05)
    assert cached._registry.live
    writer.update_tenant("acme", {"window": 8})
    assert cached.tenant("acme")["window"] == "8"


def test_entries_expire_whatever_happens(redis_url):
    cached = RedisMeta(redis_url, cache_registry=True)
    cached._registry._ttl_s = 0.05
    RedisMeta(redis_url).create_tenant("acme", {"window": 5})
    for _ in range(2):
        cached.tenant("acme")
    _raw(redis_url).hset("is:t:{acme}", "window", "6")
    assert _settle(cached, "acme", "window", "6", timeout_s=1.0) == "6"


@pytest.mark.parametrize("change", ["rotate", "delete"])
def test_a_service_with_the_cache_refuses_an_old_key_at_once(make_service, change):
    from tenants.connect import connect_service

    admin_service = make_service()
    admin = admin_service.ensure_admin_key()
    _, key = admin_service.create_tenant(admin, "acme")
    ingress = connect_service(
        admin_service.meta.url, admin_service.records.root.parent, admin_service.embedder, cache_registry=True
    )
    for _ in range(2):
        assert ingress.authenticate(key).id == "acme"
    if change == "rotate":
        new_key = admin_service.rotate_key(admin, "acme")
        assert ingress.authenticate(new_key).id == "acme"
    else:
        admin_service.delete_tenant(admin, "acme")
    with pytest.raises(AuthError):
        ingress.authenticate(key)
