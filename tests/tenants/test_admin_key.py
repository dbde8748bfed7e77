"""The admin key: a configured key (a user's own or generated) is authoritative and replaces a stored one."""

import logging

import pytest

from tenants.auth import ADMIN_KEY_RULE
from tenants.errors import AuthError, InvalidInputError

OWN_KEY = "my-own-admin-key-2026"  # no `isa.` prefix: a key of the user's choosing


def test_a_users_own_key_is_installed_and_authenticates_as_admin(make_service):
    service = make_service()
    assert service.install_admin_key(OWN_KEY) is True
    assert service.ensure_admin_key() is None  # a key is stored: none is generated
    info, tenant_key = service.create_tenant(OWN_KEY, "alice")
    assert info["id"] == "alice" and service.authenticate(tenant_key).id == "alice"
    other_process = make_service()
    assert other_process.list_tenants(OWN_KEY) == ["alice"]
    with pytest.raises(AuthError):
        other_process.list_tenants(OWN_KEY + "x")
    assert service.install_admin_key("0123456789abcdef") is True  # exactly 16 characters is enough
    assert service.list_tenants("0123456789abcdef") == ["alice"]


def test_a_changed_configured_key_replaces_the_stored_one(make_service, caplog):
    first = make_service()
    generated = first.ensure_admin_key()
    first.check_admin(generated)
    restarted = make_service()  # the next start, configured with a key of the user's own
    with caplog.at_level(logging.WARNING, logger="tenants.service"):
        assert restarted.install_admin_key(OWN_KEY) is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "replaced the stored one" in warnings[0]
    assert generated not in caplog.text and OWN_KEY not in caplog.text
    for service in (first, restarted):  # every process sees the change at once
        with pytest.raises(AuthError):
            service.check_admin(generated)
        service.check_admin(OWN_KEY)
    changed = OWN_KEY + "-changed"
    assert make_service().install_admin_key(changed) is True
    with pytest.raises(AuthError):
        first.create_tenant(OWN_KEY, "bob")
    assert first.create_tenant(changed, "bob")[0]["id"] == "bob"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tenants.service"):
        assert make_service().install_admin_key(changed) is False  # the same key again (another replica)
    assert caplog.records == []


@pytest.mark.parametrize(
    "key, problem",
    [
        ("fifteen-chars!!", "15 characters"),
        ("", "0 characters"),
        ("my own admin key with spaces", "it contains whitespace"),
        ("my-own-admin-key\n", "it contains whitespace"),
        ("isk.alice." + "s" * 43, "it has the tenant-key form"),
        ("my-own-admin-key-\u00e9t\u00e9", "it has characters an HTTP header cannot carry"),
        (None, "not a string"),
    ],
)
def test_invalid_keys_are_refused_with_the_rule(service, key, problem):
    stored = service.ensure_admin_key()
    with pytest.raises(InvalidInputError) as refused:
        service.install_admin_key(key)
    message = str(refused.value)
    assert message == f"invalid admin key ({problem}): {ADMIN_KEY_RULE}"
    assert "at least 16 printable ASCII characters, no whitespace" in message and "'isk.<tenant>.<secret>'" in message
    assert not key or key not in message  # the key is never echoed
    service.check_admin(stored)  # nothing was replaced
    with pytest.raises(AuthError):
        service.check_admin(key)
