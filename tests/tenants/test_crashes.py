"""A crash between any two steps of a change: the reconciler leaves acknowledged facts and no orphans."""

import pytest

from tenants.reconcile import reconcile
from tests.core.factories import make_record


class Crash(BaseException):
    """Stands for kill -9: no `except Exception` cleanup runs."""


def crash_at(step):
    def fault(name):
        if name == step:
            raise Crash(step)

    return fault


def check_consistent(service, tenant_id):
    """No half-done change is visible; usage, records and index agree with the committed facts."""
    facts = service.meta.records.all_facts(tenant_id)
    assert all(f["state"] == "active" and f["pending"] is None for f in facts.values())
    usage = service.meta.records.usage(tenant_id)
    assert usage == {"facts": len(facts), "bytes": sum(f["bytes"] for f in facts.values())}
    assert set(service.records.record_ids(tenant_id)) == {f["record_id"] for f in facts.values() if f["record_id"]}
    found = {f.id for f, _ in service.authenticate(KEYS[tenant_id]).search("fact", k=100)}
    assert found == set(facts)
    return facts


KEYS = {}


@pytest.fixture()
def setup(make_service):
    base = make_service()
    admin = base.ensure_admin_key()
    KEYS["alice"] = base.create_tenant(admin, "alice")[1]
    tenant = base.authenticate(KEYS["alice"])
    tenant.add_fact("fact one kept", fact_id="kept", kv=make_record("x", 5, tenant_id="alice"))
    return make_service


@pytest.mark.parametrize("step", ["insert:reserved", "insert:record-written"])
def test_insert_crash_is_rolled_back(setup, step):
    crashing = setup(fault=crash_at(step)).authenticate(KEYS["alice"])
    with pytest.raises(Crash):
        crashing.add_fact("fact two lost", fact_id="new", kv=make_record("y", 5, tenant_id="alice"))
    fresh = setup()
    assert "new" not in [f.id for f in fresh.authenticate(KEYS["alice"]).list_facts()]  # never visible
    repairs = reconcile(fresh.meta, fresh.records, older_than_s=0)
    assert repairs.inserts_rolled_back == 1
    assert set(check_consistent(fresh, "alice")) == {"kept"}


@pytest.mark.parametrize(
    ("step", "text"),
    [
        ("update:begun", "fact one kept"),
        ("update:record-written", "fact one kept"),
        ("update:committed", "fact one changed"),
    ],
)
def test_update_crash_keeps_one_whole_version(setup, step, text):
    crashing = setup(fault=crash_at(step)).authenticate(KEYS["alice"])
    with pytest.raises(Crash):
        crashing.update_fact("kept", "fact one changed", kv=make_record("z", 5, seed=3, tenant_id="alice"))
    fresh = setup()
    assert fresh.authenticate(KEYS["alice"]).get_fact("kept").text == text  # visible all along
    reconcile(fresh.meta, fresh.records, older_than_s=0)
    facts = check_consistent(fresh, "alice")
    assert facts["kept"]["text"] == text
    record = fresh.records.get("alice", facts["kept"]["record_id"])
    assert (
        record.token_ids == (make_record("z", 5, seed=3) if text.endswith("changed") else make_record("x", 5)).token_ids
    )


def test_delete_crash_leaves_no_orphan_record(setup):
    crashing = setup(fault=crash_at("delete:committed")).authenticate(KEYS["alice"])
    with pytest.raises(Crash):
        crashing.delete_fact("kept")
    fresh = setup()
    assert fresh.records.record_ids("alice") == ["kept.v1"]  # the file outlived the crash ...
    assert reconcile(fresh.meta, fresh.records, older_than_s=0).orphan_records_removed == 1
    assert check_consistent(fresh, "alice") == {}  # ... and the reconciler removed it


def test_recent_changes_are_left_to_their_writer(setup):
    crashing = setup(fault=crash_at("insert:reserved")).authenticate(KEYS["alice"])
    with pytest.raises(Crash):
        crashing.add_fact("fact in flight", fact_id="flight")
    fresh = setup()
    assert reconcile(fresh.meta, fresh.records, older_than_s=3600).inserts_rolled_back == 0
    assert fresh.meta.records.fact("alice", "flight")["state"] == "pending"
