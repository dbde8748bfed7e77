"""End users' scopes inside one tenant: each sees only its own memories, reached only through its tenant's key."""

import pytest

from tenants.auth import hash_key, new_tenant_key
from tenants.errors import (
    AuthError,
    FactNotFoundError,
    InvalidInputError,
    QuotaExceededError,
    UnknownTenantError,
)
from tenants.scopes import Scope, located_id, scoped_id, split_located
from tests.core.factories import make_record


@pytest.fixture()
def acme(service, admin):
    _, key = service.create_tenant(admin, "acme", max_facts=3)
    return service.authenticate(key), key


def test_two_end_users_of_one_tenant_never_see_each_others_memories(service, acme):
    tenant, _ = acme
    alice, bob = service.open_scope(tenant, Scope("alice")), service.open_scope(tenant, Scope("bob"))
    assert (
        len({alice.id, bob.id, tenant.id}) == 3 and alice.entry.scope == Scope("alice") and tenant.entry.scope is None
    )
    pin = alice.add_fact("alice's bank pin is 4321", fact_id="pin")
    alice.attach_kv("pin", 1, make_record("x", 5, tenant_id=alice.id))
    bob.add_fact("bob likes tennis", fact_id="tennis")
    for other in (bob, tenant):
        with pytest.raises(FactNotFoundError):
            other.get_fact("pin")
        assert all("pin" not in f.text for f, _ in other.search("alice bank pin 4321", k=50))
        assert all(f.id != "pin" for f in other.list_facts(limit=10_000))
    assert [f.text for f, _ in alice.search("bank pin", k=5)] == [pin.text] and alice.get_fact("pin").kv_ready
    assert service.records.record_ids(bob.id) == [] and service.records.record_ids(alice.id)
    # the same end user is the same scope every time; another agent or run of theirs is another scope
    assert service.open_scope(tenant, Scope("alice")).id == alice.id
    assert service.open_scope(tenant, Scope("alice", agent_id="travel")).id != alice.id
    assert sorted(s["user_id"] for s in service.scopes(tenant)) == ["alice", "alice", "bob"]


def test_a_scope_is_reached_only_through_its_own_tenants_key(service, admin, acme):
    tenant, key = acme
    alice = service.open_scope(tenant, Scope("alice"))
    assert service.open_tenant(key, alice.id).id == alice.id  # the tenant's key (LLM replicas, jobs)
    assert service.open_tenant(admin, alice.id).id == alice.id  # the admin key
    _, other_key = service.create_tenant(admin, "other")
    with pytest.raises(AuthError):
        service.open_tenant(other_key, alice.id)
    forged = new_tenant_key(alice.id)
    service.meta.update_tenant(alice.id, {"key_hash": hash_key(forged)})  # even a key hash on its entry
    with pytest.raises(AuthError):  # opens no scope by itself
        service.authenticate(forged)
    with pytest.raises(UnknownTenantError):  # nor can the admin give it one
        service.rotate_key(admin, alice.id)
    with pytest.raises(InvalidInputError):
        service.open_scope(alice, Scope("nested"))


def test_quotas_bound_each_end_user_and_the_tenant_with_all_its_end_users(service, admin):
    _, key = service.create_tenant(admin, "shop", max_facts=5, scope_max_facts=3)
    tenant = service.authenticate(key)
    alice, bob = service.open_scope(tenant, Scope("alice")), service.open_scope(tenant, Scope("bob"))
    alice.add_facts(["a", "b", "c"])
    with pytest.raises(QuotaExceededError):
        alice.add_fact("d")  # alice's own limit
    bob.add_facts(["e", "f"])
    with pytest.raises(QuotaExceededError, match="together"):
        bob.add_fact("g")  # bob is under his own limit, the tenant is at its total
    with pytest.raises(QuotaExceededError, match="together"):
        tenant.add_fact("h")  # the tenant's own memory counts in the same total
    assert (alice.usage()["facts"], bob.usage()["facts"], tenant.usage()["facts"]) == (3, 2, 0)
    assert service.meta.records.total("shop") == {"facts": 5, "bytes": 5}  # refusals refunded what they had charged
    alice.delete_fact(alice.list_facts()[0].id)
    tenant.add_fact("h")  # a deletion frees room for anyone
    service.delete_scope(tenant, Scope("bob"))
    bob_again = service.open_scope(tenant, Scope("bob"))
    bob_again.add_facts(["i", "j"])
    assert service.meta.records.total("shop")["facts"] == 5
    fact = bob_again.list_facts()[0]
    bob_again.update_fact(fact.id, "a longer text than before")
    bob_again.attach_kv(fact.id, 2, make_record("x", 5, tenant_id=bob_again.id))
    stored = sum(s.usage()["bytes"] for s in (tenant, alice, bob_again))
    assert service.meta.records.total("shop")["bytes"] == stored  # updates and K/V moved the total as they moved usage


def test_deleting_a_tenant_deletes_its_scopes(service, admin, acme):
    tenant, _ = acme
    alice = service.open_scope(tenant, Scope("alice"))
    alice.add_fact("alice's bank pin is 4321")
    alice.attach_kv(alice.list_facts()[0].id, 1, make_record("x", 5, tenant_id=alice.id))
    service.delete_tenant(admin, "acme")
    assert service.records.record_ids(alice.id) == [] and service.meta.tenant(alice.id) is None
    _, key = service.create_tenant(admin, "acme")  # the same id again: a new tenant, nothing of the old scopes
    again = service.open_scope(service.authenticate(key), Scope("alice"))
    assert again.id == alice.id and again.list_facts() == [] and again.search("bank pin", k=5) == []


def test_deleting_one_scope_leaves_the_others_and_the_tenant(service, acme):
    tenant, _ = acme
    alice, bob = service.open_scope(tenant, Scope("alice")), service.open_scope(tenant, Scope("bob"))
    alice.add_fact("alice's bank pin is 4321")
    alice.attach_kv(alice.list_facts()[0].id, 1, make_record("x", 5, tenant_id=alice.id))
    bob.add_fact("bob likes tennis")
    tenant.add_fact("the shop opens at nine")
    assert service.delete_scope(tenant, Scope("alice")) is True
    assert service.meta.tenant(alice.id) is None and service.records.record_ids(alice.id) == []
    assert [s["user_id"] for s in service.scopes(tenant)] == ["bob"]
    assert [f.text for f in bob.list_facts()] == ["bob likes tennis"]
    assert [f.text for f in tenant.list_facts()] == ["the shop opens at nine"]
    assert service.open_scope(tenant, Scope("alice")).search("bank pin", k=5) == []  # made again: empty
    assert service.delete_scope(tenant, Scope("nobody")) is False


def test_reading_an_end_users_memory_that_was_never_written_stores_nothing(service, acme):
    tenant, _ = acme
    ghost = service.open_scope(tenant, Scope("ghost"), create=False)
    assert ghost.list_facts() == [] and ghost.search("anything", k=5) == [] and ghost.usage()["facts"] == 0
    assert ghost.version() == 0 and ghost.entry.scope == Scope("ghost")
    assert service.meta.tenant(ghost.id) is None and service.scopes(tenant) == []
    written = service.open_scope(tenant, Scope("ghost"))  # a write makes it
    written.add_fact("ghost likes tea")
    assert written.id == ghost.id and service.scopes(tenant) == [{"user_id": "ghost"}]
    assert [f.text for f in service.open_scope(tenant, Scope("ghost"), create=False).list_facts()] == [
        "ghost likes tea"
    ]


def test_a_located_memory_id_opens_its_scope_only_through_its_own_tenant(service, admin, acme):
    tenant, _ = acme
    alice = service.open_scope(tenant, Scope("alice"))
    fact = alice.add_fact("alice's bank pin is 4321")
    memory_id = located_id(fact.id, alice.id)
    assert memory_id != fact.id and located_id(fact.id, tenant.id) == fact.id  # a tenant's own facts: plain ids
    fact_id, holder_id = split_located(memory_id, tenant.id)
    assert (fact_id, holder_id) == (fact.id, alice.id)
    assert service.open_holder(tenant, holder_id, fact_id).get_fact(fact_id).text == fact.text
    _, other_key = service.create_tenant(admin, "other")
    other = service.authenticate(other_key)
    for who, holder in (
        (other, split_located(memory_id, other.id)[1]),
        (other, alice.id),
        (tenant, tenant.id + "..0"),
        (tenant, "bad/id"),
    ):
        with pytest.raises(FactNotFoundError):
            service.open_holder(who, holder, fact_id)


def test_metadata_is_kept_and_updates_keep_the_earlier_versions(service, acme):
    tenant, _ = acme
    fact = tenant.add_fact("Maya has a cat", metadata={"source": "chat", "n": 1})
    assert tenant.get_fact(fact.id).metadata == {"source": "chat", "n": 1}
    tenant.update_fact(fact.id, "Maya has two cats")
    relabelled = tenant.update_fact(fact.id, None, metadata={"source": "form"})  # the same text, new metadata
    assert (relabelled.text, relabelled.version, relabelled.metadata) == ("Maya has two cats", 3, {"source": "form"})
    stored = tenant.get_fact(fact.id)
    assert [(v["version"], v["text"]) for v in stored.previous] == [(1, "Maya has a cat"), (2, "Maya has two cats")]
    for bad in ("text", {"x": float("nan")}, {"x": "y" * 5000}, {"x": object()}):
        with pytest.raises(InvalidInputError):
            tenant.add_fact("refused", metadata=bad)
    assert [f.text for f in tenant.list_facts()] == ["Maya has two cats"]  # nothing stored by a refusal


@pytest.mark.parametrize(
    "scope",
    [
        dict(user_id=""),
        dict(user_id="   "),
        dict(user_id="x" * 257),
        dict(user_id="a\nb"),
        dict(user_id="a", agent_id=""),
        dict(user_id=7),
    ],
)
def test_bad_scope_ids_are_refused(scope):
    with pytest.raises(InvalidInputError):
        Scope(**scope)


def test_tenant_ids_cannot_take_a_scopes_form(service, admin):
    with pytest.raises(InvalidInputError, match="scopes"):
        service.create_tenant(admin, "acme..x")
    assert len(scoped_id("t" * 128, Scope("u"))) <= 128
