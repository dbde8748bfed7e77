"""API keys: random, shown once, stored only as a hash, compared in constant time.

A tenant key reads `isk.<tenant id>.<secret>`, so the tenant is found without an index of all keys and
the secret is checked against that tenant's stored hash only. A generated admin key reads `isa.<secret>`;
a user's own admin key is any string that `check_admin_key` accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvcore.conversation import check_identifier
from kvcore.errors import InvalidFactError
from tenants.errors import AuthError, InvalidInputError

TENANT_PREFIX, ADMIN_PREFIX = "isk", "isa"
MIN_ADMIN_KEY_CHARS = 16
ADMIN_KEY_RULE = (
    f"an admin key has at least {MIN_ADMIN_KEY_CHARS} printable ASCII characters, no whitespace, "
    f"and is not of the tenant-key form '{TENANT_PREFIX}.<tenant>.<secret>'"
)


def new_tenant_key(tenant_id: str) -> str:
    return f"{TENANT_PREFIX}.{tenant_id}.{secrets.token_urlsafe(32)}"


def new_admin_key() -> str:
    return f"{ADMIN_PREFIX}.{secrets.token_urlsafe(32)}"


def check_admin_key(key: object) -> str:
    """`key` if it can be the admin key (generated or a user's own), else `InvalidInputError` naming the rule.

    The message never contains the key itself.
    """
    if not isinstance(key, str):
        problem = "not a string"
    elif len(key) < MIN_ADMIN_KEY_CHARS:
        problem = f"{len(key)} characters"
    elif any(char.isspace() for char in key):
        problem = "it contains whitespace"
    elif not (key.isascii() and key.isprintable()):
        problem = "it has characters an HTTP header cannot carry"
    elif key.startswith(TENANT_PREFIX + "."):
        problem = "it has the tenant-key form"
    else:
        return key
    raise InvalidInputError(f"invalid admin key ({problem}): {ADMIN_KEY_RULE}")


def hash_key(key: str) -> str:
    """SHA-256 of the whole key: keys carry 256 random bits, so no slow hash is needed."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_of(key: object) -> str:
    """The tenant id a key names (before checking it), or `AuthError` if it is not a tenant key."""
    if not isinstance(key, str) or not key.startswith(TENANT_PREFIX + ".") or key.count(".") < 2:
        raise AuthError("missing or malformed API key")
    tenant_id = key[len(TENANT_PREFIX) + 1 :].rsplit(".", 1)[0]
    try:
        return check_identifier("tenant id", tenant_id)
    except InvalidFactError:
        raise AuthError("missing or malformed API key") from None


def matches(key: str, stored_hash: str | None) -> bool:
    """Constant-time comparison of `key` with a stored hash (False when there is none)."""
    return stored_hash is not None and hmac.compare_digest(hash_key(key), stored_hash)
