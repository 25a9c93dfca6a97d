"""Tiered storage against chdb and the real S3 server: days of simulated telemetry (event
times in the past) flow hot -> warm -> cold, counts and checksums match a single-table
reference at every step, queries across tiers answer as the reference does, and a crash after
any step of any move loses and duplicates nothing."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.storage.clickhouse import migrate
from fleetline.storage.hot_sink import HotSampleStore, SourcedTelemetry, to_columns
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import query_client
from fleetline.storage.scheduling_sink import AllocationTable
from fleetline.storage.tiering import manifests
from fleetline.storage.tiering.archive import archive_layout
from fleetline.storage.tiering.loop import tiered_stores
from fleetline.storage.tiering.macros import tiered_sql
from fleetline.storage.tiering.policy import (
    COLD,
    DAY_MS,
    GPU_SAMPLES,
    HOUR_MS,
    LIFETIMES,
    WARM,
    DataClass,
    Manifest,
    retention_plan,
)
from fleetline.storage.tiering.store import Crash, TieredStore
from tests.services import service_env
from tests.support import BASE_MS

pytestmark = pytest.mark.services
NOW = (BASE_MS // DAY_MS) * DAY_MS + 12 * HOUR_MS  # midday, so whole days are closed
DAYS = 4
INTERVAL_MS = 30 * 60 * 1000  # one sample per GPU per half hour keeps the days small
# The real policy keeps 7 days warm; two keep the test's moves few while every tier is used.
POLICY = DataClass(GPU_SAMPLES.table, warm_ms=2 * DAY_MS)


def load(clickhouse, database: str) -> int:
    migrate(clickhouse, database)
    sim = FleetSimulator(
        [ClusterSpec("c1", "eu-west", 2), ClusterSpec("c2", "us-east", 1)],
        seed=5,
        interval_ms=INTERVAL_MS,
    )
    start = NOW - DAYS * DAY_MS
    batch = [
        SourcedTelemetry(0, i, record)
        for i, record in enumerate(
            r
            for t in range(DAYS * DAY_MS // INTERVAL_MS)
            for r in sim.telemetry(start + t * INTERVAL_MS)
        )
    ]
    HotSampleStore(clickhouse, database).store(to_columns(batch))
    clickhouse.command(f"CREATE TABLE {database}.reference AS {database}.gpu_samples")
    clickhouse.command(
        f"INSERT INTO {database}.reference SELECT * FROM {database}.gpu_samples "
        "SETTINGS max_partitions_per_insert_block = 1000"
    )
    return len(batch) * 8


def tiers(settings, clickhouse, database: str, **kwargs) -> TieredStore:
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    kwargs.setdefault("data", POLICY)
    return TieredStore(
        clickhouse, database, objects, settings.s3, root=f"tiers-{database}", **kwargs
    )


def fingerprint(store: TieredStore, source: str, where: str = "1") -> tuple[int, str]:
    return store._fingerprint(source, where)[:2]


UTILISATION = (
    "SELECT cluster_id, toStartOfHour(ts) AS hour, round(avg(gpu_util_pct), 4), "
    "count() FROM {src} GROUP BY cluster_id, hour ORDER BY cluster_id, hour"
)


def test_cold_archives_store_whole_floats_as_integers_and_pick_encodings_by_trial():
    import random

    rng = random.Random(3)
    n = 100_000
    table = pa.table(
        {
            "rate": pa.array([rng.randrange(10**6, 10**8) * 1024.0 for _ in range(n)]),  # KiB
            "util": pa.array([float(rng.randrange(101)) for _ in range(n)], pa.float32()),
            "power": pa.array([rng.randrange(9000) / 10 for _ in range(n)], pa.float32()),
            "offset": pa.array(range(n), pa.uint64()),
            "gpu_index": pa.array([i % 8 for i in range(n)], pa.uint8()),
            "node_id": pa.array([f"n{i % 50}" for i in range(n)]),
        }
    )
    schema, options = archive_layout(table, integral=["rate", "util"])
    assert [f.type for f in schema] == [
        pa.int64(),
        pa.int64(),
        pa.float32(),
        pa.uint64(),
        pa.uint8(),
        pa.string(),
    ]
    assert options["column_encoding"]["offset"] == "DELTA_BINARY_PACKED"

    def size(**writer) -> int:
        out = pa.BufferOutputStream()
        pq.write_table(
            table.cast(writer.pop("schema", table.schema)),
            out,
            compression="zstd",
            compression_level=19,
            **writer,
        )
        return out.getvalue().size

    chosen = size(schema=schema, **options)
    assert chosen < size()  # pyarrow's defaults: dictionary everywhere
    assert chosen < size(use_dictionary=False)
    assert chosen < size(**archive_layout(table)[1])  # the same encodings, floats kept


def test_days_of_telemetry_flow_hot_warm_cold_and_cross_tier_queries_match(settings, clickhouse):
    db = settings.clickhouse_database
    rows = load(clickhouse, db)
    store = tiers(settings, clickhouse, db)
    store.run_once(NOW)
    hot_hours = {p for p, _, _ in store.hot_partitions()}
    assert len(hot_hours) <= 25 and rows > 0
    warm, cold = store.manifests(WARM), store.manifests(COLD)
    # Whole-number readings (utilisation, temperature, throughput in KiB) are archived as
    # integers; the copy's verification read them back as the table's floats, bit for bit.
    archived = pq.read_schema(pa.BufferReader(store.objects.get(cold[0].key)))
    assert archived.field("gpu_util_pct").type == pa.int64()
    assert archived.field("nvlink_tx_bytes_per_s").type == pa.int64()
    assert archived.field("power_w").type == pa.float32()
    # 24 h hot; then two days warm (by the hour); older whole days cold, one archive a day.
    # The oldest day starts at midday (the data does), so its archive replaces 12 hours.
    assert sorted(len(m.sources) for m in cold) == [12, 24]
    assert {m.partition[:8] for m in warm}.isdisjoint({m.partition for m in cold})
    assert (
        sum(m.rows for m in warm) + sum(m.rows for m in cold) + fingerprint(store, store.hot)[0]
        == rows
    )
    # Everything not in cold answers through the union view exactly as the reference does.
    cold_until = max(m.max_ts_ms for m in cold)
    recent = f"ts > fromUnixTimestamp64Milli({cold_until}, 'UTC')"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", recent)
    query = UTILISATION.format(src=f"(SELECT * FROM {{t}} WHERE {recent})")
    assert (
        clickhouse.query(query.format(t=store.union_view)).result_rows
        == clickhouse.query(query.format(t=f"{db}.reference")).result_rows
    )
    # A query over the last hour reads only the hot table.
    last_hour = tiered_sql(store, "SELECT count() FROM $samples", NOW - HOUR_MS, NOW)
    assert "s3(" not in last_hour and f"{db}.gpu_samples" in last_hour
    over_week = tiered_sql(store, "SELECT count() FROM $samples", NOW - 5 * DAY_MS, NOW)
    assert "s3(" in over_week
    # Restoring the cold range makes the union whole again.
    restored = store.restore(NOW - DAYS * DAY_MS, cold_until)
    assert (
        restored
        == fingerprint(
            store, f"{db}.reference", f"ts <= fromUnixTimestamp64Milli({cold_until}, 'UTC')"
        )[0]
    )
    store.restore(NOW - DAYS * DAY_MS, cold_until)  # again: replaces, does not add
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference")
    assert (
        clickhouse.query(UTILISATION.format(src=store.union_view)).result_rows
        == clickhouse.query(UTILISATION.format(src=f"{db}.reference")).result_rows
    )
    # The ready queries run across the tiers; one is checked against the reference.
    from fleetline.storage.queries import READY

    span = f"$samples({NOW - 3 * DAY_MS}, {NOW})"
    for _, sql in READY.values():
        clickhouse.query(tiered_sql(store, sql.replace("$samples", span)))
    by_cluster = READY["utilisation-by-cluster"][1]
    window = (
        f"(SELECT * FROM {db}.reference WHERE ts >= fromUnixTimestamp64Milli("
        f"{NOW - 3 * DAY_MS}, 'UTC') AND ts <= fromUnixTimestamp64Milli({NOW}, 'UTC'))"
    )
    assert (
        clickhouse.query(tiered_sql(store, by_cluster.replace("$samples", span))).result_rows
        == clickhouse.query(by_cluster.replace("$samples", window)).result_rows
    )
    # A second pass has nothing to do.
    before = (len(store.manifests(WARM)), len(store.manifests(COLD)))
    store.run_once(NOW)
    assert (len(store.manifests(WARM)), len(store.manifests(COLD))) == before


class ManifestGoneAfterListing(ObjectStore):
    """Another pass uncommitting a manifest between this store's first listing and its read."""

    gone: str | None = None

    def etags(self, prefix: str = "") -> dict[str, str]:
        listed = super().etags(prefix)
        manifests = sorted(k for k in listed if "/manifests/" in k)
        if manifests and self.gone is None:
            self.gone = manifests[0]
            self.delete(self.gone)
        return listed


def test_a_query_goes_on_when_a_tiering_pass_moves_what_it_was_planned_over(
    settings, clickhouse, monkeypatch
):
    db = settings.clickhouse_database
    load(clickhouse, db)
    tiers(settings, clickhouse, db).run_once(NOW)
    sql = "SELECT count(), sum(gpu_util_pct) FROM $samples"
    planned: list[str] = []

    def expand(client, query: str, *, hot_only: bool = False) -> str:
        return tiered_sql(tiers(settings, client, db), query, hot_only=hot_only)

    def expand_then_tier(client, query: str, *, hot_only: bool = False) -> str:
        expanded = expand(client, query, hot_only=hot_only)
        if not hot_only:
            if not planned:
                # The next day's pass lands between planning the query and running it: a warm
                # day is compacted into a cold archive and its warm objects are deleted.
                tiers(settings, clickhouse, db).run_once(NOW + DAY_MS)
            planned.append(expanded)
        return expanded

    answer = query_client(clickhouse, sql, expand_then_tier, database=db)
    assert len(planned) == 2 and planned[0] != planned[1]
    assert "s3(" in planned[1]  # the answer still read the warm tier
    assert answer == query_client(clickhouse, sql, expand, database=db)
    # A manifest another pass uncommits between the listing and the read is no longer there
    # (read for the first time: one this process read before is taken as listed, and a query
    # planned over it is planned again when its object is gone, as above).
    before = tiers(settings, clickhouse, db)
    committed = {m.key for tier in (WARM, COLD) for m in before.manifests(tier)}
    monkeypatch.setattr(manifests, "_READ", {})
    objects = ObjectStore.from_settings(settings.s3)
    racing_objects = ManifestGoneAfterListing(objects.client, objects.bucket)
    racing = TieredStore(
        clickhouse, db, racing_objects, settings.s3, root=f"tiers-{db}", data=POLICY
    )
    seen = {m.key for tier in (WARM, COLD) for m in racing.manifests(tier)}
    assert racing_objects.gone is not None
    assert len(seen) == len(committed) - 1 and seen < committed


@pytest.mark.parametrize("tier", [WARM, COLD])
@pytest.mark.parametrize("step", ["copied", "verified", "committed", "switched"])
def test_a_crash_after_any_step_loses_and_duplicates_nothing(settings, clickhouse, tier, step):
    db = settings.clickhouse_database
    load(clickhouse, db)
    crashed = {"done": False}

    def crash(at: str, partition: str) -> None:
        is_cold = len(partition) == 8
        if at == step and (is_cold == (tier == COLD)) and not crashed["done"]:
            crashed["done"] = True
            raise Crash(f"killed after {at} of {partition}")

    with pytest.raises(Crash):
        tiers(settings, clickhouse, db, on_step=crash).run_once(NOW)
    # Whatever the crash left, nothing is counted twice or missing right now ...
    store = tiers(settings, clickhouse, db)
    store.rebuild_view()
    cold = store.manifests(COLD)
    cold_until = max((m.max_ts_ms for m in cold), default=0)
    recent = f"ts > fromUnixTimestamp64Milli({cold_until}, 'UTC')"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", recent)
    # ... and the next run completes the move.
    store.run_once(NOW)
    assert store.stats.refused == []
    cold = store.manifests(COLD)
    assert len(cold) == 2
    store.restore(NOW - DAYS * DAY_MS, NOW)
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference")
    # No orphans: every object in the tier folders has its manifest.
    keys = store.objects.keys(f"{store.root}/{db}/gpu_samples/")
    data = {k for k in keys if k.endswith(".parquet")}
    named = {m.key for m in store.manifests(WARM)} | {m.key for m in cold}
    assert data == named


def test_cold_retention_deletes_only_what_policy_allows(settings, clickhouse):
    db = settings.clickhouse_database
    load(clickhouse, db)
    policy = DataClass(GPU_SAMPLES.table, warm_ms=2 * DAY_MS, cold_ms=3 * DAY_MS + 12 * HOUR_MS)
    store = tiers(settings, clickhouse, db, data=policy)
    store.run_once(NOW)
    cold = sorted(m.partition for m in store.manifests(COLD))
    assert len(cold) == 1 and store.stats.expired == 1  # the oldest day only
    assert GPU_SAMPLES.cold_ms is None  # by default cold archives are kept for ever


def test_a_retention_plan_names_what_policy_lets_go():
    day = NOW - 10 * DAY_MS
    policy = DataClass(
        "t", cold_ms=5 * DAY_MS, tenant_cold_ms=(("acme", 2 * DAY_MS), ("keep", None))
    )
    assert retention_plan(policy, day, day + 3 * DAY_MS) == ("acme",)
    assert retention_plan(policy, day, day + 3 * DAY_MS - 1) == ()
    assert retention_plan(policy, day, day + 6 * DAY_MS) == ("*", "acme")  # "keep" stays
    assert retention_plan(DataClass("t", cold_ms=DAY_MS), day, day + 2 * DAY_MS) is None
    assert retention_plan(DataClass("t"), day, day + 99 * DAY_MS) == ()


def allocate(clickhouse, db: str, rows: list[tuple[int, str, str, int, str]]) -> None:
    """Allocation records as the scheduler sink stores them: (ts, tenant, node, gpu, kind)."""
    clickhouse.insert(
        f"{db}.gpu_allocations",
        [
            [ts, f"job-{tenant}", tenant, "c1", node, gpu, kind, 0, i, 0, i, "allocations", ""]
            for i, (ts, tenant, node, gpu, kind) in enumerate(rows)
        ],
        column_names=list(AllocationTable.columns),
    )


def tenant_fixture(clickhouse, db: str) -> dict[str, str]:
    """acme holds four GPUs of one node from before the data on; beta a whole node for four
    hours of the oldest day. Returns SQL conditions that pick each tenant's samples."""
    load(clickhouse, db)
    nodes = [
        n
        for (n,) in clickhouse.query(
            f"SELECT DISTINCT node_id FROM {db}.reference ORDER BY node_id"
        ).result_rows
    ]
    start = NOW - DAYS * DAY_MS
    beta_from, beta_to = start + 2 * HOUR_MS, start + 6 * HOUR_MS
    allocate(
        clickhouse,
        db,
        [(start - HOUR_MS, "acme", nodes[0], g, "ALLOCATED") for g in range(4)]
        + [(beta_from, "beta", nodes[1], g, "ALLOCATED") for g in range(8)]
        + [(beta_to, "beta", nodes[1], g, "RELEASED") for g in range(8)],
    )
    oldest_day_end = start + 12 * HOUR_MS  # the data starts at midday
    return {
        "acme": f"node_id = '{nodes[0]}' AND gpu_index < 4",
        "beta": (
            f"node_id = '{nodes[1]}' AND ts >= fromUnixTimestamp64Milli({beta_from}, "
            f"'UTC') AND ts < fromUnixTimestamp64Milli({beta_to}, 'UTC')"
        ),
        "oldest": f"ts < fromUnixTimestamp64Milli({oldest_day_end}, 'UTC')",
    }


def no_orphans(store: TieredStore, db: str) -> None:
    keys = store.objects.keys(f"{store.root}/{db}/gpu_samples/")
    assert {k for k in keys if k.endswith(".parquet")} == {m.key for m in store.manifests(WARM)} | {
        m.key for m in store.manifests(COLD)
    }


def test_tenant_retention_rewrites_cold_archives_without_the_rows_whose_time_is_up(
    settings, clickhouse
):
    db = settings.clickhouse_database
    pick = tenant_fixture(clickhouse, db)
    # acme's samples are kept three days in cold, everyone else's for ever: only the oldest
    # day (ended 3.5 days ago) loses acme's rows.
    policy = DataClass(
        GPU_SAMPLES.table, warm_ms=2 * DAY_MS, tenant_cold_ms=(("acme", 3 * DAY_MS),)
    )
    store = tiers(settings, clickhouse, db, data=policy)
    store.run_once(NOW)
    oldest, second = store.manifests(COLD)
    assert (oldest.purged, second.purged, store.stats.purged) == (("acme",), (), 1)
    store.restore(NOW - DAYS * DAY_MS, NOW)
    expected = f"NOT ({pick['oldest']} AND {pick['acme']})"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", expected)
    no_orphans(store, db)
    store.run_once(NOW)  # nothing more is due
    assert store.stats.purged == 1 and store.manifests(COLD)[0] == oldest

    # Then everyone's samples go after three days but beta's are kept for ever: the oldest
    # day keeps beta's four hours only, and what was restored of it goes too.
    policy = DataClass(
        GPU_SAMPLES.table,
        warm_ms=2 * DAY_MS,
        cold_ms=3 * DAY_MS,
        tenant_cold_ms=(("acme", 3 * DAY_MS), ("beta", None)),
    )
    store = tiers(settings, clickhouse, db, data=policy)
    store.run_once(NOW)
    assert store.manifests(COLD)[0].purged == ("*", "acme")
    expected = f"NOT ({pick['oldest']} AND NOT ({pick['beta']}))"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", expected)
    no_orphans(store, db)


@pytest.mark.parametrize("step", ["copied", "committed", "switched"])
def test_a_crash_in_a_retention_rewrite_loses_and_keeps_nothing_wrongly(settings, clickhouse, step):
    db = settings.clickhouse_database
    pick = tenant_fixture(clickhouse, db)
    tiers(settings, clickhouse, db).run_once(NOW)  # the moves, before any tenant policy
    policy = DataClass(
        GPU_SAMPLES.table, warm_ms=2 * DAY_MS, tenant_cold_ms=(("acme", 3 * DAY_MS),)
    )

    def crash(at: str, partition: str) -> None:
        if at == step:
            raise Crash(f"killed after {at} of {partition}")

    with pytest.raises(Crash):
        tiers(settings, clickhouse, db, data=policy, on_step=crash).run_once(NOW)
    store = tiers(settings, clickhouse, db, data=policy)
    store.run_once(NOW)
    assert store.manifests(COLD)[0].purged == ("acme",)
    store.restore(NOW - DAYS * DAY_MS, NOW)
    expected = f"NOT ({pick['oldest']} AND {pick['acme']})"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", expected)
    no_orphans(store, db)


def test_rows_arriving_for_an_hour_already_in_warm_follow_it_as_a_late_object(settings, clickhouse):
    db = settings.clickhouse_database
    load(clickhouse, db)
    store = tiers(settings, clickhouse, db)
    store.run_once(NOW)
    hour = store.manifests(WARM)[-1].partition  # in the newest warm day: not due for cold
    # An agent back from an outage delivers samples of that hour (new Kafka offsets).
    late = (
        f"SELECT * REPLACE (source_offset + 10000000 AS source_offset) FROM {db}.reference "
        f"WHERE formatDateTime(ts, '%Y%m%d%H', 'UTC') = '{hour}' ORDER BY "
        "source_offset, gpu_index LIMIT 16"
    )
    rows = clickhouse.query(late).result_rows
    columns = [c for c, _ in store._column_types()]
    for table in ("gpu_samples", "reference"):
        clickhouse.insert(f"{db}.{table}", rows, column_names=columns)
    # Until the pass moves them they wait in hot (the union view reads the hour from warm).
    store.run_once(NOW)
    assert f"{hour}-late1" in {m.partition for m in store.manifests(WARM)}
    assert hour not in {p for p, _, _ in store.hot_partitions()}
    cold_until = max(m.max_ts_ms for m in store.manifests(COLD))
    recent = f"ts > fromUnixTimestamp64Milli({cold_until}, 'UTC')"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", recent)
    # When the day goes cold the late object goes with its hour, and nothing is lost.
    store.run_once(NOW + 3 * DAY_MS)
    (archive,) = [m for m in store.manifests(COLD) if m.partition == hour[:8]]
    assert any(k.endswith(f"{hour}-late1.parquet") for k in archive.sources)
    store.restore(NOW - DAYS * DAY_MS, NOW + DAY_MS)
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference")
    assert store.stats.refused == []


@pytest.mark.parametrize(("step", "tier"), [("copied", WARM), ("committed", COLD)])
def test_a_sigkilled_tiering_process_loses_and_duplicates_nothing(settings, tmp_path, step, tier):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    env = {
        **os.environ,
        "FLEETLINE_S3_ENDPOINT": settings.s3.endpoint,
        "FLEETLINE_S3_BUCKET": settings.s3.bucket,
    }
    path, db = str(tmp_path / "chdb"), settings.clickhouse_database

    def child(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tests.integration.tier_child", *args],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    killed = child("crash", path, db, step, tier)
    assert killed.returncode == -9, killed.stdout + killed.stderr  # died by SIGKILL
    check = child("check", path, db)
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout.strip().splitlines()[-1])
    # Right after the kill the union view holds every row once; the next pass completes it.
    assert report["before"][0] == report["before"][1]
    assert report["after"][0] == report["after"][1]
    assert report["orphans"] == [] and report["refused"] == []


def test_a_store_reads_a_manifest_again_only_when_it_was_written_again(
    settings, clickhouse, monkeypatch
):
    db = settings.clickhouse_database
    first = tiers(settings, clickhouse, db)
    manifest = Manifest(GPU_SAMPLES.table, COLD, "20261201", "k.parquet", 5, "9", 0, 1, 10)
    first._commit(manifest)
    reads: list[str] = []
    original = ObjectStore.get

    def counted(self, key: str) -> bytes:
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(ObjectStore, "get", counted)
    assert tiers(settings, clickhouse, db).manifests(COLD) == [manifest]
    assert tiers(settings, clickhouse, db).manifests(COLD) == [manifest]
    # The committing store read it once at its commit; the later ones list the bucket only.
    assert reads == []
    purged = replace(manifest, rows=3, purged=("acme",))
    first._commit(purged)  # a retention rewrite: same key, new content
    assert tiers(settings, clickhouse, db).manifests(COLD) == [purged]
    assert len(reads) == 1  # read again once, for its new ETag
    first._uncommit(COLD, manifest.partition)
    assert tiers(settings, clickhouse, db).manifests(COLD) == []


def decide(clickhouse, db: str, times: list[int], first_offset: int = 0) -> None:
    """Decision rows as the decisions sink stores them (the columns tiering reads)."""
    clickhouse.insert(
        f"{db}.scheduling_decisions",
        [
            [
                *(ts, f"d{first_offset + i}", f"job{i % 5}", "acme", "TrainingJob", "PLACED"),
                *("fits", 0, first_offset + i, "decisions"),
            ]
            for i, ts in enumerate(times)
        ],
        column_names=[
            "ts_ms",
            "decision_id",
            "job",
            "tenant",
            "kind",
            "outcome",
            "reason",
            "source_partition",
            "source_offset",
            "source_topic",
        ],
    )


def test_a_record_table_tiers_by_the_hour_within_its_month_and_queries_read_every_tier(
    settings, clickhouse
):
    db = settings.clickhouse_database
    migrate(clickhouse, db)
    # A decision every 20 minutes over four days; the table is partitioned by the month.
    start = NOW - DAYS * DAY_MS
    times = list(range(start, NOW, 20 * 60 * 1000))
    decide(clickhouse, db, times)
    policy = replace(LIFETIMES["decisions"], hot_ms=DAY_MS, warm_ms=2 * DAY_MS)
    store = tiers(settings, clickhouse, db, data=policy)
    hot = f"{db}.scheduling_decisions"

    def count(sql: str) -> int:
        return int(clickhouse.query(sql).result_rows[0][0])

    store.run_once(NOW)
    # What the hot day holds stays; every closed hour before it moved and left the month's
    # partition, the rest of which is still there.
    kept = sum(t >= NOW - DAY_MS for t in times)
    assert count(f"SELECT count() FROM {hot}") == kept
    assert count(f"SELECT min(ts_ms) FROM {hot}") >= NOW - DAY_MS
    warm, cold = store.manifests(WARM), store.manifests(COLD)
    assert warm and cold and store.stats.refused == []
    in_cold = sum(m.rows for m in cold)
    assert kept + sum(m.rows for m in warm) + in_cold == len(times)
    # $decisions reads hot and warm, and cold once restored; the union view the same.
    everything = "SELECT count(), uniqExact(decision_id) FROM $decisions"
    samples = tiers(settings, clickhouse, db)
    tables = {"decisions": store}
    assert clickhouse.query(tiered_sql(samples, everything, tables=tables)).result_rows[0] == (
        len(times) - in_cold,
        len(times) - in_cold,
    )
    assert store.restore(start, NOW) == in_cold
    assert clickhouse.query(tiered_sql(samples, everything, tables=tables)).result_rows[0] == (
        len(times),
        len(times),
    )
    assert count(f"SELECT count() FROM {store.union_view}") == len(times)
    last_day = tiered_sql(samples, f"SELECT count() FROM $decisions({NOW - DAY_MS})", tables=tables)
    assert count(last_day) == kept
    # A decision stored late for an hour already in warm follows it as a late object; only it
    # leaves the hot table.
    moved_hour = warm[-1].min_ts_ms
    decide(clickhouse, db, [moved_hour + 1], first_offset=len(times))
    store.run_once(NOW)
    assert count(f"SELECT count() FROM {hot}") == kept
    assert any(m.partition.endswith("-late1") for m in store.manifests(WARM))
    assert count(f"SELECT count() FROM {store.union_view}") == len(times) + 1
    # A sink that read its topic again from the start stores rows every tier already holds,
    # a cold day's among them: they leave the hot table and nothing is copied twice.
    objects_before = sorted(m.key for m in store.manifests(WARM) + store.manifests(COLD))
    decide(clickhouse, db, times[:30])
    store.run_once(NOW)
    assert count(f"SELECT count() FROM {hot}") == kept
    assert sorted(m.key for m in store.manifests(WARM) + store.manifests(COLD)) == objects_before
    assert count(f"SELECT count() FROM {store.union_view}") == len(times) + 1


def test_samples_are_attributed_to_tenants_through_allocations_already_in_cold(
    settings, clickhouse
):
    db = settings.clickhouse_database
    pick = tenant_fixture(clickhouse, db)
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    chosen = {
        "samples": replace(POLICY, tenant_cold_ms=(("acme", 3 * DAY_MS),)),
        # Every allocation record goes cold at once.
        "allocations": replace(LIFETIMES["allocations"], hot_ms=HOUR_MS, warm_ms=0),
    }
    stores = tiered_stores(clickhouse, db, objects, settings.s3, chosen, root=f"tiers-{db}")
    stores["allocations"].run_once(NOW)
    assert clickhouse.query(f"SELECT count() FROM {db}.gpu_allocations").result_rows[0][0] == 0
    assert stores["allocations"].manifests(COLD)
    stores["samples"].run_once(NOW)
    store = stores["samples"]
    assert (store.manifests(COLD)[0].purged, store.stats.purged) == (("acme",), 1)
    store.restore(NOW - DAYS * DAY_MS, NOW)
    expected = f"NOT ({pick['oldest']} AND {pick['acme']})"
    assert fingerprint(store, store.union_view) == fingerprint(store, f"{db}.reference", expected)


class _Stop(Exception):
    """Raised where a command would start its work: the flags are parsed by then."""


def test_the_tier_policy_flags_of_tier_run_and_serve(settings, monkeypatch, capsys):
    from fleetline import app as composition
    from fleetline.cli import data, main

    for name, value in service_env(settings).items():  # `serve` checks they answer
        monkeypatch.setenv(name, value)

    seen: list[dict[str, DataClass]] = []

    def stores(chosen: dict[str, DataClass]) -> None:
        seen.append(chosen)
        raise _Stop

    def build(settings, options) -> None:
        seen.append(options.lifetimes)
        raise _Stop

    monkeypatch.setattr(data, "_stores", stores)
    monkeypatch.setattr(composition, "build", build)
    flags = [
        "--cold-days",
        "30",
        "--tenant-cold-days",
        "acme=2.5",
        "--tenant-cold-days",
        "keep=forever",
        "--keep",
        "decisions=48,10,400",
        "--keep",
        "logs=6,2",
    ]
    for command in (["tier", "run"], ["serve", "--no-api"]):
        with pytest.raises(_Stop):
            main([*command, *flags])
    assert len(seen) == 2
    for chosen in seen:
        assert set(chosen) == set(LIFETIMES)
        samples, decisions, logs = chosen["samples"], chosen["decisions"], chosen["logs"]
        assert samples.cold_ms == 30 * DAY_MS
        assert samples.tenant_cold_ms == (("acme", int(2.5 * DAY_MS)), ("keep", None))
        assert (decisions.hot_ms, decisions.warm_ms, decisions.cold_ms) == (
            48 * HOUR_MS,
            10 * DAY_MS,
            400 * DAY_MS,
        )
        assert (logs.hot_ms, logs.warm_ms, logs.cold_ms) == (6 * HOUR_MS, 2 * DAY_MS, None)
        assert chosen["audit"] == LIFETIMES["audit"]
    for bad in ("acme", "=3", "acme=soon", "acme=-1", "acme=inf"):
        assert main(["tier", "run", "--tenant-cold-days", bad]) == 1
        assert "TENANT=DAYS" in capsys.readouterr().err
    for bad in ("decisions", "nope=1,2", "logs=1", "logs=a,b", "logs=1,2,3,4", "logs=1,inf"):
        assert main(["tier", "run", "--keep", bad]) == 1
        assert "TABLE=HOURS,DAYS[,DAYS]" in capsys.readouterr().err
    # Samples kept apart by tenant for ever need the allocations for ever too.
    assert (
        main(["tier", "run", "--tenant-cold-days", "acme=forever", "--keep", "allocations=1,1,9"])
        == 1
    )
    assert "allocations: their cold archives must be kept" in capsys.readouterr().err
    assert main(["tier", "list", "--keep", "logs=6,2"]) == 0
    listed = capsys.readouterr().out
    assert "logs\tlogs\t6 h\t2 d\tfor ever" in listed
    assert "audit\taudit_log\t2160 h\t365 d\tfor ever" in listed
