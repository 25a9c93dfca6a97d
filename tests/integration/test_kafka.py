"""Produce and consume through the real Kafka broker, transactions included."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient

from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.support import (
    BASE_MS,
    fresh_topics,
    make_publisher,
    read_all,
    small_fleet,
    wait_until,
)

codec = default_codec()


def test_ensure_topics_is_idempotent_and_applies_settings(settings) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    kafka_clients.ensure_topics(settings.kafka, topics.specs())  # already there: no error
    metadata = AdminClient(settings.kafka.client_config()).list_topics(timeout=10)
    assert len(metadata.topics[topics.telemetry].partitions) == 3
    assert len(metadata.topics[topics.dead_letter].partitions) == 1


def test_telemetry_flows_through_kafka_keyed_and_ordered_per_node(settings) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    fleet = small_fleet(nodes=3)
    publisher = make_publisher(settings, topics)
    sent = []
    for tick in range(5):
        records = fleet.telemetry(BASE_MS + tick * 1000)
        publisher.publish_telemetry(records)
        sent += records
    publisher.flush()
    assert publisher.metrics.delivered == len(sent) == 30
    assert len(publisher.spool) == 0 and publisher.spool.acked == 29

    messages = read_all(settings, topics.telemetry, len(sent))
    assert len(messages) == len(sent)
    by_node: dict[str, list[int]] = {}
    partitions: dict[str, set[int]] = {}
    for msg in messages:
        record = codec.decode(msg.value(), expect="NodeTelemetry").record
        assert msg.key().decode() == record["node_id"]
        by_node.setdefault(record["node_id"], []).append(record["seq"])
        partitions.setdefault(record["node_id"], set()).add(msg.partition())
    assert by_node and all(seqs == sorted(seqs) and len(seqs) == 5 for seqs in by_node.values())
    assert all(len(p) == 1 for p in partitions.values())  # one node, one partition


def test_transactions_hide_aborted_records_from_read_committed_consumers(settings) -> None:
    topics = fresh_topics(partitions=1)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    producer = kafka_clients.producer(settings.kafka, transactional_id=f"{topics.prefix}-tx")
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(topics.telemetry, key=b"k", value=b"committed-1")
    producer.commit_transaction(60)
    producer.begin_transaction()
    producer.produce(topics.telemetry, key=b"k", value=b"aborted")
    producer.flush(30)  # in the log, so only the abort marker hides it
    producer.abort_transaction(60)
    producer.begin_transaction()
    producer.produce(topics.telemetry, key=b"k", value=b"committed-2")
    producer.commit_transaction(60)

    committed = [m.value() for m in read_all(settings, topics.telemetry, 2)]
    assert committed == [b"committed-1", b"committed-2"]
    everything = [m.value() for m in read_all(settings, topics.telemetry, 3, committed_only=False)]
    assert everything == [b"committed-1", b"aborted", b"committed-2"]


def test_a_read_to_the_end_stops_at_the_last_stable_offset_and_settles_past_it(settings) -> None:
    """The end a read_committed reader reaches is the last stable offset, not the high
    watermark: a transaction still open holds it back. With `settle`, the ends are asked again
    once reached, so a transaction that commits during the read is read too."""
    import threading
    import uuid

    from fleetline.streams.topics import TopicSpec

    topic = f"{fresh_topics().prefix}.log"
    kafka_clients.ensure_topics(settings.kafka, [TopicSpec(topic, 1)])
    plain = kafka_clients.producer(settings.kafka)
    plain.produce(topic, key=b"k", value=b"before")
    plain.flush(30)
    held = kafka_clients.producer(settings.kafka, transactional_id=f"t-{uuid.uuid4().hex[:8]}")
    held.init_transactions(30)
    held.begin_transaction()
    held.produce(topic, key=b"k", value=b"held")
    held.flush(30)

    ((low, end),) = kafka_clients.stable_bounds(settings.kafka, topic, [0]).values()
    assert (low, end) == (0, 1)  # the open transaction's record is at 1: the end stays at 1

    def values(settle: bool) -> list[bytes]:
        return [
            m.value()
            for m in kafka_clients.read_to_end(
                settings.kafka, topic, [0], f"r-{uuid.uuid4().hex}", 30, settle=settle
            )
        ]

    assert values(settle=False) == [b"before"]
    # A reader that settles meets the end again once it reached it; the commit lands between.
    reached = threading.Event()
    reader = kafka_clients.read_to_end(
        settings.kafka, topic, [0], f"r-{uuid.uuid4().hex}", 30, settle=True
    )
    first = next(reader)
    assert first.value() == b"before"
    committer = threading.Thread(target=lambda: (held.commit_transaction(30), reached.set()))
    committer.start()
    committer.join(30)
    assert reached.is_set()
    # The commit returns once it is decided; its marker reaches the partition a moment later.
    wait_until(
        lambda: kafka_clients.stable_bounds(settings.kafka, topic, [0])[0][1] > 1,
        10,
        "the commit's marker",
    )
    assert [m.value() for m in reader] == [b"held"]
    assert values(settle=False) == [b"before", b"held"]


def test_a_settling_read_ends_while_a_live_writer_keeps_appending(settings) -> None:
    """Readers beside a live processor (the CLI reading the scheduler's state) get the log as of
    about when they read: asking for the ends again is bounded, not repeated until they rest."""
    import threading
    import uuid

    from fleetline.streams.topics import TopicSpec

    topic = f"{fresh_topics().prefix}.live"
    kafka_clients.ensure_topics(settings.kafka, [TopicSpec(topic, 1)])
    writer = kafka_clients.producer(settings.kafka, {"linger.ms": 0})
    stop = threading.Event()
    written = threading.Event()

    def append() -> None:
        while not stop.is_set():
            writer.produce(topic, key=b"k", value=b"v")
            writer.flush(10)
            written.set()

    appending = threading.Thread(target=append, daemon=True)
    appending.start()
    assert written.wait(30)
    try:
        read = list(
            kafka_clients.read_to_end(
                settings.kafka, topic, [0], f"r-{uuid.uuid4().hex}", 30, settle=True
            )
        )
        assert appending.is_alive()  # the read ended while the log was still growing
    finally:
        stop.set()
        appending.join(30)
    assert read
