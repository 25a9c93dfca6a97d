"""The read API over the resource view (FastAPI; OpenAPI at /openapi.json, docs at /docs).

Every route reads the view through a `ViewSource`, which runs the read with the fold paused, so a
response is one consistent version of the view; each response names that version and offsets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import FastAPI, HTTPException, Query

from fleetline.processors import view_read
from fleetline.processors.view import ResourceView

T = TypeVar("T")


class ViewSource(Protocol):
    def read(self, fn: Callable[[ResourceView], T]) -> T: ...


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


def create_app(source: ViewSource) -> FastAPI:
    app = FastAPI(title="fleetline", version="0.1.0",
                  description="The global resource view of a multi-cluster GPU fleet.")

    @app.get("/v1/view", summary="Where the view stands: version, offsets, sizes, policy")
    def get_view() -> dict[str, Any]:
        return source.read(view_read.view_meta)

    @app.get("/v1/clusters", summary="Per-cluster capacity: idle, allocated, degraded GPUs")
    def list_clusters(region: str | None = None) -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.cluster_capacity(v, region)))

    @app.get("/v1/clusters/{cluster_id}", summary="One cluster's capacity and declared facts")
    def get_cluster(cluster_id: str) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            for cluster in view_read.cluster_capacity(view):
                if cluster["cluster_id"] == cluster_id:
                    return {"view_version": view.version, **cluster}
            raise HTTPException(404, f"no cluster {cluster_id!r} in the view")
        return source.read(one)

    @app.get("/v1/clusters/{cluster_id}/topology",
             summary="Spine and leaf switches, nodes and NVLink islands")
    def get_topology(cluster_id: str) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            if cluster_id not in view_read.cluster_ids(view):
                raise HTTPException(404, f"no cluster {cluster_id!r} in the view")
            return {"view_version": view.version, **view_read.topology(view, cluster_id)}
        return source.read(one)

    @app.get("/v1/nodes", summary="Nodes, filtered by cluster, status, leaf switch, labels")
    def list_nodes(
        cluster: str | None = None,
        status: Annotated[str | None,
                          Query(pattern="(?i)^(up|draining|down|unreachable)$")] = None,
        leaf_switch: str | None = None,
        label: Annotated[list[str] | None, Query(description="key=value, repeatable")] = None,
        gpus: bool = False,
    ) -> dict[str, Any]:
        labels = _labels(label)
        return source.read(lambda v: _envelope(v, [
            view_read.node_data(v, n, with_gpus=gpus)
            for n in view_read.select_nodes(v, cluster, status, labels, leaf_switch)]))

    @app.get("/v1/nodes/{node_id}", summary="One node with its GPUs")
    def get_node(node_id: str) -> dict[str, Any]:
        def one(view: ResourceView) -> dict[str, Any]:
            node = view.nodes.get(node_id)
            if node is None:
                raise HTTPException(404, f"no node {node_id!r} in the view")
            return {"view_version": view.version, **view_read.node_data(view, node)}
        return source.read(one)

    @app.get("/v1/gpus", summary="GPUs, filtered by cluster, health and capacity state")
    def list_gpus(
        cluster: str | None = None,
        health: Annotated[str | None, Query(pattern="^(healthy|degraded|failed)$")] = None,
        capacity: Annotated[str | None, Query(
            pattern="^(idle|allocated|degraded|failed|unavailable)$")] = None,
    ) -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.select_gpus(v, cluster, health,
                                                                        capacity)))

    @app.get("/v1/allocations", summary="Jobs and the GPUs bound to them")
    def list_allocations() -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.allocations(v)))

    @app.get("/v1/datasets", summary="Datasets and the clusters holding replicas")
    def list_datasets() -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.datasets(v)))

    @app.get("/v1/tenants", summary="GPUs and dataset bytes in use per tenant")
    def list_tenants() -> dict[str, Any]:
        return source.read(lambda v: _envelope(v, view_read.tenant_usage(v)))

    return app
