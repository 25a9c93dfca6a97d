"""ClickHouse (chdb) schema and hot sink, and the S3 server through the minio client."""

from __future__ import annotations

import pytest

from fleetline.app import sample_sink
from fleetline.errors import ConfigError, StorageError
from fleetline.storage.clickhouse import MIGRATIONS, connect, migrate
from fleetline.storage.hot_sink import (
    HotSampleSink,
    HotSampleStore,
    SampleSinkStats,
    SourcedTelemetry,
    to_columns,
)
from fleetline.storage.objects import ObjectStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.loop import StreamLoop
from fleetline.streams.serde import default_codec
from tests.support import (
    BASE_MS,
    Background,
    fresh_topics,
    make_publisher,
    read_all,
    small_fleet,
    wait_until,
)

codec = default_codec()


def test_to_columns_makes_one_row_per_gpu_with_its_source_offset() -> None:
    records = small_fleet(nodes=1).telemetry(BASE_MS)
    table = to_columns([SourcedTelemetry(2, 40 + i, r) for i, r in enumerate(records)])
    assert table.num_rows == 16
    assert table.column("source_offset").to_pylist() == [40] * 8 + [41] * 8
    assert table.column("gpu_index").to_pylist()[:8] == list(range(8))
    assert table.column("node_id").to_pylist()[8] == records[1]["node_id"]


def test_clickhouse_urls_are_checked() -> None:
    with pytest.raises(ConfigError, match="start with chdb://"):
        connect("postgres://x")
    with pytest.raises(ConfigError, match="names a data folder"):
        connect("chdb://")


def test_migrations_are_idempotent_and_recorded(settings, clickhouse) -> None:
    db = settings.clickhouse_database
    assert migrate(clickhouse, db) == [m.version for m in MIGRATIONS]
    assert migrate(clickhouse, db) == []
    rows = clickhouse.query(
        f"SELECT version, name FROM {db}.schema_migrations ORDER BY version"
    ).result_rows
    assert [r[0] for r in rows] == [m.version for m in MIGRATIONS]
    with pytest.raises(ConfigError):
        migrate(clickhouse, "bad-name; DROP")


def make_sink(settings, clickhouse, topics, name: str | None = None) -> StreamLoop:
    migrate(clickhouse, settings.clickhouse_database)
    return sample_sink(settings, clickhouse, topics, name, max_wait_s=0.3)


def stats(loop: StreamLoop) -> SampleSinkStats:
    step = loop.step
    assert isinstance(step, HotSampleSink)
    return step.stats


def test_sink_writes_every_sample_once_across_restarts(settings, clickhouse) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    fleet = small_fleet(nodes=2)
    publisher = make_publisher(settings, topics)
    for tick in range(3):
        publisher.publish_telemetry(fleet.telemetry(BASE_MS + tick * 1000))
    publisher.producer.produce(topics.telemetry, key=b"bad", value=b"junk")
    publisher.flush()
    db = settings.clickhouse_database

    sink = make_sink(settings, clickhouse, topics)
    loop = Background(sink.run)
    wait_until(lambda: stats(sink).messages >= 13, what="the sink")
    loop.stop()
    count = f"SELECT count(), uniqExact(node_id, seq, gpu_index) FROM {db}.gpu_samples"
    assert clickhouse.query(count).result_rows == [(96, 96)]

    # A sink that restarts (its Kafka offsets lost, as after a crash before the commit)
    # resumes from what the table holds: new rows are added, nothing is written twice.
    for tick in range(3, 5):
        publisher.publish_telemetry(fleet.telemetry(BASE_MS + tick * 1000))
    publisher.flush()
    restarted = make_sink(settings, clickhouse, topics, f"{topics.prefix}.hot-sink-fresh-group")
    loop = Background(restarted.run)
    wait_until(lambda: clickhouse.query(count).result_rows[0][0] >= 160, what="the restarted sink")
    loop.stop()
    assert clickhouse.query(count).result_rows == [(160, 160)]
    assert stats(restarted).messages == 8 + 1  # four new nodes x two ticks, and the bad one again

    letters = [read_dead_letter(m) for m in read_all(settings, topics.dead_letter, 1)]
    assert letters[0].value == b"junk" and "not Avro" in letters[0].reason
    # The bad message was dead-lettered again after the restart; its source id tells them apart.
    assert {letter.source_id for letter in letters} == {
        (topics.telemetry, letters[0].partition, letters[0].offset)
    }


def test_a_second_topic_prefix_in_the_same_database_loses_nothing(settings, clickhouse) -> None:
    # Another fleet (a new prefix) counts its offsets and its agents' seq from the start again;
    # the rows of the first must neither skip nor drop any of it.
    db = settings.clickhouse_database
    for _ in range(2):
        topics = fresh_topics(partitions=2)
        kafka_clients.ensure_topics(settings.kafka, topics.specs())
        fleet = small_fleet(nodes=2)  # the same node names, seq from 1
        publisher = make_publisher(settings, topics)
        for tick in range(3):
            publisher.publish_telemetry(fleet.telemetry(BASE_MS + tick * 1000))
        publisher.flush()
        sink = make_sink(settings, clickhouse, topics)
        loop = Background(sink.run)
        wait_until(lambda s=sink: stats(s).messages >= 12, what="the sink")
        loop.stop()
        rows = clickhouse.query(
            f"SELECT count() FROM {db}.gpu_samples WHERE source_topic = {{t:String}}",
            parameters={"t": topics.telemetry},
        ).result_rows
        assert rows == [(96,)] and stats(sink).repeats == 0


class FailingOnce(HotSampleStore):
    """The real table, whose second insert fails (as when the server goes away)."""

    calls = 0

    def store(self, table) -> None:
        self.calls += 1
        if self.calls == 2:
            raise StorageError("the table went away")
        super().store(table)


def test_a_failed_insert_stops_the_overlapped_sink_and_a_restart_loses_nothing(
    settings, clickhouse
) -> None:
    # The sink decodes the next batch while the previous one is inserted; a failed insert must
    # stop it before anything received later is stored, and a restart resumes from the table.
    topics = fresh_topics(partitions=1)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    fleet = small_fleet(nodes=2)
    publisher = make_publisher(settings, topics)
    for tick in range(6):
        publisher.publish_telemetry(fleet.telemetry(BASE_MS + tick * 1000))
    publisher.flush()
    db = settings.clickhouse_database
    sink = make_sink(settings, clickhouse, topics)
    step = sink.step
    assert isinstance(step, HotSampleSink)
    step.samples = FailingOnce(clickhouse, db)
    sink.max_messages = 8  # one batch per two ticks
    loop = Background(sink.run)
    wait_until(lambda: not loop.thread.is_alive(), what="the failing sink to stop")
    with pytest.raises(StorageError, match="went away"):
        loop.stop()
    count = f"SELECT count(), uniqExact(node_id, seq, gpu_index) FROM {db}.gpu_samples"
    assert clickhouse.query(count).result_rows == [(64, 64)]  # the first batch only

    restarted = make_sink(settings, clickhouse, topics)
    loop = Background(restarted.run)
    wait_until(lambda: clickhouse.query(count).result_rows[0][0] >= 192, what="the restart")
    loop.stop()
    assert clickhouse.query(count).result_rows == [(192, 192)]


def test_a_partition_that_moves_to_another_sink_resumes_after_the_rows_stored(
    settings, clickhouse
) -> None:
    # A second instance joins the group while telemetry keeps flowing: partitions move, and
    # each new owner starts where the table says, not where it stood when it started.
    topics = fresh_topics(partitions=2)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    fleet = small_fleet(nodes=6)  # 12 nodes, keyed into both partitions
    publisher = make_publisher(settings, topics)
    db = settings.clickhouse_database
    first = make_sink(settings, clickhouse, topics)
    loops = [Background(first.run)]
    wait_until(first.ready.is_set, what="the first sink")
    second = make_sink(settings, clickhouse, topics)
    ticks = {"sent": 0, "after_join": 0}

    def one_interval() -> bool:
        """Telemetry keeps flowing, an interval a poll, until the second sink has stored for
        ten of them."""
        publisher.publish_telemetry(fleet.telemetry(BASE_MS + ticks["sent"] * 1000))
        publisher.flush()
        ticks["sent"] += 1
        if ticks["sent"] == 3:  # takes its resume point now, joins the group seconds later
            loops.append(Background(second.run))
        ticks["after_join"] += stats(second).messages > 0
        return ticks["after_join"] >= 10

    wait_until(one_interval, 60, what="a partition to move to the second sink")
    tick = ticks["sent"]
    count = f"SELECT count(), uniqExact(node_id, seq, gpu_index) FROM {db}.gpu_samples"
    wait_until(lambda: clickhouse.query(count).result_rows[0][0] >= tick * 96, what="every sample")
    for loop in loops:
        loop.stop()
    assert clickhouse.query(count).result_rows == [(tick * 96, tick * 96)]


def test_sample_values_survive_the_trip_into_clickhouse(settings, clickhouse) -> None:
    topics = fresh_topics(partitions=1)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    record = small_fleet(nodes=1).telemetry(BASE_MS)[0]
    publisher = make_publisher(settings, topics)
    publisher.publish_telemetry([record])
    publisher.flush()
    sink = make_sink(settings, clickhouse, topics)
    loop = Background(sink.run)
    wait_until(lambda: stats(sink).rows >= 8, what="the sink")
    loop.stop()
    rows = clickhouse.query(
        f"SELECT toUnixTimestamp64Milli(ts), gpu_index, fb_used_mib, gpu_util_pct, xid_codes, "
        f"nvlink_errors_total FROM {settings.clickhouse_database}.gpu_samples "
        f"WHERE node_id = '{record['node_id']}' ORDER BY gpu_index"
    ).result_rows
    assert [r[1] for r in rows] == list(range(8))
    for row, gpu in zip(rows, record["gpus"], strict=True):
        assert row[0] == BASE_MS
        assert row[2] == gpu["fb_used_mib"]
        assert row[3] == pytest.approx(gpu["gpu_util_pct"], abs=1e-3)
        assert row[4] == [] and row[5] == 0


def test_wrong_credentials_are_a_storage_error(settings) -> None:
    import dataclasses

    bad = dataclasses.replace(settings.s3, secret_key="wrong")
    with pytest.raises(StorageError, match="writing s3://"):
        ObjectStore.from_settings(bad, bucket="fleetline-test").put("x", b"y")


def test_records_an_agent_sends_twice_are_stored_once(settings, clickhouse) -> None:
    topics = fresh_topics(partitions=2)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    fleet = small_fleet(nodes=1)
    records = [r for tick in range(3) for r in fleet.telemetry(BASE_MS + tick * 1000)]
    producer = kafka_clients.producer(settings.kafka)
    # What a rewinding agent does: the tail is sent again after the first copies landed.
    for record in records + records[2:]:
        producer.produce(
            topics.telemetry,
            key=record["node_id"].encode(),
            value=codec.encode("NodeTelemetry", record),
        )
    producer.flush(30)
    sink = make_sink(settings, clickhouse, topics)
    loop = Background(sink.run)
    wait_until(lambda: stats(sink).messages >= 10, what="the sink")
    loop.stop()
    db = settings.clickhouse_database
    assert clickhouse.query(f"SELECT count() FROM {db}.gpu_samples").result_rows == [(48,)]
    assert stats(sink).repeats == 4
    # A restarted sink knows the stored seqs too.
    producer.produce(
        topics.telemetry,
        key=records[0]["node_id"].encode(),
        value=codec.encode("NodeTelemetry", records[0]),
    )
    producer.flush(30)
    again = make_sink(settings, clickhouse, topics, f"{topics.prefix}.hot-sink-again")
    loop = Background(again.run)
    wait_until(lambda: stats(again).repeats >= 1, what="the restarted sink")
    loop.stop()
    assert clickhouse.query(f"SELECT count() FROM {db}.gpu_samples").result_rows == [(48,)]
