"""The audit chainer and emitter: the imperative shell around `processors/audit.py`.

Sources (the API, the CLI, processors) emit AuditEvents to `<prefix>.audit.requests`, keyed by
tenant. The chainer, a transactional processor, links each event into the hash chain of the same
partition number of `<prefix>.audit.log` and appends a signed digest every `digest_every` links.
The chain head (next seq, last hash) lives in a changelog-backed store committed in the same
transaction as the records, so a crash or an abort can neither fork nor skip a chain.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Message
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
    load_pem_public_key,
)

from fleetline.config import KafkaSettings
from fleetline.errors import ConfigError, InvalidEventError
from fleetline.processors.audit.chain import (
    ChainHead,
    Signer,
    chain_event,
    export_entry,
    key_id,
    stub_entry,
)
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import AUDIT_EVENT
from fleetline.streams.processor import Output, TransactionalProcessor
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics

APPLICATION_ID = "audit-chain"
HEAD_KEY = b"head"
FLEET_KEY = "_fleet"


def head_store(changelog_topic: str) -> ChangelogStore[ChainHead]:
    return ChangelogStore("chain", changelog_topic,
                          lambda head: json.dumps(head.as_data()).encode(),
                          lambda data: ChainHead.from_data(json.loads(data)))


@dataclass
class AuditChainHandler:
    codec: AvroCodec
    store: ChangelogStore[ChainHead]
    output_topic: str
    signer: Signer
    digest_every: int = 100

    def __call__(self, msg: Message) -> Sequence[Output]:
        event = self.codec.decode(msg.value(), expect=AUDIT_EVENT).record
        for name in ("event_id", "actor", "operation", "request_id"):
            if not event[name]:
                raise InvalidEventError(f"audit event {event['event_id']!r}: {name} is empty")
        partition = msg.partition()
        head, records = chain_event(self.store.get(partition, HEAD_KEY), partition, event,
                                    self.signer, self.digest_every)
        self.store.put(partition, HEAD_KEY, head)
        return [Output(self.output_topic, msg.key(), self.codec.encode("AuditRecord", record),
                       partition=partition) for record in records]


def audit_chainer(kafka: KafkaSettings, topics: Topics, signer: Signer,
                  digest_every: int = 100, instance_id: str = "0") -> TransactionalProcessor:
    """The chainer as a transactional processor; `ensure_topics` must include its changelog."""
    codec = default_codec()
    app = f"{topics.prefix}.{APPLICATION_ID}"
    store = head_store(topics.changelog(APPLICATION_ID, "chain"))
    return TransactionalProcessor(
        kafka=kafka, application_id=app, inputs=[topics.audit_requests],
        handler=AuditChainHandler(codec, store, topics.audit_log, signer, digest_every),
        dead_letter_topic=topics.dead_letter, stores=[store], instance_id=instance_id)


def load_signer(path: Path, create: bool = False) -> Signer:
    """The Ed25519 signing key in PEM (PKCS#8); with `create`, made (mode 0600) if absent."""
    if not path.exists():
        if not create:
            raise ConfigError(f"audit signing key {path} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
    try:
        key = load_pem_private_key(path.read_bytes(), password=None)
    except ValueError as exc:
        raise ConfigError(f"audit signing key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"audit signing key {path} is not an Ed25519 key")
    return Signer(key)


def load_public_keys(paths: Sequence[Path]) -> dict[str, Ed25519PublicKey]:
    """Public keys (PEM) by key id; a private key file yields its public half."""
    keys: dict[str, Ed25519PublicKey] = {}
    for path in paths:
        data = path.read_bytes()
        try:
            key = (load_pem_private_key(data, password=None).public_key()
                   if b"PRIVATE KEY" in data else load_pem_public_key(data))
        except ValueError as exc:
            raise ConfigError(f"audit verify key {path}: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"audit verify key {path} is not an Ed25519 key")
        keys[key_id(key)] = key
    return keys


def new_event(*, ts: int, actor: str, actor_role: str, operation: str, target: str,
              outcome: str, request_id: str | None = None, tenant: str | None = None,
              status: int = 0, trace_id: str | None = None, source: str = "api",
              details: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An AuditEvent record. The shell supplies time and ids; the salt is fresh randomness,
    which is what makes a masked field's commitment unguessable."""
    return {"event_id": uuid.uuid4().hex, "ts": ts, "actor": actor, "actor_role": actor_role,
            "tenant": tenant, "operation": operation, "target": target, "outcome": outcome,
            "status": status, "request_id": request_id or uuid.uuid4().hex,
            "trace_id": trace_id, "source": source, "details": dict(details or {}),
            "salt": os.urandom(16)}


class KafkaAuditEmitter:
    """Sends AuditEvents to the requests topic with an idempotent producer, keyed by tenant so a
    tenant's records share one chain."""

    def __init__(self, kafka: KafkaSettings, topics: Topics) -> None:
        self.topic = topics.audit_requests
        self.codec = default_codec()
        self.producer = kafka_clients.producer(kafka)

    def emit(self, event: Mapping[str, Any]) -> None:
        key = (event.get("tenant") or FLEET_KEY).encode()
        while True:
            try:
                self.producer.produce(self.topic, key=key,
                                      value=self.codec.encode("AuditEvent", event))
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)

    def flush(self, timeout_s: float = 30.0) -> int:
        return self.producer.flush(timeout_s)


def read_chain(kafka: KafkaSettings, topics: Topics,
               timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every AuditRecord on the audit topic, partition by partition in log order."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    codec = default_codec()
    consumer = kafka_clients.consumer(kafka, f"fleetline-audit-read-{uuid.uuid4().hex[:12]}")
    try:
        metadata = consumer.list_topics(topics.audit_log, timeout=30).topics[topics.audit_log]
        if metadata.error is not None:
            raise ConfigError(f"topic {topics.audit_log}: {metadata.error.str()}")
        ends = {}
        for p in metadata.partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topics.audit_log, p),
                                                     timeout=30, cached=False)
            if high > 0:
                ends[p] = high
        consumer.assign([TopicPartition(topics.audit_log, p, OFFSET_BEGINNING) for p in ends])
        by_partition: dict[int, list[dict[str, Any]]] = {p: [] for p in ends}
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if msg.error():
                    continue
                by_partition[msg.partition()].append(codec.decode(msg.value()).record)
                if msg.offset() + 1 >= ends[msg.partition()]:
                    ends.pop(msg.partition(), None)
            for p in list(ends):
                if consumer.position([TopicPartition(topics.audit_log, p)])[0].offset >= ends[p]:
                    ends.pop(p)
        if ends:
            raise ConfigError(f"could not read the audit topic to its end in {timeout_s}s")
    finally:
        consumer.close()
    return [r for p in sorted(by_partition) for r in by_partition[p]]


def export_window(records: list[dict[str, Any]], tenant: str | None, since_ms: int | None,
                  until_ms: int | None, reveal_sensitive: bool
                  ) -> tuple[list[dict[str, Any]], dict[int, tuple[int, bytes]]]:
    """The export entries for a tenant (None: all) and time range, and the anchors where a
    partition's window starts mid-chain. Within each partition's window, from the first
    matching event to the last, links the reader may not see are stubs and digests are kept,
    so the window verifies as a whole."""
    by_partition: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_partition.setdefault(record["partition"], []).append(record)
    entries: list[dict[str, Any]] = []
    anchors: dict[int, tuple[int, bytes]] = {}

    def matches(record: dict[str, Any]) -> bool:
        event = record["event"]
        return event is not None and (tenant is None or event["tenant"] == tenant) and (
            since_ms is None or event["ts"] >= since_ms) and (
            until_ms is None or event["ts"] <= until_ms)

    for partition in sorted(by_partition):
        chain = by_partition[partition]
        hits = [i for i, r in enumerate(chain) if matches(r)]
        if not hits:
            continue
        first, last = hits[0], hits[-1]
        # Carry on to the next digest, so the window ends signed where the chain allows.
        while last + 1 < len(chain) and chain[last]["digest"] is None:
            last += 1
        if chain[first]["seq"] != 0:
            anchors[partition] = (chain[first]["seq"], chain[first]["prev_hash"])
        for record in chain[first:last + 1]:
            visible = record["event"] is None or (
                tenant is None or record["event"]["tenant"] == tenant)
            entries.append(export_entry(record, reveal_sensitive) if visible
                           else stub_entry(record))
    return entries, anchors
