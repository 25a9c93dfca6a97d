"""The writer gate as live folds and replays use it: identity/writers.Gate over the identities
topic, read to its end before a batch's first agent record is judged.

Why "before": a revocation holds for the records the broker appended at or after it. A batch
was fetched after each of its records was appended, so reading the identities topic to its end
after the fetch sees every revocation appended before them; a replay, which reads the topic
whole, refuses the same records. Control-plane records never wait for it (the control plane is
the root, not revocable), so the scheduler's ticks and submissions pay nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import ConfigError, StreamError
from fleetline.identity.writers import (
    Gate,
    Headed,
    Registry,
    Writer,
    WriterKind,
    writer_header,
)
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import IDENTITY_EVENT
from fleetline.streams.records import appended_ms
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)
# Refusals that asking again will not change.
_REFUSED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED})


def gate_root(kafka: KafkaSettings) -> bytes:
    """The identity root a fold checks writers with, or ConfigError saying where it comes from."""
    if kafka.identity_root is None:
        raise ConfigError(
            "this process checks who wrote each record and holds no identity root: give it "
            "FLEETLINE_IDENTITY_ROOT_KEY, or run it on the control plane's host (`fleetline "
            "serve` makes .cache/keys/identity-root.key on first start)"
        )
    return kafka.identity_root


class WriterGate:
    """A Gate whose registry follows the identities topic (see the module's docstring)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        codec: AvroCodec | None = None,
    ) -> None:
        self.kafka = kafka
        self.topic = topics.identities
        self.codec = codec or default_codec()
        self.gate = Gate(gate_root(kafka))
        self._consumer: Consumer | None = None
        self._lock = threading.Lock()

    @property
    def registry(self) -> Registry:
        return self.gate.registry

    def new_batch(self, records: Iterable[Headed]) -> None:
        """A batch was fetched: before any of it is judged, read the revocations again if it
        holds a record not written by the control plane. Called before the batch changes
        anything, so a registry that cannot be read fails the batch whole (an exactly-once
        loop aborts and redoes it), never one record."""
        if any(not _control_plane(record) for record in records):
            self.refresh()

    def refresh(self, timeout_s: float = 120.0) -> None:
        """Read the identities topic up to its end as the broker gives it now. While brokers
        are lost (its leader moving, a connection destroyed under the client) it is asked
        again with a new client; a refusal by the broker's ACLs at once, anything else once
        `timeout_s` has passed, is a StreamError."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                try:
                    self._read_to_end(deadline)
                    return
                except KafkaException as exc:
                    error: KafkaError = exc.args[0]
                    if error.code() in _REFUSED or time.monotonic() > deadline:
                        raise StreamError(f"reading {self.topic}: {error.str()}") from None
                    log.info("reading %s again: %s", self.topic, error.str())
                    self._drop_consumer()
                    time.sleep(0.5)

    def _drop_consumer(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with contextlib.suppress(KafkaException, RuntimeError):  # its handle already gone
                consumer.close()

    def _read_to_end(self, deadline: float) -> None:
        if self._consumer is None:
            self._consumer = kafka_clients.consumer(
                self.kafka, f"fleetline-identities-{uuid.uuid4().hex[:12]}"
            )
            self._consumer.assign([TopicPartition(self.topic, 0, self.registry.position)])
        tp = TopicPartition(self.topic, 0)
        # A few seconds a try: a leader lost mid-call is asked again (its successor), not
        # waited on for the whole deadline while the batch's transaction runs.
        _, high = self._consumer.get_watermark_offsets(
            tp, timeout=min(5.0, max(1.0, deadline - time.monotonic())), cached=False
        )
        while self.registry.position < high:
            if time.monotonic() > deadline:
                raise StreamError(
                    f"reading {self.topic}: at offset {self.registry.position} of {high}"
                )
            for msg in self._consumer.consume(500, 0.5):
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(error)
                offset = msg.offset() or 0
                if offset < self.registry.position:
                    continue  # read again after a retry
                event = self.codec.decode(msg.value(), expect=IDENTITY_EVENT).record
                self.registry.apply(event, appended_ms(msg) or 0, offset)

    def writer_of(self, record: Headed) -> Writer:
        return self.gate.writer_of(record)

    def close(self) -> None:
        with self._lock:
            self._drop_consumer()


def _control_plane(record: Headed) -> bool:
    claimed = writer_header(record.headers())
    return claimed is not None and claimed.partition("#")[0] == WriterKind.CONTROL_PLANE.value


def replay_gate(kafka: KafkaSettings, topics: Topics) -> Gate:
    """A gate for a replay: the identities topic read whole now. A revocation holds from its
    own append time, so one appended after the records a replay folds changes nothing."""
    live = WriterGate(kafka, topics)
    try:
        live.refresh()
    finally:
        live.close()
    return live.gate


def publish_identity_event(
    kafka: KafkaSettings,
    topics: Topics,
    action: str,
    writer: Writer,
    actor: str,
    reason: str | None = None,
    clock_ms: int | None = None,
) -> int:
    """Append an ENROL or REVOKE of `writer` to the identities topic; the broker's append
    time (from which a revocation holds)."""
    codec = default_codec()
    record = {
        "action": action,
        "writer": writer.id,
        "generation": writer.generation,
        "actor": actor,
        "reason": reason,
        "ts": clock_ms if clock_ms is not None else int(time.time() * 1000),
    }
    appended: list[int] = []
    failed: list[str] = []

    def delivered(error: KafkaError | None, msg: Message) -> None:
        if error is not None:
            failed.append(error.str())
        else:
            appended.append(msg.timestamp()[1])

    producer = kafka_clients.producer(kafka, {"linger.ms": 0})
    producer.produce(
        topics.identities,
        codec.encode(IDENTITY_EVENT, record),
        writer.id.encode(),
        on_delivery=delivered,
    )
    if producer.flush(30) or failed or not appended:
        raise StreamError(
            f"the {action} of {writer.header} was not appended to {topics.identities}: "
            + (failed[0] if failed else "no answer in 30 s")
        )
    return appended[0]
