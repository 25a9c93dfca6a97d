"""Desired state: `validate`, `apply` and `delete` specs (TrainingJob, InferenceService,
Dataset) through the API, which appends them to the scheduler's request log; `apply` also takes
Cluster documents, which the API puts on the clusters topic the view folds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer
import yaml

from fleetline.cli.client import api
from fleetline.cli.common import exit_with, fail_fields
from fleetline.errors import ConfigError

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
    traceparent: Annotated[
        str | None,
        typer.Option(
            envvar="TRACEPARENT",
            help="the W3C trace context to continue (a new trace is started without one); the "
            "trace id is printed, for `fleetline trace`",
        ),
    ] = None,
) -> None:
    """Submit specs through the API, as the signed-in caller (`fleetline login`): every
    document is validated here first (exit 1 with each bad field named), then the server
    checks the caller may write for each spec's tenant, appends the desired state to the
    scheduler's request log and audits the call. Cluster documents (platform admins) declare a
    cluster's region, prices, PUE and latencies, which the view folds and the scheduler
    scores."""
    from fleetline.observability import tracing
    from fleetline.processors.scheduling.specs import Cluster

    specs, docs = documents(file)
    client = api()
    for spec, doc in zip(specs, docs, strict=True):
        if isinstance(spec, Cluster):
            name = spec.metadata.name
            answer = client.call("PUT", f"/v1/clusters/{quote(name, safe='')}", body=doc)
            print(f"cluster:{name}: declared (offset {answer['offset']})")
    jobs = [d for s, d in zip(specs, docs, strict=True) if not isinstance(s, Cluster)]
    if not jobs:
        return
    try:
        with tracing.entered("fleetline apply", traceparent) as trace:
            answer = client.call(
                "POST",
                "/v1/jobs",
                text=yaml.safe_dump_all(jobs, sort_keys=False),
                params={"wait": wait},
                headers={tracing.HEADER: trace.traceparent},
                timeout_s=(wait or 0) + 30,
            )
    finally:
        tracing.flush_spans()
    trace_id = answer["trace_id"]
    for item in answer["accepted"]:
        print(f"{item['key']}: submitted (request {item['request_offset']}, trace {trace_id})")
    if not wait:
        return
    missing = 0
    for item in answer["accepted"]:
        decision = item.get("decision")
        if decision is None:
            print(
                f"{item['key']}: no decision within {wait:g}s (is the scheduler running? "
                "`fleetline serve` runs it)"
            )
            missing += 1
        else:
            print(f"{item['key']}: {decision['outcome']} - {decision['reason']}")
    exit_with(3 if missing else 0)


def delete(
    jobs: Annotated[
        list[str] | None,
        typer.Argument(help="jobs as TENANT/NAME, datasets as dataset:TENANT/NAME"),
    ] = None,
    file: Annotated[
        str | None, typer.Option("-f", "--file", help="delete what a spec file declares")
    ] = None,
) -> None:
    """Delete jobs or datasets through the API (as the signed-in caller): their GPUs are
    released and the queue moves on."""
    from fleetline.processors.scheduling.specs import Cluster

    targets: list[tuple[str, str, bool]] = []  # (tenant, name, is a dataset)
    if file:
        specs, _ = documents(file)
        for spec in specs:
            if isinstance(spec, Cluster):
                raise ConfigError(
                    f"cluster {spec.metadata.name}: a cluster is taken out of the pool by "
                    "applying it with `retired: true`, not deleted"
                )
            targets.append((spec.metadata.tenant, spec.metadata.name, spec.kind == "Dataset"))
    for item in jobs or []:
        dataset = item.startswith("dataset:")
        tenant, sep, name = item.removeprefix("dataset:").partition("/")
        if not sep or not tenant or not name:
            raise ConfigError(
                f"{item!r}: name jobs as TENANT/NAME and datasets as dataset:TENANT/NAME"
            )
        targets.append((tenant, name, dataset))
    if not targets:
        raise ConfigError("delete needs TENANT/NAME arguments or -f FILE")
    client = api()
    for tenant, name, dataset in targets:
        path = f"{quote(tenant, safe='')}/{quote(name, safe='')}"
        answer = client.call("DELETE", f"/v1/{'datasets' if dataset else 'jobs'}/{path}")
        key = f"dataset:{tenant}/{name}" if dataset else f"{tenant}/{name}"
        print(f"{key}: delete requested (request {answer['request_offset']})")


def register(app: typer.Typer) -> None:
    app.command(name="validate")(validate)
    app.command(name="apply")(apply)
    app.command(name="delete")(delete)
