"""KV residency by use: the policy's arithmetic, and drops and re-encodes against a real redis-server."""

import time

import pytest

from config.settings import ResidencySettings
from tenants.errors import InvalidInputError
from tenants.fact_uses import UseCounter
from tenants.facts import fact_of_record, is_fact_record, record_id_for
from tenants.residency import Residency
from tenants.residency_policy import ResidencyPolicy, ResidentFact, decayed
from tests.core.factories import make_record

DAY = 86_400.0


def fact(fact_id, kv_bytes=100, score=0.0, last_used=0.0, encoded_at=0.0):
    return ResidentFact(fact_id, kv_bytes, score, last_used, encoded_at)


def policy(**settings):
    return ResidencyPolicy(ResidencySettings(**({"min_resident_s": 0} | settings)))


# ---- the policy, pure ----
def test_a_use_counts_half_after_each_half_life():
    assert decayed(8.0, 100.0, 100.0, 10.0) == 8.0
    assert decayed(8.0, 100.0, 120.0, 10.0) == pytest.approx(2.0)
    assert decayed(8.0, 100.0, 90.0, 10.0) == 8.0  # a clock behind the stored one never inflates a score


def test_drops_take_the_coldest_until_the_budget_holds():
    facts = [fact("hot", score=5), fact("warm", score=1), fact("cold", score=0.1), fact("never", score=0)]
    assert [f.fact_id for f in policy().drops(facts, 250, DAY)] == ["never", "cold"]
    assert policy().drops(facts, 400, DAY) == [] and policy().drops(facts, None, DAY) == []
    assert [f.fact_id for f in policy().drops(facts, 0, DAY)] == ["never", "cold", "warm", "hot"]
    ties = [fact("used-late", last_used=50), fact("used-early", last_used=10)]  # equal scores: longest unused first
    assert [f.fact_id for f in policy().drops(ties, 100, DAY)] == ["used-early"]


def test_freshly_encoded_facts_are_never_dropped_and_use_alone_protects_nothing():
    facts = [fact("new", encoded_at=DAY - 5), fact("just-used", last_used=DAY - 5), fact("old", encoded_at=1)]
    assert [f.fact_id for f in policy(min_resident_s=60).drops(facts, 0, DAY)] == ["old", "just-used"]


def test_a_full_budget_sets_the_use_a_dropped_fact_must_beat():
    kept = [fact("a", score=3), fact("b", score=0.7), fact("fresh", score=0, encoded_at=DAY - 5)]
    assert policy(min_resident_s=60).floor(kept, 300, DAY) == 0.7  # full: the coldest settled fact's use
    assert policy().floor(kept, 400, DAY) == 0 and policy().floor(kept, None, DAY) == 0  # room for one more
    assert not policy().wants_kv(2.9, floor=2.0) and policy().wants_kv(3.1, floor=2.0)  # the margin: 1.5x
    assert policy(reencode_margin=1.0).wants_kv(2.1, floor=2.0)


def test_the_node_budget_drops_the_coldest_of_all_memories():
    memories = {"a": [fact("a1", score=3), fact("a2", score=0.5)], "b": [fact("b1", score=1), fact("b2", score=4)]}
    assert policy().node_drops(memories, 200, DAY) == [("a", memories["a"][1]), ("b", memories["b"][0])]
    assert policy().node_drops(memories, None, DAY) == []


def test_a_sweep_plan_applies_each_memorys_budget_then_the_nodes_and_sets_the_floors():
    memories = {
        "a": [fact("a1", score=3), fact("a2", score=0.5), fact("a3", score=2)],
        "b": [fact("b1", score=1), fact("b2", score=4)],
    }
    drops, floors = policy(node_kv_bytes=300).plan(memories, {"a": 200, "b": None}, DAY)
    # a's own budget drops a2; the node's (300 of the 400 left) then the coldest of all, b1
    assert [(m, f.fact_id) for m, f in drops] == [("a", "a2"), ("b", "b1")]
    assert floors == {"a": 2.0, "b": 2.0}  # a full: its coldest kept (a3); the node full: 2 (a3) for both
    drops, floors = policy().plan(memories, {"a": None, "b": None}, DAY)
    assert drops == [] and floors == {"a": 0.0, "b": 0.0}  # no budget: nothing dropped, no floor


def test_a_dropped_fact_is_encoded_again_at_the_configured_use():
    second = policy(reencode_after_uses=2)
    assert second.wants_kv(1 + decayed(1.0, 0.0, 60.0, DAY))  # this use and one a minute ago
    assert not second.wants_kv(1 + decayed(1.0, 0.0, 2 * DAY, DAY)) and not second.wants_kv(1.0)  # too long ago
    third = policy(reencode_after_uses=3)
    assert not third.wants_kv(1.99) and third.wants_kv(2.0)


def test_records_of_a_version_encoded_again_have_their_own_ids():
    assert record_id_for("f-1", 3) == "f-1.v3" and record_id_for("f-1", 3, 2) == "f-1.v3.r2"
    assert fact_of_record("f-1.v3.r2") == ("f-1", 3) and fact_of_record("f-1.v3") == ("f-1", 3)
    assert is_fact_record("f-1.v3.r2") and not is_fact_record("chat-frame-abc")


# ---- against redis-server ----
def test_retrievals_of_every_process_add_up_decayed(service):
    first, second = (UseCounter(service.meta.uses, half_life_s=100.0) for _ in range(2))
    first.record("t", ["a", "b"], 1000.0)
    first.record("t", ["a"], 1000.0)
    second.record("t", ["a"], 1000.0)
    assert first.score("t", "a", 1000.0) == 2  # what it counted itself, before any flush
    assert first.flush(1000.0) == 3 and second.flush(1000.0) == 1 and first.floor("t", 1000.0) == 0
    assert second.score("t", "a", 1000.0) == pytest.approx(3.0)  # learnt back: both processes' retrievals
    second.record("t", ["a"], 1100.0)
    second.flush(1100.0)  # a half-life later: 3 -> 1.5, plus this one
    score, at, last = service.meta.uses.get("t", "a")
    assert (score, at, last) == (pytest.approx(2.5), 1100.0, 1100.0)
    assert service.meta.uses.get("t", "b")[0] == pytest.approx(1.0)


def _tenant_with_records(service, admin, count, budget, tenant_id="alice"):
    _, key = service.create_tenant(admin, tenant_id, kv_budget_bytes=budget)
    tenant = service.authenticate(key)
    facts = [
        tenant.add_fact(f"fact number {i} about topic{i}", kv=make_record(f"x{i}", 5, seed=i, tenant_id=tenant_id))
        for i in range(count)
    ]
    return tenant, facts


def _residency(service, owner="one", **settings):
    defaults = {"min_resident_s": 60, "drop_grace_s": 30, "half_life_s": DAY}
    return Residency(service, ResidencySettings(**(defaults | settings)), owner)


def test_a_sweep_drops_the_coldest_k_v_to_text_and_removes_its_files_later(service, admin):
    kv_bytes = make_record("x", 5).nbytes
    tenant, facts = _tenant_with_records(service, admin, 4, budget=2 * kv_bytes)
    used_before = tenant.usage()["bytes"]
    residency = _residency(service)
    now = time.time() + 3600  # past min_resident_s since encoding
    for _ in range(3):
        residency.observe(tenant.id, [facts[0], facts[2]], now - 100)
    report = residency.tick(now)
    assert (report.led, report.dropped, report.dropped_bytes) == (True, 2, 2 * kv_bytes)
    assert report.resident_bytes == 2 * kv_bytes and report.by_memory == {"alice": 2}
    kept, dropped = [tenant.get_fact(facts[i].id) for i in (0, 2)], [tenant.get_fact(facts[i].id) for i in (1, 3)]
    assert all(f.kv_ready and not f.kv_dropped for f in kept)
    assert all(not f.kv_ready and f.kv_dropped and f.encoding is None for f in dropped)
    assert tenant.usage()["bytes"] == used_before - 2 * kv_bytes
    assert service.meta.records.total("alice")["bytes"] == used_before - 2 * kv_bytes  # refunded to the quota
    hits = {f.id: f for f, _ in tenant.search("fact number topic1 topic3", k=4)}
    assert hits[facts[1].id].record_id is None and hits[facts[0].id].record_id == facts[0].record_id
    # the dropped records' files stay for chats in flight, then go
    assert service.records.path("alice", facts[1].record_id).exists()
    assert residency.sweep(now + 10).files_removed == 0 and service.records.path("alice", facts[1].record_id).exists()
    assert residency.sweep(now + 31).files_removed == 2
    assert not service.records.path("alice", facts[1].record_id).exists()
    assert service.records.path("alice", facts[0].record_id).exists()
    assert residency.sweep(now + 40).dropped == 0  # within budget now: nothing more


def test_fresh_facts_and_memories_without_a_budget_keep_their_k_v(service, admin):
    tenant, facts = _tenant_with_records(service, admin, 3, budget=0)
    _tenant_with_records(service, admin, 2, budget=None, tenant_id="bob")
    residency = _residency(service)
    assert residency.sweep(time.time()).dropped == 0  # encoded just now: protected
    report = residency.sweep(time.time() + 3600)
    assert report.dropped == 3 and report.memories == 1  # bob has no budget and no node budget applies
    assert all(tenant.get_fact(f.id).kv_dropped for f in facts)


def test_the_node_budget_spans_memories(service, admin):
    kv_bytes = make_record("x", 5).nbytes
    alice, alice_facts = _tenant_with_records(service, admin, 2, budget=None)
    bob, bob_facts = _tenant_with_records(service, admin, 2, budget=None, tenant_id="bob")
    residency = _residency(service, node_kv_bytes=3 * kv_bytes)
    now = time.time() + 3600
    residency.observe("alice", alice_facts, now - 10)
    residency.observe("bob", bob_facts[:1], now - 10)
    report = residency.tick(now)
    assert report.dropped == 1 and report.by_memory == {"bob": 1}
    assert bob.get_fact(bob_facts[1].id).kv_dropped and not bob.get_fact(bob_facts[0].id).kv_dropped


def test_a_dropped_fact_retrieved_again_is_encoded_again_under_a_new_record(service, admin):
    kv_bytes = make_record("x", 5).nbytes
    tenant, facts = _tenant_with_records(service, admin, 2, budget=kv_bytes)
    residency = _residency(service, reencode_after_uses=2)
    now = time.time() + 3600
    residency.observe(tenant.id, [facts[1]], now - 100)
    assert residency.tick(now).by_memory == {"alice": 1}
    dropped = tenant.get_fact(facts[0].id)
    assert dropped.kv_dropped and residency.describe(tenant.id, dropped)["kv"] == "dropped"
    assert residency.observe(tenant.id, [dropped], now) == []  # one use does not pay for an encoding
    assert residency.observe(tenant.id, [dropped], now + 1) == [dropped]  # the second does
    assert residency.observe(tenant.id, [dropped], now + 2) == []  # asked once, not on every chat
    again = tenant.attach_kv(dropped.id, dropped.version, make_record("x", 5, tenant_id=tenant.id))
    assert again.kv_ready and not again.kv_dropped and again.record_id == f"{dropped.id}.v1.r1"
    residency.counter.flush(now + 2)  # what GET /v1/memories/{id} shows: the shared count
    assert residency.describe(tenant.id, again) == {"kv": "kept", "uses": 3.0, "last_used": now + 2}
    # over budget again: now the other fact is the colder one
    assert residency.sweep(now + 3).by_memory == {"alice": 1} and tenant.get_fact(facts[1].id).kv_dropped
    # both dropped records' files go when due; the new record of the same version stays
    assert residency.sweep(now + 40).files_removed == 2
    assert service.records.path(tenant.id, again.record_id).exists()
    assert not service.records.path(tenant.id, facts[0].record_id).exists()
    assert tenant.get_fact(dropped.id).record_id == again.record_id


def test_a_fact_changed_during_a_sweep_is_left_to_its_writer(service, admin):
    tenant, facts = _tenant_with_records(service, admin, 1, budget=0)
    residency = _residency(service)
    memories = residency._memories(time.time() + 3600)  # the sweep's read ...
    tenant.update_fact(facts[0].id, "a new text", kv=make_record("y", 5, tenant_id=tenant.id))  # ... then a write
    resident = memories["alice"].resident[0]
    assert not residency._drop("alice", memories["alice"], resident, time.time() + 3600)
    current = tenant.get_fact(facts[0].id)
    assert current.version == 2 and current.kv_ready and service.records.path("alice", current.record_id).exists()


def test_one_process_at_a_time_applies_the_budgets(service, admin):
    _tenant_with_records(service, admin, 1, budget=0)
    first, second = _residency(service, owner="one"), _residency(service, owner="two")
    later = time.time() + 3600
    assert first.sweep(later).led and not second.sweep(later).led
    assert first.sweep(later).led  # its holder keeps it


def test_a_negative_budget_is_refused(service, admin):
    with pytest.raises(InvalidInputError):
        service.create_tenant(admin, "carol", kv_budget_bytes=-1)
    info, _ = service.create_tenant(admin, "carol", kv_budget_bytes=1000)
    assert info["kv_budget_bytes"] == 1000


def test_a_dropped_fact_must_beat_the_coldest_kept_fact_where_the_budget_is_full(service, admin):
    kv_bytes = make_record("x", 5).nbytes
    tenant, (hot, cold) = _tenant_with_records(service, admin, 2, budget=kv_bytes)
    residency = _residency(service)
    now = time.time() + 3600
    for _ in range(5):
        residency.observe(tenant.id, [hot], now - 100)
    assert residency.tick(now).by_memory == {"alice": 1}  # the cold one goes; the hot one fills the budget
    dropped = tenant.get_fact(cold.id)
    assert residency.observe(tenant.id, [dropped], now + 1) == []
    residency.counter.flush(now + 1)  # learns the memory's floor: the hot fact's 5 uses
    assert residency.counter.floor(tenant.id, now + 1) == pytest.approx(5.0, rel=1e-3)
    # past the floor by the margin (1.5x): its 8th use, not its 7th, beats the hot fact's 5 uses
    assert [residency.observe(tenant.id, [dropped], now + 2 + i) for i in range(6)] == [[]] * 6  # uses 2..7
    assert residency.observe(tenant.id, [dropped], now + 8) == [dropped]
