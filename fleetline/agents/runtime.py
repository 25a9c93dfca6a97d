"""The node agent's shell: collector records -> spool -> Kafka, plus its command loop.

Every record is appended to the on-disk spool first, then sent in spool order by an idempotent
producer keyed by node id. Kafka's acknowledgements advance the spool's `acked` mark. A send
never times out (`SENDS`): across a link cut or a broker outage librdkafka retries in order,
and the spool keeps what is beyond `max_in_flight` and what a restarted agent sends again. A
failed delivery (a refusal, or a timeout where a producer is given one) rewinds sending to the
first unacknowledged record once the in-flight ones have all reported; the records queued
behind it are purged, so that none of them reaches the topic ahead of it. So a node's records
reach the topic in order with none lost; an outage can repeat some, which consumers drop by the
per-node `seq` they carry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, Message

from fleetline.agents.spool import DiskSpool
from fleetline.errors import StreamError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import AvroCodec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

# A publisher's producer settings. No send times out: when a queued send times out, librdkafka
# bumps its producer epoch and sends the records queued behind it at once, and when the link is
# back by then they reach the topic before `pump` hears of the failure and purges them: ahead
# of the record that failed, resent later (seq 61 before 25 after a 30 s cut healed as 15 s
# timeouts fell due). Waiting is librdkafka's in-order retry; a restart's resend is the spool's.
SENDS: Mapping[str, object] = {"message.timeout.ms": 0, **kafka_clients.ACROSS_LINKS}


@dataclass
class PublisherMetrics:
    delivered: int = 0
    failed_deliveries: int = 0
    resent: int = 0
    rewinds: int = 0


@dataclass
class TelemetryPublisher:
    """Sends NodeTelemetry, NodeState and CommandResult through a spool, keyed by node id."""

    producer: Any
    codec: AvroCodec
    topics: Topics
    spool: DiskSpool
    max_in_flight: int = 20_000
    retry_backoff_s: float = 1.0
    metrics: PublisherMetrics = field(default_factory=PublisherMetrics)
    _next: int = field(init=False, default=-1)
    _in_flight: int = field(init=False, default=0)
    _delivered: set[int] = field(init=False, default_factory=set)
    _failed: bool = field(init=False, default=False)
    _purged: bool = field(init=False, default=False)
    _retry_at: float = field(init=False, default=0.0)
    _highest_sent: int = field(init=False, default=-1)
    _dropped_seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._next = self.spool.acked + 1

    def figures(self) -> dict[str, int]:
        """The spool's size and losses and the deliveries retried, for reports and /metrics."""
        return {
            "bytes": self.spool.size_bytes,
            "records": len(self.spool),
            "dropped": self.spool.dropped,
            "unspooled": self.spool.unspooled,
            "resent": self.metrics.resent,
            "rewinds": self.metrics.rewinds,
        }

    # -- recording ------------------------------------------------------------------------

    def _record(self, topic: str, schema: str, record: Mapping[str, Any]) -> None:
        self.spool.append(topic, record["node_id"].encode(), self.codec.encode(schema, record))

    def publish_telemetry(self, records: Iterable[Mapping[str, Any]], send: bool = True) -> int:
        return self.publish("telemetry", records, send=send)

    def publish_states(self, records: Iterable[Mapping[str, Any]], send: bool = True) -> int:
        return self.publish("state", records, send=send)

    def publish_results(self, records: Iterable[Mapping[str, Any]], send: bool = True) -> int:
        return self.publish("result", records, send=send)

    def publish(self, kind: str, records: Iterable[Mapping[str, Any]], *, send: bool = True) -> int:
        """Spool records of one kind; with `send` False (the node's link is down) they wait
        in the spool until a later `pump`."""
        topic, schema = {
            "telemetry": (self.topics.telemetry, "NodeTelemetry"),
            "state": (self.topics.node_state, "NodeState"),
            "result": (self.topics.command_results, "CommandResult"),
        }[kind]
        count = 0
        for record in records:
            self._record(topic, schema, record)
            count += 1
        if send:
            self.pump()
        return count

    # -- sending --------------------------------------------------------------------------

    def _on_delivery(self, err: KafkaError | None, msg: Message, offset: int) -> None:
        self._in_flight -= 1
        if err is None:
            self.metrics.delivered += 1
            self._delivered.add(offset)
        else:
            self.metrics.failed_deliveries += 1
            if not self._failed:
                log.warning("delivery failed (%s); will resend from the spool", err.str())
            self._failed = True

    def _advance_acked(self) -> None:
        acked = self.spool.acked
        if self.spool.dropped != self._dropped_seen:
            # The bound moved the mark past entries that may have been delivered meanwhile.
            self._dropped_seen = self.spool.dropped
            self._delivered = {o for o in self._delivered if o > acked}
        while acked + 1 in self._delivered:
            acked += 1
            self._delivered.discard(acked)
        if acked > self.spool.acked:
            self.spool.ack(acked)

    def pump(self, timeout_s: float = 0.0) -> None:
        """Serve delivery reports, advance the acked mark, send what the spool holds next."""
        self.producer.poll(timeout_s)
        self._advance_acked()
        if self._failed:
            if self._in_flight > 0:
                if not self._purged:
                    # Records still queued behind the failed one would reach the topic ahead
                    # of it when the link returns (a cut outlasting the timeout of its first
                    # records only): fail them now, so that the resend keeps the node's order.
                    self.producer.purge(in_queue=True, in_flight=False, blocking=False)
                    self._purged = True
                return  # wait until every outstanding delivery has reported
            self._failed = False
            self._purged = False
            self._delivered.clear()
            self._next = self.spool.acked + 1
            self._retry_at = time.monotonic() + self.retry_backoff_s
            self.metrics.rewinds += 1
        if time.monotonic() < self._retry_at:
            return
        self._next = max(self._next, self.spool.acked + 1)  # skip what the bound dropped
        for entry in self.spool.entries_from(self._next):
            if self._in_flight >= self.max_in_flight:
                break
            try:
                self.producer.produce(
                    entry.topic,
                    key=entry.key,
                    value=entry.value,
                    on_delivery=lambda err, msg, o=entry.offset: self._on_delivery(err, msg, o),
                )
            except BufferError:
                break
            if entry.offset <= self._highest_sent:
                self.metrics.resent += 1
            self._highest_sent = max(self._highest_sent, entry.offset)
            self._in_flight += 1
            self._next = entry.offset + 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until everything spooled is acknowledged, or raise after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.spool) or self._in_flight:
            if time.monotonic() > deadline:
                raise StreamError(
                    f"{len(self.spool)} spooled records still unacknowledged after "
                    f"{timeout_s:.0f}s ({self.metrics.failed_deliveries} failed deliveries)"
                )
            self.pump(0.05)
