"""ClickHouse and the storage tiers: `sql`, `query`, `tier run`, `archive restore`."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from fleetline.cli.common import (
    Since,
    TopicPrefix,
    Until,
    analyst_query,
    audit_read,
    parse_time_ms,
    print_tsv,
    settings,
)
from fleetline.errors import ConfigError, FleetlineError
from fleetline.storage.tiering.policy import (
    DAY_MS,
    HOUR_MS,
    LIFETIMES,
    DataClass,
    check_lifetimes,
)

if TYPE_CHECKING:
    from fleetline.storage.tiering.store import TieredStore


class TierPolicy:
    """The retention flags `serve`, `tier run` and `archive restore` share."""

    HotHours = Annotated[float, typer.Option(help="hours a sample stays in ClickHouse")]
    WarmDays = Annotated[float, typer.Option(help="days it stays in warm Parquet")]
    ColdDays = Annotated[
        float | None, typer.Option(help="delete cold archives older than this (default: keep)")
    ]
    TenantColdDays = Annotated[
        list[str] | None,
        typer.Option(
            metavar="TENANT=DAYS",
            help="keep the GPU samples of a tenant's allocations in cold "
            "for another time than --cold-days (DAYS or `forever`; repeatable): archives are "
            "rewritten without the rows whose time is up",
        ),
    ]

    Keep = Annotated[
        list[str] | None,
        typer.Option(
            metavar="TABLE=HOURS,DAYS[,DAYS]",
            help="another lifetime for a table: hours hot, days warm, days cold (none: keep "
            f"for ever); repeatable; tables: {', '.join(LIFETIMES)} (`fleetline tier list` "
            "shows each one's)",
        ),
    ]


def lifetimes(
    hot_hours: float,
    warm_days: float,
    cold_days: float | None,
    tenant_cold_days: list[str] | None,
    keep: list[str] | None = None,
) -> dict[str, DataClass]:
    """Every table's lifetime: the GPU samples' from their own flags, any table's from
    `--keep`, the rest as `LIFETIMES` has them."""

    def lived(data: DataClass, hot: float, warm: float, cold: float | None) -> DataClass:
        return replace(
            data,
            hot_ms=int(hot * HOUR_MS),
            warm_ms=int(warm * DAY_MS),
            cold_ms=None if cold is None else int(cold * DAY_MS),
        )

    chosen = {
        **LIFETIMES,
        "samples": replace(
            lived(LIFETIMES["samples"], hot_hours, warm_days, cold_days),
            tenant_cold_ms=tenant_retention(tenant_cold_days or [], DAY_MS),
        ),
    }
    for value in keep or []:
        name, sep, spec = value.partition("=")
        parts = spec.split(",")
        try:
            if not sep or name not in LIFETIMES or len(parts) not in (2, 3):
                raise ValueError(value)
            hot, warm = float(parts[0]), float(parts[1])
            cold = float(parts[2]) if len(parts) == 3 and parts[2] else None
            chosen[name] = lived(chosen[name], hot, warm, cold)
        except (ValueError, OverflowError):  # not a number, or inf
            raise ConfigError(
                f"--keep {value!r}: expected TABLE=HOURS,DAYS[,DAYS] with TABLE one of "
                f"{', '.join(LIFETIMES)}"
            ) from None
    check_lifetimes(chosen)
    return chosen


def tenant_retention(values: list[str], day_ms: int) -> tuple[tuple[str, int | None], ...]:
    """`TENANT=DAYS` (or `TENANT=forever`) flags as a DataClass's tenant_cold_ms."""
    out: dict[str, int | None] = {}
    for value in values:
        tenant, sep, days = value.partition("=")
        try:
            keep_ms = None if days == "forever" else int(float(days) * day_ms)
        except (ValueError, OverflowError):  # not a number, or inf
            keep_ms = -1
        if not (sep and tenant) or (keep_ms is not None and keep_ms < 0):
            raise ConfigError(
                f"--tenant-cold-days {value!r}: expected TENANT=DAYS or TENANT=forever"
            )
        out[tenant] = keep_ms
    return tuple(sorted(out.items()))


def sql(
    query: Annotated[str, typer.Argument(help="one read-only query")],
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Run a read-only ClickHouse SQL query on the configured store.

    With the embedded chdb store, a running `fleetline serve` or `fleetline run` owns it and
    answers the query; otherwise it is opened here. $samples stands for GPU samples across
    hot, warm and restored tiers; $samples(-1h) or $samples(FROM, TO) reads only the tiers
    that range needs. Only the store's tables and functions that compute on values are
    allowed (docs/storage.md). Each query is audited (its SHA-256 and the rows returned).
    """

    from fleetline.processors.audit.runtime import data_access

    config = settings("clickhouse", "kafka")
    result = analyst_query(config, query)
    audit_read(config, topic_prefix, "sql.run", "sql", data_access(query, len(result.rows)))
    print_tsv(result.columns, result.rows)


def query(
    name: Annotated[str, typer.Argument(help="a ready query, or `list`")],
    since: Annotated[
        str, typer.Option("--from", help="-<n>h / -<n>d, epoch ms or ISO 8601")
    ] = "-1h",
    until: Until = None,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Run a ready query over all storage tiers (`fleetline query list` names them); audited
    like `fleetline sql`."""
    from fleetline.processors.audit.runtime import data_access
    from fleetline.storage.queries import READY, ready_sql

    if name == "list":
        for ready, (doc, _) in sorted(READY.items()):
            print(f"{ready:<30} {doc}")
        return
    if name not in READY:
        raise ConfigError(f"no ready query {name!r}; `fleetline query list` names them")
    config = settings("clickhouse", "kafka")
    sql = ready_sql(name, since, until)
    result = analyst_query(config, sql)
    audit_read(config, topic_prefix, "sql.ready", name, data_access(sql, len(result.rows)))
    print_tsv(result.columns, result.rows)


def trace(
    trace_id: Annotated[
        str, typer.Argument(help="32 hex digits (printed by apply, returned by the API)")
    ],
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Follow one request across the fleet: where it entered (API or CLI), the scheduler's
    decisions and GPU bindings, the cluster agents' workload events and the log lines of that
    trace, with the time of each hop since the first and since the one before (audited like
    `fleetline sql`)."""
    from fleetline.processors.audit.runtime import data_access
    from fleetline.storage.queries import trace_sql

    config = settings("clickhouse", "kafka")
    sql = trace_sql(trace_id.strip().lower())
    result = analyst_query(config, sql)
    audit_read(config, topic_prefix, "sql.trace", trace_id, data_access(sql, len(result.rows)))
    if not result.rows:
        raise FleetlineError(f"no rows under trace {trace_id} (yet: sinks store within seconds)")
    first = previous = int(result.rows[0][0])
    clusters = sorted({r[2] for r in result.rows if r[2]})
    span_s = (int(result.rows[-1][0]) - first) / 1000
    print(
        f"trace {trace_id}: {len(result.rows)} hops over {span_s:.3f} s"
        + (f" across {', '.join(clusters)}" if clusters else "")
    )
    for ts_ms, hop, cluster_id, what, job, _tenant, detail in result.rows:
        print(
            f"+{(int(ts_ms) - first) / 1000:8.3f}s ({(int(ts_ms) - previous) / 1000:+7.3f}) "
            f"{hop:<14} {cluster_id or '-':<10} {what:<26} {job:<22} {detail}"
        )
        previous = int(ts_ms)


tier = typer.Typer(help="Move closed data hot -> warm -> cold, by policy.", no_args_is_help=True)
archive = typer.Typer(help="Rehydrate a cold range into ClickHouse.", no_args_is_help=True)


def _stores(chosen: dict[str, DataClass]) -> dict[str, TieredStore]:
    from fleetline.storage.clickhouse import connect, migrate
    from fleetline.storage.objects import ObjectStore
    from fleetline.storage.tiering.loop import tiered_stores

    config = settings("s3", "clickhouse")
    client = connect(config.clickhouse_url)
    migrate(client, config.clickhouse_database)
    objects = ObjectStore.from_settings(config.s3)
    objects.ensure_bucket()
    return tiered_stores(client, config.clickhouse_database, objects, config.s3, chosen)


@tier.command(name="run")
def tier_run(
    now: Annotated[
        str | None, typer.Option(help="the moment the policy is applied at (default: the clock)")
    ] = None,
    every: Annotated[float | None, typer.Option(metavar="SECONDS", help="run repeatedly")] = None,
    hot_hours: TierPolicy.HotHours = 24,
    warm_days: TierPolicy.WarmDays = 7,
    cold_days: TierPolicy.ColdDays = None,
    tenant_cold_days: TierPolicy.TenantColdDays = None,
    keep: TierPolicy.Keep = None,
) -> None:
    """One tiering pass over every table (or one every --every seconds), when no other
    process owns the embedded store; one JSON line a table."""
    from fleetline.storage.tiering.loop import wall_clock_ms

    stores = _stores(lifetimes(hot_hours, warm_days, cold_days, tenant_cold_days, keep))
    while True:
        at = parse_time_ms(now) if now else wall_clock_ms()
        for name, store in stores.items():
            stats = store.run_once(at)
            print(
                json.dumps(
                    {
                        "table": name,
                        "to_warm": stats.to_warm,
                        "to_cold": stats.to_cold,
                        "completed_after_crash": stats.completed_after_crash,
                        "expired": stats.expired,
                        "purged": stats.purged,
                        "rows_moved": stats.rows_moved,
                        "refused": stats.refused,
                    }
                )
            )
        if not every:
            return
        time.sleep(every)


@tier.command(name="list")
def tier_list(keep: TierPolicy.Keep = None) -> None:
    """Each table's lifetime (with --keep as `serve` and `tier run` take it): hot hours, warm
    days, cold days."""

    def days(ms: int | None) -> str:
        return "for ever" if ms is None else f"{ms / DAY_MS:g} d"

    rows = [
        [
            name,
            data.table,
            f"{data.hot_ms / HOUR_MS:g} h",
            days(data.warm_ms),
            days(data.cold_ms),
            ", ".join(f"{t}: {days(ms)}" for t, ms in data.tenant_cold_ms) or "-",
        ]
        for name, data in lifetimes(24, 7, None, None, keep).items()
    ]
    print_tsv(["name", "table", "hot", "warm", "cold", "tenants' cold"], rows)


@archive.command(name="restore")
def archive_restore(
    since: Since = None,
    until: Until = None,
    table: Annotated[
        str, typer.Option(help=f"which table's archives: {', '.join(LIFETIMES)}")
    ] = "samples",
) -> None:
    """Rehydrate the cold rows of [--from, --to] into the table's `_restored` table."""
    if not (since and until):
        raise ConfigError("archive restore needs --from and --to")
    if table not in LIFETIMES:
        raise ConfigError(f"--table {table!r}: one of {', '.join(LIFETIMES)}")
    store = _stores(dict(LIFETIMES))[table]
    rows = store.restore(parse_time_ms(since), parse_time_ms(until))
    print(f"{rows} rows restored into {store.restored} (queryable in {store.union_view})")


def register(app: typer.Typer) -> None:
    app.command(name="sql")(sql)
    app.command(name="query")(query)
    app.command(name="trace")(trace)
    app.add_typer(tier, name="tier")
    app.add_typer(archive, name="archive")
