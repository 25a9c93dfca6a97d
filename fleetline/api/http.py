"""The HTTP API over the resource view and the audit log (FastAPI; OpenAPI at /openapi.json).

Every route is declared with a `Rule` and passes one guard: authenticate the bearer token,
authorise the role and hold the request to the principal's tenant. `create_app` refuses to build
an app with a route that has no rule. Every call, allowed or refused, becomes an AuditEvent.
Reads of the view run with the fold paused, so a response is one version of the view.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from fleetline.api.auth import Authenticator
from fleetline.api.rbac import Principal, Rule, authorize
from fleetline.errors import (
    AuthenticationError,
    FleetlineError,
    PermissionDenied,
    QueryError,
    StorageError,
)
from fleetline.processors.audit.chain import is_sensitive, masked_event
from fleetline.processors.audit.runtime import new_event
from fleetline.processors.view import read as view_read
from fleetline.processors.view.fold import ResourceView
from fleetline.storage.audit_store import AuditQuery, AuditTable

log = logging.getLogger(__name__)
T = TypeVar("T")


class ViewSource(Protocol):
    def read(self, fn: Callable[[ResourceView], T]) -> T: ...


class AuditEmitter(Protocol):
    def emit(self, event: dict[str, Any]) -> None: ...


class JobsPort(Protocol):
    """The scheduler as the API reaches it: its request log, its committed state, its
    decisions (`processors/scheduler_runtime.KafkaJobs`)."""

    def submit(self, requests: list[dict[str, Any]]) -> list[int]: ...

    def jobs(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    def job(self, key: str) -> dict[str, Any] | None: ...

    def decisions(self, job: str) -> list[dict[str, Any]]: ...


class StaticView:
    """A view that does not move: a replay's result, served for an investigation."""

    def __init__(self, view: ResourceView) -> None:
        self.view = view

    def read(self, fn: Callable[[ResourceView], T]) -> T:
        return fn(self.view)


def _labels(selector: list[str] | None) -> dict[str, str]:
    out = {}
    for item in selector or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HTTPException(422, f"label selector {item!r} is not key=value")
        out[key] = value
    return out


def _envelope(view: ResourceView, items: Any) -> dict[str, Any]:
    return {"view_version": view.version, "watermark_ms": view.watermark_ms, "items": items}


def _in_scope(tenant: str | None, scope: str | None) -> bool:
    return scope is None or tenant == scope


def _redact_gpu(view: ResourceView, gpu: dict[str, Any], scope: str | None) -> dict[str, Any]:
    """Another tenant's job on a GPU shows as `allocated`, never by name."""
    job = gpu.get("job_id")
    if job is not None:
        allocation = view.allocations.get(job)
        if allocation is None or not _in_scope(allocation.tenant, scope):
            gpu = {**gpu, "job_id": None}
    return gpu


def _redact_node(view: ResourceView, node: dict[str, Any], principal: Principal,
                 scope: str | None) -> dict[str, Any]:
    node = dict(node)
    if not principal.sees_sensitive:
        node["labels"] = {k: ("***" if is_sensitive(k) else v) for k, v in node["labels"].items()}
    if "gpus" in node:
        node["gpus"] = [_redact_gpu(view, g, scope) for g in node["gpus"]]
    return node


def create_app(source: ViewSource, authenticator: Authenticator, audit: AuditEmitter,
               audit_table: AuditTable | None = None,
               sql: Callable[[str], dict[str, Any]] | None = None,
               ready_query: Callable[[str, str, str | None], dict[str, Any]] | None = None,
               clock: Callable[[], int] = lambda: int(time.time() * 1000),
               jobs: JobsPort | None = None) -> FastAPI:
    app = FastAPI(title="fleetline", version="0.1.0",
                  description="The global resource view of a multi-cluster GPU fleet, and its "
                              "audit log. Every route needs `Authorization: Bearer <token>`.")
    rules: dict[tuple[str, str], Rule] = {}

    def guard(rule: Rule) -> Callable[..., Principal]:
        def check(request: Request) -> Principal:
            try:
                principal = authenticator.authenticate(request.headers.get("authorization"))
            except AuthenticationError as exc:
                request.state.refusal = str(exc)
                log.warning("refused %s %s: %s", request.method, request.url.path, exc)
                raise HTTPException(401, str(exc),
                                    headers={"WWW-Authenticate": "Bearer"}) from None
            request.state.principal = principal
            # The tenant a request reaches for: in its path (/v1/jobs/{tenant}/...) or asked
            # for with ?tenant=.
            requested = request.path_params.get("tenant") or request.query_params.get("tenant")
            try:
                request.state.scope = authorize(principal, rule, requested)
            except PermissionDenied as exc:
                request.state.refusal = str(exc)
                log.warning("denied %s %s to %s: %s", request.method, request.url.path,
                            principal.subject, exc)
                raise HTTPException(403, str(exc)) from None
            return principal
        return check

    def route(method: str, path: str, rule: Rule, **kwargs: Any) -> Callable:
        rules[(method, path)] = rule
        return app.api_route(path, methods=[method], dependencies=[Depends(guard(rule))],
                             **kwargs)

    @app.middleware("http")
    async def audit_every_call(request: Request, call_next):
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        trace = request.headers.get("traceparent", "")
        trace_id = trace.split("-")[1] if trace.count("-") >= 3 else None
        response = await call_next(request)
        response.headers["X-Request-ID"] = request_id
        if request.url.path in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"):
            return response
        principal: Principal | None = getattr(request.state, "principal", None)
        status = response.status_code
        outcome = ("SUCCEEDED" if status < 400 else "UNAUTHENTICATED" if status == 401
                   else "DENIED" if status == 403 else "FAILED")
        matched = request.scope.get("route")
        template = matched.path if isinstance(matched, APIRoute) else request.url.path
        details = {"query": str(request.url.query)} if request.url.query else {}
        refusal = getattr(request.state, "refusal", None)
        if refusal:
            details["reason"] = refusal
        audit.emit(new_event(
            ts=clock(), actor=principal.subject if principal else "anonymous",
            actor_role=principal.role if principal else "none",
            tenant=(getattr(request.state, "scope", None) or
                    (principal.tenant if principal else None)),
            operation=f"api.{request.method} {template}", target=request.url.path,
            outcome=outcome, status=status, request_id=request_id, trace_id=trace_id,
            source="api", details=details))
        return response

    fleet = Rule("fleet", "read", tenant_scoped=False)

    @route("GET", "/v1/view", fleet, summary="Where the view stands: version, offsets, sizes")
    def get_view() -> dict[str, Any]:
        return source.read(view_read.view_meta)

    @route("GET", "/v1/clusters", fleet, summary="Per-cluster capacity: idle, allocated, "
           "degraded GPUs")
    def list_clusters(region: str | None = None) -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.cluster_capacity(v, region)))

    @route("GET", "/v1/clusters/{cluster_id}", fleet, summary="One cluster's capacity and facts")
    def get_cluster(cluster_id: str) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            for cluster in view_read.cluster_capacity(view):
                if cluster["cluster_id"] == cluster_id:
                    return {"view_version": view.version, **cluster}
            raise HTTPException(404, f"no cluster {cluster_id!r} in the view")
        return source.read(one)

    @route("GET", "/v1/clusters/{cluster_id}/topology", fleet,
           summary="Spine and leaf switches, nodes and NVLink islands")
    def get_topology(cluster_id: str) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            if cluster_id not in view_read.cluster_ids(view):
                raise HTTPException(404, f"no cluster {cluster_id!r} in the view")
            return {"view_version": view.version, **view_read.topology(view, cluster_id)}
        return source.read(one)

    @route("GET", "/v1/nodes", Rule("fleet", "read"),
           summary="Nodes, filtered by cluster, status, leaf switch, labels")
    def list_nodes(
        request: Request,
        cluster: str | None = None,
        status: Annotated[str | None,
                          Query(pattern="(?i)^(up|draining|down|unreachable)$")] = None,
        leaf_switch: str | None = None,
        label: Annotated[list[str] | None, Query(description="key=value, repeatable")] = None,
        gpus: bool = False,
    ) -> dict[str, Any]:
        labels = _labels(label)
        principal, scope = request.state.principal, request.state.scope
        return source.read(lambda v: _envelope(v, [
            _redact_node(v, view_read.node_data(v, n, with_gpus=gpus), principal, scope)
            for n in view_read.select_nodes(v, cluster, status, labels, leaf_switch)]))

    @route("GET", "/v1/nodes/{node_id}", Rule("fleet", "read"), summary="One node with its GPUs")
    def get_node(request: Request, node_id: str) -> dict[str, Any]:
        principal, scope = request.state.principal, request.state.scope

        def one(view: ResourceView) -> dict[str, Any]:
            node = view.nodes.get(node_id)
            if node is None:
                raise HTTPException(404, f"no node {node_id!r} in the view")
            return {"view_version": view.version,
                    **_redact_node(view, view_read.node_data(view, node), principal, scope)}
        return source.read(one)

    @route("GET", "/v1/gpus", Rule("fleet", "read"),
           summary="GPUs, filtered by cluster, health and capacity state")
    def list_gpus(
        request: Request,
        cluster: str | None = None,
        health: Annotated[str | None, Query(pattern="^(healthy|degraded|failed)$")] = None,
        capacity: Annotated[str | None, Query(
            pattern="^(idle|allocated|degraded|failed|unavailable)$")] = None,
    ) -> dict[str, Any]:
        scope = request.state.scope
        return source.read(lambda v: _envelope(v, [
            _redact_gpu(v, g, scope) for g in view_read.select_gpus(v, cluster, health,
                                                                     capacity)]))

    def in_scope(request: Request, rows: Callable[[ResourceView], list[dict[str, Any]]]
                 ) -> dict[str, Any]:
        """The rows of the caller's tenant scope (all for a role that spans tenants)."""
        scope = request.state.scope
        return source.read(lambda v: _envelope(v, [
            row for row in rows(v) if _in_scope(row["tenant"], scope)]))

    @route("GET", "/v1/allocations", Rule("jobs", "read"),
           summary="Jobs of the caller's tenant and the GPUs bound to them")
    def list_allocations(request: Request, tenant: str | None = None) -> dict[str, Any]:
        return in_scope(request, view_read.allocations)

    @route("GET", "/v1/datasets", Rule("datasets", "read"),
           summary="The caller's tenant's datasets and the clusters holding replicas")
    def list_datasets(request: Request, tenant: str | None = None) -> dict[str, Any]:
        return in_scope(request, view_read.datasets)

    @route("GET", "/v1/tenants", Rule("usage", "read"),
           summary="GPUs and dataset bytes in use by the caller's tenant (all, for admins)")
    def list_tenants(request: Request, tenant: str | None = None) -> dict[str, Any]:
        return in_scope(request, view_read.tenant_usage)

    def _audit_table() -> AuditTable:
        if audit_table is None:
            raise HTTPException(503, "the audit store is not configured on this server")
        return audit_table

    @route("GET", "/v1/audit", Rule("audit", "read"),
           summary="Search audit records (the caller's tenant only, unless admin or auditor)")
    def search_audit(request: Request, tenant: str | None = None,
                     since_ms: Annotated[int | None, Query(alias="from")] = None,
                     until_ms: Annotated[int | None, Query(alias="to")] = None,
                     op: str | None = None, actor: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> dict[str, Any]:
        principal: Principal = request.state.principal
        records = _audit_table().search(AuditQuery(request.state.scope, since_ms, until_ms, op,
                                                   actor, limit))
        return {"items": [{"partition": r["partition"], "seq": r["seq"], "hash": r["hash"].hex(),
                           **masked_event(r["event"], principal.sees_sensitive)}
                          for r in records]}

    @route("GET", "/v1/audit/activity", Rule("audit", "read"),
           summary="Ready query: calls per operation and outcome, tenant-scoped")
    def audit_activity(request: Request, since_ms: Annotated[int, Query(alias="from")],
                       until_ms: Annotated[int, Query(alias="to")],
                       tenant: str | None = None) -> dict[str, Any]:
        return {"items": _audit_table().activity(request.state.scope, since_ms, until_ms)}

    @route("POST", "/v1/sql", Rule("sql", "run", tenant_scoped=False),
           summary="Raw read-only ClickHouse SQL: platform admins only")
    def run_sql(body: dict[str, str]) -> dict[str, Any]:
        if sql is None:
            raise HTTPException(503, "no ClickHouse store is configured on this server")
        if "query" not in body:
            raise HTTPException(422, "body needs a query")
        return sql(body["query"])

    @route("GET", "/v1/queries/{name}", Rule("fleet", "read", tenant_scoped=False),
           summary="A ready query over all storage tiers (see `fleetline query list`)")
    def run_ready_query(name: str, since: Annotated[str, Query(alias="from")] = "-1h",
                        until: Annotated[str | None, Query(alias="to")] = None) -> dict[str, Any]:
        from fleetline.storage.queries import READY

        if name not in READY:
            raise HTTPException(404, f"no ready query {name!r}; known: {sorted(READY)}")
        if ready_query is None:
            raise HTTPException(503, "no ClickHouse store is configured on this server")
        return ready_query(name, since, until)

    def _jobs() -> JobsPort:
        if jobs is None:
            raise HTTPException(503, "the scheduler is not configured on this server")
        return jobs

    @route("POST", "/v1/jobs", Rule("jobs", "write"), status_code=202,
           summary="Submit TrainingJob / InferenceService / Dataset specs (YAML or JSON body)")
    async def apply_specs(request: Request, tenant: str | None = None) -> dict[str, Any]:
        from fleetline.processors.scheduling.codec import datasets_first, submit_request
        from fleetline.processors.scheduling.specs import SpecError, parse_specs

        text = (await request.body()).decode(errors="replace")
        try:
            specs = parse_specs(text)
        except SpecError as exc:
            raise HTTPException(422, [{"path": e.path, "message": e.message}
                                      for e in exc.errors]) from None
        scope = request.state.scope
        outside = sorted({s.metadata.tenant for s in specs} - ({scope} if scope else set()))
        if scope is not None and outside:
            raise HTTPException(403, f"{request.state.principal.subject} may only submit for "
                                f"tenant {scope}, the specs name {', '.join(outside)}")
        import yaml

        documents = [d for d in yaml.safe_load_all(text) if d is not None]
        principal: Principal = request.state.principal
        ordered = datasets_first(specs, documents)
        requests = [submit_request(spec, doc, clock(), uuid.uuid4().hex, principal.subject)
                    for spec, doc in ordered]
        offsets = _jobs().submit(requests)
        return {"accepted": [{"key": r["key"], "kind": spec.kind, "request_offset": o}
                             for r, (spec, _), o in zip(requests, ordered, offsets,
                                                        strict=True)]}

    @route("GET", "/v1/jobs", Rule("jobs", "read"),
           summary="The scheduler's jobs of the caller's tenant: phase, conditions, GPUs")
    def list_jobs(request: Request, tenant: str | None = None,
                  phase: str | None = None) -> dict[str, Any]:
        items = [j for j in _jobs().jobs(request.state.scope)
                 if phase is None or j["phase"] == phase]
        return {"items": [{k: v for k, v in j.items() if k != "explanation"} for j in items]}

    def one_job(tenant: str, name: str) -> dict[str, Any]:
        job = _jobs().job(f"{tenant}/{name}")
        if job is None:
            raise HTTPException(404, f"no job {tenant}/{name}")
        return job

    @route("GET", "/v1/jobs/{tenant}/{name}", Rule("jobs", "read"),
           summary="One job's desired state, phase, conditions and GPUs")
    def get_job(tenant: str, name: str) -> dict[str, Any]:
        return {k: v for k, v in one_job(tenant, name).items() if k != "explanation"}

    @route("GET", "/v1/jobs/{tenant}/{name}/explain", Rule("jobs", "read"),
           summary="Why the job is where it is, or why it waits: the latest decision with "
                   "every cluster's score or reason (history=true: every decision)")
    def explain_job(tenant: str, name: str, history: bool = False) -> dict[str, Any]:
        job = one_job(tenant, name)
        out = {"job": job["key"], "phase": job["phase"], "conditions": job["conditions"],
               "decision": job.get("explanation")}
        if history:
            out["history"] = _jobs().decisions(job["key"])
        return out

    @route("DELETE", "/v1/jobs/{tenant}/{name}", Rule("jobs", "write"), status_code=202,
           summary="Delete a job: its GPUs are released and the queue moves on")
    def delete_job(request: Request, tenant: str, name: str) -> dict[str, Any]:
        from fleetline.processors.scheduling.codec import new_request

        one_job(tenant, name)
        principal: Principal = request.state.principal
        (offset,) = _jobs().submit([new_request("DELETE", f"{tenant}/{name}", tenant, clock(),
                                                uuid.uuid4().hex, actor=principal.subject)])
        return {"deleted": f"{tenant}/{name}", "request_offset": offset}

    @route("PUT", "/v1/tenants/{tenant}/policy", Rule("quotas", "write", tenant_scoped=False),
           summary="Set a tenant's quotas, reservations and fair-share weight (platform admins)")
    def set_tenant_policy(request: Request, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        from fleetline.processors.scheduling.codec import canonical_json, new_request
        from fleetline.processors.scheduling.tenancy import TenantPolicy

        policy = TenantPolicy.from_data({**body, "tenant": tenant})
        principal: Principal = request.state.principal
        (offset,) = _jobs().submit([new_request(
            "TENANT_POLICY", tenant, tenant, clock(), uuid.uuid4().hex,
            actor=principal.subject, spec_json=canonical_json(policy.as_data()))])
        return {"tenant": tenant, "policy": policy.as_data(), "request_offset": offset}

    @app.exception_handler(PermissionDenied)
    async def denied(request: Request, exc: PermissionDenied) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    @app.exception_handler(FleetlineError)
    async def refused(request: Request, exc: FleetlineError) -> JSONResponse:
        # A bad query or argument is the caller's to fix; a store that is down is ours.
        status = 503 if isinstance(exc, StorageError) and not isinstance(exc, QueryError) \
            else 400
        return JSONResponse({"detail": str(exc)}, status_code=status)

    missing = [f"{sorted(r.methods)[0]} {r.path}" for r in app.routes
               if isinstance(r, APIRoute) and (sorted(r.methods)[0], r.path) not in rules]
    if missing:
        raise RuntimeError(f"routes without an access rule: {missing}")
    app.state.rules = rules
    return app
