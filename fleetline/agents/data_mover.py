"""A simulated data mover: the cluster layer's stand-in that carries out dataset prewarms.

It reads the scheduler's DatasetPrewarm orders and, when the copy would be done (the order's
estimate, compressed by `speedup` so a demo does not wait hours), answers with a DATASET_READY
request on the scheduler's log; the scheduler then records the new replica and starts the jobs
that waited for it. A real mover would copy the objects (between S3 buckets, say) first.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

from fleetline.config import KafkaSettings
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.runtime import send
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import DATASET_PREWARM
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
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"{self.topics.prefix}.{self.group_id}"

    def run(self, stop: threading.Event) -> None:
        consumer = kafka_clients.consumer(
            self.kafka,
            f"{self.topics.prefix}.{self.group_id}",
            {"enable.auto.commit": True, "enable.auto.offset.store": True},
        )
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        due: list[tuple[float, str, str]] = []  # (when, ticket, tenant)
        consumer.subscribe([self.topics.prewarms], on_assign=lambda c, ps: self.ready.set())
        try:
            while not stop.is_set():
                msg = consumer.poll(0.1)
                error = msg.error() if msg is not None else None
                if msg is not None and error is None:
                    order = self.codec.decode(msg.value(), expect=DATASET_PREWARM).record
                    delay = min(order["estimated_s"] / self.speedup, self.max_delay_s)
                    ticket = f"{order['dataset_id']}@{order['to_cluster']}"
                    heapq.heappush(due, (time.monotonic() + delay, ticket, order["tenant"]))
                elif error is not None and error.code() != KafkaError._PARTITION_EOF:
                    log.warning("data mover: %s", error.str())
                while due and due[0][0] <= time.monotonic():
                    _, ticket, tenant = heapq.heappop(due)
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
                    producer.flush(10)
                    self.moved.append(ticket)
        finally:
            consumer.close()
            producer.flush(10)
