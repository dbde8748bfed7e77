"""The tenants layer's front door: admin operations, and authentication that opens one tenant's facts.

Every fact operation is a method of `Tenant` (`tenants/tenant.py`), which only this service hands out, after
checking an API key or the admin key; how each change is ordered against a crash is `tenants/fact_writes.py`.
"""

from __future__ import annotations

import json
import logging
import time

from kvcore.store import LocalFactStore
from tenants.auth import TENANT_PREFIX, check_admin_key, hash_key, matches, new_admin_key, new_tenant_key, tenant_of
from tenants.embedding import Embedder
from tenants.errors import AuthError, FactNotFoundError, InvalidInputError, TenantExistsError, UnknownTenantError
from tenants.fact_writes import Fault, no_fault
from tenants.facts import check_id
from tenants.index_sync import TenantIndexes
from tenants.redis_meta import RedisMeta
from tenants.scopes import NO_KEY, SEPARATOR, Scope, is_scoped, scoped_id
from tenants.tenant import Tenant

log = logging.getLogger(__name__)


class TenantService:
    """Admin operations and authentication over one Redis, one record store and one index directory."""

    def __init__(
        self,
        meta: RedisMeta,
        records: LocalFactStore,
        embedder: Embedder,
        indexes: TenantIndexes,
        *,
        max_facts: int = 100_000,
        max_bytes: int = 4 << 30,
        max_fact_chars: int = 2000,
        fault: Fault = no_fault,
    ) -> None:
        self.meta, self.records, self.embedder, self.indexes = meta, records, embedder, indexes
        self.defaults = {"max_facts": max_facts, "max_bytes": max_bytes}
        self.max_fact_chars = max_fact_chars
        self.fault = fault

    # ---- admin ----
    def ensure_admin_key(self) -> str | None:
        """Create the admin key if there is none; the key is returned (and shown) only this once."""
        key = new_admin_key()
        return key if self.meta.set_admin_hash(hash_key(key)) else None

    def install_admin_key(self, key: str) -> bool:
        """Install a configured admin key (app args or INFERSCALE_ADMIN_KEY), replacing any stored one.

        A configured key is authoritative: the key it replaces stops working at once. True when the stored
        key changed; `InvalidInputError` (naming the rule) for a key that cannot be an admin key.
        """
        digest = hash_key(check_admin_key(key))
        previous = self.meta.replace_admin_hash(digest)
        if previous is not None and previous != digest:
            log.warning("the configured admin key replaced the stored one; the previous admin key no longer works")
        return previous != digest

    def check_admin(self, key: object) -> None:
        if not isinstance(key, str) or not matches(key, self.meta.admin_hash()):
            raise AuthError("missing or wrong admin key")

    def create_tenant(
        self,
        admin_key: str,
        tenant_id: str,
        *,
        max_facts: int | None = None,
        max_bytes: int | None = None,
        window: int = 5,
        model_fingerprint: str = "",
        recompute: int | None = None,
        neighbours: int = 0,
        scope_max_facts: int | None = None,
        scope_max_bytes: int | None = None,
        kv_budget_bytes: int | None = None,
    ) -> tuple[dict, str]:
        """Register a tenant; returns its registry entry and its API key (shown only this once). `max_facts` and
        `max_bytes` bound its own memory and all its end users' together; `scope_max_*` bound each end user's
        (None: the same as the tenant's). `recompute`:
        the facts its chats prefill after the injected ones when a chat does not say (None: the cluster's);
        `window` turns and `neighbours` nearest facts: the context its facts are encoded behind;
        `kv_budget_bytes`: the K/V bytes its memory and each end user's keep at most (KV residency, `residency.py`;
        None: the cluster's)."""
        self.check_admin(admin_key)
        tenant_id = check_id("tenant id", tenant_id)
        if is_scoped(tenant_id):
            raise InvalidInputError(f"tenant id {tenant_id!r} holds {SEPARATOR!r}, which is kept for end users' scopes")
        limits = {
            "max_facts": max_facts or self.defaults["max_facts"],
            "max_bytes": max_bytes or self.defaults["max_bytes"],
        }
        limits |= {
            "scope_max_facts": scope_max_facts or limits["max_facts"],
            "scope_max_bytes": scope_max_bytes or limits["max_bytes"],
        }
        if any(not isinstance(v, int) or v < 1 for v in limits.values()) or not isinstance(window, int) or window < 0:
            raise InvalidInputError("quotas must be positive integers and the window a non-negative integer")
        if recompute is not None and (not isinstance(recompute, int) or recompute < 0):
            raise InvalidInputError("recompute must be a non-negative integer")
        if not isinstance(neighbours, int) or neighbours < 0:
            raise InvalidInputError("neighbours must be a non-negative integer")
        if kv_budget_bytes is not None and (not isinstance(kv_budget_bytes, int) or kv_budget_bytes < 0):
            raise InvalidInputError("kv_budget_bytes must be a non-negative integer")
        key = new_tenant_key(tenant_id)
        fields = {
            "key_hash": hash_key(key),
            **limits,
            "window": window,
            "model_fingerprint": model_fingerprint,
            "created": time.time(),
        } | ({} if recompute is None else {"recompute": recompute})
        fields |= {"neighbours": neighbours} if neighbours else {}
        fields |= {} if kv_budget_bytes is None else {"kv_budget_bytes": kv_budget_bytes}
        self.meta.create_tenant(tenant_id, fields)
        return self.tenant_info(admin_key, tenant_id), key

    def tenant_info(self, admin_key: str, tenant_id: str) -> dict:
        self.check_admin(admin_key)
        info = self.meta.tenant(check_id("tenant id", tenant_id))
        if info is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        return _public(info) | {
            "usage": self.meta.records.usage(tenant_id),
            "total": self.meta.records.total(tenant_id),
        }

    def list_tenants(self, admin_key: str) -> list[str]:
        self.check_admin(admin_key)
        return self.meta.tenant_ids()

    def rotate_key(self, admin_key: str, tenant_id: str) -> str:
        """A new API key for the tenant; the old one stops working at once."""
        self.check_admin(admin_key)
        if is_scoped(check_id("tenant id", tenant_id)) or self.meta.tenant(tenant_id) is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")  # a scope has no key of its own
        key = new_tenant_key(tenant_id)
        self.meta.update_tenant(tenant_id, {"key_hash": hash_key(key)})
        return key

    def delete_tenant(self, admin_key: str, tenant_id: str) -> None:
        """Remove a tenant: its key stops working at once, then its records and index are removed, and so are
        those of its end users' scopes."""
        self.check_admin(admin_key)
        scopes = self.meta.scope_ids(check_id("tenant id", tenant_id))
        if not self.meta.delete_tenant(tenant_id):
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        self._drop_stored(tenant_id)
        for scoped in scopes:
            self.meta.delete_tenant(scoped)
            self._drop_stored(scoped)

    def _drop_stored(self, tenant_id: str) -> None:
        """What a deleted tenant or scope left beside Redis: its records and its retrieval index."""
        self.records.drop_tenant(tenant_id)
        self.indexes.forget(tenant_id, remove_snapshot=True)

    def tenant_for_admin(self, admin_key: str, tenant_id: str) -> Tenant:
        """A tenant's facts opened with the admin key (encoder jobs write on a tenant's behalf)."""
        self.check_admin(admin_key)
        info = self.meta.tenant(check_id("tenant id", tenant_id))
        if info is None:
            raise UnknownTenantError(f"unknown tenant {tenant_id!r}")
        return Tenant(self, tenant_id, info)

    def open_tenant(self, key: str, tenant_id: str) -> Tenant:
        """A tenant's facts (or one of its scopes') opened with the admin key or the tenant's own key (jobs and
        encodings act with either)."""
        if isinstance(key, str) and key.startswith(f"{TENANT_PREFIX}."):
            tenant = self.authenticate(key)
            if tenant.id == tenant_id:
                return tenant
            info = self.meta.tenant(check_id("tenant id", tenant_id)) if is_scoped(tenant_id) else None
            if info is None or info.get("parent") != tenant.id:
                raise AuthError("missing or wrong API key")
            return Tenant(self, tenant_id, info)
        return self.tenant_for_admin(key, tenant_id)

    def open_scope(self, tenant: Tenant, scope: Scope, create: bool = True) -> Tenant:
        """An end user's memory inside `tenant`, made on first use with the tenant's settings and quotas; with
        `create` False (reads) one not made yet is opened empty and nothing is stored."""
        if tenant.entry.scope is not None:
            raise InvalidInputError("a scope has no scopes of its own")
        scoped = scoped_id(tenant.id, scope)
        info = self.meta.tenant(scoped)
        if info is None:
            fields = {k: v for k, v in tenant._info.items() if k not in ("id", "key_hash", "created")}
            fields |= {
                "max_facts": fields.get("scope_max_facts", fields["max_facts"]),
                "max_bytes": fields.get("scope_max_bytes", fields["max_bytes"]),
            }
            fields |= {
                "key_hash": NO_KEY,
                "parent": tenant.id,
                "scope": json.dumps(scope.as_dict()),
                "created": time.time(),
            }
            if not create:
                return Tenant(self, scoped, {k: str(v) for k, v in fields.items()} | {"id": scoped})
            try:
                self.meta.create_scope(tenant.id, scoped, fields)
            except TenantExistsError:
                pass  # made meanwhile by another request
            info = self.meta.tenant(scoped)
            if info is None:
                raise UnknownTenantError(f"unknown tenant {tenant.id!r}")
        return Tenant(self, scoped, info)

    def open_holder(self, tenant: Tenant, holder_id: str, fact_id: str) -> Tenant:
        """The scope of `tenant` stored under `holder_id` (which a located memory id names); a scope that does
        not exist, or is not this tenant's, answers as the fact not found."""
        try:
            info = self.meta.tenant(check_id("scope id", holder_id)) if tenant.entry.scope is None else None
        except InvalidInputError:
            info = None
        if info is None or info.get("parent") != tenant.id:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return Tenant(self, holder_id, info)

    def delete_scope(self, tenant: Tenant, scope: Scope) -> bool:
        """Remove an end user's scope of `tenant` and everything in it (True if it existed)."""
        if tenant.entry.scope is not None:
            raise InvalidInputError("a scope has no scopes of its own")
        scoped = scoped_id(tenant.id, scope)
        held = self.meta.records.usage(scoped)
        existed = self.meta.delete_tenant(scoped)
        if existed:  # its facts leave the tenant's total
            self.meta.records.charge_total(tenant.id, -held["facts"], -held["bytes"])
        self.meta.remove_scope(tenant.id, scoped)  # after: a crash between leaves an id `scopes` skips
        self._drop_stored(scoped)
        return existed

    def scopes(self, tenant: Tenant) -> list[dict[str, str]]:
        """The end users' scopes a tenant holds memories for."""
        entries = [self.meta.tenant(s) for s in self.meta.scope_ids(tenant.id)]
        return [json.loads(e["scope"]) for e in entries if e and e.get("parent") == tenant.id]

    # ---- tenants ----
    def authenticate(self, api_key: object) -> Tenant:
        tenant_id = tenant_of(api_key)
        info = self.meta.tenant(tenant_id)
        if info is None or "parent" in info or not matches(api_key, info.get("key_hash")):  # type: ignore[arg-type]
            raise AuthError("missing or wrong API key")  # the same answer for an unknown tenant
        return Tenant(self, tenant_id, info)


def _public(info: dict[str, str]) -> dict:
    return {
        "id": info["id"],
        "max_facts": int(info["max_facts"]),
        "max_bytes": int(info["max_bytes"]),
        "window": int(info["window"]),
        "model_fingerprint": info.get("model_fingerprint", ""),
        "neighbours": int(info.get("neighbours", 0)),
        "created": float(info["created"]),
    } | {key: int(info[key]) for key in ("recompute", "kv_budget_bytes") if key in info}
