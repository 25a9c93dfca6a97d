"""`fleetline postmortem`: an incident report of a window, from the log and the tiers."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Annotated

import typer

from fleetline.cli.common import TopicPrefix, analyst_query, settings


def postmortem(
    since: Annotated[str, typer.Option("--from", help="-<n>h / -<n>m, epoch ms or ISO 8601")],
    until: Annotated[
        str | None, typer.Option("--to", help="the window's end (default: now)")
    ] = None,
    cluster: Annotated[str | None, typer.Option(help="only this cluster")] = None,
    job: Annotated[str | None, typer.Option(help="only this job (TENANT/NAME)")] = None,
    node: Annotated[str | None, typer.Option(help="only this node")] = None,
    service: Annotated[str | None, typer.Option(help="only this service (TENANT/NAME)")] = None,
    out: Annotated[Path, typer.Option(help="where to write OUT.json, OUT.md and OUT.html")] = Path(
        "postmortem"
    ),
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """An incident report of the window: the faults and their detection (when, by which fold
    or rule, how long after), every decision, order, fence and automated action that
    followed with its actor and reason, the impact on each job and service, the audit chain
    verified with the digests that sign the window, and plots. Read only from the log and the
    storage tiers (hot, warm or cold, wherever the window's rows now lie); the same log and
    window give byte-identical JSON. Writes OUT.json, OUT.md and OUT.html (self-contained)."""
    from fleetline.app import audit_public_keys
    from fleetline.moments import parse_moment
    from fleetline.processors.postmortem.files import write
    from fleetline.processors.postmortem.gather import incident_report, unread_cold
    from fleetline.processors.postmortem.report import Scope
    from fleetline.storage.clickhouse import connect
    from fleetline.storage.query_service import owned_elsewhere
    from fleetline.streams.topics import Topics

    if sum(x is not None for x in (cluster, job, node, service)) > 1:
        raise typer.BadParameter("name at most one of --cluster, --job, --node, --service")
    now = int(time.time() * 1000)
    from_ms = parse_moment(since, now)
    to_ms = parse_moment(until, now) if until is not None else now
    config = settings("kafka", "clickhouse")

    if not owned_elsewhere(config.clickhouse_url):
        # (Through the process that owns the store, its API's postmortem checks the same.)
        unread_cold(connect(config.clickhouse_url), config, from_ms, to_ms)
    report = incident_report(
        config.kafka,
        Topics(topic_prefix),
        functools.partial(analyst_query, config),
        from_ms,
        to_ms,
        Scope(cluster, job, node, service),
        audit_public_keys(config),
    )
    written = write(report, out, f"Postmortem of {Scope(cluster, job, node, service).words()}")
    print(report["summary"])
    for kind, path in written.items():
        print(f"{kind}: {path}")


def register(app: typer.Typer) -> None:
    app.command(name="postmortem")(postmortem)
