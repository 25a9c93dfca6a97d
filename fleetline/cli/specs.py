"""Desired state: `validate`, `apply` and `delete` specs (TrainingJob, InferenceService,
Dataset), appended to the scheduler's request log."""

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
from fleetline.streams.topics import Topics

SpecFile = Annotated[str, typer.Option("-f", "--file", help="a spec file, or - for stdin")]


def documents(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The specs of a file (or stdin), validated, with their documents; exit 1 naming every
    bad field."""
    from fleetline.processors.scheduling.specs import SpecError, parse_specs

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        specs = parse_specs(text)
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
) -> None:
    """One AuditEvent per request the CLI appended, as the API does for its calls."""
    from fleetline.processors.audit.runtime import KafkaAuditEmitter, new_event

    emitter = KafkaAuditEmitter(config.kafka, topics)
    for target, request_id in zip(targets, request_ids, strict=True):
        emitter.emit(
            new_event(
                ts=now_ms(),
                actor=actor,
                actor_role="operator",
                operation=operation,
                target=target,
                outcome="SUCCEEDED",
                request_id=request_id,
                source="cli",
                tenant=tenant or target.split("/")[0].removeprefix("dataset:"),
            )
        )
    if emitter.flush(30):
        raise FleetlineError("the requests were sent but their audit events were not delivered")


def validate(file: SpecFile) -> None:
    """Check TrainingJob / InferenceService / Dataset specs (YAML or JSON) and name every bad
    field (example: tests/specs/llm-pretrain.yaml)."""
    specs, _ = documents(file)
    for spec in specs:
        print(f"{spec.kind} {spec.metadata.tenant}/{spec.metadata.name}: valid")


def _wait_for_decisions(
    config: Settings, topics: Topics, keys: list[str], offsets: list[int], timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The latest decision about each key made at or after its request's log offset, once each
    is settled (placed, accepted or rejected) or the time is up (then it may be QUEUED)."""
    from fleetline.processors.scheduling.runtime import DecisionFollower

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
            settled = [k for k, d in latest.items() if d["outcome"] != "QUEUED"]
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
            help="wait up to this long for each spec to be placed, accepted or "
            "rejected, then print the latest decision about it (a job still queued shows why); "
            "exit 3 if one has no decision at all",
        ),
    ] = None,
    actor: Actor = "cli",
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Submit specs to the scheduler: every document is validated first (exit 1 with each bad
    field named), then the desired state is appended to the scheduler's request log. The
    scheduler runs in `fleetline serve`."""
    from fleetline.processors.scheduling.codec import datasets_first, submit_request
    from fleetline.processors.scheduling.runtime import submit

    specs, docs = documents(file)
    config = settings("kafka")
    topics = Topics(topic_prefix)
    requests = [
        submit_request(spec, doc, now_ms(), uuid.uuid4().hex, actor)
        for spec, doc in datasets_first(specs, docs)
    ]
    offsets = submit(config.kafka, topics, requests)
    audit_requests(
        config,
        topics,
        actor,
        "job.apply",
        [r["key"] for r in requests],
        [r["request_id"] for r in requests],
    )
    for request, offset in zip(requests, offsets, strict=True):
        print(f"{request['key']}: submitted (request {offset})")
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
    from fleetline.processors.scheduling.codec import new_request
    from fleetline.processors.scheduling.runtime import submit

    keys: list[tuple[str, str]] = []  # (request key, tenant)
    if file:
        specs, _ = documents(file)
        for spec in specs:
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
