"""Facts of one tenant: insert, search, update, delete, quotas and precise errors that store nothing."""

import time

import pytest
import torch

from tenants.errors import (
    AuthError,
    ConflictError,
    FactExistsError,
    FactNotFoundError,
    InvalidInputError,
    QuotaExceededError,
    TenantExistsError,
    UnknownTenantError,
)
from tests.core.factories import make_record


def test_admin_key_is_shown_once_and_required(service, admin):
    assert admin.startswith("isa.") and service.ensure_admin_key() is None
    with pytest.raises(AuthError):
        service.create_tenant("isa.wrong", "alice")
    info, key = service.create_tenant(admin, "alice", max_facts=5)
    assert info["max_facts"] == 5 and key.startswith("isk.alice.")
    with pytest.raises(TenantExistsError):
        service.create_tenant(admin, "alice")
    with pytest.raises(InvalidInputError):
        service.create_tenant(admin, "../etc")
    assert service.meta.tenant("alice")["key_hash"] != key  # only the hash is stored
    with pytest.raises(UnknownTenantError):
        service.tenant_info(admin, "nobody")


def test_keys_authenticate_and_rotate(service, admin):
    _, key = service.create_tenant(admin, "alice")
    assert service.authenticate(key).id == "alice"
    for bad in (None, "", "isk.alice.wrong", key + "x", "isk.bob." + key.rsplit(".", 1)[1], "isa.x"):
        with pytest.raises(AuthError):
            service.authenticate(bad)
    new = service.rotate_key(admin, "alice")
    with pytest.raises(AuthError):
        service.authenticate(key)
    assert service.authenticate(new).id == "alice"


def test_insert_search_update_delete(service, admin):
    alice = service.authenticate(service.create_tenant(admin, "alice")[1])
    dog = alice.add_fact("my dog is called Rex", source_turn=3)
    cat = alice.add_fact("the cat sleeps on the sofa", fact_id="cat")
    assert dog.version == 1 and not dog.kv_ready and cat.id == "cat"
    assert [f.id for f, _ in alice.search("what is my dog called", k=1)] == [dog.id]
    updated = alice.update_fact(dog.id, "my dog is called Max now", version=1)
    assert updated.version == 2 and alice.get_fact(dog.id).text == "my dog is called Max now"
    with pytest.raises(ConflictError):
        alice.update_fact(dog.id, "stale writer", version=1)
    hits = alice.search("dog Max", k=2)
    assert hits[0][0].text == "my dog is called Max now" and hits[0][1] > hits[1][1]
    alice.delete_fact(dog.id)
    assert [f.id for f, _ in alice.search("dog Max", k=5)] == ["cat"]  # gone from retrieval at once
    with pytest.raises(FactNotFoundError):
        alice.get_fact(dog.id)
    with pytest.raises(FactNotFoundError):
        alice.delete_fact(dog.id)
    assert alice.usage()["facts"] == 1 and alice.usage()["bytes"] == len("the cat sleeps on the sofa")
    assert [f.id for f in alice.list_facts()] == ["cat"]


def test_kv_records_are_versioned_and_removed_with_their_fact(service, admin):
    alice = service.authenticate(service.create_tenant(admin, "alice")[1])
    fact = alice.add_fact("my dog is called Rex")
    encoded = alice.attach_kv(fact.id, 1, make_record("x", 5, tenant_id="alice"))
    assert encoded.record_id == f"{fact.id}.v1" and service.records.record_ids("alice") == [f"{fact.id}.v1"]
    assert (
        alice.get_fact(fact.id).encoding["window"] == 2
        and alice.get_fact(fact.id).encoding["model_fingerprint"] == "f" * 24
    )
    assert alice.usage()["bytes"] == len("my dog is called Rex") + make_record("x", 5).nbytes
    with pytest.raises(ConflictError):
        alice.attach_kv(fact.id, 7, make_record("x", 5, tenant_id="alice"))
    second = alice.update_fact(fact.id, "my dog is called Max", kv=make_record("y", 5, seed=2, tenant_id="alice"))
    assert service.records.record_ids("alice") == [f"{fact.id}.v2"]  # the old version's record is gone
    assert service.records.get("alice", second.record_id).token_ids == make_record("y", 5, seed=2).token_ids
    alice.delete_fact(fact.id)
    assert service.records.record_ids("alice") == [] and alice.usage() | {"max_facts": 0, "max_bytes": 0} == {
        "facts": 0,
        "bytes": 0,
        "max_facts": 0,
        "max_bytes": 0,
    }


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.add_fact(""), InvalidInputError),
        (lambda t: t.add_fact("   "), InvalidInputError),
        (lambda t: t.add_fact("x" * 201), InvalidInputError),
        (lambda t: t.add_fact(42), InvalidInputError),
        (lambda t: t.add_fact("ok", fact_id="../x"), InvalidInputError),
        (lambda t: t.add_fact("ok", source_turn=-1), InvalidInputError),
        (lambda t: t.add_fact("ok", fact_id="dup"), FactExistsError),
        (lambda t: t.search("q", k=0), InvalidInputError),
        (lambda t: t.list_facts(limit=0), InvalidInputError),
        (lambda t: t.get_fact("nope"), FactNotFoundError),
        (lambda t: t.placement("../dup"), InvalidInputError),
    ],
)
def test_bad_input_is_refused_and_stores_nothing(make_service, call, error):
    service = make_service(max_fact_chars=200)
    admin = service.ensure_admin_key()
    tenant = service.authenticate(service.create_tenant(admin, "alice")[1])
    tenant.add_fact("first", fact_id="dup")
    before = (tenant.usage(), tenant.version(), service.meta.records.fact_ids("alice"))
    with pytest.raises(error):
        call(tenant)
    assert (tenant.usage(), tenant.version(), service.meta.records.fact_ids("alice")) == before


def test_quotas_in_facts_and_bytes(service, admin):
    tenant = service.authenticate(service.create_tenant(admin, "alice", max_facts=2, max_bytes=30)[1])
    tenant.add_fact("one two three")  # 13 bytes
    with pytest.raises(QuotaExceededError, match="bytes"):
        tenant.add_fact("this text is far too long ok")
    tenant.add_fact("four")
    with pytest.raises(QuotaExceededError, match="facts"):
        tenant.add_fact("five")
    with pytest.raises(QuotaExceededError, match="bytes"):
        tenant.update_fact(tenant.list_facts()[0].id, "x" * 20)
    assert tenant.usage()["facts"] == 2 and tenant.usage()["bytes"] == 17


def test_replicas_placement_reports_land_per_fact_and_replica(service, admin, redis_url):
    from tenants.placement import PlacementWriter
    from tenants.redis_meta import RedisMeta

    tenant = service.authenticate(service.create_tenant(admin, "alice")[1])
    rex, tom = tenant.add_fact("my dog is called Rex"), tenant.add_fact("my cat is called Tom")
    assert tenant.placement(rex.id) == {}
    one, two = PlacementWriter(RedisMeta(redis_url), "h-slot0"), PlacementWriter(RedisMeta(redis_url), "h-slot1")
    one(tenant.id, f"{rex.id}.v1", (1, 2), "gpu")
    one(tenant.id, f"{rex.id}.v1", (1, 2), "disk")  # the latest report of a batch wins
    one(tenant.id, "chat-frame-abc", (1,), "gpu")  # not a fact: ignored
    two(tenant.id, f"{rex.id}.v1", (1, 2), "cpu")
    two(tenant.id, f"{tom.id}.v1", (3,), "gpu")
    assert one.flush() and two.flush()
    assert {r: p["tier"] for r, p in tenant.placement(rex.id).items()} == {"h-slot0": "disk", "h-slot1": "cpu"}
    assert tenant.placement(rex.id)["h-slot0"]["version"] == 1
    two(tenant.id, f"{rex.id}.v1", (1, 2), None)  # evicted from h-slot1
    tenant.delete_fact(tom.id)
    two(tenant.id, f"{tom.id}.v1", (3,), "cpu")  # a late report of a deleted fact
    assert two.flush()
    assert list(tenant.placement(rex.id)) == ["h-slot0"]
    assert not RedisMeta(redis_url)._redis.hexists(f"is:t:{{{tenant.id}}}:place", tom.id)  # not resurrected
    restarted = PlacementWriter(RedisMeta(redis_url), "h-slot0").start()  # forgets what h-slot0 said before
    deadline = time.monotonic() + 5
    while tenant.placement(rex.id):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    restarted(tenant.id, f"{rex.id}.v1", (1, 2), "disk")  # what it finds on disk after the restart
    restarted.close()
    assert tenant.placement(rex.id)["h-slot0"]["tier"] == "disk"


def test_placement_reports_wait_out_a_redis_outage(service, admin, redis_url):
    from tenants.placement import PlacementWriter
    from tenants.redis_meta import RedisMeta

    tenant = service.authenticate(service.create_tenant(admin, "bob")[1])
    fact = tenant.add_fact("bob plays the cello")
    writer = PlacementWriter(RedisMeta("redis://127.0.0.1:1/0"), "h-slot0")  # nothing listens there
    writer(tenant.id, f"{fact.id}.v1", (1,), "gpu")
    assert writer.flush() is False
    writer._meta = RedisMeta(redis_url)  # the server is reachable again
    assert writer.flush() and tenant.placement(fact.id)["h-slot0"]["tier"] == "gpu"


def test_a_batch_insert_is_all_or_nothing(service, admin):
    """One refused fact (an id that exists) refuses the batch and leaves no trace of the others; a batch
    that goes through stores every fact with its K/V under one store version."""
    tenant = service.authenticate(service.create_tenant(admin, "alice")[1])
    tenant.add_fact("the first", fact_id="dup")
    version = service.records.version("alice")
    kvs = [make_record("x", 5, seed=i, tenant_id="alice") for i in range(3)]
    with pytest.raises(FactExistsError):
        tenant.add_facts(["a", "b", "c"], fact_ids=["n1", "dup", "n2"], kvs=kvs)
    assert [f.id for f in tenant.list_facts()] == ["dup"] and tenant.usage()["facts"] == 1
    assert service.records.record_ids("alice") == [] and service.records.version("alice") == version
    facts = tenant.add_facts(["a", "b", "c"], fact_ids=["n1", "n2", "n3"], kvs=kvs)
    assert [f.kv_ready for f in facts] == [True] * 3 and service.records.version("alice") == version + 1
    assert torch.equal(service.records.get("alice", "n2.v1").k, kvs[1].k)
    with pytest.raises(InvalidInputError, match="distinct"):
        tenant.add_facts(["x", "y"], fact_ids=["z", "z"])


def test_an_int8_store_charges_the_bytes_it_holds_and_serves_the_facts_codes(service, admin):
    """With the record store set to int8, every way a fact's K/V arrives (insert, attach, update) is stored as codes
    and charged at the codes' bytes: quotas and residency count what the disk holds."""
    alice = service.authenticate(service.create_tenant(admin, "alice")[1])
    service.records.set_precision("int8")
    dense = make_record("x", 40, tenant_id="alice", dtype=torch.bfloat16)
    coded_bytes = dense.with_precision("int8").nbytes
    assert coded_bytes < 0.6 * dense.nbytes
    added = alice.add_fact("my dog is called Rex", kv=dense)
    late = alice.add_fact("my cat is called Tom")
    alice.attach_kv(late.id, 1, make_record("y", 40, seed=2, tenant_id="alice", dtype=torch.bfloat16))
    text_bytes = len("my dog is called Rex") + len("my cat is called Tom")
    assert alice.usage()["bytes"] == text_bytes + 2 * coded_bytes
    record = service.records.get("alice", added.record_id)
    assert record.precision == "int8" and torch.equal(record.dense().k, dense.with_precision("int8").dense().k)
    updated = alice.update_fact(added.id, "my dog is called Max", kv=make_record("z", 40, seed=3, tenant_id="alice"))
    assert service.records.get("alice", updated.record_id).precision == "int8"
    assert alice.usage()["bytes"] == text_bytes + 2 * coded_bytes  # same length of text, same shape of codes
