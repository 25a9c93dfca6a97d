"""The audit log: search (held to the caller's tenant) and a ready activity query."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.processors.audit.chain import masked_event
from fleetline.storage.audit_store import AuditQuery


def register(route: Routes, ports: Ports) -> None:
    @route(
        "GET",
        "/v1/audit",
        Rule("audit", "read"),
        response_model=models.AuditPage,
        summary="Search audit records (the caller's tenant only, unless admin or auditor)",
    )
    def search_audit(
        request: Request,
        tenant: str | None = None,
        since_ms: Annotated[int | None, Query(alias="from")] = None,
        until_ms: Annotated[int | None, Query(alias="to")] = None,
        op: str | None = None,
        actor: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        principal: Principal = request.state.principal
        records = ports.audit().search(
            AuditQuery(request.state.scope, since_ms, until_ms, op, actor, limit)
        )
        return {
            "items": [
                {
                    "partition": r["partition"],
                    "seq": r["seq"],
                    "hash": r["hash"].hex(),
                    **masked_event(r["event"], principal.sees_sensitive),
                }
                for r in records
            ]
        }

    @route(
        "GET",
        "/v1/audit/activity",
        Rule("audit", "read"),
        response_model=models.ActivityPage,
        summary="Ready query: calls per operation and outcome, tenant-scoped",
    )
    def audit_activity(
        request: Request,
        since_ms: Annotated[int, Query(alias="from")],
        until_ms: Annotated[int, Query(alias="to")],
        tenant: str | None = None,
    ) -> dict[str, Any]:
        return {"items": ports.audit().activity(request.state.scope, since_ms, until_ms)}
