"""Declarations of the fleet: what an operator says of a cluster (platform admins)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Rule
from fleetline.api.routing import Routes
from fleetline.processors.scheduling.specs import Cluster


def register(route: Routes, ports: Ports) -> None:
    @route(
        "PUT",
        "/v1/clusters/{cluster_id}",
        Rule("fleet", "write", tenant_scoped=False),
        response_model=models.ClusterDeclared,
        summary="Declare a cluster's region, prices, PUE and latencies (a Cluster document)",
    )
    def declare_cluster(cluster_id: str, body: Cluster) -> dict[str, Any]:
        if body.metadata.name != cluster_id:
            raise HTTPException(
                422, f"metadata.name {body.metadata.name!r} is not the path's {cluster_id!r}"
            )
        # The event time is also the seq: a later declaration replaces an earlier one.
        ts = ports.clock()
        record = body.record(ts, ts)
        (offset,) = ports.declare_clusters()([record])
        return {"cluster_id": cluster_id, "offset": offset, "record": record}
