"""A tenant's history is named in its registry entry in one step with reading the one it replaces, so concurrent
writers each delete what they replaced, and a late write never brings a deleted tenant back."""

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
