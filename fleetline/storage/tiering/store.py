"""The tiers of one data class: hot ClickHouse, warm Parquet on S3, cold daily archives, and
the moves between them (each one copy -> verify -> commit manifest -> switch the union view ->
delete source; see the package's docstring)."""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
from clickhouse_connect.driver.binding import format_query_value
from clickhouse_connect.driver.client import Client

from fleetline.config import S3Settings
from fleetline.errors import (
    ConfigError,
    IntegrityError,
    ObjectMissing,
    QueryError,
    StorageError,
)
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.objects import ObjectStore
from fleetline.storage.queries import with_allocation
from fleetline.storage.tiering.archive import whole_numbers_sql, write_archive
from fleetline.storage.tiering.manifests import read_manifests
from fleetline.storage.tiering.policy import (
    COLD,
    DAY_MS,
    EVERYONE_ELSE,
    GPU_SAMPLES,
    HOUR_MS,
    WARM,
    DataClass,
    Manifest,
    TierStats,
    hour_of,
    partition_start_ms,
    retention_plan,
)

log = logging.getLogger(__name__)
# ClickHouse retries a failing S3 request 500 times by default (with backoff), so a tiering pass
# against an object store that went away hung for many minutes (the chaos suite's S3 outage
# found it); a pass should fail within seconds instead and leave the retry to the next one.
S3_SETTINGS = {"s3_retry_attempts": 5}


class Crash(BaseException):
    """Raised by a step hook in tests to stop a move exactly after a step, like a kill would."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# A bound string: `{b_<sha256 prefix>:String}` stands for the value `_bind` registered.
_PLACEHOLDER = re.compile(r"\{(b_[0-9a-f]{16}):String\}")


@dataclass
class TieredStore:
    """The tiers of one data class in one ClickHouse database and one bucket."""

    client: Client
    database: str
    objects: ObjectStore
    s3: S3Settings
    data: DataClass = GPU_SAMPLES
    root: str = "tiers"
    on_step: Callable[[str, str], None] = lambda step, partition: None
    # The allocations' tiers, which attribute GPU samples to tenants (None: the hot table).
    allocations: TieredStore | None = None
    stats: TierStats = field(default_factory=TierStats)
    _manifests: dict[str, dict[str, Manifest]] | None = field(default=None, repr=False)
    _types: list[tuple[str, str]] | None = field(default=None, repr=False)
    # Values the SQL this store composes refers to by placeholder (`_bind`).
    _bound: dict[str, str] = field(default_factory=dict, repr=False)

    # --- names and keys ------------------------------------------------------------------

    @property
    def hot(self) -> str:
        return f"{self.database}.{self.data.table}"

    @property
    def restored(self) -> str:
        return f"{self.database}.{self.data.table}_restored"

    @property
    def union_view(self) -> str:
        return f"{self.database}.{self.data.table}_all"

    def _key(self, tier: str, partition: str) -> str:
        return f"{self.root}/{self.database}/{self.data.table}/{tier}/{partition}.parquet"

    def _manifest_key(self, tier: str, partition: str) -> str:
        return f"{self.root}/{self.database}/{self.data.table}/manifests/{tier}/{partition}.json"

    def _url(self, key: str) -> str:
        scheme = "https" if self.s3.secure else "http"
        return f"{scheme}://{self.s3.endpoint}/{self.objects.bucket}/{key}"

    def _s3(self, keys: Sequence[str]) -> str:
        """An s3() table function over the keys, with the hot table's exact structure."""
        if not keys:
            raise ConfigError("no objects to read")
        if len(keys) == 1:
            url = self._url(keys[0])
        else:
            # s3() takes {a,b,c} alternatives; the keys share everything up to the file name.
            prefix = keys[0].rsplit("/", 1)[0]
            names = ",".join(k.rsplit("/", 1)[1].removesuffix(".parquet") for k in keys)
            url = self._url(f"{prefix}/{{{names}}}.parquet")
        return (
            f"s3({self._bind(url)}, {self._bind(self.s3.access_key)}, "
            f"{self._bind(self.s3.secret_key)}, 'Parquet', {self._bind(self._structure())})"
        )

    def _bind(self, value: str) -> str:
        """A placeholder for `value` in SQL this store composes: the queries it runs bind it as
        a parameter; SQL that cannot take parameters (a view's definition, SQL handed to
        another caller) gets it quoted by the driver (`inline`)."""
        name = "b_" + hashlib.sha256(value.encode()).hexdigest()[:16]
        self._bound[name] = value
        return "{" + name + ":String}"

    def _parameters(self, sql: str) -> dict[str, str]:
        return {name: self._bound[name] for name in _PLACEHOLDER.findall(sql)}

    def inline(self, sql: str) -> str:
        return _PLACEHOLDER.sub(lambda m: str(format_query_value(self._bound[m[1]])), sql)

    def _column_types(self) -> list[tuple[str, str]]:
        if self._types is None:
            self._types = self._read_column_types()
        return self._types

    def _read_column_types(self) -> list[tuple[str, str]]:
        return [
            (str(n), str(t))
            for n, t in self._query(
                "SELECT name, type FROM system.columns WHERE database = {db:String} AND "
                "table = {t:String} AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') "
                "ORDER BY position",
                {"db": self.database, "t": self.data.table},
            )
        ]

    def _structure(self) -> str:
        return ", ".join(f"{name} {kind}" for name, kind in self._column_types())

    def _columns(self) -> str:
        return ", ".join(name for name, _ in self._column_types())

    # --- plumbing --------------------------------------------------------------------------

    def _query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        try:
            return [
                tuple(row)
                for row in self.client.query(
                    sql,
                    parameters={**self._parameters(sql), **(parameters or {})},
                    settings=S3_SETTINGS,
                ).result_rows
            ]
        except CLICKHOUSE_ERRORS as exc:
            raise QueryError(f"{sql.split()[0]} on {self.data.table}: {exc}") from None

    def _command(self, sql: str) -> None:
        try:
            self.client.command(sql, parameters=self._parameters(sql) or None, settings=S3_SETTINGS)
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"{sql.split()[0]} on {self.data.table}: {exc}") from None

    def _fingerprint(self, source: str, where: str = "1") -> tuple[int, str, int, int]:
        return self._archive_source(source, where, whole_floats=False)[0]

    def _archive_source(
        self, source: str, where: str = "1", whole_floats: bool = True
    ) -> tuple[tuple[int, str, int, int], list[str]]:
        """The rows' fingerprint (count, checksum, min and max time) and, in the same read,
        the float columns whose every value is a whole number (see `archive_layout`)."""
        ts = self.data.ts_column
        floats = (
            [name for name, kind in self._column_types() if "Float" in kind] if whole_floats else []
        )
        counts = "".join(f", countIf(NOT {whole_numbers_sql(name)})" for name in floats)
        ((rows, checksum, low, high, *not_whole),) = self._query(
            f"SELECT count(), toString(sum(cityHash64(tuple({self._columns()})))), "
            f"toUnixTimestamp64Milli(min({ts})), toUnixTimestamp64Milli(max({ts})){counts} "
            f"FROM {source} WHERE {where}"
        )
        whole = [name for name, count in zip(floats, not_whole, strict=True) if count == 0]
        return (int(rows), str(checksum), int(low), int(high)), whole

    def manifests(self, tier: str) -> list[Manifest]:
        """The committed manifests of a tier (listed from the bucket once, then kept current by
        this store's own commits and deletes). A manifest read before is taken from this
        process's cache while its ETag is the same, so a query's store (one a query) lists
        the bucket instead of reading every manifest."""
        if self._manifests is None:
            self._manifests = {WARM: {}, COLD: {}}
            for t in (WARM, COLD):
                prefix = f"{self.root}/{self.database}/{self.data.table}/manifests/{t}/"
                try:
                    listed = self.objects.etags(prefix)
                except ObjectMissing:
                    listed = {}  # no bucket yet: nothing has been tiered
                for m in read_manifests(self.objects, prefix, listed):
                    self._manifests[t][m.partition] = m
        return sorted(self._manifests[tier].values(), key=lambda m: m.partition)

    def _committed(self, tier: str, partition: str) -> Manifest | None:
        self.manifests(tier)
        return self._manifests[tier].get(partition)  # type: ignore[index]

    def _commit(self, manifest: Manifest) -> None:
        self.objects.put(
            self._manifest_key(manifest.tier, manifest.partition),
            manifest.as_json(),
            "application/json",
        )
        self.manifests(manifest.tier)
        self._manifests[manifest.tier][manifest.partition] = manifest  # type: ignore[index]

    def _uncommit(self, tier: str, partition: str) -> None:
        key = self._manifest_key(tier, partition)
        if self.objects.keys(key):
            self.objects.delete(key)
        self.manifests(tier)
        self._manifests[tier].pop(partition, None)  # type: ignore[index]

    def _size(self, key: str) -> int:
        return self.objects.size(key)

    # --- the union view --------------------------------------------------------------------

    def ensure_tables(self) -> None:
        self.ensure_restored()
        self.rebuild_view()

    def ensure_restored(self) -> None:
        """The table `restore` rehydrates cold rows into (the union view reads it)."""
        self._command(f"CREATE TABLE IF NOT EXISTS {self.restored} AS {self.hot}")

    def _time_filter(self, since_ms: int | None, until_ms: int | None) -> str:
        ts = self.data.ts_column
        return (
            " AND ".join(
                [f"{ts} >= fromUnixTimestamp64Milli({since_ms}, 'UTC')"] * (since_ms is not None)
                + [f"{ts} <= fromUnixTimestamp64Milli({until_ms}, 'UTC')"] * (until_ms is not None)
            )
            or "1"
        )

    def hot_sql(self, since_ms: int | None, until_ms: int | None) -> str:
        where = self._time_filter(since_ms, until_ms)
        return f"SELECT {self._columns()} FROM {self.hot} WHERE {where}"

    def source_sql(self, since_ms: int | None = None, until_ms: int | None = None) -> str:
        """SELECT over hot, warm and restored cold rows, each hour from exactly one tier;
        with a time range, only the tiers and objects that overlap it."""
        ts = self.data.ts_column
        cols = self._columns()
        warm = self.manifests(WARM)
        cold = self.manifests(COLD)
        moved = sorted(
            {m.partition[:10] for m in warm}
            | {
                hour_of(h)
                for m in cold
                for h in range(
                    partition_start_ms(m.partition),
                    partition_start_ms(m.partition) + DAY_MS,
                    HOUR_MS,
                )
            }
        )

        def overlaps(m: Manifest) -> bool:
            return (since_ms is None or m.max_ts_ms >= since_ms) and (
                until_ms is None or m.min_ts_ms <= until_ms
            )

        time_filter = self._time_filter(since_ms, until_ms)
        hour_expr = f"formatDateTime({ts}, '%Y%m%d%H', 'UTC')"
        exclude = (
            f" AND {hour_expr} NOT IN ({', '.join(self._bind(p) for p in moved)})" if moved else ""
        )
        branches = [f"SELECT {cols} FROM {self.hot} WHERE {time_filter}{exclude}"]
        # Warm keys a cold archive has replaced are gone or going. Cold archives themselves
        # are not queried in place (unless the data class says so): `restore` rehydrates a
        # range into the _restored table.
        replaced = {k for m in cold for k in m.sources}
        warm_keys = sorted(m.key for m in warm if overlaps(m) and m.key not in replaced)
        if warm_keys:
            branches.append(f"SELECT {cols} FROM {self._s3(warm_keys)} WHERE {time_filter}")
        cold_keys = sorted(m.key for m in cold if overlaps(m))
        if self.data.cold_in_place and cold_keys:
            branches.append(f"SELECT {cols} FROM {self._s3(cold_keys)} WHERE {time_filter}")
        elif not self.data.cold_in_place:
            branches.append(f"SELECT {cols} FROM {self.restored} WHERE {time_filter}")
        return " UNION ALL ".join(branches)

    def rebuild_view(self) -> None:
        # A view's definition keeps no parameters: its values are quoted by the driver.
        self._command(
            f"CREATE OR REPLACE VIEW {self.union_view} AS {self.inline(self.source_sql())}"
        )

    # --- moves -----------------------------------------------------------------------------

    def hot_partitions(self) -> list[tuple[str, int, int]]:
        """(hour, min ts ms, max ts ms) of every hot partition holding rows."""
        ts = self.data.ts_column
        rows = self._query(
            f"SELECT formatDateTime({ts}, '%Y%m%d%H', 'UTC') AS hour, "
            f"toUnixTimestamp64Milli(min({ts})), toUnixTimestamp64Milli(max({ts})) "
            f"FROM {self.hot} GROUP BY hour ORDER BY hour"
        )
        return [(str(h), int(lo), int(hi)) for h, lo, hi in rows]

    def run_once(self, now_ms: int) -> TierStats:
        """One pass: finish interrupted moves, move what policy says is due, expire.

        Each step runs for every due partition before the next step starts (copy, verify and
        commit each hour; then switch the view once; then drop the hot hours), which keeps the
        guarantees of a single move and costs one view rebuild a pass."""
        self.ensure_tables()
        committed: list[str] = []
        for partition, _, _ in self.hot_partitions():
            if partition_start_ms(partition) + HOUR_MS <= now_ms - self.data.hot_ms:
                try:
                    self._copy_to_warm(partition)
                    committed.append(partition)
                except IntegrityError as exc:
                    log.warning("not moving %s: %s", partition, exc)
                    self.stats.refused.append(str(exc))
        if committed:
            self.rebuild_view()
            self.on_step("switched", committed[-1])
            for partition in committed:
                if self._unmoved(partition)[0]:
                    # Rows came in for the hour after it was copied: the next pass moves them
                    # as a late object; dropping now would lose them.
                    continue
                self._drop_hot(partition)
        replaced: list[str] = []
        for day in sorted({m.partition[:8] for m in self.manifests(WARM)}):
            due = partition_start_ms(day) + DAY_MS <= now_ms - self.data.warm_ms
            if due and self._committed(COLD, day) is None:
                replaced.extend(self._copy_to_cold(day))
        for cold in self.manifests(COLD):  # committed in an earlier, interrupted pass
            replaced.extend(
                k
                for k in cold.sources
                if self._committed(WARM, k.rsplit("/", 1)[1].removesuffix(".parquet")) is not None
            )
        if replaced:
            self.rebuild_view()
            self.on_step("switched", replaced[-1].rsplit("/", 1)[1][:8])
            self._delete_warm(sorted(set(replaced)))
        self._apply_retention(now_ms)
        return self.stats

    def _hot_where(self, partition: str) -> str:
        # A range on ts, not a formatted hour, so ClickHouse prunes partitions and granules.
        low = partition_start_ms(partition)
        ts = self.data.ts_column
        return (
            f"{ts} >= fromUnixTimestamp64Milli({low}, 'UTC') AND "
            f"{ts} < fromUnixTimestamp64Milli({low + HOUR_MS}, 'UTC')"
        )

    def _drop_hot(self, partition: str) -> None:
        if not self.data.hourly_partitions:
            # The hour shares its partition with others: delete exactly the rows the hour's
            # warm objects hold (one that came in since they were written stays, and moves
            # as a late object).
            held = " OR ".join(
                f"({self._identity}) IN ({moved})" for moved in self._moved_sets(partition)
            )
            self._command(
                f"ALTER TABLE {self.hot} DELETE WHERE {self._hot_where(partition)} AND "
                f"({held or '0'}) SETTINGS mutations_sync = 1"
            )
            return
        ids = self._query(
            f"SELECT DISTINCT _partition_id FROM {self.hot} WHERE {self._hot_where(partition)}"
        )
        for (partition_id,) in ids:
            # PARTITION ID takes a literal, not a parameter: quoted by the driver.
            self._command(
                f"ALTER TABLE {self.hot} DROP PARTITION ID {format_query_value(str(partition_id))}"
            )

    @property
    def _identity(self) -> str:
        """The columns that tell one row from another, as SQL."""
        return ", ".join(self.data.identity)

    def _warm_of(self, hour: str) -> list[Manifest]:
        return [m for m in self.manifests(WARM) if m.partition[:10] == hour]

    def _moved_sets(self, hour: str) -> list[str]:
        """SELECTs of the identities the hour's copies hold: its warm objects, and its day's
        cold archive once there is one (a sink that read its topic again from the start, its
        hot rows all tiered, stores rows cold already holds)."""
        identity = self._identity
        keys = sorted(m.key for m in self._warm_of(hour))
        selects = [f"SELECT {identity} FROM {self._s3(keys)}"] if keys else []
        cold = self._committed(COLD, hour[:8])
        if cold is not None:
            selects.append(
                f"SELECT {identity} FROM {self._s3([cold.key])} WHERE {self._hot_where(hour)}"
            )
        return selects

    def _unmoved_where(self, hour: str) -> str:
        """The hot rows of an hour that no copy of the hour holds."""
        return " AND ".join(
            [self._hot_where(hour)]
            + [f"({self._identity}) NOT IN ({moved})" for moved in self._moved_sets(hour)]
        )

    def _unmoved(self, hour: str) -> tuple[int, str, int, int]:
        return self._fingerprint(self.hot, self._unmoved_where(hour))

    def _copy_verify_commit(
        self,
        partition: str,
        write: Callable[[], None],
        manifest: Manifest,
        copy: str,
        source: str,
        refusal: str,
    ) -> None:
        """Every move's three steps: write the copy, read it back and compare its rows and
        checksum with the manifest's (taken from the source), then commit the manifest (with
        the copy's size). A copy that differs is never committed: IntegrityError, the source
        kept."""
        write()
        self.on_step("copied", partition)
        rows, checksum = self._fingerprint(self._s3([manifest.key]))[:2]
        if (rows, checksum) != (manifest.rows, manifest.checksum):
            raise IntegrityError(
                f"{copy} holds {rows} rows / {checksum}, {source} {manifest.rows} / "
                f"{manifest.checksum}; {refusal}"
            )
        self.on_step("verified", partition)
        self._commit(replace(manifest, bytes=self._size(manifest.key)))
        self.on_step("committed", partition)

    def _copy_to_warm(self, partition: str) -> None:
        """Copy, verify and commit one hot hour (or find it committed by an earlier pass). Rows
        that came in for an hour after it moved are moved as the hour's next late object."""
        earlier = self._warm_of(partition)
        moved = earlier or self._committed(COLD, partition[:8]) is not None
        name = partition if not moved else f"{partition}-late{len(earlier)}"
        where = self._unmoved_where(partition)
        rows, checksum, low, high = self._fingerprint(self.hot, where)
        if moved and rows == 0:
            # Everything the hot table holds for the hour is in a copy already (a pass stopped
            # after its commit, or a sink stored rows again): only the drop is left.
            self.stats.completed_after_crash += 1
            return
        key = self._key(WARM, name)
        order = ", ".join(self.data.order_by)
        self._copy_verify_commit(
            partition,
            lambda: self._command(
                f"INSERT INTO FUNCTION {self._s3([key])} SELECT {self._columns()} FROM {self.hot} "
                f"WHERE {where} ORDER BY {order} SETTINGS s3_truncate_on_insert = 1, "
                "output_format_parquet_compression_method = 'zstd', "
                # Bloom filters cost ~8 bytes a sample over high-cardinality metric columns;
                # time and key ranges are pruned by the page index, which stays.
                "output_format_parquet_write_bloom_filter = 0"
            ),
            Manifest(self.data.table, WARM, name, key, rows, checksum, low, high, 0),
            f"warm copy {key}",
            "the hot partition",
            "not moving it",
        )
        self.stats.to_warm += 1
        self.stats.rows_moved += rows

    def _copy_to_cold(self, day: str) -> list[str]:
        """Compact, verify and commit one warm day; return the warm keys it replaces."""
        key = self._key(COLD, day)
        sources = [m for m in self.manifests(WARM) if m.partition.startswith(day)]
        keys = sorted(m.key for m in sources)
        expected_rows = sum(m.rows for m in sources)
        (rows, checksum, low, high), whole = self._archive_source(self._s3(keys))
        if rows != expected_rows:
            raise IntegrityError(
                f"warm objects of {day} hold {rows} rows, their manifests say {expected_rows}"
            )
        order = ", ".join(self.data.order_by)
        self._copy_verify_commit(
            day,
            lambda: self._write_archive(
                key,
                [
                    f"SELECT {self._columns()} FROM {self._s3([source])} ORDER BY {order}"
                    for source in keys
                ],
                whole,
            ),
            Manifest(self.data.table, COLD, day, key, rows, checksum, low, high, 0, tuple(keys)),
            f"cold archive {key}",
            "the warm objects",
            "not moving them",
        )
        self.stats.to_cold += 1
        self.stats.rows_moved += rows
        return keys

    def _write_archive(self, key: str, selects: Sequence[str], whole: Sequence[str]) -> None:
        """One cold archive of what `selects` read, one at a time (`write_archive`)."""

        def read(select: str) -> pa.Table:
            try:
                return self.client.query_arrow(
                    select, parameters=self._parameters(select), settings=S3_SETTINGS
                )
            except CLICKHOUSE_ERRORS as exc:
                raise QueryError(f"reading rows for {key}: {exc}") from None

        with tempfile.NamedTemporaryFile(suffix=".parquet") as spool:
            write_archive(spool.name, (read(select) for select in selects), whole)
            self.objects.put_file(key, spool.name)

    def _delete_warm(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._uncommit(WARM, key.rsplit("/", 1)[1].removesuffix(".parquet"))
            if self.objects.keys(key):
                self.objects.delete(key)

    def _apply_retention(self, now_ms: int) -> None:
        cold = self.manifests(COLD)
        replaced = {k for m in cold for k in m.sources if f"/{COLD}/" in k}
        if replaced:  # archives a purge replaced, left by an interrupted pass
            folder = f"{self.root}/{self.database}/{self.data.table}/{COLD}/"
            for key in sorted(replaced & set(self.objects.keys(folder))):
                self.objects.delete(key)
        for m in cold:
            plan = retention_plan(self.data, partition_start_ms(m.partition), now_ms)
            if plan is None:
                self._expire(m)
            elif set(plan) - set(m.purged):
                self._purge(m, tuple(sorted(set(plan) | set(m.purged))))

    def _tenanted(self, source: str) -> str:
        """`source`'s rows with the tenant each belongs to, as `_tenant` ('' for none)."""
        cols = self._columns()
        if self.data.tenant_column is not None:
            return f"(SELECT {cols}, {self.data.tenant_column} AS _tenant FROM {source})"
        # The allocation in force, as the utilisation-by-tenant query finds it, from every
        # tier the allocations are in (their cold archives read in place).
        picked = ", ".join(f"s.{name} AS {name}" for name, _ in self._column_types())
        allocations = (
            f"{self.database}.gpu_allocations"
            if self.allocations is None
            else f"({self.allocations.inline(self.allocations.source_sql())})"
        )
        joined = with_allocation(source, allocations, self.data.ts_column)
        return f"(SELECT {picked}, if(a.kind = 'ALLOCATED', a.tenant, '') AS _tenant FROM {joined})"

    def _purge(self, m: Manifest, purged: tuple[str, ...]) -> None:
        """Rewrite a cold archive without the rows of the tenants retention let go (copy ->
        verify -> commit manifest -> switch -> delete the old archive), or delete it when
        nothing is left."""
        overrides = [tenant for tenant, _ in self.data.tenant_cold_ms]
        if EVERYONE_ELSE in purged:
            kept = [t for t in overrides if t not in purged]
            keep = f"_tenant IN ({', '.join(self._bind(t) for t in kept)})" if kept else "0"
        else:
            keep = f"_tenant NOT IN ({', '.join(self._bind(t) for t in purged)})"
        source = self._tenanted(self._s3([m.key]))
        (rows, checksum, low, high), whole = self._archive_source(source, keep)
        if rows == 0:
            self._expire(m)
            return
        key = self._key(COLD, f"{m.partition}-{_digest(','.join(purged))}")
        ts = self.data.ts_column
        order = ", ".join(self.data.order_by)
        day = partition_start_ms(m.partition)
        self._copy_verify_commit(
            m.partition,
            lambda: self._write_archive(
                key,
                [
                    f"SELECT {self._columns()} FROM {source} WHERE {keep} AND {ts} >= "
                    f"fromUnixTimestamp64Milli({hour}, 'UTC') AND {ts} < "
                    f"fromUnixTimestamp64Milli({hour + HOUR_MS}, 'UTC') ORDER BY {order}"
                    for hour in range(day, day + DAY_MS, HOUR_MS)
                ],
                whole,
            ),
            Manifest(
                self.data.table,
                COLD,
                m.partition,
                key,
                rows,
                checksum,
                low,
                high,
                0,
                (*m.sources, m.key),
                purged,
            ),
            f"purged archive {key}",
            "expected",
            f"keeping {m.key}",
        )
        self.rebuild_view()
        self._forget_restored(m, replace=True)
        self.on_step("switched", m.partition)
        if self.objects.keys(m.key):
            self.objects.delete(m.key)
        self.stats.purged += 1

    def _forget_restored(self, m: Manifest, replace: bool = False) -> None:
        """Rows of `m`'s day rehydrated earlier go with what retention removed: deleted, or
        with `replace`, restored again from the current archive."""
        day = partition_start_ms(m.partition)
        ts = self.data.ts_column
        where = (
            f"{ts} >= fromUnixTimestamp64Milli({day}, 'UTC') AND "
            f"{ts} < fromUnixTimestamp64Milli({day + DAY_MS}, 'UTC')"
        )
        ((held,),) = self._query(f"SELECT count() FROM {self.restored} WHERE {where}")
        if not held:
            return
        if replace:
            self.restore(day, day + DAY_MS - 1)
        else:
            self._command(
                f"ALTER TABLE {self.restored} DELETE WHERE {where} SETTINGS mutations_sync = 1"
            )

    def _expire(self, manifest: Manifest) -> None:
        self._uncommit(COLD, manifest.partition)
        self.rebuild_view()
        self._forget_restored(manifest)
        if self.objects.keys(manifest.key):
            self.objects.delete(manifest.key)
        self.stats.expired += 1

    def unrestored(self, since_ms: int, until_ms: int) -> list[Manifest]:
        """Cold archives overlapping [since, until] that a query of the range cannot read: not
        read in place, and their rows in the range not (all) restored."""
        if self.data.cold_in_place:
            return []
        self.ensure_restored()
        out = []
        for m in self.manifests(COLD):
            if m.max_ts_ms < since_ms or m.min_ts_ms > until_ms:
                continue
            where = self._time_filter(max(since_ms, m.min_ts_ms), min(until_ms, m.max_ts_ms))
            ((held,),) = self._query(f"SELECT count() FROM {self.restored} WHERE {where}")
            if int(held) == 0:
                out.append(m)
        return out

    def restore(self, since_ms: int, until_ms: int) -> int:
        """Rehydrate cold rows in [since, until] into the `_restored` table (replacing what an
        earlier restore put there for the range); return the rows restored."""
        self.ensure_tables()
        cold = [
            m for m in self.manifests(COLD) if m.max_ts_ms >= since_ms and m.min_ts_ms <= until_ms
        ]
        ts = self.data.ts_column
        where = (
            f"{ts} >= fromUnixTimestamp64Milli({since_ms}, 'UTC') AND "
            f"{ts} <= fromUnixTimestamp64Milli({until_ms}, 'UTC')"
        )
        self._command(
            f"ALTER TABLE {self.restored} DELETE WHERE {where} SETTINGS mutations_sync = 1"
        )
        if not cold:
            return 0
        self._command(
            f"INSERT INTO {self.restored} SELECT {self._columns()} FROM "
            f"{self._s3(sorted(m.key for m in cold))} WHERE {where} "
            "SETTINGS max_partitions_per_insert_block = 10000"
        )
        ((rows,),) = self._query(f"SELECT count() FROM {self.restored} WHERE {where}")
        return int(rows)
