"""The audit log: search (held to the caller's tenant) and a ready activity query."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, PlainTextResponse

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.processors.audit.chain import masked_event
from fleetline.processors.postmortem.render import markdown, page
from fleetline.processors.postmortem.report import Scope
from fleetline.storage.audit_store import AuditQuery


def register(route: Routes, ports: Ports) -> None:
    register_postmortem(route, ports)

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


def register_postmortem(route: Routes, ports: Ports) -> None:
    @route(
        "GET",
        "/v1/postmortem",
        Rule("audit", "read"),
        summary="An incident report of a window, from the log and the storage tiers: faults and "
        "their detection, the actions that followed, each job's moves, the audit chain verified "
        "(format=json, markdown or html; a caller held to a tenant gets its own jobs)",
    )
    async def postmortem(
        request: Request,
        since_ms: Annotated[int, Query(alias="from")],
        until_ms: Annotated[int, Query(alias="to")],
        tenant: str | None = None,
        cluster: str | None = None,
        job: str | None = None,
        node: str | None = None,
        service: str | None = None,
        format: Literal["json", "markdown", "html"] = "json",
    ) -> Any:
        scope = Scope(cluster, job, node, service, tenant=request.state.scope)
        # (A window it can say nothing true of is a ConfigError: the app's handler says 400.)
        report = await run_in_threadpool(ports.postmortem(), since_ms, until_ms, scope)
        title = f"Postmortem of {scope.words()}"
        if format == "markdown":
            return PlainTextResponse(markdown(report, title), media_type="text/markdown")
        if format == "html":
            return HTMLResponse(page(report, title))
        return report
