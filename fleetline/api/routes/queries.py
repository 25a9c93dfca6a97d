"""ClickHouse over every storage tier: raw read-only SQL (platform admins) and ready queries."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import HTTPException, Query, Request

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Rule
from fleetline.api.routing import Routes
from fleetline.processors.audit.runtime import data_access
from fleetline.storage.queries import READY, logs_sql, progress_sql, ready_sql, trace_sql

LEVELS = "(?i)^(debug|info|warning|error|critical)$"
Since = Annotated[str, Query(alias="from", description="-<n>s|m|h|d, epoch ms or ISO 8601")]
Until = Annotated[str | None, Query(alias="to")]


def _answer(request: Request, sql: str, result: dict[str, Any]) -> dict[str, Any]:
    request.state.data_access = data_access(sql, len(result["rows"]))
    return result


def register(route: Routes, ports: Ports) -> None:
    @route(
        "POST",
        "/v1/sql",
        Rule("sql", "run", tenant_scoped=False),
        response_model=models.SqlResult,
        summary="Raw read-only ClickHouse SQL: platform admins only",
    )
    def run_sql(body: models.SqlRequest, request: Request) -> dict[str, Any]:
        return _answer(request, body.query, ports.sql_port()(body.query))

    @route(
        "GET",
        "/v1/queries/{name}",
        Rule("fleet", "read", tenant_scoped=False),
        response_model=models.SqlResult,
        summary="A ready query over all storage tiers (see `fleetline query list`)",
    )
    def run_ready_query(
        request: Request,
        name: str,
        since: Since = "-1h",
        until: Until = None,
    ) -> dict[str, Any]:
        if name not in READY:
            raise HTTPException(404, f"no ready query {name!r}; known: {sorted(READY)}")
        if ports.ready_query is None:
            raise HTTPException(503, "no ClickHouse store is configured on this server")
        result = ports.ready_query(name, since, until)
        return _answer(request, ready_sql(name, since, until), result)

    @route(
        "GET",
        "/v1/traces/{trace_id}",
        Rule("jobs", "read"),
        response_model=models.SqlResult,
        summary="One request's trace across the API, the scheduler and the clusters, in time "
        "order (a tenant's users see their tenant's rows)",
    )
    def trace(trace_id: str, request: Request) -> dict[str, Any]:
        sql = trace_sql(trace_id)
        result = ports.sql_port()(sql)
        scope = request.state.scope
        if scope is not None:
            # Only rows that name the caller's tenant (none when the store answered without
            # a tenant column: a caller held to a tenant never sees unattributed rows).
            columns = result["columns"]
            tenant = columns.index("tenant") if "tenant" in columns else None
            result["rows"] = [
                r for r in result["rows"] if tenant is not None and r[tenant] == scope
            ]
        return _answer(request, sql, result)

    @route(
        "GET",
        "/v1/jobs/{tenant}/{name}/progress",
        Rule("jobs", "read"),
        response_model=models.SqlResult,
        summary="A training job's reported steps, loss, throughput and checkpoints, over "
        "every placement (from the cluster agents' workload events in ClickHouse)",
    )
    def job_progress(tenant: str, name: str, request: Request) -> dict[str, Any]:
        sql = progress_sql(f"{tenant}/{name}")
        return _answer(request, sql, ports.sql_port()(sql))

    @route(
        "GET",
        "/v1/logs",
        Rule("sql", "run", tenant_scoped=False),
        response_model=models.SqlResult,
        summary="Log lines of every fleetline process (newest first): platform admins only",
    )
    def search_logs(
        request: Request,
        since: Since = "-1h",
        until: Until = None,
        q: str | None = None,
        level: Annotated[str | None, Query(pattern=LEVELS)] = None,
        process: str | None = None,
        trace_id: Annotated[str | None, Query(pattern="^[0-9a-f]{32}$")] = None,
        limit: Annotated[int, Query(ge=1, le=5000)] = 200,
    ) -> dict[str, Any]:
        sql = logs_sql(since, until, q, level, process, trace_id, limit)
        return _answer(request, sql, ports.sql_port()(sql))
