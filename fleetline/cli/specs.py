"""Desired state: `validate`, `apply` and `delete` specs (TrainingJob, InferenceService,
Dataset), appended to the scheduler's request log; `apply` also takes Cluster documents, which
go to the clusters topic the view folds."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from fleetline.cli.common import Actor, TopicPrefix, exit_with, fail_fields, now_ms, settings
from fleetline.config import Settings
from fleetline.errors import ConfigError, FleetlineError
from fleetline.observability.tracing import TraceContext
from fleetline.streams.topics import Topics

SpecFile = Annotated[str, typer.Option("-f", "--file", help="a spec file, or - for stdin")]


def documents(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The specs of a file (or stdin), validated, with their documents; exit 1 naming every
    bad field."""
    from fleetline.processors.scheduling.specs import DOCUMENT_KINDS, SpecError, parse_documents

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        specs = parse_documents(text, DOCUMENT_KINDS)
    except SpecError as exc:
        fail_fields(path, exc.errors)
    return specs, [d for d in yaml.safe_load_all(text) if d is not None]


def audit_requests(
    config: Settings,
    topics: Topics,
    actor: str,
    operation: str,
    targets: list[str],
    request_ids: list[str],
    tenant: str | None = None,
    fleet_wide: bool = False,
    trace_id: str | None = None,
    at_ms: int | None = None,
) -> None:
    """One AuditEvent per request the CLI appended, as the API does for its calls (a tenant's
    own, unless `fleet_wide`), at `at_ms` (when the requests were made; default now)."""
    from fleetline.processors.audit.runtime import KafkaAuditEmitter, new_event

    emitter = KafkaAuditEmitter(config.kafka, topics)
    for target, request_id in zip(targets, request_ids, strict=True):
        emitter.emit(
            new_event(
                ts=at_ms or now_ms(),
                actor=actor,
                actor_role="operator",
                operation=operation,
                target=target,
                outcome="SUCCEEDED",
                request_id=request_id,
                trace_id=trace_id,
                source="cli",
                tenant=None
                if fleet_wide
                else tenant or target.split("/")[0].removeprefix("dataset:"),
            )
        )
    if emitter.flush(30):
        raise FleetlineError("the requests were sent but their audit events were not delivered")


def validate(file: SpecFile) -> None:
    """Check TrainingJob / InferenceService / Dataset / Cluster documents (YAML or JSON) and
    name every bad field (examples: tests/specs/llm-pretrain.yaml, tests/specs/clusters.yaml)."""
    from fleetline.processors.scheduling.specs import Cluster

    specs, _ = documents(file)
    for spec in specs:
        name = (
            spec.metadata.name
            if isinstance(spec, Cluster)
            else f"{spec.metadata.tenant}/{spec.metadata.name}"
        )
        print(f"{spec.kind} {name}: valid")


def _wait_for_decisions(
    config: Settings, topics: Topics, keys: list[str], offsets: list[int], timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The latest decision about each key made at or after its request's log offset, once each
    is settled (placed, accepted, rejected, or waiting for its data to be copied: the copy
    may take hours) or the time is up (then it may be QUEUED)."""
    from fleetline.processors.scheduling.client import DecisionFollower

    wanted = dict(zip(keys, offsets, strict=True))
    latest: dict[str, dict[str, Any]] = {}
    follower = DecisionFollower(config.kafka, topics)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for decision in follower.poll():
                key = decision["job"]
                if key in wanted and decision["input_offset"] >= wanted[key]:
                    latest[key] = decision
            settled = [
                k for k, d in latest.items() if d["outcome"] != "QUEUED" or d.get("prewarms")
            ]
            if len(settled) == len(wanted) or time.monotonic() > deadline:
                return latest
    finally:
        follower.close()


def apply(
    file: SpecFile,
    wait: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="wait up to this long for each spec to be placed, accepted, rejected or "
            "queued for its data's copy, then print the latest decision about it (a job still "
            "queued shows why); "
            "exit 3 if one has no decision at all",
        ),
    ] = None,
    actor: Actor = "cli",
    topic_prefix: TopicPrefix = "fleetline",
    traceparent: Annotated[
        str | None,
        typer.Option(
            envvar="TRACEPARENT",
            help="the W3C trace context to continue (a new trace is started without one); the "
            "trace id is printed, for `fleetline trace`",
        ),
    ] = None,
) -> None:
    """Submit specs to the scheduler: every document is validated first (exit 1 with each bad
    field named), then the desired state is appended to the scheduler's request log (the
    scheduler runs in `fleetline serve`). Cluster documents declare a cluster's region, prices,
    PUE and latencies on the clusters topic, which the view folds and the scheduler scores."""
    from fleetline.observability import tracing
    from fleetline.processors.scheduling.specs import Cluster
    from fleetline.processors.view.runtime import declare_clusters

    specs, docs = documents(file)
    config = settings("kafka")
    topics = Topics(topic_prefix)
    clusters = [s for s in specs if isinstance(s, Cluster)]
    if clusters:
        ts = now_ms()  # also the seq: a later declaration of a cluster replaces an earlier one
        offsets = declare_clusters(config.kafka, topics, [c.record(ts, ts) for c in clusters])
        targets = [f"cluster:{c.metadata.name}" for c in clusters]
        ids = [uuid.uuid4().hex for _ in clusters]
        audit_requests(config, topics, actor, "cluster.apply", targets, ids, fleet_wide=True)
        for target, offset in zip(targets, offsets, strict=True):
            print(f"{target}: declared (offset {offset} of {topics.clusters})")
    jobs = [(s, d) for s, d in zip(specs, docs, strict=True) if not isinstance(s, Cluster)]
    if not jobs:
        return
    try:
        with tracing.entered("fleetline apply", traceparent) as trace:
            _submit_jobs(config, topics, jobs, actor, trace, wait)
    finally:
        tracing.flush_spans()


def _submit_jobs(
    config: Settings,
    topics: Topics,
    jobs: list[tuple[Any, Any]],
    actor: str,
    trace: TraceContext,
    wait: float | None,
) -> None:
    """Append the job and dataset specs under one trace, audit them, and (with `wait`) print
    each one's decision."""
    from fleetline.processors.scheduling.client import submit
    from fleetline.processors.scheduling.codec import spec_requests

    entered_ms = now_ms()
    requests = [
        r
        for _, r in spec_requests(
            [s for s, _ in jobs],
            [d for _, d in jobs],
            entered_ms,
            actor,
            lambda: uuid.uuid4().hex,
            lambda: trace.traceparent,
        )
    ]
    offsets = submit(config.kafka, topics, requests)
    audit_requests(
        config,
        topics,
        actor,
        "job.apply",
        [r["key"] for r in requests],
        [r["request_id"] for r in requests],
        trace_id=trace.trace_id,
        at_ms=entered_ms,
    )
    for request, offset in zip(requests, offsets, strict=True):
        print(f"{request['key']}: submitted (request {offset}, trace {trace.trace_id})")
    if not wait:
        return
    decided = _wait_for_decisions(config, topics, [r["key"] for r in requests], offsets, wait)
    missing = 0
    for request in requests:
        decision = decided.get(request["key"])
        if decision is None:
            print(
                f"{request['key']}: no decision within {wait:g}s (is the scheduler running? "
                "`fleetline serve` runs it)"
            )
            missing += 1
        else:
            print(f"{request['key']}: {decision['outcome']} - {decision['reason']}")
    exit_with(3 if missing else 0)


def delete(
    jobs: Annotated[
        list[str] | None,
        typer.Argument(help="jobs as TENANT/NAME, datasets as dataset:TENANT/NAME"),
    ] = None,
    file: Annotated[
        str | None, typer.Option("-f", "--file", help="delete what a spec file declares")
    ] = None,
    actor: Actor = "cli",
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Delete jobs or datasets: their GPUs are released and the queue moves on."""
    from fleetline.processors.scheduling.client import submit
    from fleetline.processors.scheduling.codec import new_request
    from fleetline.processors.scheduling.specs import Cluster

    keys: list[tuple[str, str]] = []  # (request key, tenant)
    if file:
        specs, _ = documents(file)
        for spec in specs:
            if isinstance(spec, Cluster):
                raise ConfigError(
                    f"cluster {spec.metadata.name}: a cluster is taken out of the pool by "
                    "applying it with `retired: true`, not deleted"
                )
            tenant, name = spec.metadata.tenant, spec.metadata.name
            keys.append(
                (f"dataset:{name}", tenant)
                if spec.kind == "Dataset"
                else (f"{tenant}/{name}", tenant)
            )
    for item in jobs or []:
        dataset = item.startswith("dataset:")
        tenant, sep, name = item.removeprefix("dataset:").partition("/")
        if not sep or not tenant or not name:
            raise ConfigError(
                f"{item!r}: name jobs as TENANT/NAME and datasets as dataset:TENANT/NAME"
            )
        keys.append((f"dataset:{name}", tenant) if dataset else (f"{tenant}/{name}", tenant))
    if not keys:
        raise ConfigError("delete needs TENANT/NAME arguments or -f FILE")
    config = settings("kafka")
    topics = Topics(topic_prefix)
    requests = [
        new_request("DELETE", key, tenant, now_ms(), uuid.uuid4().hex, actor=actor)
        for key, tenant in keys
    ]
    offsets = submit(config.kafka, topics, requests)
    audit_requests(
        config,
        topics,
        actor,
        "job.delete",
        [k for k, _ in keys],
        [r["request_id"] for r in requests],
    )
    for (key, _), offset in zip(keys, offsets, strict=True):
        print(f"{key}: delete requested (request {offset})")


def register(app: typer.Typer) -> None:
    app.command(name="validate")(validate)
    app.command(name="apply")(apply)
    app.command(name="delete")(delete)
