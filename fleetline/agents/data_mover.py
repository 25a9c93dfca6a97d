"""The data mover: the cluster layer's agent that carries out the scheduler's dataset prewarms.

It reads DatasetPrewarm orders and copies each dataset's objects from the source cluster's store
into the target's (agents/dataplane/prewarm.py: digests verified on arrival, at the rate the
order grants, which the scheduler holds to the tenant's `bandwidth_gbps` quota), reports how far
it is (DATASET_PROGRESS, at most every `progress_every_s`) and, once the replica is complete,
answers DATASET_READY; the scheduler then places the jobs that waited for it. A copy that cannot
complete (its source does not match its manifest) is reported with its reason and never marked
ready.

An order's offset is committed only once its answer is acknowledged, so a mover killed with
copies in hand takes them up again after a restart, where they were (an answer may come twice;
the scheduler takes a replica it already has as a no-op). It runs in `fleetline serve` (unless
`--no-data-mover`), in `fleetline run`, and on its own as `fleetline agent data-mover`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from fleetline.agents.dataplane.prewarm import CopyError, CopyReport, Mask, copy_dataset, mask_key
from fleetline.config import KafkaSettings, S3Settings
from fleetline.errors import FleetlineError
from fleetline.processors.scheduling.client import send
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.specs import dataset_prefix
from fleetline.storage.checkpoints import cluster_bucket
from fleetline.storage.objects import ObjectStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import DATASET_PREWARM
from fleetline.streams.records import where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

ACTOR = "data-mover"


@dataclass
class DataMover:
    kafka: KafkaSettings
    s3: S3Settings
    topics: Topics
    group_id: str = "data-mover"
    object_key: bytes | None = None  # the deployment's object-encryption key (masking)
    copies: int = 4  # at once (each at its own order's rate)
    progress_every_s: float = 1.0
    codec: AvroCodec = field(default_factory=default_codec)
    moved: list[str] = field(default_factory=list)  # tickets answered ready
    failed: list[str] = field(default_factory=list)
    reports: dict[str, CopyReport] = field(default_factory=dict)
    received: int = 0  # orders read, answered or not
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"{self.topics.prefix}.{self.group_id}"

    def run(self, stop: threading.Event) -> None:
        consumer = kafka_clients.consumer(self.kafka, self.name, {"enable.auto.commit": False})
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        pool = ThreadPoolExecutor(self.copies, thread_name_prefix="data-mover")
        # partition -> offset -> its copy; answered copies leave, the rest hold the commit back
        copying: dict[int, dict[int, Future[None]]] = {}
        read_to: dict[int, int] = {}  # partition -> one past the last offset received
        halt = threading.Event()  # stops the copies (on shutdown or a lost partition)

        def assigned(c: Consumer, partitions: list[TopicPartition]) -> None:
            self.ready.set()

        def revoked(c: Consumer, partitions: list[TopicPartition]) -> None:
            # What was received but not answered is copied on by the next owner.
            for tp in partitions:
                for future in copying.pop(tp.partition, {}).values():
                    future.cancel()
                read_to.pop(tp.partition, None)

        consumer.subscribe([self.topics.prewarms], on_assign=assigned, on_revoke=revoked)
        try:
            while not stop.is_set():
                msg = consumer.poll(0.1)
                error = msg.error() if msg is not None else None
                if msg is not None and error is None:
                    _, partition, offset = where(msg)
                    order = self.codec.decode(msg.value(), expect=DATASET_PREWARM).record
                    copying.setdefault(partition, {})[offset] = pool.submit(
                        self._carry_out, producer, order, halt
                    )
                    self.received += 1
                    read_to[partition] = offset + 1
                elif error is not None and error.code() != KafkaError._PARTITION_EOF:
                    log.warning("data mover: %s", error.str())
                self._commit(consumer, copying, read_to)
        finally:
            halt.set()
            pool.shutdown(wait=True, cancel_futures=True)
            consumer.close()
            producer.flush(10)

    def _commit(
        self,
        consumer: Consumer,
        copying: dict[int, dict[int, Future[None]]],
        read_to: dict[int, int],
    ) -> None:
        offsets = []
        for partition in sorted(copying):
            futures = copying[partition]
            answered = False
            for offset, future in list(futures.items()):
                if not future.done() or future.cancelled():
                    continue
                try:
                    future.result()  # a copy's own failure is answered inside it
                except _Stopped:
                    continue  # not answered: held back, taken up after a restart
                del futures[offset]
                answered = True
            if not answered:
                continue
            # Up to (not past) the oldest order still being copied.
            offsets.append(
                TopicPartition(
                    self.topics.prewarms, partition, min(futures, default=read_to[partition])
                )
            )
        if offsets:
            consumer.commit(offsets=offsets, asynchronous=False)

    def _carry_out(self, producer: Producer, order: dict[str, Any], halt: threading.Event) -> None:
        ticket = f"{order['dataset_id']}@{order['to_cluster']}"
        prefix = order.get("prefix") or dataset_prefix(order["tenant"], order["dataset_id"])
        tenant = order["tenant"]
        last = 0.0

        def progress(copied: int, total: int) -> None:
            nonlocal last
            if time.monotonic() - last >= self.progress_every_s or copied == total:
                last = time.monotonic()
                self._report(producer, "DATASET_PROGRESS", ticket, tenant, copied, total)

        try:
            if not order.get("from_cluster"):
                raise FleetlineError("the order names no cluster to copy from")
            report = copy_dataset(
                self._store(order["from_cluster"]),
                self._store(order["to_cluster"]),
                prefix,
                order["rate_gbps"] * 1e9 / 8,
                halt,
                progress,
                self._mask(order),
            )
        except FleetlineError as exc:
            log.warning("data mover: the copy of %s failed: %s", ticket, exc)
            self._report(producer, "DATASET_PROGRESS", ticket, tenant, error=str(exc))
            self.failed.append(ticket)
            return
        if report is None:
            raise _Stopped  # not answered: the next owner of the order copies on
        log.info(
            "data mover: %s: %d bytes copied (%d kept) in %.1f s, %.3f Gbit/s, refetched %s",
            ticket,
            report.copied_bytes,
            report.kept_bytes,
            report.elapsed_s,
            report.rate_bps / 1e9,
            report.refetched or "none",
        )
        self.reports[ticket] = report
        self._report(producer, "DATASET_READY", ticket, tenant)
        self.moved.append(ticket)

    def _mask(self, order: dict[str, Any]) -> Mask | None:
        fields = tuple(order.get("mask_fields") or ())
        if not fields:
            return None
        if self.object_key is None:
            raise CopyError(
                f"the copy leaves its region and must mask {', '.join(fields)}, but no "
                "object-encryption key is set (FLEETLINE_OBJECT_ENCRYPTION_KEY) to mask under"
            )
        return Mask(fields, mask_key(self.object_key, order["tenant"]))

    def _store(self, cluster_id: str) -> ObjectStore:
        return ObjectStore.from_settings(self.s3, cluster_bucket(self.s3.bucket, cluster_id))

    def _report(
        self,
        producer: Producer,
        kind: str,
        ticket: str,
        tenant: str,
        copied: int = 0,
        total: int = 0,
        error: str | None = None,
    ) -> None:
        body = None
        if kind == "DATASET_PROGRESS":
            body = {"error": error} if error else {"copied_bytes": copied, "total_bytes": total}
        send(
            producer,
            self.topics,
            new_request(
                kind,
                ticket,
                tenant,
                int(time.time() * 1000),
                uuid.uuid4().hex,
                spec_json=json.dumps(body) if body is not None else None,
                actor=ACTOR,
            ),
            self.codec,
        )
        if producer.flush(10):
            raise FleetlineError(f"the data mover's {kind} for {ticket} was not delivered")


class _Stopped(Exception):
    """A copy stopped before it was done (the mover shutting down)."""
