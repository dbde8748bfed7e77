"""End users inside a tenant: Mem0's `user_id`, with an optional `agent_id` and `run_id`.

A tenant is an application; its end users each need a memory of their own. A scope is stored as a tenant of
its own whose id is derived from the tenant's and the scope's (`scoped_id`), so everything keyed by a tenant id
(fact metadata, records, retrieval indexes, prefix-cache salts, placement, device-arena keys) keeps scopes
apart exactly as it keeps tenants apart. Its registry entry names its parent and copies the parent's
settings; no API key opens it directly (its key hash matches no key): it is reached through its tenant's key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tenants.errors import InvalidInputError

SEPARATOR = ".."  # refused in tenant ids, so a scope's id never names a tenant
MAX_ID_CHARS = 256
NO_KEY = "scope"  # a scope entry's key hash: no key hashes to it


@dataclass(frozen=True)
class Scope:
    """Whose memory: an end user, optionally narrowed to an agent and a run (Mem0's entity ids)."""

    user_id: str
    agent_id: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("user_id", "agent_id", "run_id"):
            value = getattr(self, name)
            if value is None and name != "user_id":
                continue
            if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS or not value.isprintable():
                raise InvalidInputError(f"{name} must be 1-{MAX_ID_CHARS} printable characters")

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in (("user_id", self.user_id), ("agent_id", self.agent_id), ("run_id", self.run_id)) if v}


def scoped_id(tenant_id: str, scope: Scope) -> str:
    """The id a scope is stored under: a readable start of the tenant's id and a digest of both (at most 126
    characters, the identifier alphabet, unique per (tenant, scope))."""
    digest = hashlib.sha256(json.dumps([tenant_id, scope.user_id, scope.agent_id, scope.run_id]).encode()).hexdigest()
    return f"{tenant_id[:100]}{SEPARATOR}{digest[:24]}"


def is_scoped(tenant_id: str) -> bool:
    return SEPARATOR in tenant_id


LOCATED = "~"  # joins a fact id and its scope's digest in a memory id that finds its own scope (not in ids)


def located_id(fact_id: str, holder_id: str) -> str:
    """A memory id that names the scope holding the fact (`holder_id`: the scope's stored id; a tenant's own
    facts keep their plain ids): Mem0's clients get, update and delete a memory by its id alone."""
    return f"{fact_id}{LOCATED}{holder_id.rsplit(SEPARATOR, 1)[1]}" if is_scoped(holder_id) else fact_id


def split_located(memory_id: str, tenant_id: str) -> tuple[str, str | None]:
    """(fact id, the stored id of the scope it names or None) of a memory id of `tenant_id`."""
    fact_id, marked, digest = memory_id.partition(LOCATED)
    return (fact_id, f"{tenant_id[:100]}{SEPARATOR}{digest}" if marked else None)
