"""Automated operations: repair tickets (read by anyone who reads the fleet, moved by platform
admins) and the capacity forecast."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from fleetline.api.ports import Ports
from fleetline.api.rbac import Principal, Rule
from fleetline.api.routing import Routes
from fleetline.processors.operations.forecast import HOURS_PER_WEEK, capacity_plan
from fleetline.processors.operations.runtime import ops_event, recommendation_events
from fleetline.storage.queries import demand_sql


class TicketMove(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["IN_REPAIR", "REPAIRED", "ESCALATED"] = Field(
        description="IN_REPAIR (someone works on it), REPAIRED (start the burn-in), ESCALATED"
    )
    note: str = ""


class Tuning(BaseModel):
    model_config = ConfigDict(extra="forbid")

    days: int = Field(30, ge=1, le=365, description="how much history to learn from")


class CapacityAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster_id: str
    model: str
    weeks: int = Field(4, ge=1, le=26)
    lead_weeks: int = Field(4, ge=0, le=52)
    capacity_gpus: int | None = Field(None, ge=1, description="default: GPUs seen lately")


def _plan(
    ports: Ports, cluster_id: str, model: str, weeks: int, lead_weeks: int, capacity: int | None
) -> dict[str, Any]:
    rows = ports.sql_port()(demand_sql(cluster_id, model))["rows"]
    if not rows:
        raise HTTPException(404, f"no demand history for {model} in {cluster_id}")
    capacity = capacity or int(rows[-1][2])
    try:
        plan = capacity_plan(
            [int(r[0]) for r in rows],
            [float(r[1]) for r in rows],
            capacity,
            weeks,
            lead_weeks * HOURS_PER_WEEK,
        )
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    return {"cluster_id": cluster_id, "model": model, "capacity_gpus": capacity, **plan}


def register(route: Routes, ports: Ports) -> None:
    @route(
        "GET",
        "/v1/tickets",
        Rule("fleet", "read", tenant_scoped=False),
        summary="Repair tickets: node, rule, evidence, severity, state and history",
    )
    def list_tickets(state: str | None = None, node_id: str | None = None) -> dict[str, Any]:
        tickets = [
            t
            for t in ports.ops().tickets()
            if (state is None or t["state"] == state)
            and (node_id is None or t["node_id"] == node_id)
        ]
        return {"tickets": tickets}

    @route(
        "GET",
        "/v1/tickets/{ticket_id}",
        Rule("fleet", "read", tenant_scoped=False),
        summary="One repair ticket with its evidence and every transition",
    )
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        ticket = ports.ops().ticket(ticket_id)
        if ticket is None:
            raise HTTPException(404, f"no ticket {ticket_id!r}")
        return ticket

    @route(
        "POST",
        "/v1/tickets/{ticket_id}",
        Rule("fleet", "write", tenant_scoped=False),
        status_code=202,
        summary="Move a ticket: IN_REPAIR, REPAIRED (starts the burn-in) or ESCALATED",
    )
    def move_ticket(request: Request, ticket_id: str, body: TicketMove) -> dict[str, Any]:
        principal: Principal = request.state.principal
        ops = ports.ops()
        if ops.ticket(ticket_id) is None:
            raise HTTPException(404, f"no ticket {ticket_id!r}")
        offset = ops.move(ticket_id, body.state, body.note, principal.subject, ports.clock())
        return {"ticket_id": ticket_id, "state": body.state, "ops_offset": offset}

    @route(
        "GET",
        "/v1/forecast",
        Rule("fleet", "read", tenant_scoped=False),
        summary="GPU demand forecast of a cluster and GPU model, with its back-test and the "
        "first hour it needs more GPUs than the cluster has",
    )
    def forecast(
        cluster_id: str,
        model: str,
        weeks: int = Query(4, ge=1, le=26),
        lead_weeks: int = Query(4, ge=0, le=52),
        capacity_gpus: int | None = Query(None, ge=1, description="default: GPUs seen lately"),
    ) -> dict[str, Any]:
        return _plan(ports, cluster_id, model, weeks, lead_weeks, capacity_gpus)

    @route(
        "POST",
        "/v1/forecast/requests",
        Rule("fleet", "write", tenant_scoped=False),
        summary="Forecast a cluster's demand for a GPU model and, when it crosses what the "
        "cluster has, append a capacity request to the operations log as the caller",
    )
    def request_capacity(request: Request, body: CapacityAsk) -> dict[str, Any]:
        principal: Principal = request.state.principal
        plan = _plan(
            ports, body.cluster_id, body.model, body.weeks, body.lead_weeks, body.capacity_gpus
        )
        crossing = plan["crossing"]
        if not isinstance(crossing, dict):
            return {**plan, "requested": None}
        event = ops_event(
            "CAPACITY_REQUEST",
            ports.clock(),
            {
                "cluster_id": body.cluster_id,
                "model": body.model,
                "capacity_gpus": plan["capacity_gpus"],
                "needed_gpus": crossing["needed_gpus"],
                "at_hour": crossing["hour"],
                "lead_weeks": body.lead_weeks,
                "request_id": uuid.uuid4().hex,
            },
            key=f"{body.cluster_id}/{body.model}",
            actor=principal.subject,
        )
        (offset,) = ports.ops().append([event])
        return {**plan, "requested": {"ops_offset": offset, **json.loads(event["payload_json"])}}

    @route(
        "POST",
        "/v1/recommendations",
        Rule("fleet", "write", tenant_scoped=False),
        summary="Tune the running training jobs (checkpoint interval, batch size) from the "
        "stored history and append each recommendation to the operations log as the caller",
    )
    def recommend(request: Request, body: Tuning) -> dict[str, Any]:
        principal: Principal = request.state.principal
        sql = ports.sql_port()
        events = recommendation_events(
            lambda query: sql(query)["rows"],
            ports.scheduler().jobs(None),
            ports.clock(),
            principal.subject,
            body.days,
        )
        offsets = ports.ops().append(events) if events else []
        return {
            "recommendations": [json.loads(e["payload_json"]) for e in events],
            "ops_offsets": offsets,
        }
