"""Mem0's platform API, as `mem0ai`'s `MemoryClient` and `AsyncMemoryClient` call it, over the same `Gateway`.

An application that already talks to Mem0 points its client at inferscale (`host=`) with a tenant's key and
keeps its code: `Token` auth, trailing-slash paths, entity ids (`user_id`, `agent_id`, `run_id`) at the top of
an add and inside `filters` elsewhere, Mem0's response shapes and `detail` in errors. Memories are facts of
the tenant's scopes (`tenants/scopes.py`); a memory id names its scope (`located_id`), so get, update, delete
and history need nothing but the id, as in Mem0. What Mem0 has and inferscale does not (organizations and
projects, webhooks, exports, summaries, profiles, categories, expiry, app ids, metadata filters) is refused
with a 400 that names it, never ignored.
"""

# No `from __future__ import annotations`: the routes' dependency types are made inside `mem0_router`, and
# FastAPI must read them as objects when it declares each route.
import asyncio
from datetime import datetime, timezone
from typing import Annotated, Any, Callable

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.gateway import Gateway
from deployments.schemas import Message, scope_input, scope_of
from tenants.errors import FactNotFoundError, InvalidInputError, JobNotFoundError
from tenants.facts import Fact
from tenants.scopes import Scope, located_id
from tenants.tenant import Tenant

PAGE_SIZE_MAX = 1000
_FEATURES = {  # Mem0 routes with no counterpart here, by path prefix: what each is
    "/v1/exports/": "memory exports",
    "/v1/summary/": "memory summaries",
    "/v2/profiles/": "user profiles",
    "/v1/feedback/": "memory feedback",
    "/api/v1/": "organizations, projects and webhooks",
}


class _Mem0Body(BaseModel):
    """A Mem0 request body: the fields a subclass names; any other field that is set is refused by name."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unknown(self) -> "_Mem0Body":
        for name, value in (self.model_extra or {}).items():
            if value is None or (name in _NO_OPS and value == _NO_OPS[name]):
                continue
            raise ValueError(f"'{name}' is not supported by inferscale")
        return self


_NO_OPS: dict[str, Any] = {
    "rerank": False,
    "latest_only": True,
    "show_expired": False,
    "keyword_search": False,
    "async_mode": True,
    "version": "v2",
    "output_format": "v1.1",
    "expiration_date": None,
}


def scope_of_filters(raw: dict[str, Any] | None) -> Scope | None:
    """The scope Mem0's `filters` name: entity ids, alone or under one `AND` (None: the tenant's own memory)."""
    raw = raw or {}
    conditions: dict[str, Any] = {}
    for part in raw["AND"] if set(raw) == {"AND"} and isinstance(raw["AND"], list) else [raw]:
        if not isinstance(part, dict):
            raise InvalidInputError("filters: each condition must be an object")
        for name, value in part.items():
            if name not in ("user_id", "agent_id", "run_id"):
                raise InvalidInputError(
                    f"filters: '{name}' is not supported by inferscale (only user_id, "
                    "agent_id and run_id, alone or under one AND)"
                )
            if not isinstance(value, str):
                raise InvalidInputError(f"filters: {name} must be a string (operators are not supported)")
            conditions[name] = value
    try:
        return scope_of(conditions.get("user_id"), conditions.get("agent_id"), conditions.get("run_id"))
    except ValueError as exc:
        raise InvalidInputError(f"filters: {exc}") from None


class Add(_Mem0Body):
    """Mem0's add request: messages stored as memories of one end user, agent or run."""

    messages: list[Message] = Field(..., min_length=1, max_length=2000)
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    metadata: dict[str, Any] | None = None
    infer: bool = True  # True: facts are extracted by an encoding job; False: each message is a memory as sent

    @model_validator(mode="after")
    def _metadata_needs_facts(self) -> "Add":
        if self.infer and self.metadata is not None:
            raise ValueError("metadata is kept with memories stored as sent: send infer=false with it")
        return self


class Search(_Mem0Body):
    """Mem0's search request: a query, the scope's filters, how many and how close."""

    query: str = Field(..., min_length=1)
    filters: dict[str, Any] | None = None
    top_k: int = Field(10, ge=1, le=1000)
    threshold: float | None = Field(None, ge=-1.0, le=1.0, description="Leave out memories scored below it.")


class GetAll(_Mem0Body):
    """Mem0's list request: the scope's filters."""

    filters: dict[str, Any] | None = None


class Update(_Mem0Body):
    """Mem0's update request: a memory's new text and/or metadata."""

    text: str | None = Field(None, min_length=1)
    metadata: dict[str, Any] | None = None


class BatchItem(BaseModel):
    """One memory of a Mem0 batch update."""

    model_config = ConfigDict(extra="forbid")

    memory_id: str
    text: str | None = Field(None, min_length=1)
    metadata: dict[str, Any] | None = None


class Batch(BaseModel):
    """Mem0's batch update (or delete) request."""

    model_config = ConfigDict(extra="forbid")

    memories: list[BatchItem] = Field(..., min_length=1, max_length=1000)


def _entity_query(
    user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None, app_id: str | None = None
) -> Scope | None:
    if app_id is not None:
        raise InvalidInputError("'app_id' is not supported by inferscale")
    return scope_input(user_id, agent_id, run_id)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def memory_of(fact: Fact, holder: Tenant) -> dict[str, Any]:
    """A fact in Mem0's shape, with its located id and its K/V state beside."""
    scope = holder.entry.scope.as_dict() if holder.entry.scope else {}
    return {
        "id": located_id(fact.id, holder.id),
        "memory": fact.text,
        "user_id": scope.get("user_id"),
        "agent_id": scope.get("agent_id"),
        "run_id": scope.get("run_id"),
        "app_id": None,
        "metadata": fact.metadata,
        "categories": [],
        "created_at": _iso(fact.created),
        "updated_at": _iso(fact.updated),
        "expiration_date": None,
        "version": fact.version,
        "kv_ready": fact.kv_ready,
    }


def history_of(fact: Fact, holder: Tenant) -> list[dict[str, Any]]:
    """The fact's versions as Mem0's history entries, oldest first."""
    texts = [*(v["text"] for v in fact.previous), fact.text]
    times = [*(v["at"] for v in fact.previous), fact.updated]
    first = fact.version - len(fact.previous)
    memory_id = located_id(fact.id, holder.id)
    scope = holder.entry.scope.as_dict() if holder.entry.scope else {}
    return [
        {
            "id": f"{memory_id}.v{first + i}",
            "memory_id": memory_id,
            "event": "ADD" if first + i == 1 else "UPDATE",
            "old_memory": texts[i - 1] if i else None,
            "new_memory": text,
            "user_id": scope.get("user_id"),
            "created_at": _iso(at),
            "updated_at": _iso(at),
        }
        for i, (text, at) in enumerate(zip(texts, times))
    ]


def mem0_router(gateway: Gateway, tenant_dep: Any, key_of: Callable[[Request], str | None]) -> APIRouter:
    """The routes `mem0ai`'s clients call (`tenant_dep`: the API's tenant authentication)."""
    router = APIRouter(tags=["mem0"])
    memories = gateway.memories
    TenantDep = Annotated[Tenant, Depends(tenant_dep)]
    EntityQuery = Annotated[Scope | None, Depends(_entity_query)]

    @router.get("/v1/ping/")
    async def ping(tenant: TenantDep) -> dict[str, Any]:
        """The key's check; Mem0's clients need an organization and a project: the cluster and the tenant."""
        return {
            "status": "ok",
            "message": "API key is valid",
            "org_id": "inferscale",
            "project_id": tenant.id,
            "user_email": None,
        }

    @router.post("/v3/memories/add/")
    async def add(request: Request, tenant: TenantDep, body: Add) -> dict[str, Any]:
        holder = memories.in_scope(tenant, _entity_query(body.user_id, body.agent_id, body.run_id), write=True)
        key = key_of(request) or ""
        if body.infer:
            job = gateway.jobs.extract(holder, key, body.messages)
            return {
                "results": [],
                "event_id": located_id(job["job_id"], holder.id),
                "status": "PENDING",
                "message": "memory extraction queued; GET /v1/event/{event_id}/ for its status",
            }
        texts = [m.content for m in body.messages if m.role != "system"]
        if not texts:
            raise InvalidInputError("messages hold no user or assistant content to store")
        added = memories.add_facts(holder, key, texts, body.metadata)  # on the loop: it schedules their encoding
        return {"results": [{**memory_of(f, holder), "event": "ADD"} for f in added]}

    @router.get("/v1/event/{event_id}/")
    async def event(tenant: TenantDep, event_id: str) -> dict[str, Any]:
        """An extraction's status (its encoding job's): PENDING, RUNNING, SUCCEEDED or FAILED."""
        try:
            holder, job_id = memories.locate(tenant, event_id, None)
        except FactNotFoundError:
            raise JobNotFoundError(f"no event {event_id!r}") from None
        job = holder.job(job_id)
        return {**job, "id": event_id, "status": str(job.get("status", "")).upper().replace("QUEUED", "PENDING")}

    @router.post("/v3/memories/search/")
    async def search(tenant: TenantDep, body: Search) -> dict[str, Any]:
        holder = memories.in_scope(tenant, scope_of_filters(body.filters))
        hits = await asyncio.to_thread(holder.search, body.query, body.top_k)
        return {
            "results": [
                {**memory_of(f, holder), "score": round(float(s), 6)}
                for f, s in hits
                if body.threshold is None or s >= body.threshold
            ]
        }

    @router.post("/v3/memories/")
    async def get_all(
        request: Request, tenant: TenantDep, body: GetAll, page: int = 1, page_size: int = 100
    ) -> dict[str, Any]:
        if page < 1 or not 1 <= page_size <= PAGE_SIZE_MAX:
            raise InvalidInputError(f"page must be >= 1 and page_size within 1..{PAGE_SIZE_MAX}")
        holder = memories.in_scope(tenant, scope_of_filters(body.filters))
        count = holder.usage()["facts"]
        facts = holder.list_facts((page - 1) * page_size, page_size)
        link = lambda p: str(request.url.include_query_params(page=p, page_size=page_size))  # noqa: E731
        return {
            "count": count,
            "next": link(page + 1) if page * page_size < count else None,
            "previous": link(page - 1) if page > 1 else None,
            "results": [memory_of(f, holder) for f in facts],
        }

    @router.get("/v1/memories/{memory_id}/")
    async def get(tenant: TenantDep, scope: EntityQuery, memory_id: str) -> dict[str, Any]:
        holder, fact_id = memories.locate(tenant, memory_id, scope)
        return memory_of(holder.get_fact(fact_id), holder)

    @router.get("/v1/memories/{memory_id}/history/")
    async def history(tenant: TenantDep, scope: EntityQuery, memory_id: str) -> list[dict[str, Any]]:
        holder, fact_id = memories.locate(tenant, memory_id, scope)
        return history_of(holder.get_fact(fact_id), holder)

    @router.put("/v1/memories/{memory_id}/")
    async def update(
        request: Request, tenant: TenantDep, scope: EntityQuery, memory_id: str, body: Update
    ) -> dict[str, Any]:
        if body.text is None and body.metadata is None:
            raise InvalidInputError("send text or metadata to update")
        holder, fact_id = memories.locate(tenant, memory_id, scope)
        fact = memories.update_fact(holder, key_of(request) or "", fact_id, body.text, metadata=body.metadata)
        return {**memory_of(fact, holder), "event": "UPDATE"}

    @router.delete("/v1/memories/{memory_id}/")
    async def delete(tenant: TenantDep, scope: EntityQuery, memory_id: str) -> dict[str, Any]:
        memories.delete_memory(tenant, scope, memory_id)
        return {"message": "Memory deleted successfully!", "id": memory_id}

    @router.delete("/v1/memories/")
    async def delete_all(tenant: TenantDep, scope: EntityQuery) -> dict[str, Any]:
        """Every memory of one end user's scope (a tenant's own memory is never deleted wholesale here)."""
        if scope is None:
            raise InvalidInputError("name whose memories to delete: user_id (and agent_id, run_id)")
        gateway.service.delete_scope(tenant, scope)
        return {"message": "Memories deleted successfully!"}

    @router.put("/v1/batch/")
    async def batch_update(request: Request, tenant: TenantDep, body: Batch) -> dict[str, Any]:
        for item in body.memories:
            holder, fact_id = memories.locate(tenant, item.memory_id, None)
            memories.update_fact(holder, key_of(request) or "", fact_id, item.text, metadata=item.metadata)
        return {"message": f"Successfully updated {len(body.memories)} memories"}

    @router.delete("/v1/batch/")
    async def batch_delete(tenant: TenantDep, body: Batch) -> dict[str, Any]:
        for item in body.memories:
            memories.delete_memory(tenant, None, item.memory_id)
        return {"message": f"Successfully deleted {len(body.memories)} memories"}

    @router.get("/v1/entities/")
    async def entities(tenant: TenantDep) -> dict[str, Any]:
        """Each user, agent and run id of the tenant's scopes that hold memories, with their count (a scope made by
        a write stays, empty, once its memories are deleted one by one)."""
        counts: dict[tuple[str, str], int] = {}
        for scope in gateway.service.scopes(tenant):
            facts = memories.in_scope(tenant, Scope(**scope)).usage()["facts"]
            for kind in ("user", "agent", "run") if facts else ():
                if f"{kind}_id" in scope:
                    counts[kind, scope[f"{kind}_id"]] = counts.get((kind, scope[f"{kind}_id"]), 0) + facts
        results = [
            {"id": name, "name": name, "type": kind, "total_memories": n, "owner": tenant.id, "metadata": None}
            for (kind, name), n in sorted(counts.items())
        ]
        return {"count": len(results), "results": results}

    @router.delete("/v2/entities/{kind}/{name}/")
    async def delete_entity(tenant: TenantDep, kind: str, name: str) -> dict[str, Any]:
        """Every scope whose user, agent or run id is `name` (deleting one already gone deletes nothing)."""
        if kind not in ("user", "agent", "run"):
            raise InvalidInputError(f"entity type {kind!r} is not supported by inferscale (user, agent or run)")
        gone = [Scope(**s) for s in gateway.service.scopes(tenant) if s.get(f"{kind}_id") == name]
        for scope in gone:
            gateway.service.delete_scope(tenant, scope)
        return {"message": "Entity deleted successfully.", "deleted_scopes": len(gone)}

    async def profile(tenant: TenantDep, kind: str, name: str) -> None:
        raise InvalidInputError("user profiles are not supported by inferscale")

    for method in ("GET", "POST"):  # a route per method: one operation id each in the OpenAPI document
        router.add_api_route(
            "/v2/entities/{kind}/{name}/profile/", profile, methods=[method], name=f"profile_{method.lower()}"
        )

    def refusal(feature: str) -> Callable[..., Any]:
        async def refuse(tenant: TenantDep, rest: str = "") -> None:
            raise InvalidInputError(f"Mem0's {feature} are not supported by inferscale")

        return refuse

    for prefix, feature in _FEATURES.items():
        router.add_api_route(
            prefix + "{rest:path}",
            refusal(feature),
            methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
            include_in_schema=False,
        )
    return router
