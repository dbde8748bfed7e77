"""Nothing of one tenant reaches another, through any call of the tenants layer, even with guessed ids."""

import pytest

from tenants.errors import AuthError, FactNotFoundError
from tests.core.factories import make_record


@pytest.fixture()
def two(service, admin):
    alice = service.authenticate(service.create_tenant(admin, "alice")[1])
    bob = service.authenticate(service.create_tenant(admin, "bob")[1])
    return alice, bob


def test_identical_text_stays_two_records(two):
    alice, bob = two
    a = alice.add_fact("my dog is called Rex", fact_id="dog")
    b = bob.add_fact("my dog is called Rex", fact_id="dog")
    alice.update_fact("dog", "my dog is called Max")
    assert bob.get_fact("dog").text == "my dog is called Rex" and a.id == b.id == "dog"
    bob.delete_fact("dog")
    assert alice.get_fact("dog").text == "my dog is called Max"


def test_no_call_reaches_the_other_tenants_facts(service, two):
    alice, bob = two
    secret = alice.add_fact("alice's bank pin is 4321", fact_id="pin")
    alice.attach_kv("pin", 1, make_record("x", 5, tenant_id="alice"))
    bob.add_fact("bob likes tennis")
    for attempt in (
        lambda: bob.get_fact("pin"),
        lambda: bob.update_fact("pin", "hacked"),
        lambda: bob.delete_fact("pin"),
        lambda: bob.attach_kv("pin", 1, make_record("x", 5, tenant_id="bob")),
        lambda: bob.placement("pin"),
    ):
        with pytest.raises(FactNotFoundError):
            attempt()
    assert all(f.id != "pin" for f in bob.list_facts(limit=10_000))
    assert all("pin" not in f.text for f, _ in bob.search("alice bank pin 4321", k=50))
    assert alice.get_fact("pin").text == secret.text and alice.get_fact("pin").kv_ready
    assert service.records.record_ids("bob") == []


def test_a_key_only_opens_its_own_tenant(service, two):
    alice, _ = two
    key = service.rotate_key(service_admin(service), "alice")
    secret = key.rsplit(".", 1)[1]
    with pytest.raises(AuthError):
        service.authenticate(f"isk.bob.{secret}")  # alice's secret under bob's name


def service_admin(service):
    from tenants.auth import hash_key, new_admin_key

    key = new_admin_key()
    service.meta.set_admin_hash(hash_key(key), replace=True)
    return key
