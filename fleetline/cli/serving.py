"""Inference traffic: `router` (the traffic entry layer) and `load` (a bounded diurnal load
against it, loopback only)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
import yaml

from fleetline.cli.common import Json, TopicPrefix, console, print_json, settings, table


def router(
    port: Annotated[int, typer.Option(help="the port it listens on (0: any free one)")] = 8090,
    host: Annotated[str, typer.Option(help="the address it listens on")] = "127.0.0.1",
    policy: Annotated[
        Path | None,
        typer.Option(help="a YAML routing policy: weights, retries, retry budget, report_ms"),
    ] = None,
    no_report: Annotated[
        bool, typer.Option("--no-report", help="do not send load reports to the autoscaler")
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Run the router: forward POST /v1/services/TENANT/NAME/infer to the ready replica with
    the lowest expected latency for the client's region (header X-Fleetline-Region), fail over
    on an error within a retry budget, and report each service's load to the scheduler's
    autoscaler every second (until interrupted). GET /v1/routes shows the weights."""
    from fleetline.agents.router.server import Router, load_policy
    from fleetline.streams.topics import Topics

    config = settings("kafka")
    data = yaml.safe_load(policy.read_text()) if policy else None
    router_ = Router(config, Topics(topic_prefix), load_policy(data), report=not no_report)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def announce() -> None:
        while router_.address is None and not stop.is_set():
            stop.wait(0.05)
        console.print(f"router listening on {router_.address}")

    threading.Thread(target=announce, daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        router_.run(host, port, stop)


def load(
    service: Annotated[str, typer.Argument(help="tenant/name of the InferenceService")],
    router_url: Annotated[
        str, typer.Option("--router", help="the router's address (loopback only)")
    ] = "http://127.0.0.1:8090",
    region: Annotated[
        list[str] | None,
        typer.Option(help="REGION=WEIGHT[@OFFSET_H], repeatable (default: eu-west=1)"),
    ] = None,
    peak_rps: Annotated[float, typer.Option(min=0.0, help="requests/s at noon, weight 1")] = 50.0,
    day_s: Annotated[float, typer.Option(min=1.0, help="seconds one compressed day lasts")] = 120.0,
    night: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="the night's share of the peak")
    ] = 0.05,
    steps: Annotated[
        str | None,
        typer.Option(help="a stepped curve instead of a day: AT_S:RPS,AT_S:RPS,... (x weight)"),
    ] = None,
    duration_s: Annotated[float, typer.Option(min=0.1, help="stop after this long")] = 60.0,
    max_requests: Annotated[int, typer.Option(min=1, help="stop after this many")] = 100_000,
    json_: Json = False,
) -> None:
    """Send a diurnal curve of requests per region to the router (bounded in count and time,
    loopback only) and print what came back: requests, failures, retries, latency percentiles
    by time slice."""
    from fleetline.demo.load import LoadPlan, run_load

    weights: dict[str, float] = {}
    offsets: dict[str, float] = {}
    for item in region or ["eu-west=1"]:
        name, _, rest = item.partition("=")
        weight, _, offset = (rest or "1").partition("@")
        weights[name] = float(weight)
        if offset:
            offsets[name] = float(offset)
    plan = LoadPlan(
        router_url,
        service,
        weights,
        peak_rps=peak_rps,
        day_s=day_s,
        night=night,
        offset_h=offsets,
        steps=[
            (float(at), float(rps))
            for at, _, rps in (step.partition(":") for step in steps.split(","))
        ]
        if steps
        else (),
        duration_s=duration_s,
        max_requests=max_requests,
    )
    result = asyncio.run(run_load(plan))
    summary = result.summary(span_s=duration_s)
    if json_:
        print_json(summary)
        return
    out = table("from s", "requests", "ok", "failed", "p50 ms", "p95 ms", "replicas")
    for row in summary["buckets"]:
        out.add_row(*(str(row[k]) for k in row))
    console.print(out)
    totals = {k: v for k, v in summary.items() if k != "buckets"}
    console.print(json.dumps(totals))


def register(app: typer.Typer) -> None:
    app.command()(router)
    app.command()(load)
