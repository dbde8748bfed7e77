"""Retrieval indexes kept current by the change feed: no Redis round trip while a tenant is unchanged, every
announced change found by the next search, a deleted and re-created tenant never served its old facts."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from tenants.connect import connect_service
from tenants.index_mirror import Found, MirrorIndexes, MirrorLedger, SearchAsk, copy_bytes


def _reader(writer_service):
    """A second process's view of the same store (the ingress: change feed on)."""
    return connect_service(
        writer_service.meta.url, writer_service.records.root.parent, writer_service.embedder, cache_registry=True
    )


def _soon(search, want, timeout_s: float = 1.0):
    """The search's texts once they equal `want` or `timeout_s` has passed. Redis writes the announcement in
    the same pass of its event loop as the writer's answer, not always before it: microseconds later."""
    deadline = time.monotonic() + timeout_s
    while (found := [f.text for f, _ in search()]) != want and time.monotonic() < deadline:
        time.sleep(0.002)
    return found


def _acme(make_service, fact: str):
    """(writer service, admin key, tenant key, reader service) of a tenant `acme` holding `fact`."""
    writer = make_service()
    admin = writer.ensure_admin_key()
    _, key = writer.create_tenant(admin, "acme")
    writer.authenticate(key).add_facts([fact])
    return writer, admin, key, _reader(writer)


def _count_log_reads(service) -> list[str]:
    calls: list[str] = []
    original = service.meta.log.log_since

    def counted(tenant_id, last_id, count=10_000):
        calls.append(tenant_id)
        return original(tenant_id, last_id, count)

    service.meta.log.log_since = counted
    return calls


def test_an_unchanged_tenant_is_searched_without_a_round_trip_and_a_change_is_seen_at_once(make_service):
    writer, admin, key, reader = _acme(make_service, "Maya has a grey cat called Pixel.")
    reads = _count_log_reads(reader)
    tenant = reader.authenticate(key)
    for _ in range(3):
        assert [f.text for f, _ in tenant.search("cat", 5)] == ["Maya has a grey cat called Pixel."]
    assert len(reads) <= 2  # caught up once (twice if the subscription was confirmed in between), then quiet
    before = len(reads)
    writer.authenticate(key).add_facts(["Maya works at the aquarium."])
    both = ["Maya works at the aquarium.", "Maya has a grey cat called Pixel."]
    assert _soon(lambda: tenant.search("aquarium", 5), both) == both
    assert len(reads) == before + 1  # one catch-up, when the announcement arrived
    fact_id = next(f.id for f, _ in tenant.search("aquarium", 1))
    writer.authenticate(key).delete_fact(fact_id)
    assert _soon(lambda: tenant.search("aquarium", 5), both[1:]) == both[1:]


def test_a_recreated_tenant_is_never_served_its_old_facts(make_service):
    writer, admin, key, reader = _acme(make_service, "The vault code is 4417.")
    for _ in range(2):
        assert reader.authenticate(key).search("vault code", 5)
    writer.delete_tenant(admin, "acme")
    _, new_key = writer.create_tenant(admin, "acme")  # the same id, someone else's now, with no facts yet
    assert _soon(lambda: reader.authenticate(new_key).search("vault code", 5), []) == []
    writer.authenticate(new_key).add_facts(["Tea is served at four."])
    tea = ["Tea is served at four."]
    assert _soon(lambda: reader.authenticate(new_key).search("vault code", 5), tea) == tea


def test_without_a_live_feed_every_search_catches_up_with_redis(make_service):
    writer, admin, key, reader = _acme(make_service, "Maya has a grey cat called Pixel.")
    tenant = reader.authenticate(key)
    for _ in range(2):
        tenant.search("cat", 5)
    reads = _count_log_reads(reader)
    redis.Redis.from_url(writer.meta.url).execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    for _ in range(3):  # the loss is noticed at the next search; until a new subscription, Redis every time
        tenant.search("cat", 5)
    assert len(reads) == 3
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not reader.meta._feed.live:
        tenant.search("cat", 5)
        time.sleep(0.05)
    assert reader.meta._feed.live
    before = len(reads)
    for _ in range(3):
        tenant.search("cat", 5)
    assert len(reads) - before <= 1  # quiet again


def test_the_search_copy_gets_each_committed_change_and_a_stale_answer_is_searched_again(make_service):
    """The embedder's copy starts from the whole tenant, then gets only what changed (a committed fact is in the
    next batch's updates); an answer from a copy whose tenant changed meanwhile is not used: the ingress's own
    index answers, with the fact added since."""
    writer, admin, key, reader = _acme(make_service, "Maya has a grey cat called Pixel.")
    tenant, copy, ledger = reader.authenticate(key), MirrorIndexes(), MirrorLedger(1 << 20)
    updates, first = reader.indexes.mirror_updates(["acme"], ledger)
    assert [u.kind for u in updates] == ["snapshot"] and len(updates[0].ids) == 1
    copy.apply(updates)
    added = writer.authenticate(key).add_facts(["Maya works at the aquarium."])[0]
    time.sleep(0.05)  # the change's announcement reaches the reader's feed
    updates, second = reader.indexes.mirror_updates(["acme"], ledger)
    assert [(u.kind, len(u.ids)) for u in updates] == [("upsert", 1)] and second["acme"] != first["acme"]
    copy.apply(updates)
    vector = reader.embedder.embed(["Where does Maya work?"])[0]
    ((scores, ids),) = copy.search(torch.as_tensor(vector)[None], [SearchAsk("acme", 5)])
    found = Found(scores, ids, second["acme"])
    fresh = tenant.retrieve(vector, 5, found)
    assert fresh.from_copy and [f.text for f, _ in fresh.hits] == [f.text for f, _ in tenant.retrieve(vector, 5).hits]
    assert fresh.hits[0][0].text == "Maya works at the aquarium." and fresh.hits[0][0].id == added.id
    writer.authenticate(key).add_facts(["Maya works at the city aquarium on Sundays."])
    time.sleep(0.05)
    reader.indexes.sync("acme")  # another question's catch-up: the copy's answer is now stale
    stale = tenant.retrieve(vector, 5, found)
    assert not stale.from_copy and len(stale.hits) == 3  # searched here: the new fact is in
    assert "Maya works at the city aquarium on Sundays." in [f.text for f, _ in stale.hits]


def test_tenants_take_turns_in_a_small_copy_and_come_back_whole(make_service):
    """A copy with room for one tenant: the next tenant's snapshot comes with the first one's drop, and the first
    comes back whole (its changes meanwhile were not kept for the copy); a second copy of the same indexes is
    refused (its journal would be emptied by the first)."""
    writer, admin, key, reader = _acme(make_service, "Maya has a grey cat called Pixel.")
    _, other_key = writer.create_tenant(admin, "globex")
    writer.authenticate(other_key).add_facts(["Globex sells turbines."])
    ledger = MirrorLedger(copy_bytes(1, 384) + 100)
    updates, _ = reader.indexes.mirror_updates(["acme"], ledger)
    assert [(u.tenant_id, u.kind) for u in updates] == [("acme", "snapshot")]
    updates, _ = reader.indexes.mirror_updates(["globex"], ledger)
    assert [(u.tenant_id, u.kind) for u in updates] == [("acme", "drop"), ("globex", "snapshot")]
    writer.authenticate(key).add_facts(["Maya works at the aquarium."])
    time.sleep(0.05)
    updates, generations = reader.indexes.mirror_updates(["acme"], ledger)
    assert [(u.tenant_id, u.kind, len(u.ids)) for u in updates] == [("globex", "drop", 0), ("acme", "snapshot", 2)]
    both, _ = reader.indexes.mirror_updates(["acme", "globex"], ledger)  # both wanted, room for one: globex waits
    assert [(u.tenant_id, u.kind) for u in both] == [("globex", "drop")] and ledger.holds("acme")
    with pytest.raises(ValueError, match="second"):
        reader.indexes.mirror_updates(["acme"], MirrorLedger(1 << 20))
    with pytest.raises(ValueError, match="second"):  # as a second batcher's `follow` asks, before any batch
        reader.indexes.claim(MirrorLedger(1 << 20))
    reader.indexes.claim(ledger)  # the copy it keeps: again, fine
    reader.indexes.release(ledger)  # that copy is gone: no changes kept for it, and another copy may claim
    other = MirrorLedger(1 << 20)
    updates, _ = reader.indexes.mirror_updates(["acme"], other)
    assert [(u.tenant_id, u.kind) for u in updates] == [("acme", "snapshot")]
