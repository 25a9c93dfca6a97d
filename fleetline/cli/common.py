"""What every command shares: settings, the console, options used by several commands, output."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fleetline.config import Settings
from fleetline.errors import ConfigError, StorageError
from fleetline.streams.topics import CONTROL_PLANE, OPERATOR, Topics

if TYPE_CHECKING:
    from fleetline.storage.query_service import QueryResult

# Tables are not wrapped to 80 columns when the output is a file or a pipe.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
errors = Console(stderr=True, highlight=False)

TopicPrefix = Annotated[str, typer.Option("--topic-prefix", help="the topics' prefix")]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed on "
        "stderr); without it, no endpoint",
    ),
]
MetricsHost = Annotated[
    str | None,
    typer.Option(help="the address /metrics listens on (default: FLEETLINE_ADVERTISE_HOST)"),
]
ListenHost = Annotated[
    str | None,
    typer.Option(help="the address it listens on (default: FLEETLINE_ADVERTISE_HOST)"),
]


def listen_host(host: str | None) -> str:
    """A --host flag's address, or this host's advertised one (FLEETLINE_ADVERTISE_HOST,
    127.0.0.1 unset)."""
    return host or Settings.from_env().advertise_host


def expose_metrics(host: str | None, port: int | None, process: str, *collectors: Any) -> None:
    """Serve /metrics for this process (with `collectors` registered), if a port was given."""
    if port is None:
        return
    host = listen_host(host)
    from fleetline.observability import metrics

    for i, collector in enumerate(collectors):
        metrics.register_collector(f"{process}/{i}", collector)
    bound = metrics.serve_metrics(host, port)
    print(f"{process}: metrics at http://{host}:{bound}/metrics", file=sys.stderr, flush=True)


Json = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
ViewGroup = Annotated[
    str, typer.Option("--group", help="the view processors' group; its snapshots are used")
]
At = Annotated[
    str | None, typer.Option("--at", help="the view as it was at this time (ISO 8601 or epoch ms)")
]
AtOffsets = Annotated[
    str | None,
    typer.Option("--offsets", help='exact log position: {"topic": {"partition": offset}}'),
]
NoSnapshots = Annotated[
    bool, typer.Option("--no-snapshots", help="fold from the start of the log, ignoring snapshots")
]
Since = Annotated[str | None, typer.Option("--from", help="ISO 8601, epoch ms or -<n>s|m|h|d")]
Until = Annotated[str | None, typer.Option("--to", help="ISO 8601, epoch ms or -<n>s|m|h|d")]


Need = Literal["kafka", "s3", "clickhouse"]


def settings(*needs: Need, kind: str | None = OPERATOR) -> Settings:
    """The settings from the environment, once each service the command `needs` has answered
    (a few seconds at most, in the order named): a command fails fast, in one line, when one is
    down. On the host of a secured local broker, a command given no Kafka sign-in signs in as
    its `kind` of process (`serve` the control plane, an agent its own; the operator's reads
    by default; None: as the environment says, for a command that starts the broker)."""
    # A command on the host of a deployment seals and opens objects with its key, as `serve`
    # made it (another host's processes are given FLEETLINE_OBJECT_ENCRYPTION_KEY), and finds
    # its kind's Kafka credentials where `infra start --secure` made them.
    config = Settings.from_env().with_deployment_key(create=False)
    if kind == CONTROL_PLANE:
        # The control plane holds the identity root (made on its first start) and checks
        # every record's writer with it; it writes as the control plane.
        config = config.with_identity_root(create=True)
    if kind is not None:
        config = local_sign_in(config, kind)
    for need in needs:  # in the order given: the one named first is reported first
        if need == "kafka":
            from fleetline.streams.kafka import probe as probe_kafka

            probe_kafka(config.kafka)
        elif need == "s3":
            from fleetline.storage.objects import probe as probe_s3

            probe_s3(config.s3)
        else:
            from fleetline.storage.clickhouse import probe as probe_clickhouse

            probe_clickhouse(config.clickhouse_url)
    return config


def local_sign_in(config: Settings, kind: str) -> Settings:
    """The settings signed in to this host's secured broker as `kind`, when they name no
    sign-in of their own and the broker they point at is the one `infra start --secure` runs
    here (its credentials are in the cache, owner-only, beside the deployment key)."""
    if "sasl.username" in config.kafka.client_overrides:
        return config
    from fleetline.infra import LocalServices

    try:
        secrets = LocalServices.from_settings(config).kafka.secrets
    except ConfigError:  # the settings name brokers this host does not run
        return config
    if secrets is None:
        return config
    return replace(
        config,
        kafka=replace(
            config.kafka,
            client_overrides={**config.kafka.client_overrides, **secrets.client_conf(kind)},
        ),
    )


def analyst_query(config: Settings, sql: str) -> QueryResult:
    """An analyst query (allow-listed, read-only, within the configured limits, macros over
    every tier) on the configured store: its QueryResult."""
    from fleetline.storage.query_service import run_query
    from fleetline.storage.tiering.macros import expander

    return run_query(
        config.clickhouse_url,
        sql,
        expand=expander(config),
        limits=config.query_limits,
        database=config.clickhouse_database,
    )


def audit_read(
    config: Settings,
    prefix: str,
    operation: str,
    target: str,
    details: dict[str, str],
    tenant: str | None = None,
) -> None:
    """Chain a read of stored data done here (a query, an export) before its result is shown:
    who (this host's user), what and how much. When the audit log cannot take it, the command
    fails and shows nothing."""
    import getpass

    from fleetline.processors.audit.runtime import KafkaAuditEmitter, new_event

    emitter = KafkaAuditEmitter(config.kafka, Topics(prefix))
    emitter.emit(
        new_event(
            ts=now_ms(),
            actor=getpass.getuser(),
            actor_role="operator",
            operation=operation,
            target=target,
            outcome="SUCCEEDED",
            source="cli",
            tenant=tenant,
            details=details,
        )
    )
    if emitter.flush(30.0):
        why = f": {emitter.refused[-1]}" if emitter.refused else ""
        raise StorageError(
            f"the audit log ({config.kafka.bootstrap_servers}) did not take the record of this "
            f"read{why}; nothing is shown"
        )


def topics(prefix: str) -> Topics:
    return Topics(prefix)


def now_ms() -> int:
    return int(time.time() * 1000)


def parse_time_ms(text: str) -> int:
    """Epoch milliseconds, an ISO 8601 time (UTC when it names no zone), or -<n>s|m|h|d ago."""
    from fleetline.moments import parse_moment

    return parse_moment(text, now_ms())


def pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    """KEY=VALUE flags as a mapping; ConfigError names the one that is not."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def exit_with(code: int) -> None:
    """End the command with `code` (0: success)."""
    if code:
        raise typer.Exit(code)


def print_json(data: Any, indent: int | None = 2) -> None:
    print(json.dumps(data, indent=indent, sort_keys=True, default=str))


def print_tsv(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A query's result as tab-separated lines (a header, then a line per row)."""
    print("\t".join(columns))
    for row in rows:
        print("\t".join(str(v) for v in row))


def table(*columns: str, title: str | None = None, numeric: Sequence[str] = ()) -> Table:
    """A plain table (no box), numeric columns right-aligned."""
    out = Table(
        *(), title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left"
    )
    for name in columns:
        out.add_column(name, justify="right" if name in numeric else "left", no_wrap=True)
    return out


def fail_fields(source: str, errors_: Iterable[Any]) -> None:
    """Print each bad field of a spec file on stderr and end with exit code 1."""
    for error in errors_:
        print(f"{source}: {error}", file=sys.stderr)
    raise typer.Exit(1)


def ship_logs(config: Settings, topics: Topics, process: str, cluster_id: str = "") -> Any:
    """Ship this process's log lines to the logs topic (LogRecord); the handler, for
    `logs.unship` when the process ends."""
    import logging

    from fleetline.observability import logs
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec

    codec = default_codec()
    producer = kafka_clients.producer(
        config.kafka, {"linger.ms": 200, "logger": logging.getLogger("fleetline.logship")}
    )
    handler = logs.KafkaLogHandler(
        producer,
        lambda record: codec.encode(topics.record_of(topics.logs), record),
        topics.logs,
        process,
        cluster_id,
    )
    return logs.ship(handler)
