"""The scheduler's decisions and allocations sunk into ClickHouse from Kafka, and the ready
queries built on them (job wait times, utilisation by tenant, preemptions) answering as a
reference computed in Python does."""

from __future__ import annotations

import time

import pytest

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.processors.scheduling.codec import effect_record
from fleetline.processors.scheduling.effects import AllocationChange
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.storage.clickhouse import migrate
from fleetline.storage.hot_sink import HotSampleStore, SourcedTelemetry, to_columns
from fleetline.storage.objects import ObjectStore
from fleetline.storage.queries import ready_sql
from fleetline.storage.scheduling_sink import AllocationTable, DecisionTable
from fleetline.storage.sinks import RecordSink
from fleetline.storage.tiering.macros import tiered_sql
from fleetline.storage.tiering.store import TieredStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import ALLOCATION, SCHEDULING_DECISION
from fleetline.streams.loop import StreamLoop
from fleetline.streams.serde import default_codec
from tests.scheduling_support import Driver, fleet_view, training
from tests.support import BASE_MS, Background, fresh_topics, wait_until

pytestmark = pytest.mark.services
CODEC = default_codec()


def test_decisions_and_allocations_answer_wait_times_and_utilisation_by_tenant(
    settings, clickhouse
):
    db = settings.clickhouse_database
    migrate(clickhouse, db)
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    clusters = [ClusterSpec("us-east-a", "us-east", 4)]
    view, _ = fleet_view(clusters)
    d = Driver(view, now_ms=BASE_MS + 10_000)
    d.submit(training("a", workers=2, tenant="alpha"))
    d.submit(training("b", workers=2, tenant="beta"))
    d.submit(training("c", workers=2, tenant="beta"))  # the cluster is full: c waits
    d.tick(seconds=600)
    d.delete("alpha/a")  # ... until a goes, 600 s later
    d.submit(training("urgent", workers=2, tenant="ops", priority="critical"))
    producer = kafka_clients.producer(settings.kafka)
    topic_of = {SCHEDULING_DECISION: topics.decisions, ALLOCATION: topics.allocations}
    for effect in d.effects:
        name, key, record = effect_record(effect)
        if name in topic_of:
            producer.produce(topic_of[name], key=key.encode(), value=CODEC.encode(name, record))
    assert producer.flush(30) == 0
    decisions = d.decisions()
    changes = [e for e in d.effects if isinstance(e, AllocationChange)]
    sinks = [
        RecordSink(CODEC, topic, record, table)
        for topic, record, table in (
            (topics.decisions, SCHEDULING_DECISION, DecisionTable(clickhouse, db)),
            (topics.allocations, ALLOCATION, AllocationTable(clickhouse, db)),
        )
    ]
    runners = [
        Background(
            StreamLoop(
                settings.kafka,
                f"{topics.prefix}.{sink.destination.name}",
                [sink.topic],
                sink,
                topics.dead_letter,
            ).run
        )
        for sink in sinks
    ]
    try:
        wait_until(
            lambda: (
                sinks[0].stats.records == len(decisions) and sinks[1].stats.records == len(changes)
            ),
            what="the sinks",
        )
    finally:
        for runner in runners:
            runner.stop()
    rows = clickhouse.query(f"SELECT count() FROM {db}.gpu_allocations").result_rows[0][0]
    assert rows == sum(len(c.gpus) for c in changes)

    # GPU samples every 5 minutes from before the first placement to after the last change.
    sim = FleetSimulator(clusters, seed=5, interval_ms=300_000)
    records = [r for t in range(0, 16) for r in sim.telemetry(BASE_MS + 5_500 + t * 300_000)]
    HotSampleStore(clickhouse, db).store(
        to_columns([SourcedTelemetry(0, i, r) for i, r in enumerate(records)])
    )
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    store = TieredStore(clickhouse, db, objects, settings.s3)

    def ready(name: str) -> list[tuple]:
        sql = tiered_sql(
            store, ready_sql(name, str(BASE_MS), str(BASE_MS + 10**8)), now_ms=BASE_MS + 10**8
        )
        return [tuple(r) for r in clickhouse.query(sql).result_rows]

    # Reference: each sample belongs to the tenant whose allocation was in force on its GPU.
    timeline: dict[tuple[str, int], list[tuple[int, str, str]]] = {}
    for change in changes:
        for ref in change.gpus:
            timeline.setdefault(ref, []).append((change.ts, change.kind, change.tenant))
    by_tenant: dict[str, list[float]] = {}
    for record in records:
        for gpu in record["gpus"]:
            events = [
                e
                for e in timeline.get((record["node_id"], gpu["gpu_index"]), [])
                if e[0] <= record["ts"]
            ]
            owner = events[-1][2] if events and events[-1][1] == "ALLOCATED" else "(unallocated)"
            by_tenant.setdefault(owner, []).append(gpu["gpu_util_pct"])
    got = {row[0]: (row[1], row[3]) for row in ready("utilisation-by-tenant")}
    assert set(got) == set(by_tenant) == {"alpha", "beta", "ops", "(unallocated)"}
    for tenant, utils in by_tenant.items():
        assert got[tenant] == (
            pytest.approx(round(sum(utils) / len(utils), 2), abs=0.011),
            len(utils),
        )

    waits = {(row[0], row[1]): row for row in ready("job-wait-times")}
    # beta: b placed at once, c after 600 s; alpha's a at once; ops' urgent preempted its way.
    assert waits[("beta", 2)][2:4] == (2, 0)
    assert waits[("beta", 2)][6] == pytest.approx(600.0)
    assert waits[("alpha", 2)][2] == 1 and waits[("ops", 4)][2] == 1
    preempted = {row[0]: row[2] for row in ready("preemptions")}
    assert preempted == {
        p.tenant: sum(1 for q in decisions if q.outcome == "PREEMPTED" and q.tenant == p.tenant)
        for p in decisions
        if p.outcome == "PREEMPTED"
    }
    assert preempted  # the critical job took someone's GPUs
    # A decision range that holds none of them finds nothing.
    none = tiered_sql(store, ready_sql("job-wait-times", "0", "1000"), now_ms=int(time.time()))
    assert clickhouse.query(none).result_rows == []
