"""The HTTP API (FastAPI; OpenAPI at /openapi.json): the composition of its routes.

Every route is declared with a `Rule` and passes one guard: authenticate the bearer token,
authorise the role and hold the request to the principal's tenant. `create_app` refuses to build
an app with a route that has no rule. Every call, allowed or refused, becomes an AuditEvent.
Reads of the view run with the fold paused, so a response is one version of the view. A new
route goes in the `routes/` module of its area, declared through `Routes`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from fleetline.api.auth import Authenticator
from fleetline.api.body_limit import BodyLimit
from fleetline.api.dashboard import SIGN_IN, mount_console
from fleetline.api.ports import (
    Append,
    DeclareClusters,
    HistoryPort,
    JobsPort,
    OperationsPort,
    Ports,
    Postmortem,
    ReadyQuery,
    Sql,
)
from fleetline.api.rbac import Principal
from fleetline.api.routes import audit as audit_routes
from fleetline.api.routes import clusters as cluster_routes
from fleetline.api.routes import dashboard as dashboard_routes
from fleetline.api.routes import jobs as job_routes
from fleetline.api.routes import observability as observability_routes
from fleetline.api.routes import operations as operations_routes
from fleetline.api.routes import queries as query_routes
from fleetline.api.routes import view as view_routes
from fleetline.api.routing import Routes
from fleetline.errors import (
    FleetlineError,
    PermissionDenied,
    QueryError,
    StorageError,
    StreamError,
)
from fleetline.observability import logs, metrics, tracing
from fleetline.processors.audit.runtime import AuditEmitter, new_event
from fleetline.processors.view.read import ViewSource
from fleetline.storage.audit_store import AuditTable

log = logging.getLogger(__name__)
_UNAUDITED = ("/", SIGN_IN, "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/metrics")
# The dashboard's static files (code and styles, no data): served to anyone, not audited.
UI_PREFIX = "/ui"


def _audit_middleware(
    audit: AuditEmitter, clock: Callable[[], int]
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    async def audit_every_call(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        started, entered_ms = time.perf_counter(), clock()
        # The request enters here: a span in the caller's trace, or the root of a new one.
        name = f"{request.method} {request.url.path}"
        with tracing.entered(name, request.headers.get(tracing.HEADER)) as trace:
            request.state.trace = trace
            with logs.traced(trace.trace_id):  # what the call logs carries its trace id
                response = await call_next(request)
        response.headers["X-Request-ID"] = request_id
        response.headers[tracing.HEADER] = trace.traceparent
        matched = request.scope.get("route")
        path = request.url.path
        static = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        # Route templates, never raw paths, as labels: their number is bounded.
        route = matched.path if isinstance(matched, APIRoute) else UI_PREFIX if static else "other"
        metrics.API_REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        metrics.API_SECONDS.labels(request.method, route).observe(time.perf_counter() - started)
        if path in _UNAUDITED or static:
            return response
        template = matched.path if isinstance(matched, APIRoute) else path
        principal: Principal | None = getattr(request.state, "principal", None)
        status = response.status_code
        outcome = (
            "SUCCEEDED"
            if status < 400
            else "UNAUTHENTICATED"
            if status == 401
            else "DENIED"
            if status == 403
            else "FAILED"
        )
        details = {"query": str(request.url.query)} if request.url.query else {}
        refusal = getattr(request.state, "refusal", None)
        if refusal:
            details["reason"] = refusal
        # What a data-reading route says it returned (routes/queries.py: the SQL's digest, rows).
        details.update(getattr(request.state, "data_access", {}))
        audit.emit(
            new_event(
                ts=entered_ms,  # when the call came in: it heads its trace
                actor=principal.subject if principal else "anonymous",
                actor_role=principal.role if principal else "none",
                tenant=(
                    getattr(request.state, "scope", None)
                    or (principal.tenant if principal else None)
                ),
                operation=f"api.{request.method} {template}",
                target=request.url.path,
                outcome=outcome,
                status=status,
                request_id=request_id,
                trace_id=trace.trace_id,
                source="api",
                details=details,
            )
        )
        return response

    return audit_every_call


def create_app(
    source: ViewSource,
    authenticator: Authenticator,
    audit: AuditEmitter,
    audit_table: AuditTable | None = None,
    sql: Sql | None = None,
    ready_query: ReadyQuery | None = None,
    clock: Callable[[], int] = lambda: int(time.time() * 1000),
    jobs: JobsPort | None = None,
    max_body_bytes: int = 1024 * 1024,
    history: HistoryPort | None = None,
    clusters: DeclareClusters | None = None,
    operations: OperationsPort | None = None,
    signals: Append | None = None,
    commands: Append | None = None,
    postmortems: Postmortem | None = None,
) -> FastAPI:
    """The API over a view, the audit store, ClickHouse and the scheduler (each optional but
    the view: a route whose port is missing answers 503). A request body over `max_body_bytes`
    is refused with 413 (and audited, like every refusal)."""
    app = FastAPI(
        title="fleetline",
        version="0.1.0",
        description="The global resource view of a multi-cluster GPU fleet, its "
        "scheduler and its audit log. Every route needs "
        "`Authorization: Bearer <token>`.",
    )
    routes = Routes(app, authenticator)
    ports = Ports(
        source,
        audit_table,
        sql,
        ready_query,
        jobs,
        clock,
        history,
        clusters,
        operations,
        signals,
        commands,
        postmortems,
    )
    # Added first, so it runs inside the audit middleware: a refused body is audited too.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.middleware("http")(_audit_middleware(audit, clock))
    for area in (
        view_routes,
        cluster_routes,
        audit_routes,
        query_routes,
        job_routes,
        operations_routes,
        observability_routes,
        dashboard_routes,
    ):
        area.register(routes, ports)

    @app.exception_handler(PermissionDenied)
    async def denied(request: Request, exc: PermissionDenied) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    @app.exception_handler(FleetlineError)
    async def refused(request: Request, exc: FleetlineError) -> JSONResponse:
        # A bad query or argument is the caller's to fix; a store or a log that is down or
        # refuses this server is ours.
        ours = isinstance(exc, StreamError | StorageError) and not isinstance(exc, QueryError)
        status = 503 if ours else 400
        return JSONResponse({"detail": str(exc)}, status_code=status)

    jwt_config = authenticator.config.jwt
    mount_console(app, UI_PREFIX, jwt_config.sign_in() if jwt_config else None)
    missing = routes.unruled()
    if missing:
        raise RuntimeError(f"routes without an access rule: {missing}")
    app.state.rules = routes.rules
    return app
