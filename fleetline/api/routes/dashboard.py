"""What the operators' console needs beyond the other routes: who is signed in, and a stream of
changes (server-sent events) so pages update without reloading. The console itself is static
files under /ui (fleetline/api/dashboard/), which read everything through the API with the
same bearer token, so a tenant's users see exactly what the API shows them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Query, Request
from fastapi.responses import StreamingResponse

from fleetline.api import models
from fleetline.api.ports import Ports
from fleetline.api.rbac import PERMISSIONS, Principal, Rule
from fleetline.api.routing import Routes
from fleetline.processors.view.model import ResourceView

JOBS_EVERY_S = 2.0


def _view_state(view: ResourceView) -> dict[str, Any]:
    return {"view_version": view.version, "watermark_ms": view.watermark_ms}


def register(route: Routes, ports: Ports) -> None:
    @route(
        "GET",
        "/v1/me",
        Rule("fleet", "read", tenant_scoped=False),
        response_model=models.Me,
        summary="The signed-in principal: subject, role, tenant and permissions",
    )
    def me(request: Request) -> dict[str, Any]:
        principal: Principal = request.state.principal
        return {
            "subject": principal.subject,
            "role": principal.role,
            "tenant": principal.tenant,
            "permissions": sorted(f"{r}:{v}" for r, v in PERMISSIONS[principal.role]),
        }

    @route(
        "GET",
        "/v1/stream",
        Rule("fleet", "read"),
        summary="Server-sent events: `update` whenever the view or the caller's jobs change "
        "(checked every `every_s`), a comment every 15 s to keep the connection open; ends "
        "after `max_s` (clients reconnect)",
        response_class=StreamingResponse,
    )
    async def stream(
        request: Request,
        every_s: Annotated[float, Query(ge=0.1, le=60)] = 1.0,
        max_s: Annotated[float, Query(gt=0, le=3600)] = 300.0,
    ) -> StreamingResponse:
        principal: Principal = request.state.principal
        scope = request.state.scope
        sees_jobs = ("jobs", "read") in PERMISSIONS[principal.role] and ports.jobs is not None

        def jobs_digest() -> tuple[str, dict[str, int]]:
            if not sees_jobs or ports.jobs is None:
                return "", {}
            jobs = ports.jobs.jobs(scope)
            phases: dict[str, int] = {}
            for j in jobs:
                phases[j["phase"]] = phases.get(j["phase"], 0) + 1
            shape = [
                (j["key"], j["phase"], j.get("actual"), j.get("checkpoint_step")) for j in jobs
            ]
            digest = hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:16]
            return digest, phases

        async def events() -> AsyncIterator[str]:
            ends = time.monotonic() + max_s
            last: dict[str, Any] | None = None
            quiet_since = time.monotonic()
            jobs_read_at, digest = 0.0, ""
            phases: dict[str, int] = {}
            while time.monotonic() < ends and not await request.is_disconnected():
                state = ports.view.read(_view_state)
                # The jobs are read at most every JOBS_EVERY_S: an instance without the
                # scheduler reads them from its changelog topic.
                if time.monotonic() - jobs_read_at >= max(every_s, JOBS_EVERY_S):
                    digest, phases = await asyncio.to_thread(jobs_digest)
                    jobs_read_at = time.monotonic()
                now = {**state, "jobs_digest": digest, "phases": phases}
                if now != last:
                    last, quiet_since = now, time.monotonic()
                    yield f"event: update\ndata: {json.dumps(now)}\n\n"
                elif time.monotonic() - quiet_since > 15:
                    quiet_since = time.monotonic()
                    yield ": still here\n\n"
                await asyncio.sleep(every_s)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
