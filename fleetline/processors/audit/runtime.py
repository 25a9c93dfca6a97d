"""The audit chainer and emitter: the imperative shell around `processors/audit/chain.py`.

Sources (the API, the CLI, processors) emit AuditEvents to `<prefix>.audit.requests`, keyed by
tenant. The chainer, a transactional processor, links each event into the hash chain of the same
partition number of `<prefix>.audit.log` and appends a signed digest every `digest_every` links.
The chain head (next seq, last hash) lives in a changelog-backed store committed in the same
transaction as the records, so a crash or an abort can neither fork nor skip a chain.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import KafkaError, Message
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
    load_pem_public_key,
)

from fleetline.config import KafkaSettings
from fleetline.errors import ConfigError, FleetlineError, InvalidEventError
from fleetline.identity.authority import workload_refusal
from fleetline.identity.writers import EstablishesWriters, WriterRefused
from fleetline.processors.audit.chain import (
    ChainHead,
    Signer,
    chain_event,
    key_id,
)
from fleetline.processors.audit.sources import (
    decision_event,
    order_event,
    refused_event,
    workload_event,
)
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.events import (
    AUDIT_EVENT,
    AUDIT_RECORD,
    SCHEDULING_DECISION,
    WORKLOAD_EVENT,
    WORKLOAD_ORDER,
)
from fleetline.streams.loop import MessageStep, StepResult, StreamLoop
from fleetline.streams.records import Output, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics, TopicSpec
from fleetline.streams.writers import WriterGate

APPLICATION_ID = "audit-chain"
CHAIN_STORE = "chain"  # each partition's chain head
LINK_APPLICATION_ID = "audit-link"
HEAD_KEY = b"head"
FLEET_KEY = "_fleet"


def head_store(changelog_topic: str) -> ChangelogStore[ChainHead]:
    return ChangelogStore(
        "chain",
        changelog_topic,
        lambda head: json.dumps(head.as_data()).encode(),
        lambda data: ChainHead.from_data(json.loads(data)),
    )


class AuditChainStep(MessageStep):
    """Links each event into its partition's chain; the chain head is a changelog-backed store
    written in the same transaction as the records."""

    def __init__(
        self,
        codec: AvroCodec,
        store: ChangelogStore[ChainHead],
        output_topic: str,
        signer: Signer,
        digest_every: int = 100,
    ) -> None:
        self.codec = codec
        self.heads = store  # each partition's chain head
        self.stores = [store]
        self.output_topic = output_topic
        self.signer = signer
        self.digest_every = digest_every

    def handle(self, message: Message) -> Sequence[Output]:
        msg = message
        event = self.codec.decode(msg.value(), expect=AUDIT_EVENT).record
        for name in ("event_id", "actor", "operation", "request_id"):
            if not event[name]:
                raise InvalidEventError(f"audit event {event['event_id']!r}: {name} is empty")
        _, partition, _ = where(msg)
        head, records = chain_event(
            self.heads.get(partition, HEAD_KEY), partition, event, self.signer, self.digest_every
        )
        self.heads.put(partition, HEAD_KEY, head)
        return [
            Output(
                self.output_topic,
                msg.key(),
                self.codec.encode(AUDIT_RECORD, record),
                partition=partition,
            )
            for record in records
        ]


def changelog(topics: Topics) -> TopicSpec:
    """The chainer's heads changelog (a partition per audit partition), as the composition
    root creates it."""
    return topics.changelog_spec(APPLICATION_ID, CHAIN_STORE, partitions=topics.audit_partitions)


def audit_chainer(
    kafka: KafkaSettings,
    topics: Topics,
    signer: Signer,
    digest_every: int = 100,
    instance_id: str = "0",
) -> StreamLoop:
    """The chainer, exactly once; `ensure_topics` must include its changelog."""
    store = head_store(topics.changelog(APPLICATION_ID, CHAIN_STORE))
    step = AuditChainStep(default_codec(), store, topics.audit_log, signer, digest_every)
    return StreamLoop(
        kafka,
        f"{topics.prefix}.{APPLICATION_ID}",
        [topics.audit_requests],
        step,
        topics.dead_letter,
        exactly_once=True,
        instance_id=instance_id,
    )


class AuditLinkStep(MessageStep):
    """Turns the control plane's own actions (decisions, orders, workload transitions) and the
    records the folds refused for their writer into AuditEvents for the chainer, in the same
    transaction as the offsets it read: each is audited once, and the event commits to the
    digest of the action's exact bytes. A workload event is audited with its established
    writer, and refused (dead-lettered) when that writer may not report for its cluster."""

    def __init__(self, codec: AvroCodec, topics: Topics, gate: EstablishesWriters) -> None:
        self.codec = codec
        self.gate = gate
        self.output_topic = topics.audit_requests
        self.workloads = topics.workloads
        self.dead_letter = topics.dead_letter
        self.sources: dict[str, tuple[str, Any]] = {
            topics.decisions: (SCHEDULING_DECISION, decision_event),
            topics.orders: (WORKLOAD_ORDER, order_event),
        }

    def process(self, messages: list[Message]) -> StepResult[None]:
        self.gate.new_batch(messages)
        return super().process(messages)

    def handle(self, message: Message) -> Sequence[Output]:
        topic = message.topic() or ""
        if topic == self.dead_letter:
            return self._refused(message)
        value = message.value()
        if value is None:  # a compacted topic's tombstone: nothing was done
            return []
        digest = hashlib.sha256(value).hexdigest()
        if topic == self.workloads:
            writer = self.gate.writer_of(message)
            record = self.codec.decode(value, expect=WORKLOAD_EVENT).record
            refusal = workload_refusal(writer, record["cluster_id"])
            if refusal is not None:
                raise WriterRefused(writer.header, refusal)
            event = workload_event(record, digest, writer.header)
        else:
            expect, convert = self.sources[topic]
            event = convert(self.codec.decode(value, expect=expect).record, digest)
        return [] if event is None else self._output(event)

    def _output(self, event: dict[str, Any]) -> list[Output]:
        event = {**event, "salt": os.urandom(16)}
        key = (event.get("tenant") or FLEET_KEY).encode()
        return [Output(self.output_topic, key, self.codec.encode(AUDIT_EVENT, event))]

    def _refused(self, message: Message) -> list[Output]:
        """A dead letter the control plane wrote because a record's writer was refused: the
        chain names the true writer. Anything else on the topic is not an action to audit."""
        letter = read_dead_letter(message)
        if letter.error != WriterRefused.__name__ or not _from_control_plane(self.gate, message):
            return []  # only the control plane's folds refuse records for their writer
        try:
            claimed = self.codec.decode(letter.value).record.get("actor") or None
        except FleetlineError:
            claimed = None
        return self._output(
            refused_event(
                letter.writer,
                letter.reason,
                letter.application,
                letter.source_id,
                claimed,
                message.timestamp()[1],
            )
        )


def _from_control_plane(gate: EstablishesWriters, message: Message) -> bool:
    try:
        return gate.writer_of(message).is_control_plane
    except FleetlineError:
        return False


def audit_linker(kafka: KafkaSettings, topics: Topics, instance_id: str = "0") -> StreamLoop:
    """The linker, exactly once: what the scheduler and the cluster agents did, and what the
    folds refused, to the chainer."""
    return StreamLoop(
        kafka,
        f"{topics.prefix}.{LINK_APPLICATION_ID}",
        [topics.decisions, topics.orders, topics.workloads, topics.dead_letter],
        AuditLinkStep(default_codec(), topics, WriterGate(kafka, topics)),
        topics.dead_letter,
        exactly_once=True,
        instance_id=instance_id,
    )


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
        loaded = load_pem_private_key(path.read_bytes(), password=None)
    except ValueError as exc:
        raise ConfigError(f"audit signing key {path}: {exc}") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ConfigError(f"audit signing key {path} is not an Ed25519 key")
    return Signer(loaded)


def load_public_keys(paths: Sequence[Path]) -> dict[str, Ed25519PublicKey]:
    """Public keys (PEM) by key id; a private key file yields its public half."""
    keys: dict[str, Ed25519PublicKey] = {}
    for path in paths:
        data = path.read_bytes()
        try:
            key = (
                load_pem_private_key(data, password=None).public_key()
                if b"PRIVATE KEY" in data
                else load_pem_public_key(data)
            )
        except ValueError as exc:
            raise ConfigError(f"audit verify key {path}: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"audit verify key {path} is not an Ed25519 key")
        keys[key_id(key)] = key
    return keys


def new_event(
    *,
    ts: int,
    actor: str,
    actor_role: str,
    operation: str,
    target: str,
    outcome: str,
    request_id: str | None = None,
    tenant: str | None = None,
    status: int = 0,
    trace_id: str | None = None,
    source: str = "api",
    details: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """An AuditEvent record. The shell supplies time and ids; the salt is fresh randomness,
    which is what makes a masked field's commitment unguessable."""
    return {
        "event_id": uuid.uuid4().hex,
        "ts": ts,
        "actor": actor,
        "actor_role": actor_role,
        "tenant": tenant,
        "operation": operation,
        "target": target,
        "outcome": outcome,
        "status": status,
        "request_id": request_id or uuid.uuid4().hex,
        "trace_id": trace_id,
        "source": source,
        "details": dict(details or {}),
        "salt": os.urandom(16),
    }


class AuditEmitter(Protocol):
    """Where sources (the API, the CLI, processors) send their AuditEvents."""

    def emit(self, event: dict[str, Any]) -> None: ...


def data_access(sql: str, rows: int) -> dict[str, str]:
    """What the audit records of a read of stored data: the SQL's digest (not its text, which
    may hold what the reader looked for) and how many rows it returned."""
    return {"sql_sha256": hashlib.sha256(sql.encode()).hexdigest(), "rows": str(rows)}


class KafkaAuditEmitter:
    """Sends AuditEvents to the requests topic with an idempotent producer, keyed by tenant so a
    tenant's records share one chain."""

    def __init__(self, kafka: KafkaSettings, topics: Topics) -> None:
        self.topic = topics.audit_requests
        self.codec = default_codec()
        self.producer = kafka_clients.producer(kafka)
        # Why records were refused (a missing topic, a denied principal): a refused record
        # leaves the queue as surely as a written one, so an empty queue proves nothing.
        self.refused: list[str] = []

    def emit(self, event: dict[str, Any]) -> None:
        key = (event.get("tenant") or FLEET_KEY).encode()
        while True:
            try:
                self.producer.produce(
                    self.topic,
                    key=key,
                    value=self.codec.encode(AUDIT_EVENT, event),
                    on_delivery=self._delivered,
                )
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)

    def _delivered(self, error: KafkaError | None, _message: object) -> None:
        if error is not None:
            self.refused.append(f"{self.topic}: {error.str()}")

    def flush(self, timeout_s: float = 30.0) -> int:
        """How many records are not written: still queued after `timeout_s`, or refused by
        the broker (`refused` says why)."""
        return self.producer.flush(timeout_s) + len(self.refused)


def published_decisions(
    kafka: KafkaSettings, topics: Topics, timeout_s: float = 60.0
) -> list[tuple[dict[str, Any], str]]:
    """Every decision on its topic in log order, with the SHA-256 of its exact bytes (what the
    linker chains, and `unaudited_decisions` compares)."""
    codec = default_codec()
    out = []
    for msg in kafka_clients.read_to_end(
        kafka, topics.decisions, [0], f"fleetline-audit-read-{uuid.uuid4().hex[:12]}", timeout_s
    ):
        value = msg.value() or b""
        out.append(
            (
                codec.decode(value, expect=SCHEDULING_DECISION).record,
                hashlib.sha256(value).hexdigest(),
            )
        )
    return out


def read_chain(
    kafka: KafkaSettings, topics: Topics, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    """Every AuditRecord on the audit topic, partition by partition in log order."""
    codec = default_codec()
    partitions = kafka_clients.partitions_of(kafka, topics.audit_log)
    by_partition: dict[int, list[dict[str, Any]]] = {p: [] for p in partitions}
    for msg in kafka_clients.read_to_end(
        kafka,
        topics.audit_log,
        partitions,
        f"fleetline-audit-read-{uuid.uuid4().hex[:12]}",
        timeout_s,
    ):
        by_partition[msg.partition() or 0].append(codec.decode(msg.value()).record)
    return [r for p in sorted(by_partition) for r in by_partition[p]]
