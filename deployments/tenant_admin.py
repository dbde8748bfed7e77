"""The admin routes' work, transport aside: tenants created, listed, shown and deleted with the admin key."""

from __future__ import annotations

from typing import Any

from deployments.schemas import CreateTenant
from tenants.service import TenantService


class TenantAdmin:
    """Admin requests turned into `TenantService` calls, and their answers into the API's shape."""

    def __init__(self, service: TenantService) -> None:
        self._service = service

    def create_tenant(self, admin_key: str | None, body: CreateTenant) -> dict[str, Any]:
        info, key = self._service.create_tenant(
            admin_key or "",
            body.id,
            max_facts=body.max_facts,
            max_bytes=body.max_bytes,
            window=body.window,
            recompute=body.recompute,
            neighbours=body.neighbours,
            scope_max_facts=body.scope_max_facts,
            scope_max_bytes=body.scope_max_bytes,
            kv_budget_bytes=body.kv_budget_bytes,
        )
        return {"tenant": info, "api_key": key}

    def list_tenants(self, admin_key: str | None) -> dict[str, Any]:
        return {"tenants": self._service.list_tenants(admin_key or "")}

    def tenant_info(self, admin_key: str | None, tenant_id: str) -> dict[str, Any]:
        return self._service.tenant_info(admin_key or "", tenant_id)

    def delete_tenant(self, admin_key: str | None, tenant_id: str) -> dict[str, Any]:
        self._service.delete_tenant(admin_key or "", tenant_id)
        return {"id": tenant_id, "deleted": True}
