"""Reads of the resource view: clusters, nodes, GPUs, topology, allocations, datasets, usage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import HTTPException, Query, Request

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.moments import parse_moment
from fleetline.processors.audit.chain import is_sensitive
from fleetline.processors.view import read as view_read
from fleetline.processors.view.model import ResourceView


def _labels(selector: list[str] | None) -> dict[str, str]:
    out = {}
    for item in selector or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HTTPException(422, f"label selector {item!r} is not key=value")
        out[key] = value
    return out


def _page(view: ResourceView, items: Any) -> dict[str, Any]:
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


def _redact_node(
    view: ResourceView, node: dict[str, Any], principal: Principal, scope: str | None
) -> dict[str, Any]:
    node = dict(node)
    if not principal.sees_sensitive:
        node["labels"] = {k: ("***" if is_sensitive(k) else v) for k, v in node["labels"].items()}
    if "gpus" in node:
        node["gpus"] = [_redact_gpu(view, g, scope) for g in node["gpus"]]
    return node


At = Annotated[
    str | None,
    Query(
        description="the view as it stood at this moment (ISO 8601, epoch ms or -<n>s|m|h|d), "
        "replayed from snapshots and the log; the response then carries `as_of`"
    ),
]


def register(route: Routes, ports: Ports) -> None:
    source = ports.view
    fleet = Rule("fleet", "read", tenant_scoped=False)

    def read(at: str | None, fn: Callable[[ResourceView], dict[str, Any]]) -> dict[str, Any]:
        """`fn` over the live view, or over the view replayed to `at` (marked `as_of`)."""
        if at is None:
            return source.read(fn)
        view, as_of = ports.view_at(parse_moment(at, ports.clock()))
        return {**view.read(fn), "as_of": as_of.as_data()}

    @route(
        "GET",
        "/v1/view",
        fleet,
        response_model=models.ViewMeta,
        summary="Where the view stands: version, offsets, sizes",
    )
    def get_view(at: At = None) -> dict[str, Any]:
        return read(at, view_read.view_meta)

    @route(
        "GET",
        "/v1/clusters",
        fleet,
        response_model=models.Page[models.ClusterCapacity],
        summary="Per-cluster capacity: idle, allocated, degraded GPUs",
    )
    def list_clusters(region: str | None = None, at: At = None) -> dict[str, Any]:
        return read(at, lambda v: _page(v, view_read.cluster_capacity(v, region)))

    @route(
        "GET",
        "/v1/clusters/{cluster_id}",
        fleet,
        response_model=models.OneCluster,
        summary="One cluster's capacity and facts",
    )
    def get_cluster(cluster_id: str, at: At = None) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            for cluster in view_read.cluster_capacity(view):
                if cluster["cluster_id"] == cluster_id:
                    return {"view_version": view.version, **cluster}
            raise HTTPException(404, f"no cluster {cluster_id!r} in the view")

        return read(at, one)

    @route(
        "GET",
        "/v1/clusters/{cluster_id}/topology",
        fleet,
        response_model=models.Topology,
        summary="Spine and leaf switches, nodes and NVLink islands",
    )
    def get_topology(cluster_id: str, at: At = None) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            if cluster_id not in view_read.cluster_ids(view):
                raise HTTPException(404, f"no cluster {cluster_id!r} in the view")
            return {"view_version": view.version, **view_read.topology(view, cluster_id)}

        return read(at, one)

    @route(
        "GET",
        "/v1/nodes",
        Rule("fleet", "read"),
        response_model=models.Page[models.Node],
        summary="Nodes, filtered by cluster, status, leaf switch, labels",
    )
    def list_nodes(
        request: Request,
        cluster: str | None = None,
        status: Annotated[str | None, Query(pattern="(?i)^(up|draining|down|unreachable)$")] = None,
        leaf_switch: str | None = None,
        label: Annotated[list[str] | None, Query(description="key=value, repeatable")] = None,
        gpus: bool = False,
        at: At = None,
    ) -> dict[str, Any]:
        labels = _labels(label)
        principal, scope = request.state.principal, request.state.scope
        return read(
            at,
            lambda v: _page(
                v,
                [
                    _redact_node(v, view_read.node_data(v, n, with_gpus=gpus), principal, scope)
                    for n in view_read.select_nodes(v, cluster, status, labels, leaf_switch)
                ],
            ),
        )

    @route(
        "GET",
        "/v1/nodes/{node_id}",
        Rule("fleet", "read"),
        response_model=models.OneNode,
        summary="One node with its GPUs",
    )
    def get_node(request: Request, node_id: str, at: At = None) -> dict[str, Any]:
        principal, scope = request.state.principal, request.state.scope

        def one(view: ResourceView) -> dict[str, Any]:
            node = view.nodes.get(node_id)
            if node is None:
                raise HTTPException(404, f"no node {node_id!r} in the view")
            return {
                "view_version": view.version,
                **_redact_node(view, view_read.node_data(view, node), principal, scope),
            }

        return read(at, one)

    @route(
        "GET",
        "/v1/gpus",
        Rule("fleet", "read"),
        response_model=models.Page[models.Gpu],
        summary="GPUs, filtered by cluster, health and capacity state",
    )
    def list_gpus(
        request: Request,
        cluster: str | None = None,
        health: Annotated[str | None, Query(pattern="^(healthy|degraded|failed)$")] = None,
        capacity: Annotated[
            str | None, Query(pattern="^(idle|allocated|degraded|failed|unavailable)$")
        ] = None,
        at: At = None,
    ) -> dict[str, Any]:
        scope = request.state.scope
        return read(
            at,
            lambda v: _page(
                v,
                [
                    _redact_gpu(v, g, scope)
                    for g in view_read.select_gpus(v, cluster, health, capacity)
                ],
            ),
        )

    def in_scope(
        request: Request, rows: Callable[[ResourceView], list[dict[str, Any]]], at: str | None
    ) -> dict[str, Any]:
        """The rows of the caller's tenant scope (all for a role that spans tenants)."""
        scope = request.state.scope
        return read(
            at, lambda v: _page(v, [row for row in rows(v) if _in_scope(row["tenant"], scope)])
        )

    @route(
        "GET",
        "/v1/allocations",
        Rule("jobs", "read"),
        response_model=models.Page[models.AllocationBody],
        summary="Jobs of the caller's tenant and the GPUs bound to them",
    )
    def list_allocations(
        request: Request, tenant: str | None = None, at: At = None
    ) -> dict[str, Any]:
        return in_scope(request, view_read.allocations, at)

    @route(
        "GET",
        "/v1/datasets",
        Rule("datasets", "read"),
        response_model=models.Page[models.DatasetBody],
        summary="The caller's tenant's datasets and the clusters holding replicas",
    )
    def list_datasets(request: Request, tenant: str | None = None, at: At = None) -> dict[str, Any]:
        return in_scope(request, view_read.datasets, at)

    @route(
        "GET",
        "/v1/tenants",
        Rule("usage", "read"),
        response_model=models.Page[models.TenantUsageBody],
        summary="GPUs and dataset bytes in use by the caller's tenant (all, for admins)",
    )
    def list_tenants(request: Request, tenant: str | None = None, at: At = None) -> dict[str, Any]:
        return in_scope(request, view_read.tenant_usage, at)
