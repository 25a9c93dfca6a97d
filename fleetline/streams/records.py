"""What a stream step reads and writes: incoming records, outgoing ones, positions in the log.

Plain types only, so the pure cores can speak of messages without importing a Kafka client:
`confluent_kafka.Message` satisfies `Record` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# topic -> partition -> the next offset to read: where a fold, a snapshot or a tick stands.
Offsets = dict[str, dict[int, int]]


class Record(Protocol):
    """One message as a step sees it (the accessors of `confluent_kafka.Message`)."""

    def topic(self) -> str | None: ...

    def partition(self) -> int | None: ...

    def offset(self) -> int | None: ...

    def key(self) -> bytes | None: ...

    def value(self) -> bytes | None: ...


# confluent_kafka.TIMESTAMP_LOG_APPEND_TIME: the broker stamped the message when it appended it.
_LOG_APPEND_TIME = 2


def appended_ms(record: Record) -> int | None:
    """When the broker appended the record, if its topic stamps LogAppendTime (None for a
    producer's own CreateTime, or a record that carries no timestamp)."""
    stamp = getattr(record, "timestamp", None)
    if stamp is None:
        return None
    kind, ms = stamp()
    return int(ms) if kind == _LOG_APPEND_TIME else None


def where(record: Record) -> tuple[str, int, int]:
    """(topic, partition, offset) of a record read from a topic (never None there)."""
    topic, partition, offset = record.topic(), record.partition(), record.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("a record read from a topic names its topic, partition and offset")
    return topic, partition, offset


@dataclass(frozen=True)
class Output:
    """One message a step asks the loop to produce."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None
    headers: list[tuple[str, str | bytes | None]] | None = None


def copy_offsets(offsets: Offsets) -> Offsets:
    return {topic: dict(partitions) for topic, partitions in offsets.items()}


def position(offsets: Offsets) -> int:
    """How far a set of offsets is into the log: their sum, which only grows as a fold goes on."""
    return sum(sum(partitions.values()) for partitions in offsets.values())
