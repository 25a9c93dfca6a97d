"""A simulated data mover: the cluster layer's stand-in that carries out dataset prewarms.

It reads the scheduler's DatasetPrewarm orders and, when the copy would be done (the order's
estimate, compressed by `speedup` so a demo does not wait hours), answers with a DATASET_READY
request on the scheduler's log; the scheduler then records the new replica and starts the jobs
that waited for it. A real mover would copy the objects (between S3 buckets, say) first.

An order's offset is committed only once its answer is acknowledged, so a mover stopped with
orders in hand answers them after a restart (an answer may come twice; the scheduler takes a
replica it already has as a no-op). It runs in `fleetline run`, in `fleetline serve
--data-mover` and on its own as `fleetline agent data-mover`.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.processors.scheduling.client import send
from fleetline.processors.scheduling.codec import new_request
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import DATASET_PREWARM
from fleetline.streams.records import where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class SimulatedDataMover:
    kafka: KafkaSettings
    topics: Topics
    speedup: float = 3600.0  # an hour of copying takes a second
    max_delay_s: float = 2.0
    group_id: str = "data-mover"
    codec: AvroCodec = field(default_factory=default_codec)
    moved: list[str] = field(default_factory=list)
    received: int = 0  # orders read, answered or not
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"{self.topics.prefix}.{self.group_id}"

    def run(self, stop: threading.Event) -> None:
        consumer = kafka_clients.consumer(
            self.kafka, f"{self.topics.prefix}.{self.group_id}", {"enable.auto.commit": False}
        )
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        due: list[tuple[float, int, str, str, int]] = []  # (when, offset, ticket, tenant, part)
        pending: dict[int, set[int]] = {}  # partition -> offsets not yet answered
        read_to: dict[int, int] = {}  # partition -> one past the last offset received

        def assigned(c: Consumer, partitions: list[TopicPartition]) -> None:
            self.ready.set()

        def revoked(c: Consumer, partitions: list[TopicPartition]) -> None:
            # What was received but not answered is answered by the next owner.
            for tp in partitions:
                pending.pop(tp.partition, None)
                read_to.pop(tp.partition, None)
            due[:] = [d for d in due if d[4] in pending]
            heapq.heapify(due)

        consumer.subscribe([self.topics.prewarms], on_assign=assigned, on_revoke=revoked)
        try:
            while not stop.is_set():
                msg = consumer.poll(0.1)
                error = msg.error() if msg is not None else None
                if msg is not None and error is None:
                    _, partition, offset = where(msg)
                    order = self.codec.decode(msg.value(), expect=DATASET_PREWARM).record
                    delay = min(order["estimated_s"] / self.speedup, self.max_delay_s)
                    ticket = f"{order['dataset_id']}@{order['to_cluster']}"
                    heapq.heappush(
                        due, (time.monotonic() + delay, offset, ticket, order["tenant"], partition)
                    )
                    pending.setdefault(partition, set()).add(offset)
                    self.received += 1
                    read_to[partition] = offset + 1
                elif error is not None and error.code() != KafkaError._PARTITION_EOF:
                    log.warning("data mover: %s", error.str())
                answered: set[int] = set()
                while due and due[0][0] <= time.monotonic():
                    _, offset, ticket, tenant, partition = heapq.heappop(due)
                    self._answer(producer, ticket, tenant)
                    pending[partition].discard(offset)
                    answered.add(partition)
                if answered:
                    producer.flush(10)
                    # Up to (not past) the oldest order still waiting for its answer.
                    consumer.commit(
                        offsets=[
                            TopicPartition(
                                self.topics.prewarms, p, min(pending[p], default=read_to[p])
                            )
                            for p in sorted(answered)
                        ],
                        asynchronous=False,
                    )
        finally:
            consumer.close()
            producer.flush(10)

    def _answer(self, producer: Producer, ticket: str, tenant: str) -> None:
        send(
            producer,
            self.topics,
            new_request(
                "DATASET_READY",
                ticket,
                tenant,
                int(time.time() * 1000),
                uuid.uuid4().hex,
                actor="data-mover",
            ),
            self.codec,
        )
        self.moved.append(ticket)
