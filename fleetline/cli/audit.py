"""The tamper-evident audit log: `audit verify|search|export`, and `auth token`."""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from fleetline.api.rbac import Role
from fleetline.cli.common import (
    Need,
    Since,
    TopicPrefix,
    Until,
    audit_read,
    exit_with,
    now_ms,
    parse_time_ms,
    settings,
)
from fleetline.config import Settings
from fleetline.errors import ConfigError

audit = typer.Typer(
    no_args_is_help=True,
    help="Verify, search and export the tamper-evident audit log. verify checks hash links, "
    "seq continuity and signed digests and names the first broken link (exit 2); search "
    "and export read ClickHouse (or Kafka).",
)


class Source(StrEnum):
    KAFKA = "kafka"
    CLICKHOUSE = "clickhouse"
    ARCHIVE = "archive"


# What each source is read from.
_NEEDS: dict[Source, Need] = {
    Source.KAFKA: "kafka",
    Source.CLICKHOUSE: "clickhouse",
    Source.ARCHIVE: "s3",
}


class Format(StrEnum):
    JSONL = "jsonl"
    CSV = "csv"
    PARQUET = "parquet"


SourceOption = Annotated[
    Source, typer.Option(help="where the chain is read from (archive: verify only)")
]
Tenant = Annotated[str | None, typer.Option(help="only this tenant's events")]
Reveal = Annotated[bool, typer.Option(help="include sensitive fields unmasked (platform admins)")]


def _verify_keys(config: Settings) -> dict[str, Any]:
    from fleetline.app import audit_public_keys

    return audit_public_keys(config)


def _records(config: Settings, source: Source, prefix: str) -> list[dict[str, Any]]:
    from fleetline.streams.topics import Topics

    if source == Source.KAFKA:
        from fleetline.processors.audit.runtime import read_chain

        return read_chain(config.kafka, Topics(prefix))
    from fleetline.storage.audit_store import AuditTable
    from fleetline.storage.clickhouse import connect

    table = AuditTable(connect(config.clickhouse_url), config.clickhouse_database)
    # The prefix's own chains: other deployments or runs may share the database.
    return list(table.records(topic=Topics(prefix).audit_log))


@audit.command()
def verify(
    file: Annotated[Path | None, typer.Option(help="an export file instead of a source")] = None,
    source: SourceOption = Source.KAFKA,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Check the chain: hash links, seq continuity, signed digests (exit 2 when broken)."""
    from fleetline.app import sealed_objects
    from fleetline.processors.audit.chain import export_entry
    from fleetline.processors.audit.chain import verify as verify_chain
    from fleetline.storage import audit_export
    from fleetline.storage.audit_store import AuditArchive

    config = settings() if file is not None else settings(_NEEDS[source])
    keys = _verify_keys(config)
    anchors = None
    if file is not None:
        entries, named, anchors = audit_export.read(file)
        if not keys:
            print(
                "warning: no FLEETLINE_AUDIT_VERIFY_KEYS; trusting the keys the export names",
                file=sys.stderr,
            )
            keys = named
    elif source == Source.ARCHIVE:
        entries = list(AuditArchive(sealed_objects(config), f"audit/{topic_prefix}").entries())
    else:
        entries = [
            export_entry(r, reveal_sensitive=True) for r in _records(config, source, topic_prefix)
        ]
    report = verify_chain(entries, keys, anchors)
    print(
        json.dumps(
            {
                "ok": report.ok,
                "checked": report.checked,
                "digests": report.digests,
                "first_broken": report.first_broken,
                "unsigned_tail": report.unsigned_tail,
            },
            indent=2,
        )
    )
    exit_with(0 if report.ok else 2)


@audit.command()
def search(
    tenant: Tenant = None,
    since: Since = None,
    until: Until = None,
    op: Annotated[str | None, typer.Option(help="operation, e.g. 'api.GET /v1/nodes'")] = None,
    actor: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1)] = 100,
    reveal: Reveal = False,
    source: SourceOption = Source.CLICKHOUSE,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Events matching the filters, newest first, one JSON line each (ClickHouse)."""
    from fleetline.processors.audit.chain import masked_event
    from fleetline.storage.audit_store import AuditQuery, AuditTable
    from fleetline.storage.clickhouse import connect

    if source != Source.CLICKHOUSE:
        raise ConfigError("audit search reads ClickHouse (--source clickhouse)")
    config = settings("clickhouse")
    table = AuditTable(connect(config.clickhouse_url), config.clickhouse_database)
    for record in table.search(
        AuditQuery(
            tenant,
            parse_time_ms(since) if since else None,
            parse_time_ms(until) if until else None,
            op,
            actor,
            limit,
        )
    ):
        print(
            json.dumps(
                {
                    "partition": record["partition"],
                    "seq": record["seq"],
                    **masked_event(record["event"], reveal),
                },
                sort_keys=True,
            )
        )


@audit.command()
def export(
    out: Annotated[Path, typer.Option(help="the file to write")],
    format: Annotated[Format, typer.Option()] = Format.JSONL,
    tenant: Tenant = None,
    since: Since = None,
    until: Until = None,
    to_s3: Annotated[
        str | None,
        typer.Option(
            metavar="KEY",
            help="also upload (encrypted when FLEETLINE_OBJECT_ENCRYPTION_KEY is set)",
        ),
    ] = None,
    reveal: Reveal = False,
    source: SourceOption = Source.KAFKA,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """An export of a tenant's (or everyone's) events in a range that verifies on its own."""
    from fleetline.app import sealed_objects
    from fleetline.processors.audit.chain import export_window
    from fleetline.storage import audit_export

    if source == Source.ARCHIVE:
        raise ConfigError("audit export reads Kafka or ClickHouse")
    config = settings(_NEEDS[source], "kafka", *(("s3",) if to_s3 else ()))
    entries, anchors = export_window(
        _records(config, source, topic_prefix),
        tenant,
        parse_time_ms(since) if since else None,
        parse_time_ms(until) if until else None,
        reveal,
    )
    count = audit_export.write(out, str(format), entries, _verify_keys(config), anchors)
    audit_read(
        config,
        topic_prefix,
        "audit.export",
        to_s3 or out.name,
        {
            "links": str(count),
            "format": str(format),
            "window": f"{since or '-'}..{until or '-'}",
            "revealed": str(reveal).lower(),
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        },
        tenant=tenant,
    )
    if to_s3:
        sealed_objects(config).put(to_s3, out.read_bytes())
    print(f"{count} links written to {out}" + (f" and s3 {to_s3}" if to_s3 else ""))


auth = typer.Typer(help="Mint an API token.", no_args_is_help=True)


@auth.command()
def token(
    name: Annotated[str, typer.Option(help="who the token is for")],
    role: Annotated[Role, typer.Option()],
    tenant: Annotated[str | None, typer.Option()] = None,
    expires: Annotated[
        str | None,
        typer.Option(
            metavar="WHEN",
            help="refused from then on: +<n>h|d (from now), an ISO 8601 time or epoch ms",
        ),
    ] = None,
) -> None:
    """Mint an API token (for automation) and print its config line (only its SHA-256 is
    stored). A role the config lists under require_mfa cannot be served by a token."""
    from datetime import UTC, datetime

    from fleetline.api.auth import token_digest

    value = "fl_" + secrets.token_urlsafe(32)
    entry: dict[str, Any] = {
        "name": name,
        "sha256": token_digest(value),
        "role": str(role),
        "tenant": tenant,
    }
    if expires:
        if expires.startswith("+"):  # "+30d": as far after now as "-30d" is before it
            now = now_ms()
            at_ms = 2 * now - parse_time_ms("-" + expires[1:])
        else:
            at_ms = parse_time_ms(expires)
        entry["expires"] = datetime.fromtimestamp(at_ms / 1000, UTC).isoformat()
    print(f"token (shown once; give it to {name}): {value}")
    print("add to the tokens list in FLEETLINE_AUTH_CONFIG:")
    print("  - " + json.dumps(entry))


def register(app: typer.Typer) -> None:
    app.add_typer(audit, name="audit")
    app.add_typer(auth, name="auth")
