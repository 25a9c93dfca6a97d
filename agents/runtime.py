"""The node agent's shell: turns records from a collector into Kafka messages keyed by node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, Message

from fleetline.errors import StreamError
from fleetline.streams.serde import AvroCodec
from fleetline.streams.topics import Topics


@dataclass
class TelemetryPublisher:
    """Publishes NodeTelemetry and NodeState with an idempotent producer, keyed by node id."""

    producer: Any
    codec: AvroCodec
    topics: Topics
    failed: list[str] = field(default_factory=list)
    delivered: int = 0

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed.append(f"{msg.topic()} key={msg.key()!r}: {err.str()}")

    def _send(self, topic: str, schema: str, record: Mapping[str, Any]) -> None:
        value = self.codec.encode(schema, record)
        key = record["node_id"].encode()
        while True:
            try:
                self.producer.produce(topic, key=key, value=value, on_delivery=self._on_delivery)
                break
            except BufferError:
                self.producer.poll(0.05)
        self.producer.poll(0)

    def publish_telemetry(self, records: Iterable[Mapping[str, Any]]) -> int:
        count = 0
        for record in records:
            self._send(self.topics.telemetry, "NodeTelemetry", record)
            count += 1
        return count

    def publish_states(self, records: Iterable[Mapping[str, Any]]) -> int:
        count = 0
        for record in records:
            self._send(self.topics.node_state, "NodeState", record)
            count += 1
        return count

    def flush(self, timeout_s: float = 30.0) -> None:
        remaining = self.producer.flush(timeout_s)
        if remaining:
            raise StreamError(f"{remaining} messages still undelivered after {timeout_s:.0f}s")
        if self.failed:
            raise StreamError(f"{len(self.failed)} messages failed: {self.failed[:3]}")
