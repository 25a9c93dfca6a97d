"""Each port's contract, one test case per port, run against every real backend it has.

A port is what the shells reach through: an object store (S3, plain or sealed), the view's
snapshot store (S3), a sink's destination (ClickHouse tables, the audit archive on S3) and the
changelog-backed store (Kafka). A backend passes by passing the port's case unchanged.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Message
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleetline.config import Settings
from fleetline.errors import IntegrityError, StorageError
from fleetline.processors.audit.chain import Signer, chain_event, export_entry
from fleetline.processors.audit.runtime import new_event
from fleetline.processors.operations.fold import OpsFold, TicketChanged
from fleetline.processors.operations.runtime import ticket_record
from fleetline.processors.scheduling.codec import effect_record, new_request
from fleetline.processors.scheduling.effects import AllocationChange, Decision
from fleetline.processors.view import codec as view_codec
from fleetline.storage.audit_store import AuditArchive, AuditTable
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.crypto import MAGIC, ObjectCipher, SealedObjectStore
from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
from fleetline.storage.log_sink import LogTable
from fleetline.storage.objects import ObjectStore
from fleetline.storage.operations_sink import EnergyPriceTable, TicketTable
from fleetline.storage.scheduling_sink import AllocationTable, DecisionTable, WorkloadEventTable
from fleetline.storage.sinks import Destination, Sourced
from fleetline.storage.state_sink import NodeStateTable
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import TopicSpec
from tests.fleet_events import fold, scenario_events
from tests.scheduling_support import THREE, Driver, fleet_view, training
from tests.services import snapshot_store
from tests.support import BASE_MS, small_fleet

CODEC = default_codec()

# -- object stores ------------------------------------------------------------------------------


@pytest.fixture(params=["plain", "sealed"])
def objects(request: pytest.FixtureRequest, settings: Settings) -> ObjectStore | SealedObjectStore:
    store = ObjectStore.from_settings(settings.s3, bucket="fleetline-contract")
    store.ensure_bucket()
    if request.param == "plain":
        return store
    return SealedObjectStore(store, ObjectCipher(os.urandom(32)))


def test_an_object_store_keeps_what_it_is_given(objects) -> None:
    root = f"contract/{uuid.uuid4().hex[:8]}"
    payload = bytes(range(256)) * 4096
    objects.put(f"{root}/a/part-0.bin", payload)
    objects.put(f"{root}/a/part-1.bin", b"second")
    assert objects.get(f"{root}/a/part-0.bin") == payload
    assert objects.keys(f"{root}/a/") == [f"{root}/a/part-0.bin", f"{root}/a/part-1.bin"]
    objects.delete(f"{root}/a/part-1.bin")
    assert objects.keys(f"{root}/") == [f"{root}/a/part-0.bin"]
    with pytest.raises(StorageError, match="NoSuchKey"):
        objects.get(f"{root}/missing")


# -- the view's snapshots -----------------------------------------------------------------------


def test_the_snapshot_store_finds_the_newest_snapshot_within_offsets(settings, objects) -> None:
    snapshots = snapshot_store(settings, objects=objects)
    assert snapshots.latest("shard-000") is None
    view = fold(scenario_events(seconds=3))
    view.advance("t", 0, 9)
    first = snapshots.save("shard-000", view)
    view.advance("t", 0, 19)
    second = snapshots.save("shard-000", view)
    assert [i.position for i in snapshots.list("shard-000")] == [10, 20]
    assert snapshots.latest("shard-000") == second
    assert snapshots.latest("shard-000", within={"t": {0: 15}}) == first
    assert snapshots.latest("shard-000", within={"t": {0: 5}}) is None
    assert view_codec.to_data(snapshots.load(second)) == view_codec.to_data(view)
    # An orphan blob (crash before its manifest) is invisible; a tampered blob is refused.
    blobs = snapshots.blobs
    blobs.store.put(f"{blobs.root}/shard-000/{'9' * 20}-x.view.json.gz", b"junk")
    assert snapshots.latest("shard-000") == second
    blob, _ = view_codec.encode(fold(scenario_events(seconds=1)))
    blobs.store.put(second.blob_key, blob)
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        snapshots.load(second)
    for i in range(8):
        view.advance("t", 0, 30 + i)
        snapshots.save("shard-000", view)
    assert len(snapshots.list("shard-000")) == 5  # pruned to `keep`
    if isinstance(objects, SealedObjectStore):
        # What lands in the bucket is sealed; read under another key it is passed over, and a
        # replay folds that part from the log instead.
        raw = objects.store
        newest = snapshots.list("shard-000")[-1]
        assert raw.get(newest.blob_key).startswith(MAGIC)
        other = SealedObjectStore(raw, ObjectCipher(os.urandom(32)))
        assert snapshot_store(settings, blobs.root, other).list("shard-000") == []
        # ... and so is it read with no key at all (a command run without the operator's key).
        assert snapshot_store(settings, blobs.root, raw).list("shard-000") == []


# -- sinks' destinations ------------------------------------------------------------------------


def _scheduler_records() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    view, _ = fleet_view(THREE)
    driver = Driver(view, now_ms=BASE_MS + 10_000)
    driver.submit(training("a", workers=2))
    driver.submit(training("b", workers=1, tenant="globex"))
    driver.delete("acme/a")
    decisions = [effect_record(e)[2] for e in driver.effects if isinstance(e, Decision)]
    changes = [effect_record(e)[2] for e in driver.effects if isinstance(e, AllocationChange)]
    return decisions, changes


def _audit_records() -> list[dict[str, Any]]:
    """Links of two chains, alternating: record i is of partition i % 2, as the chainer
    writes each partition's chain to the same partition of the audit log."""
    signer = Signer(Ed25519PrivateKey.generate())
    heads: dict[int, Any] = {}
    out = []
    for i in range(6):
        heads[i % 2], records = chain_event(
            heads.get(i % 2),
            i % 2,
            new_event(
                ts=BASE_MS + i,
                actor="alice",
                actor_role="user",
                operation="api.GET /v1/nodes",
                target="/v1/nodes",
                outcome="SUCCEEDED",
                tenant="acme",
            ),
            signer,
            digest_every=100,
        )
        out += records
    return out


def _node_states() -> list[dict[str, Any]]:
    return small_fleet(nodes=2).initial_states(BASE_MS)


def _ticket_records() -> list[dict[str, Any]]:
    """Every change of two tickets, as the operations fold writes them to the tickets topic."""
    fold = OpsFold()
    out = []
    for i, node in enumerate(("n1", "n2", "n1", "n2", "n1", "n2")):
        finding = {
            "node_id": node,
            "cluster_id": "c1",
            "rule": "thermal",
            "severity": "WARNING",
            "summary": f"GPU 0 at {90 + i} C",
            "evidence": {"gpu": 0},
        }
        event = {
            "event_id": str(i),
            "kind": "OBSERVE",
            "ts": BASE_MS + i,
            "key": "",
            "actor": "",
            "payload_json": json.dumps({"findings": [finding]}),
        }
        out += [
            ticket_record(e.ticket) for e in fold.step(event, i) if isinstance(e, TicketChanged)
        ]
    return out


def _energy_requests() -> list[dict[str, Any]]:
    return [
        new_request(
            "ENERGY",
            c,
            "",
            BASE_MS + i,
            f"e{i}",
            spec_json=json.dumps({"cluster_id": c, "price_per_kwh": [0.1 + i / 100] * 24}),
        )
        for i, c in enumerate(("c1", "c2", "c1", "c2", "c1", "c2"))
    ]


def _workload_events() -> list[dict[str, Any]]:
    """What a cluster agent reports of one job's run, in the order it reports it."""
    kinds = ["STARTING", "RUNNING", "PROGRESS", "CHECKPOINTED", "PROGRESS", "EXITED"]
    return [
        {
            "job": "acme/a",
            "tenant": "acme",
            "cluster_id": "c1",
            "epoch": 1,
            "attempt": 1,
            "ts": BASE_MS + i,
            "event": kind,
            "trace_id": "0" * 32,
            "pid": 4242,
            "step": 10 * i if kind in ("PROGRESS", "CHECKPOINTED") else None,
            "loss": 1.0 / (i + 1) if kind == "PROGRESS" else None,
            "samples_per_s": 512.0 if kind == "PROGRESS" else None,
            "exit_code": 0 if kind == "EXITED" else None,
            "checkpoint_uri": "s3://ckpt/acme/a/30" if kind == "CHECKPOINTED" else None,
            "bytes": 1 << 20 if kind == "CHECKPOINTED" else None,
            "seconds": 0.4 if kind == "CHECKPOINTED" else None,
            "from_cluster": None,
            "detail": f"{kind.lower()} in the contract",
        }
        for i, kind in enumerate(kinds)
    ]


def _log_records() -> list[dict[str, Any]]:
    """Log lines as the log handler ships them (`observability/logs.py`)."""
    return [
        {
            "ts": BASE_MS + i,
            "level": ("INFO", "WARNING", "ERROR")[i % 3],
            "logger": "fleetline.contract",
            "process": f"serve-{i % 2}",
            "host": "host-a",
            "cluster_id": "c1" if i % 2 else "",
            "message": f"line {i}",
            "trace_id": "",
            "fields": {"n": str(i)},
        }
        for i in range(6)
    ]


DESTINATIONS = [
    "node-states",
    "decisions",
    "allocations",
    "workload-events",
    "logs",
    "audit-table",
    "audit-archive",
    "repair-tickets",
    "energy-prices",
]


@pytest.fixture(params=DESTINATIONS)
def destination(
    request: pytest.FixtureRequest, settings: Settings
) -> Iterator[tuple[Destination, list[dict[str, Any]], bool]]:
    """(a destination on its real backend, records it keeps, whether it tells topics apart)."""
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    db = settings.clickhouse_database
    decisions, changes = _scheduler_records()
    match request.param:
        case "node-states":
            yield NodeStateTable(client, db), _node_states(), True
        case "decisions":
            yield DecisionTable(client, db), decisions, True
        case "allocations":
            yield AllocationTable(client, db), changes, True
        case "workload-events":
            yield WorkloadEventTable(client, db), _workload_events(), True
        case "logs":
            yield LogTable(client, db), _log_records(), True
        case "audit-table":
            yield AuditTable(client, db), _audit_records(), True
        case "repair-tickets":
            yield TicketTable(client, db), _ticket_records(), True
        case "energy-prices":
            yield EnergyPriceTable(client, db), _energy_requests(), True
        case "audit-archive":
            store = ObjectStore.from_settings(settings.s3)
            store.ensure_bucket()
            sealed = SealedObjectStore(store, ObjectCipher(os.urandom(32)))
            # The archive keeps export entries, one folder (root) per topic prefix.
            yield (
                AuditArchive(sealed, f"contract/{uuid.uuid4().hex[:8]}"),
                [export_entry(r, reveal_sensitive=True) for r in _audit_records()],
                False,
            )


def test_a_destination_resumes_after_what_it_stored(destination) -> None:
    store, records, names_topics = destination
    topic = f"contract.{uuid.uuid4().hex[:8]}"
    assert store.resume_offsets(topic) == {}
    # Records of two partitions, offsets as the log gave them (not from zero).
    batch = [Sourced(i % 2, 40 + i, record, topic) for i, record in enumerate(records)]
    store.store(batch[:3])
    assert store.resume_offsets(topic) == {
        p: max(s.offset for s in batch[:3] if s.partition == p) + 1 for p in (0, 1)
    }
    store.store(batch[3:])
    expected = {p: max(s.offset for s in batch if s.partition == p) + 1 for p in (0, 1)}
    assert store.resume_offsets(topic) == expected
    if names_topics:
        # Another topic prefix in the same store starts from nothing, and moves nothing here.
        other = f"contract.{uuid.uuid4().hex[:8]}"
        assert store.resume_offsets(other) == {}
        store.store([Sourced(0, 7, records[0], other)])
        assert store.resume_offsets(other) == {0: 8}
        assert store.resume_offsets(topic) == expected


def test_the_sample_store_resumes_after_what_it_stored_and_knows_each_node_s_seq(
    settings,
) -> None:
    """The hot samples' store (gpu_samples), written the way the sample sink writes it: where
    each partition resumes, the highest seq of each node, per topic prefix."""
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    store = HotSampleStore(client, settings.clickhouse_database)
    topic, other = (f"contract.{uuid.uuid4().hex[:8]}" for _ in range(2))
    fleet = small_fleet(nodes=2)
    records = [r for t in range(3) for r in fleet.telemetry(BASE_MS + t * 1000)]
    messages = [
        Message(
            topic=topic,
            partition=i % 2,
            offset=40 + i,
            key=r["node_id"].encode(),
            value=CODEC.encode("NodeTelemetry", r),
        )
        for i, r in enumerate(records)
    ]
    assert store.resume_offsets(topic) == {} and store.node_watermarks(topic) == {}
    sink = HotSampleSink(CODEC, store, topic)
    result = sink.process(messages)
    assert result.payload is not None and not result.dead_letters
    sink.store(result.payload)
    assert store.resume_offsets(topic) == {
        p: max(m.offset() for m in messages if m.partition() == p) + 1 for p in (0, 1)
    }
    newest: dict[str, int] = {}
    for r in records:
        newest[r["node_id"]] = max(newest.get(r["node_id"], 0), r["seq"])
    assert store.node_watermarks(topic) == newest and len(newest) > 1
    # Another topic prefix in the same table starts from nothing.
    assert store.resume_offsets(other) == {} and store.node_watermarks(other) == {}


def test_node_states_an_agent_sends_again_are_stored_once(settings) -> None:
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    db = settings.clickhouse_database
    topic = f"contract.{uuid.uuid4().hex[:8]}"
    states = _node_states()
    table = NodeStateTable(client, db)
    table.store([Sourced(0, i, r, topic) for i, r in enumerate(states)])
    # The agent was killed before its spool's mark moved: it sends the last two again (same
    # seq, later offsets), to this sink and, after a restart, to a new one.
    table.store([Sourced(0, 10 + i, r, topic) for i, r in enumerate(states[-2:])])
    NodeStateTable(client, db).store([Sourced(0, 20 + i, r, topic) for i, r in enumerate(states)])
    newer = {**states[0], "seq": states[0]["seq"] + 1}
    NodeStateTable(client, db).store([Sourced(0, 30, newer, topic)])
    rows = client.query(
        f"SELECT node_id, seq FROM {db}.node_states WHERE source_topic = {{t:String}}",
        parameters={"t": topic},
    ).result_rows
    assert sorted(rows) == sorted(
        [(r["node_id"], r["seq"]) for r in states] + [(newer["node_id"], newer["seq"])]
    )


# -- changelog-backed state ---------------------------------------------------------------------


def test_a_changelog_store_restores_what_was_committed_and_only_that(settings) -> None:
    topic = f"contract.{uuid.uuid4().hex[:8]}.changelog"
    kafka_clients.ensure_topics(
        settings.kafka, [TopicSpec(topic, 2, {"cleanup.policy": "compact"})]
    )
    store: ChangelogStore[str] = ChangelogStore("s", topic, str.encode, bytes.decode)
    producer = kafka_clients.producer(settings.kafka)
    store.put(0, b"a", "one")
    store.put(1, b"b", "two")
    assert store.get(0, b"a") == "one" and store.committed(0, b"a") is None
    for partition, key, value in store.pending_changelog():
        producer.produce(topic, key=key, value=value, partition=partition)
    store.commit()
    store.put(0, b"a", None)  # a delete...
    for partition, key, value in store.pending_changelog():
        producer.produce(topic, key=key, value=value, partition=partition)
    store.commit()
    store.put(1, b"c", "staged")  # ... and a write never committed (its batch aborted)
    store.abort()
    assert producer.flush(30) == 0
    restored: ChangelogStore[str] = ChangelogStore("s", topic, str.encode, bytes.decode)
    assert restored.restore(settings.kafka, [0, 1]) == 3
    assert dict(restored.items()) == {b"b": "two"}
    assert restored.partitions() == [0, 1]
