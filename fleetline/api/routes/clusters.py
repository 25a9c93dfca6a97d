"""What operators do to the fleet (platform admins): declare clusters, cordon and uncordon
them, send commands to nodes, give clusters their electricity prices."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.errors import FleetlineError
from fleetline.processors.health.runtime import signal
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.energy import EnergyProfile
from fleetline.processors.scheduling.specs import Cluster

FLEET_WRITE = Rule("fleet", "write", tenant_scoped=False)


class Cordon(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, description="why, for the audit trail")


class NodeCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster_id: str = Field(description="the node's cluster")
    kind: Literal["DRAIN", "CORDON", "UNCORDON", "SET_POWER_CAP", "APPLY_CONFIG"]
    power_cap_w: float | None = Field(default=None, gt=0, description="SET_POWER_CAP: watts")
    config_version: str | None = Field(default=None, description="APPLY_CONFIG: its version")
    config: dict[str, str] = Field(default_factory=dict, description="APPLY_CONFIG settings")
    command_id: str | None = Field(default=None, description="default: a new random id")


def _actor(request: Request) -> str:
    principal: Principal = request.state.principal
    return principal.subject


def register(route: Routes, ports: Ports) -> None:
    @route(
        "PUT",
        "/v1/clusters/{cluster_id}",
        FLEET_WRITE,
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

    def cluster_signal(kind: Literal["CORDON", "UNCORDON"]) -> Any:
        def send(request: Request, cluster_id: str, body: Cordon | None = None) -> dict[str, Any]:
            record = signal(
                kind,
                cluster_id,
                ports.clock(),
                actor=_actor(request),
                reason=body.reason if body else None,
            )
            return {"cluster_id": cluster_id, "signal": kind, "offset": ports.signal()(record)}

        return send

    route(
        "POST",
        "/v1/clusters/{cluster_id}/cordon",
        FLEET_WRITE,
        status_code=202,
        summary="Take a whole cluster out of placement: what runs there stays, nothing new lands",
    )(cluster_signal("CORDON"))
    route(
        "POST",
        "/v1/clusters/{cluster_id}/uncordon",
        FLEET_WRITE,
        status_code=202,
        summary="Return a cordoned cluster to placement",
    )(cluster_signal("UNCORDON"))

    @route(
        "POST",
        "/v1/nodes/{node_id}/commands",
        FLEET_WRITE,
        status_code=202,
        summary="Send a command to a node's agent (its CommandResult lands on commands.result)",
    )
    def command_node(request: Request, node_id: str, body: NodeCommand) -> dict[str, Any]:
        if body.kind == "SET_POWER_CAP" and body.power_cap_w is None:
            raise HTTPException(422, "SET_POWER_CAP needs power_cap_w")
        record = {
            "command_id": body.command_id or uuid.uuid4().hex,
            "cluster_id": body.cluster_id,
            "node_id": node_id,
            "ts": ports.clock(),
            "issued_by": _actor(request),
            "kind": body.kind,
            "power_cap_w": body.power_cap_w,
            "config_version": body.config_version,
            "config": body.config,
        }
        offset = ports.command()(record)
        return {"command_id": record["command_id"], "node_id": node_id, "offset": offset}

    @route(
        "PUT",
        "/v1/energy",
        FLEET_WRITE,
        status_code=202,
        summary="Give clusters their electricity by the hour (UTC): a list of "
        "{cluster_id, price_per_kwh: [24], renewable_share: [24], windows?, pue?}",
    )
    def set_energy(request: Request, body: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            profiles = [EnergyProfile.from_data(item) for item in body]
        except (FleetlineError, TypeError, KeyError, ValueError) as exc:
            raise HTTPException(422, f"energy profile: {exc}") from None
        ts = ports.clock()
        requests = [
            new_request(
                "ENERGY",
                p.cluster_id,
                "",
                ts,
                uuid.uuid4().hex,
                actor=_actor(request),
                spec_json=canonical_json(p.as_data()),
            )
            for p in profiles
        ]
        offsets = ports.scheduler().submit(requests)
        return {
            "profiles": [p.cluster_id for p in profiles],
            "request_offsets": offsets,
        }
