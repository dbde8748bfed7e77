"""A tenant's memories as the API's routes read and change them (ours and Mem0's): which memory a request
names (the tenant's own, or an end user's scope), and writes whose K/V is encoded after they return."""

from __future__ import annotations

from typing import Any

from deployments.fact_encoding import FactEncoder
from deployments.job_queue import JobQueue
from deployments.schemas import AddMemories, SearchMemories, UpdateMemory
from tenants.errors import FactNotFoundError
from tenants.facts import Fact
from tenants.residency import Residency
from tenants.scopes import Scope, scoped_id, split_located
from tenants.service import TenantService
from tenants.tenant import Tenant


class Memories:
    """Memory routes' work, transport aside: pick the memory, write (encoding later), read, search, delete."""

    def __init__(
        self, service: TenantService, encoder: FactEncoder, jobs: JobQueue, residency: Residency | None = None
    ) -> None:
        self._service, self._encoder, self._jobs, self._residency = service, encoder, jobs, residency

    def in_scope(self, tenant: Tenant, scope: Scope | None, write: bool = False) -> Tenant:
        """The memory a request is about: an end user's scope of the tenant, or (None) the tenant's own. Only a
        write makes a scope; reading one that was never written stores nothing."""
        return tenant if scope is None else self._service.open_scope(tenant, scope, create=write)

    def locate(self, tenant: Tenant, memory_id: str, scope: Scope | None) -> tuple[Tenant, str]:
        """The memory (tenant's or scope's) holding a fact, and the fact's id: a located memory id names its scope
        itself (what Mem0's clients send), a plain one is looked up in `scope` (None: the tenant's own)."""
        fact_id, holder_id = split_located(memory_id, tenant.id)
        if holder_id is None:
            return self.in_scope(tenant, scope), fact_id
        if scope is not None and scoped_id(tenant.id, scope) != holder_id:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return self._service.open_holder(tenant, holder_id, fact_id), fact_id

    def add_facts(self, holder: Tenant, api_key: str, texts: list[str], metadata: dict | None = None) -> list[Fact]:
        """Store facts now (served by their text) and encode their K/V in the background."""
        added = holder.add_facts(texts, metadata=metadata)
        self._encoder.encode_later(api_key, holder.id, added)
        return added

    def update_fact(
        self,
        holder: Tenant,
        api_key: str,
        fact_id: str,
        text: str | None,
        *,
        version: int | None = None,
        metadata: dict | None = None,
    ) -> Fact:
        fact = holder.update_fact(fact_id, text, version=version, metadata=metadata)
        self._encoder.encode_later(api_key, holder.id, [fact])
        return fact

    def add_memories(self, tenant: Tenant, api_key: str, body: AddMemories) -> tuple[int, dict[str, Any]]:
        holder = self.in_scope(tenant, body.scope(), write=True)
        if body.facts is not None:
            added = self.add_facts(holder, api_key, body.facts)
            return 200, {"results": [{"id": f.id, "memory": f.text, "event": "ADD"} for f in added]}
        return 202, self._jobs.extract(holder, api_key, body.messages or [])

    def search(self, tenant: Tenant, body: SearchMemories) -> dict[str, Any]:
        hits = self.in_scope(tenant, body.scope()).search(body.query, body.limit)
        return {"results": [{"id": f.id, "memory": f.text, "score": round(float(s), 6)} for f, s in hits]}

    def list_memories(self, tenant: Tenant, offset: int, limit: int) -> dict[str, Any]:
        return {"results": [_memory(f) for f in tenant.list_facts(offset, limit)], "usage": tenant.usage()}

    def get_memory(self, tenant: Tenant, scope: Scope | None, memory_id: str) -> dict[str, Any]:
        """The fact, and where serving replicas hold its K/V ({replica: {tier, version, at}})."""
        holder, fact_id = self.locate(tenant, memory_id, scope)
        fact = holder.get_fact(fact_id)
        found = {**_memory(fact), "placement": holder.placement(fact_id)}
        if self._residency is not None:
            found["residency"] = self._residency.describe(holder.id, fact)
        return found

    def encode_again(self, holder: Tenant, api_key: str, facts: list[Fact]) -> None:
        """Encode, in the background, facts whose K/V residency dropped and that are retrieved again."""
        self._encoder.encode_later(api_key, holder.id, facts)

    def update_memory(
        self, tenant: Tenant, scope: Scope | None, api_key: str, memory_id: str, body: UpdateMemory
    ) -> dict[str, Any]:
        holder, fact_id = self.locate(tenant, memory_id, scope)
        fact = self.update_fact(holder, api_key, fact_id, body.memory, version=body.version)
        return {"id": fact.id, "memory": fact.text, "version": fact.version, "event": "UPDATE"}

    def delete_memory(self, tenant: Tenant, scope: Scope | None, memory_id: str) -> dict[str, Any]:
        holder, fact_id = self.locate(tenant, memory_id, scope)
        holder.delete_fact(fact_id)
        return {"id": memory_id, "event": "DELETE"}


def _memory(fact: Fact) -> dict[str, Any]:
    return {
        "id": fact.id,
        "memory": fact.text,
        "version": fact.version,
        "kv_ready": fact.kv_ready,
        "created": fact.created,
        "updated": fact.updated,
        "metadata": fact.metadata,
    }
