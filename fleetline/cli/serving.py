"""Inference traffic: `router` (the traffic entry layer) and `load` (a bounded diurnal load
against it, loopback or a lab's addresses only)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from fleetline.cli.common import (
    Json,
    ListenHost,
    TopicPrefix,
    console,
    listen_host,
    print_json,
    settings,
    table,
)
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.streams.topics import ROUTER, Topics


def router(
    port: Annotated[int, typer.Option(help="the port it listens on (0: any free one)")] = 8090,
    host: ListenHost = None,
    policy: Annotated[
        Path | None,
        typer.Option(help="a YAML routing policy: weights, retries, retry budget, report_ms"),
    ] = None,
    no_report: Annotated[
        bool, typer.Option("--no-report", help="do not send load reports to the autoscaler")
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
    open_: Annotated[
        bool,
        typer.Option(
            "--open",
            help="serve inference to anyone who reaches it, without FLEETLINE_AUTH_CONFIG "
            "(one host, tests)",
        ),
    ] = False,
    processes: Annotated[
        int,
        typer.Option(
            min=1,
            help="router processes on the one port (SO_REUSEPORT; the kernel spreads the "
            "connections), each reporting its own load; the autoscaler adds them up",
        ),
    ] = 1,
) -> None:
    """Run the router: forward POST /v1/services/TENANT/NAME/infer to the ready replica with
    the lowest expected latency for the client's region (header X-Fleetline-Region), fail over
    on an error within a retry budget, and report each service's load to the scheduler's
    autoscaler every second (until interrupted). GET /v1/routes shows the weights.

    Callers need a bearer token from FLEETLINE_AUTH_CONFIG (an API token or a JWT whose role
    may call the tenant's services); with FLEETLINE_TLS_* set it serves HTTPS and reaches the
    replicas over mutual TLS."""
    config = settings("kafka", kind=ROUTER)
    data = yaml.safe_load(policy.read_text()) if policy else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run = RouterRun(config, topic_prefix, data, not no_report, open_, listen_host(host), port)
    if processes == 1:
        with contextlib.suppress(KeyboardInterrupt):
            run.serve(stop, reuse_port=False)
        return
    if port == 0:
        raise ConfigError("--processes above 1 needs a fixed --port (each process binds it)")
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ended = context.Event()
    children = [
        context.Process(
            target=_router_process,
            args=(run, ended),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    console.print(f"router: {processes} processes on port {port}")
    try:
        while not stop.is_set() and all(child.is_alive() for child in children):
            stop.wait(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        ended.set()
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    failed = [c.exitcode for c in children if c.exitcode not in (0, None)]
    if failed and not stop.is_set():
        raise ConfigError(f"a router process ended with exit code {failed[0]}")


@dataclass(frozen=True)
class RouterRun:
    """What each router process is started with (a multiprocessing target's argument)."""

    config: Settings
    topic_prefix: str
    policy: Any  # the routing policy's data, or None
    report: bool
    open_: bool
    host: str
    port: int

    def serve(self, stop: threading.Event, reuse_port: bool) -> None:
        """One router, serving until `stop` (printing where it listens once it does)."""
        from fleetline.agents.router.server import Router, load_policy

        router_ = Router(
            self.config,
            Topics(self.topic_prefix),
            load_policy(self.policy),
            report=self.report,
            admit=inference_admission(self.config, self.open_),
        )

        def announce() -> None:
            while router_.address is None and not stop.is_set():
                stop.wait(0.05)
            console.print(f"router listening on {router_.address}")

        threading.Thread(target=announce, daemon=True).start()
        router_.run(self.host, self.port, stop, reuse_port)


def _router_process(run: RouterRun, ended: Any) -> None:
    """One of several router processes (a multiprocessing target): until `ended` is set."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends its processes itself

    def follow_parent() -> None:
        ended.wait()
        stop.set()

    threading.Thread(target=follow_parent, daemon=True).start()
    run.serve(stop, reuse_port=True)


def inference_admission(config: Settings, open_: bool) -> Any:
    """The router's token check from FLEETLINE_AUTH_CONFIG; None (no check) only when asked."""
    from fleetline.api.auth import AuthConfig, Authenticator, inference_admission

    if config.auth_config is None:
        if not open_:
            raise ConfigError(
                "the router checks callers' tokens: set FLEETLINE_AUTH_CONFIG (see `fleetline "
                "auth token`), or run it with --open"
            )
        return None
    return inference_admission(Authenticator(AuthConfig.from_file(config.auth_config)))


def load(
    service: Annotated[str, typer.Argument(help="tenant/name of the InferenceService")],
    router_url: Annotated[
        str,
        typer.Option(
            "--router", help="the router's address (loopback, or a lab's on this machine)"
        ),
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
    token: Annotated[
        str | None,
        typer.Option(
            envvar="FLEETLINE_TOKEN", help="the bearer token the router asks for (an API token)"
        ),
    ] = None,
    json_: Json = False,
) -> None:
    """Send a diurnal curve of requests per region to the router (bounded in count and time,
    loopback or a lab's addresses only) and print what came back: requests, failures,
    retries, latency percentiles by time slice."""
    from fleetline.demo.load import LoadPlan, run_load
    from fleetline.infra.lab import lab_subnets

    config = Settings.from_env()

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
        labs=tuple(lab_subnets(config.cache_dir)),
        token=token,
        ca_file=str(config.tls.ca) if config.tls else None,
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


def explain_service(
    config: Settings, topics: Topics, record: dict[str, Any], state: Any, region: str | None
) -> None:
    """A service's replicas (the scheduler's), their registry records, the load its autoscaler
    last saw, and the router's weights (default policy) for its clients' regions."""
    from fleetline.agents.router.routing import RoutingPolicy, weights
    from fleetline.agents.router.server import read_registry

    scaling = record.get("scaling") or {}
    print("\nReplicas (the scheduler's):")
    for key in scaling.get("replicas", []):
        replica = state.committed(0, f"job:{key}".encode()) or {}
        clusters = ", ".join(sorted(replica.get("allocation") or {})) or "-"
        print(
            f"  {key:<28} {replica.get('role', '?'):<8} {replica.get('phase', '?'):<9} {clusters}"
        )
    registry = read_registry(config, topics)
    now = int(time.time() * 1000)
    policy = RoutingPolicy()
    mine = sorted(
        (e for e in registry.endpoints.values() if e.service == record["key"]),
        key=lambda e: e.replica,
    )
    print("\nThe registry (each replica's latest record):")
    for e in mine:
        age = (now - e.ts) / 1000
        silent = "" if e.fresh(now, policy) else " (silent: not routed)"
        print(
            f"  {e.replica:<28} {e.state:<9} {e.cluster_id} ({e.region}) {e.address or '-'}: "
            f"{e.inflight} in flight, {e.queue} queued of {e.concurrency} slots, "
            f"p50 {e.latency_p50_ms} ms, {age:.1f}s ago{silent}"
        )
    load = scaling.get("load")
    if load:
        print(
            f"\nThe autoscaler last saw ({load.get('router')}): {load['requests']} requests in "
            f"{load['window_ms'] / 1000:g}s {load.get('by_region')}, "
            f"latency {load.get('latency_ms')}, utilisation {load['utilisation']}, "
            f"queue {load.get('queue')}"
            + (
                f"; under target since {scaling['low_since_ms']}"
                if scaling.get("low_since_ms")
                else ""
            )
        )
    spec = record["document"]["spec"]
    for client in [region] if region else spec.get("regions", []):
        shown = weights(
            registry, registry.routable(record["key"], now, policy), client, policy, {}, {}
        )
        print(f"\nThe router's weights for clients in {client} (best first):")
        for w in shown:
            print(
                f"  {w.replica:<28} expected {w.expected_ms:.1f} ms = link {w.link_ms:g} ms + "
                f"service {w.service_ms:.1f} ms x (1 + {w.waiting} waiting / {w.slots} slots)"
            )
        if not shown:
            print("  no ready replica")


def register(app: typer.Typer) -> None:
    app.command()(router)
    app.command()(load)
