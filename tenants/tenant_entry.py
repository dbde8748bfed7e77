"""A tenant's (or an end user's scope's) registry entry, parsed once into typed fields.

Redis hands a registry entry back as strings; a `Tenant` parses it when it is opened, so the rest of the code
reads `entry.window`, never `int(info.get("window", 0))`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from tenants.scopes import Scope


@dataclass(frozen=True)
class TenantEntry:
    """Whose memory an entry is, how its facts are encoded and what bounds them."""

    root_id: str  # the tenant whose quotas bound this memory's total: its own id, or a scope's tenant
    scope: Scope | None  # the end user this memory belongs to, for a scope of a tenant; None for the tenant's own
    max_facts: int
    max_bytes: int
    window: int  # conversation turns each fact is encoded behind
    neighbours: int  # nearest facts each fact is encoded behind (after its window turns)
    recompute: int | None  # facts a chat prefills after the injected ones when it does not say; None: the cluster's
    model_fingerprint: str
    kv_budget_bytes: int | None = None  # K/V bytes this memory keeps at most (KV residency); None: the cluster's
    history: str | None = None  # the conversation history captured in chunks for history mode (its id), if any
    history_tokens: int = 0

    @classmethod
    def parse(cls, tenant_id: str, info: Mapping[str, str]) -> TenantEntry:
        """The entry stored for `tenant_id` (every field as Redis returns it: a string)."""
        return cls(
            root_id=info.get("parent", tenant_id),
            scope=Scope(**json.loads(info["scope"])) if "scope" in info else None,
            max_facts=int(info["max_facts"]),
            max_bytes=int(info["max_bytes"]),
            window=int(info.get("window", 0)),
            neighbours=int(info.get("neighbours", 0)),
            recompute=int(info["recompute"]) if "recompute" in info else None,
            model_fingerprint=info.get("model_fingerprint", ""),
            kv_budget_bytes=int(info["kv_budget_bytes"]) if "kv_budget_bytes" in info else None,
            history=info.get("history") or None,
            history_tokens=int(info.get("history_tokens", 0)),
        )
