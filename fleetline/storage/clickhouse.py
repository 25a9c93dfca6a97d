"""ClickHouse access from one URL, and versioned, idempotent schema migrations.

`chdb:///path` opens an embedded ClickHouse engine in this process (the default); chdb allows
one process per data path, so that process owns the store and serves queries for the others
(see `storage/query_service.py`). `http(s)://host:port` reaches a ClickHouse server, which any
number of processes may share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import clickhouse_connect
from chdb import ChdbError
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from fleetline.errors import ConfigError, ServiceUnavailable, StorageError
from fleetline.observability import crashes
from fleetline.probe import refusal

# What a ClickHouse call raises: the client's errors (a server's answer, a connection that
# failed) and the embedded engine's own.
CLICKHOUSE_ERRORS: tuple[type[Exception], ...] = (ClickHouseError, ChdbError)


def probe(url: str, timeout_s: float = 5.0) -> None:
    """Raise ServiceUnavailable unless a ClickHouse server URL accepts a connection within
    `timeout_s`; an embedded (chdb://) store has nothing to reach."""
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"}:
        return
    port = parts.port or (8443 if parts.scheme == "https" else 8123)
    why = refusal(parts.hostname or "", port, timeout_s)
    if why is not None:
        raise ServiceUnavailable(
            f"ClickHouse is not answering at {parts.hostname}:{port} ({why}); point "
            "FLEETLINE_CLICKHOUSE_URL at a running server, or unset it for the embedded store"
        )


def connect(url: str) -> Client:
    parts = urlsplit(url)
    try:
        if parts.scheme == "chdb":
            if not parts.path or parts.path == "/":
                raise ConfigError(f"{url!r}: a chdb URL names a data folder, chdb:///var/lib/x")
            Path(parts.path).mkdir(parents=True, exist_ok=True)
            client = clickhouse_connect.get_client(dsn=f"chdb://{parts.path}")
            crashes.reinstall()  # the engine just put ClickHouse's signal handlers first
            return client
        if parts.scheme in {"http", "https"}:
            return clickhouse_connect.get_client(dsn=url)
    except (*CLICKHOUSE_ERRORS, OSError) as exc:  # type: ignore[misc]
        hint = (
            " (chdb admits one process per data folder: is another fleetline process "
            "holding it without serving queries?)"
            if parts.scheme == "chdb"
            else ""
        )
        raise StorageError(f"cannot open ClickHouse at {url!r}: {exc}{hint}") from None
    raise ConfigError(f"{url!r}: ClickHouse URLs start with chdb://, http:// or https://")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


# Append only: a released migration never changes, a new version follows it.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "gpu samples hot table",
        (
            """
        CREATE TABLE IF NOT EXISTS {db}.gpu_samples (
            ts DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
            cluster_id LowCardinality(String),
            region LowCardinality(String),
            node_id LowCardinality(String),
            gpu_index UInt8,
            gpu_uuid LowCardinality(String),
            vendor LowCardinality(String),
            model LowCardinality(String),
            gpu_util_pct Float32 CODEC(Gorilla, ZSTD(1)),
            mem_copy_util_pct Nullable(Float32) CODEC(Gorilla, ZSTD(1)),
            fb_used_mib UInt32 CODEC(T64, ZSTD(1)),
            fb_total_mib UInt32 CODEC(T64, ZSTD(1)),
            nvlink_tx_bytes_per_s Nullable(Float64) CODEC(Gorilla, ZSTD(1)),
            nvlink_rx_bytes_per_s Nullable(Float64) CODEC(Gorilla, ZSTD(1)),
            nvlink_errors_total Nullable(UInt64) CODEC(T64, ZSTD(1)),
            rdma_packet_loss_ratio Nullable(Float64) CODEC(Gorilla, ZSTD(1)),
            temperature_c Float32 CODEC(Gorilla, ZSTD(1)),
            power_w Float32 CODEC(Gorilla, ZSTD(1)),
            ecc_sbe_total UInt64 CODEC(T64, ZSTD(1)),
            ecc_dbe_total UInt64 CODEC(T64, ZSTD(1)),
            xid_codes Array(UInt16),
            seq UInt64 CODEC(Delta, ZSTD(1)),
            source_partition UInt16,
            source_offset UInt64 CODEC(Delta, ZSTD(1))
        )
        ENGINE = MergeTree
        PARTITION BY toStartOfHour(ts)
        ORDER BY (cluster_id, node_id, gpu_index, ts)
        """,
        ),
    ),
    Migration(
        2,
        "gpu samples: GpuSample v2 fields",
        (
            """
        ALTER TABLE {db}.gpu_samples
            ADD COLUMN IF NOT EXISTS pcie_tx_bytes_per_s Nullable(Float64) CODEC(Gorilla, ZSTD(1)),
            ADD COLUMN IF NOT EXISTS pcie_rx_bytes_per_s Nullable(Float64) CODEC(Gorilla, ZSTD(1)),
            ADD COLUMN IF NOT EXISTS sm_clock_mhz Nullable(UInt16) CODEC(T64, ZSTD(1)),
            ADD COLUMN IF NOT EXISTS mem_clock_mhz Nullable(UInt16) CODEC(T64, ZSTD(1)),
            ADD COLUMN IF NOT EXISTS power_limit_w Nullable(Float32) CODEC(Gorilla, ZSTD(1)),
            ADD COLUMN IF NOT EXISTS nvlink_links_active Nullable(UInt8)
        """,
        ),
    ),
    Migration(
        3,
        "audit log",
        (
            """
        CREATE TABLE IF NOT EXISTS {db}.audit_log (
            partition UInt16,
            seq UInt64,
            source_offset UInt64,
            chained_at_ms Int64,
            kind LowCardinality(String),
            prev_hash String,
            content_digest String,
            hash String,
            event_id String,
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            actor String,
            actor_role LowCardinality(String),
            tenant Nullable(String),
            operation LowCardinality(String),
            target String,
            outcome LowCardinality(String),
            status Int32,
            request_id String,
            trace_id Nullable(String),
            source LowCardinality(String),
            details Map(String, String),
            salt String,
            digest String
        )
        ENGINE = MergeTree
        ORDER BY (partition, seq)
        """,
        ),
    ),
    Migration(
        4,
        "node state history",
        (
            """
        CREATE TABLE IF NOT EXISTS {db}.node_states (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            cluster_id LowCardinality(String),
            region LowCardinality(String),
            node_id LowCardinality(String),
            seq UInt64,
            state LowCardinality(String),
            reason Nullable(String),
            labels Map(String, String),
            gpu_count UInt16,
            leaf_switch LowCardinality(Nullable(String)),
            spine_switch LowCardinality(Nullable(String)),
            agent_version LowCardinality(String),
            agent_spool_bytes Nullable(UInt64),
            agent_spool_dropped Nullable(UInt64),
            source_partition UInt16,
            source_offset UInt64
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (cluster_id, node_id, ts_ms)
        """,
        ),
    ),
    Migration(
        5,
        "scheduling decisions and GPU allocations",
        (
            """
        CREATE TABLE IF NOT EXISTS {db}.scheduling_decisions (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            decision_id String,
            job String,
            tenant LowCardinality(String),
            kind LowCardinality(String),
            outcome LowCardinality(String),
            priority Int8,
            reason String,
            clusters Array(LowCardinality(String)),
            gpus UInt32,
            preempted_by Nullable(String),
            victims Array(String),
            lost_gpu_s Nullable(Float64),
            resume_from_checkpoint_ms Nullable(Int64),
            input_offset Int64,
            view_version Int64,
            policy_digest LowCardinality(String),
            source_partition UInt16,
            source_offset UInt64
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (tenant, job, ts_ms)
        """,
            """
        CREATE TABLE IF NOT EXISTS {db}.gpu_allocations (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            job_id String,
            tenant LowCardinality(String),
            cluster_id LowCardinality(String),
            node_id LowCardinality(String),
            gpu_index UInt8,
            kind LowCardinality(String),
            priority Int8,
            seq UInt64,
            source_partition UInt16,
            source_offset UInt64
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (node_id, gpu_index, ts_ms)
        """,
        ),
    ),
    Migration(
        6,
        "sunk tables name the topic each row came from",
        (
            "ALTER TABLE {db}.node_states ADD COLUMN IF NOT EXISTS source_topic "
            "LowCardinality(String) DEFAULT ''",
            "ALTER TABLE {db}.audit_log ADD COLUMN IF NOT EXISTS source_topic "
            "LowCardinality(String) DEFAULT ''",
            "ALTER TABLE {db}.scheduling_decisions ADD COLUMN IF NOT EXISTS source_topic "
            "LowCardinality(String) DEFAULT ''",
            "ALTER TABLE {db}.gpu_allocations ADD COLUMN IF NOT EXISTS source_topic "
            "LowCardinality(String) DEFAULT ''",
        ),
    ),
    # Rows stored before name no topic and count for any (as in migration 6).
    Migration(
        7,
        "sample rows name the topic they came from",
        (
            "ALTER TABLE {db}.gpu_samples ADD COLUMN IF NOT EXISTS source_topic "
            "LowCardinality(String) DEFAULT ''",
        ),
    ),
    # A sink batch (up to 400,000 rows, ~60-80 MB) is written as one Compact part (one data
    # file instead of two per column: ~15 % less CPU an insert); merged parts past 128 MiB are
    # Wide, which queries reading a few columns prefer.
    Migration(
        8,
        "sample inserts write compact parts",
        ("ALTER TABLE {db}.gpu_samples MODIFY SETTING min_bytes_for_wide_part = 134217728",),
    ),
    # Trace ids (issue 18) come from the messages' `traceparent` headers; '' where there was none.
    Migration(
        9,
        "trace ids beside decisions and allocations; workload events; logs",
        (
            "ALTER TABLE {db}.scheduling_decisions ADD COLUMN IF NOT EXISTS trace_id String "
            "DEFAULT ''",
            "ALTER TABLE {db}.gpu_allocations ADD COLUMN IF NOT EXISTS trace_id String DEFAULT ''",
            """
        CREATE TABLE IF NOT EXISTS {db}.workload_events (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            job String,
            tenant LowCardinality(String),
            cluster_id LowCardinality(String),
            epoch Int64,
            attempt Int32,
            event LowCardinality(String),
            trace_id String,
            pid Nullable(Int32),
            step Nullable(Int64),
            loss Nullable(Float64),
            samples_per_s Nullable(Float64),
            exit_code Nullable(Int32),
            checkpoint_uri Nullable(String),
            bytes Nullable(Int64),
            seconds Nullable(Float64),
            from_cluster Nullable(String),
            detail Nullable(String),
            source_partition UInt16,
            source_offset UInt64,
            source_topic LowCardinality(String)
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (tenant, job, ts_ms)
        """,
            """
        CREATE TABLE IF NOT EXISTS {db}.logs (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            level LowCardinality(String),
            logger LowCardinality(String),
            process LowCardinality(String),
            host LowCardinality(String),
            cluster_id LowCardinality(String),
            message String,
            trace_id String,
            fields Map(String, String),
            source_partition UInt16,
            source_offset UInt64,
            source_topic LowCardinality(String)
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMMDD(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (process, ts_ms)
        """,
        ),
    ),
    Migration(
        10,
        "repair tickets; clusters' electricity by the hour",
        (
            """
        CREATE TABLE IF NOT EXISTS {db}.repair_tickets (
            ts_ms Int64,
            ts DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(ts_ms, 'UTC'),
            ticket_id String,
            node_id LowCardinality(String),
            cluster_id LowCardinality(String),
            rule LowCardinality(String),
            severity LowCardinality(String),
            state LowCardinality(String),
            seq UInt32,
            opened_ms Int64,
            summary String,
            reason String,
            evidence String,
            source_partition UInt16,
            source_offset UInt64,
            source_topic LowCardinality(String)
        )
        ENGINE = MergeTree
        PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(ts_ms, 'UTC'))
        ORDER BY (node_id, ticket_id, seq)
        """,
            """
        CREATE TABLE IF NOT EXISTS {db}.energy_prices (
            ts_ms Int64,
            cluster_id LowCardinality(String),
            hour UInt8,
            price_per_kwh Float64,
            renewable_share Float64,
            pue Float64,
            source_partition UInt16,
            source_offset UInt64,
            source_topic LowCardinality(String)
        )
        ENGINE = MergeTree
        ORDER BY (cluster_id, hour, ts_ms)
        """,
        ),
    ),
)


def migrate(
    client: Client, database: str, migrations: tuple[Migration, ...] = MIGRATIONS
) -> list[int]:
    """Apply the migrations not applied yet, in order; return the versions applied now."""
    if not database.replace("_", "").isalnum():
        raise ConfigError(f"database name {database!r} must be letters, digits and _")
    try:
        client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
        client.command(
            f"CREATE TABLE IF NOT EXISTS {database}.schema_migrations "
            "(version UInt32, name String) ENGINE = MergeTree ORDER BY version"
        )
        done = {
            row[0]
            for row in client.query(f"SELECT version FROM {database}.schema_migrations").result_rows
        }
        applied = []
        for migration in sorted(migrations, key=lambda m: m.version):
            if migration.version in done:
                continue
            for statement in migration.statements:
                client.command(statement.format(db=database))
            client.insert(
                f"{database}.schema_migrations",
                [[migration.version, migration.name]],
                column_names=["version", "name"],
            )
            applied.append(migration.version)
        return applied
    except CLICKHOUSE_ERRORS as exc:
        raise StorageError(f"migrating ClickHouse database {database}: {exc}") from None
