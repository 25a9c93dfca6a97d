"""The query macros over the tiers: `$samples` (and the union view's name) become the tiers a
query's range needs; `$decisions`, `$allocations`, `$workloads`, `$logs`, `$audit` and
`$node_states` the same over their tables' tiers (`LIFETIMES`), `$tickets` and
`$energy_prices` their hot tables, each optionally within a range."""

from __future__ import annotations

import re
from collections.abc import Mapping

from clickhouse_connect.driver.client import Client

from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.moments import parse_moment
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import Expand
from fleetline.storage.tiering.loop import tiered_stores, wall_clock_ms
from fleetline.storage.tiering.policy import LIFETIMES
from fleetline.storage.tiering.store import TieredStore

_MACRO = re.compile(r"\$samples(?:\((?P<args>[^)]*)\))?")
# The record tables: $decisions(FROM, TO) is the decisions in a range, $allocations every
# GPU binding (an ASOF JOIN needs those from before the range too), $workloads the cluster
# agents' workload events, $logs every process's log lines, $audit the audit log (each over
# its tiers where a store of it is given), $node_states every node's reported states,
# $tickets every repair ticket change,
# $energy_prices the clusters' electricity by the hour (hot only).
HOT_TABLES = {
    "decisions": "scheduling_decisions",
    "allocations": "gpu_allocations",
    "workloads": "workload_events",
    "logs": "logs",
    "audit": "audit_log",
    "node_states": "node_states",
    "tickets": "repair_tickets",
    "energy_prices": "energy_prices",
}
_TABLE_MACRO = re.compile(rf"\$(?P<name>{'|'.join(HOT_TABLES)})\b(?:\((?P<args>[^)]*)\))?")


def tiered_sql(
    store: TieredStore,
    sql: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    now_ms: int | None = None,
    hot_only: bool = False,
    tables: Mapping[str, TieredStore] | None = None,
) -> str:
    """`sql` with each `$samples` replaced by the tiers overlapping [since, until] only, so
    a query over the last hour reads the hot table and nothing from S3. A macro may carry
    its own range: `$samples(-1h)`, `$samples(-7d, -1d)`, `$samples(<ISO or ms>, ...)`.
    `hot_only`: the hot table in place of every tier (the same columns and range; what a
    query is checked against before it runs, see storage/query_service.py). `tables`: the
    record tables' tiers by macro name ($decisions ...); one not given is read hot."""
    tables = tables or {}
    if "$samples" not in sql and not _TABLE_MACRO.search(sql):
        raise ConfigError(
            "a tiered query names its source as $samples (or $decisions, $allocations, "
            "$workloads, $logs, $audit, $node_states, $tickets, $energy_prices)"
        )
    if not hot_only:  # the tiers' union reads it; the hot table alone does not
        store.ensure_restored()
    now = wall_clock_ms() if now_ms is None else now_ms

    def expand(match: re.Match[str]) -> str:
        low, high = since_ms, until_ms
        if match["args"] is not None:
            parts = [p.strip() for p in match["args"].split(",")]
            if not 1 <= len(parts) <= 2 or not parts[0]:
                raise ConfigError(f"{match[0]}: give one or two times")
            low = parse_moment(parts[0], now)
            high = parse_moment(parts[1], now) if len(parts) == 2 and parts[1] else None
        return f"({store.hot_sql(low, high) if hot_only else store.source_sql(low, high)})"

    def table(match: re.Match[str]) -> str:
        name = HOT_TABLES[match["name"]]
        parts = [p.strip() for p in (match["args"] or "").split(",")]
        low = parse_moment(parts[0], now) if parts and parts[0] else None
        high = parse_moment(parts[1], now) if len(parts) == 2 and parts[1] else None
        tiers = tables.get(match["name"])
        if tiers is not None:
            if not hot_only:
                tiers.ensure_restored()
            over = tiers.hot_sql(low, high) if hot_only else tiers.source_sql(low, high)
            return f"({tiers.inline(over)})"
        if match["args"] is None:
            return f"{store.database}.{name}"
        where = (
            " AND ".join(
                [
                    *([f"ts_ms >= {low}"] if low is not None else []),
                    *([f"ts_ms < {high}"] if high is not None else []),
                ]
            )
            or "1"
        )
        return f"(SELECT * FROM {store.database}.{name} WHERE {where})"

    # The caller runs this SQL as it is: the values are quoted by the driver.
    return store.inline(_TABLE_MACRO.sub(table, _MACRO.sub(expand, sql)))


def expander(settings: Settings) -> Expand:
    """Macro expansion for queries run on a client of the configured store: `$samples` (and
    the union view `<db>.gpu_samples_all`, which stands for the same) become the tiers the
    query's range needs; SQL without a macro comes back unchanged."""
    objects = ObjectStore.from_settings(settings.s3)
    database = settings.clickhouse_database
    # Each tiered table's union view (`<db>.<table>_all`) stands for its macro.
    union_views = {
        name: re.compile(rf"\b{re.escape(database)}\.{data.table}_all\b")
        for name, data in LIFETIMES.items()
    }

    def expand(client: Client, sql: str, *, hot_only: bool = False) -> str:
        for name, view in union_views.items():
            sql = view.sub(f"${name}", sql)
        if "$samples" not in sql and not _TABLE_MACRO.search(sql):
            return sql
        stores = tiered_stores(client, database, objects, settings.s3)
        return tiered_sql(stores.pop("samples"), sql, hot_only=hot_only, tables=stores)

    return expand
