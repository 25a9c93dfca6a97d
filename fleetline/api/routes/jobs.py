"""The scheduler: submit specs, list and explain jobs, delete them, set tenants' policies."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import yaml
from fastapi import HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.observability.tracing import TraceContext
from fleetline.processors.scheduling.codec import (
    canonical_json,
    new_request,
    spec_requests,
)
from fleetline.processors.scheduling.specs import Cluster, SpecError, parse_specs
from fleetline.processors.scheduling.state import Job
from fleetline.processors.scheduling.tenancy import TenantPolicy, TenantTerms


def _public(job: dict[str, Any]) -> dict[str, Any]:
    """A job as the API shows it: its latest decision summed up in `why` (the whole decision
    is in /explain)."""
    out = {k: v for k, v in job.items() if k != "explanation"}
    explanation = job.get("explanation")
    out["why"] = explanation.get("reason") if isinstance(explanation, dict) else None
    return out


# The longest an apply may hold its call open waiting for decisions.
MAX_WAIT_S = 600.0


def _decided(decision: dict[str, Any] | None) -> dict[str, Any] | None:
    """What `apply --wait` shows of a decision: its outcome and reason."""
    if decision is None:
        return None
    return {k: decision.get(k) for k in ("outcome", "reason", "cluster_id", "decision_id")}


def register(route: Routes, ports: Ports) -> None:
    clock = ports.clock

    @route(
        "POST",
        "/v1/jobs",
        Rule("jobs", "write"),
        status_code=202,
        response_model=models.AcceptedPage,
        summary="Submit TrainingJob / InferenceService / Dataset specs (YAML or JSON body)",
    )
    async def apply_specs(
        request: Request,
        tenant: str | None = None,
        wait: Annotated[
            float | None,
            Query(
                ge=0,
                le=MAX_WAIT_S,
                description="seconds to wait for each spec's decision (placed, accepted, "
                "rejected, or queued for its data's copy); each item then carries it",
            ),
        ] = None,
    ) -> dict[str, Any]:
        text = (await request.body()).decode(errors="replace")
        try:
            specs = parse_specs(text)
        except SpecError as exc:
            raise HTTPException(
                422, [{"path": e.path, "message": e.message} for e in exc.errors]
            ) from None
        clusters = [s.metadata.name for s in specs if isinstance(s, Cluster)]
        if clusters:
            raise HTTPException(
                422,
                f"Cluster {', '.join(clusters)}: a cluster is declared with "
                "PUT /v1/clusters/{name} (platform admins)",
            )
        scope = request.state.scope
        outside = sorted({s.metadata.tenant for s in specs} - ({scope} if scope else set()))
        if scope is not None and outside:
            raise HTTPException(
                403,
                f"{request.state.principal.subject} may only submit for "
                f"tenant {scope}, the specs name {', '.join(outside)}",
            )
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
        principal: Principal = request.state.principal
        trace: TraceContext = request.state.trace
        ordered = spec_requests(
            specs,
            documents,
            clock(),
            principal.subject,
            lambda: uuid.uuid4().hex,
            lambda: trace.traceparent,
        )
        offsets = ports.scheduler().submit([r for _, r in ordered])
        keys = [r["key"] for _, r in ordered]
        decided = (
            await run_in_threadpool(ports.scheduler().wait, keys, offsets, wait) if wait else {}
        )
        return {
            "trace_id": trace.trace_id,
            "accepted": [
                {
                    "key": r["key"],
                    "kind": spec.kind,
                    "request_offset": o,
                    **({"decision": _decided(decided.get(r["key"]))} if wait else {}),
                }
                for (spec, r), o in zip(ordered, offsets, strict=True)
            ],
        }

    @route(
        "GET",
        "/v1/jobs",
        Rule("jobs", "read"),
        response_model=models.JobPage,
        summary="The scheduler's jobs of the caller's tenant: phase, conditions, GPUs",
    )
    def list_jobs(
        request: Request, tenant: str | None = None, phase: str | None = None
    ) -> dict[str, Any]:
        items = [
            j
            for j in ports.scheduler().jobs(request.state.scope)
            if phase is None or j["phase"] == phase
        ]
        return {"items": [_public(j) for j in items]}

    @route(
        "GET",
        "/v1/queue",
        Rule("jobs", "read"),
        response_model=models.QueuePage,
        summary="Every queued job of the caller's tenant: the constraint that binds it and the "
        "smallest change that would place it now, checked by placing it again",
    )
    async def queue_fits(request: Request, tenant: str | None = None) -> dict[str, Any]:
        scope = request.state.scope
        return {"items": await run_in_threadpool(ports.scheduler().fits, scope)}

    def delete(request: Request, key: str, tenant: str) -> int:
        """Append a DELETE of `key` by the caller; its offset in the request log."""
        principal: Principal = request.state.principal
        (offset,) = ports.scheduler().submit(
            [new_request("DELETE", key, tenant, clock(), uuid.uuid4().hex, actor=principal.subject)]
        )
        return offset

    def one_job(tenant: str, name: str) -> dict[str, Any]:
        job = ports.scheduler().job(f"{tenant}/{name}")
        if job is None:
            raise HTTPException(404, f"no job {tenant}/{name}")
        return job

    @route(
        "GET",
        "/v1/jobs/{tenant}/{name}",
        Rule("jobs", "read"),
        response_model=models.Job,
        summary="One job's desired state, phase, conditions and GPUs",
    )
    def get_job(tenant: str, name: str) -> dict[str, Any]:
        job = one_job(tenant, name)
        # The trace its decisions, orders and workload events carry (`fleetline trace`).
        return {**_public(job), "trace_id": Job.from_data(job).trace_id}

    @route(
        "GET",
        "/v1/jobs/{tenant}/{name}/explain",
        Rule("jobs", "read"),
        response_model=models.Explanation,
        summary="Why the job is where it is, or why it waits: the latest decision with "
        "every cluster's score or reason (history=true: every decision)",
    )
    def explain_job(tenant: str, name: str, history: bool = False) -> dict[str, Any]:
        job = one_job(tenant, name)
        out = {
            "job": job["key"],
            "phase": job["phase"],
            "conditions": job["conditions"],
            "decision": job.get("explanation"),
        }
        if history:
            out["history"] = ports.scheduler().decisions(job["key"])
        return out

    @route(
        "DELETE",
        "/v1/jobs/{tenant}/{name}",
        Rule("jobs", "write"),
        status_code=202,
        response_model=models.Deleted,
        summary="Delete a job: its GPUs are released and the queue moves on",
    )
    def delete_job(request: Request, tenant: str, name: str) -> dict[str, Any]:
        one_job(tenant, name)
        offset = delete(request, f"{tenant}/{name}", tenant)
        return {"deleted": f"{tenant}/{name}", "request_offset": offset}

    @route(
        "DELETE",
        "/v1/datasets/{tenant}/{name}",
        Rule("jobs", "write"),
        status_code=202,
        response_model=models.Deleted,
        summary="Delete a dataset: its replicas are forgotten and its storage quota freed",
    )
    def delete_dataset(request: Request, tenant: str, name: str) -> dict[str, Any]:
        key = f"dataset:{name}"
        offset = delete(request, key, tenant)
        return {"deleted": f"{key} of {tenant}", "request_offset": offset}

    @route(
        "PUT",
        "/v1/tenants/{tenant}/policy",
        Rule("quotas", "write", tenant_scoped=False),
        response_model=models.TenantPolicySet,
        summary="Set a tenant's quotas, reservations and fair-share weight (platform admins)",
    )
    def set_tenant_policy(request: Request, tenant: str, body: TenantTerms) -> dict[str, Any]:
        policy = TenantPolicy(tenant=tenant, **dict(body))
        principal: Principal = request.state.principal
        (offset,) = ports.scheduler().submit(
            [
                new_request(
                    "TENANT_POLICY",
                    tenant,
                    tenant,
                    clock(),
                    uuid.uuid4().hex,
                    actor=principal.subject,
                    spec_json=canonical_json(policy.as_data()),
                )
            ]
        )
        return {"tenant": tenant, "policy": policy.as_data(), "request_offset": offset}
