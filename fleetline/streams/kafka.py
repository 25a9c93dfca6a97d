"""confluent-kafka clients built from settings, and idempotent topic creation."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from fleetline.config import KafkaSettings
from fleetline.errors import ServiceUnavailable, StreamError
from fleetline.probe import refusal
from fleetline.streams.records import where
from fleetline.streams.topics import TopicSpec

# The Java clients' default partitioner, so every client maps a key to the same partition.
PARTITIONER = "murmur2_random"


def admin_client(kafka: KafkaSettings) -> AdminClient:
    return AdminClient(dict(kafka.client_config()))  # type: ignore[arg-type]  # a Logger too


def probe(kafka: KafkaSettings, timeout_s: float = 5.0) -> None:
    """Raise ServiceUnavailable unless a broker answers a metadata request within `timeout_s`
    (librdkafka's own connection errors are kept out of the log; the one line says it)."""

    def unavailable(reason: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"Kafka is not answering at {kafka.bootstrap_servers} ({reason}); start the local "
            "broker with `fleetline infra start`, or point FLEETLINE_KAFKA_BOOTSTRAP at a "
            "running one"
        )

    # A refused connection is known at once; librdkafka would retry it until the timeout.
    refused = []
    for server in kafka.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        why = refusal(host, int(port), timeout_s) if port.isdigit() else "no port"
        if why is None:
            break
        refused.append(f"{server.strip()}: {why}")
    else:
        raise unavailable("; ".join(refused))
    silent = logging.getLogger("fleetline.librdkafka.probe")
    silent.propagate = False
    silent.addHandler(logging.NullHandler())
    admin = AdminClient(dict(kafka.client_config(logger=silent)))  # type: ignore[arg-type]
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise unavailable(exc.args[0].str()) from None


def ensure_topics(
    kafka: KafkaSettings, specs: Iterable[TopicSpec], timeout_s: float = 30.0
) -> None:
    """Create the topics that do not exist yet, replicated as the settings say (by default as
    the cluster's defaults say); an existing topic is left as it is."""
    specs = list(specs)
    durability = (
        {"min.insync.replicas": str(kafka.min_insync_replicas)}
        if kafka.min_insync_replicas is not None
        else {}
    )
    new = [
        NewTopic(
            spec.name,
            num_partitions=spec.partitions,
            replication_factor=kafka.replication_factor,
            config={**durability, **spec.config},
        )
        for spec in specs
    ]
    if not new:
        return
    # Keep the client referenced until every future resolves: collecting it cancels them.
    admin = admin_client(kafka)
    futures = admin.create_topics(new, operation_timeout=timeout_s, request_timeout=timeout_s)
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise StreamError(f"creating topic {name}: {exc.args[0].str()}") from None
    # Created is not yet visible: a consumer subscribing before the broker's metadata has the
    # topic gets "Subscribed topic not available". Return once every topic is listed.
    deadline = time.monotonic() + timeout_s
    while True:
        listed = admin.list_topics(timeout=timeout_s).topics
        missing = [
            spec.name
            for spec in specs
            if spec.name not in listed
            or listed[spec.name].error is not None
            or not listed[spec.name].partitions
        ]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise StreamError(f"topics created but not visible after {timeout_s}s: {missing}")
        time.sleep(0.1)


def producer(
    kafka: KafkaSettings,
    config: Mapping[str, object] | None = None,
    *,
    transactional_id: str | None = None,
) -> Producer:
    """An idempotent producer (transactional when an id is given), batching with lz4;
    `config` adds or overrides librdkafka settings."""
    conf = kafka.client_config(
        **{
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "lz4",
            "linger.ms": 20,
            "partitioner": PARTITIONER,
            **(config or {}),
        }
    )
    if transactional_id is not None:
        conf["transactional.id"] = transactional_id
    return Producer(conf)


def consumer(
    kafka: KafkaSettings, group_id: str, config: Mapping[str, object] | None = None
) -> Consumer:
    """A read_committed consumer that never commits by itself (unless `config` says so)."""
    return Consumer(
        kafka.client_config(
            **{
                "group.id": group_id,
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                **(config or {}),
            }
        )
    )


def next_offsets(messages: Iterable[Message]) -> dict[tuple[str, int], int]:
    """The offsets to commit after `messages`: one past the last of each partition."""
    last: dict[tuple[str, int], int] = {}
    for msg in messages:
        last[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
    return last


def topic_partitions(offsets: Mapping[tuple[str, int], int]) -> list[TopicPartition]:
    return [
        TopicPartition(topic, partition, offset) for (topic, partition), offset in offsets.items()
    ]


def partitions_of(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[int]:
    """The partition numbers of an existing topic."""
    metadata = admin_client(kafka).list_topics(topic, timeout=timeout_s).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise StreamError(f"topic {topic} does not exist (is the topic prefix right?)")
    return sorted(metadata.partitions)


def committed_offsets(
    kafka: KafkaSettings, group: str, topic: str, timeout_s: float = 30.0
) -> dict[int, int]:
    """The offsets consumer `group` has committed in `topic`, by partition (none: absent)."""
    partitions = [TopicPartition(topic, p) for p in partitions_of(kafka, topic, timeout_s)]
    reader = Consumer(kafka.client_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        return {
            tp.partition: tp.offset
            for tp in reader.committed(partitions, timeout=timeout_s)
            if tp.offset >= 0
        }
    finally:
        reader.close()


def group_lag(
    kafka: KafkaSettings, group: str, topics: Iterable[str], timeout_s: float = 30.0
) -> int:
    """Messages in these topics that consumer `group` has not committed past (all of a
    partition's retained log where it has committed nothing)."""
    partitions = [TopicPartition(t, p) for t in topics for p in partitions_of(kafka, t, timeout_s)]
    reader = Consumer(kafka.client_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        lag = 0
        for tp in reader.committed(partitions, timeout=timeout_s):
            low, high = _watermarks(reader, tp, timeout_s)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag
    finally:
        reader.close()


# While a new topic's partitions elect their leaders, the broker answers these; asking again
# a moment later is the fix.
_ELECTING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)


def _watermarks(reader: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = reader.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
            return int(low), int(high)
        except KafkaException as exc:
            if exc.args[0].code() not in _ELECTING or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_to_end(
    kafka: KafkaSettings,
    topic: str,
    partitions: Iterable[int],
    group_id: str,
    timeout_s: float = 60.0,
) -> Iterator[Message]:
    """The committed messages of `partitions` of `topic`, from the start up to each one's end
    as it was when the read began (its position past the last transaction marker). Waiting for
    end-of-partition instead would never finish while a live writer keeps appending."""
    reader = consumer(kafka, group_id)
    try:
        ends: dict[int, int] = {}
        for p in sorted(set(partitions)):
            low, high = _watermarks(reader, TopicPartition(topic, p), timeout_s)
            if high > low:
                ends[p] = high
        if not ends:
            return
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        remaining = set(ends)
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise StreamError(
                    f"reading {topic}: nothing arrived for {timeout_s:.0f}s; partitions "
                    f"not at their end: {sorted(remaining)}"
                )
            msg = reader.poll(0.2)
            if msg is None:
                for tp in reader.position([TopicPartition(topic, p) for p in remaining]):
                    if tp.offset >= ends[tp.partition]:
                        remaining.discard(tp.partition)
                continue
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                raise StreamError(f"reading {topic}: {error.str()}")
            _, partition, offset = where(msg)
            if offset >= ends[partition]:
                remaining.discard(partition)
                continue  # appended after the read began
            yield msg
            # The limit is on a stalled read, not on what the caller does with each message
            # (a replay folds the scheduler's whole log as it reads it).
            deadline = time.monotonic() + timeout_s
            if offset + 1 >= ends[partition]:
                remaining.discard(partition)
    finally:
        reader.close()
