"""Prometheus metrics of the serving process (`/metrics`, text exposition format)."""

from __future__ import annotations

from fastapi import Response

from fleetline.api.ports import Ports
from fleetline.api.rbac import Rule
from fleetline.api.routing import Routes
from fleetline.observability.metrics import exposition


def register(route: Routes, ports: Ports) -> None:
    @route(
        "GET",
        "/metrics",
        Rule("fleet", "read", tenant_scoped=False),
        summary="Prometheus metrics: loops, lag, dead letters, decisions, sinks, tiering, API "
        "calls and the fleet's GPUs under DCGM exporter names (not audited per scrape)",
        response_class=Response,
    )
    def prometheus_metrics() -> Response:
        body, content_type = exposition()
        return Response(body, media_type=content_type)
