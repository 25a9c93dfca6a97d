"""The end-to-end slice: simulated agents -> Kafka -> resource-view processor and ClickHouse sink.

This is the imperative shell that wires the pure parts together; the README's first command
runs it through `fleetline run`.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetline import pipeline_jobs
from fleetline.agents.data_mover import SimulatedDataMover
from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator, cluster_info
from fleetline.config import Settings
from fleetline.errors import StreamError
from fleetline.processors.audit.chain import Signer, export_entry, verify
from fleetline.processors.audit.runtime import APPLICATION_ID as AUDIT_APP
from fleetline.processors.audit.runtime import KafkaAuditEmitter, audit_chainer, load_signer
from fleetline.processors.replay import offsets_at, rebuild
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.runtime import SchedulerService, scheduler_topics
from fleetline.processors.view import read as view_read
from fleetline.processors.view.runtime import APPLICATION_ID, ViewProcessor
from fleetline.storage.audit_store import AuditTable
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
from fleetline.storage.objects import ObjectStore
from fleetline.storage.offset_sink import OffsetSink
from fleetline.storage.query_service import QueryService
from fleetline.storage.scheduling_sink import AllocationTable, DecisionTable
from fleetline.storage.snapshots import S3ViewSnapshots
from fleetline.storage.tiers import expander
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import ALLOCATION, AUDIT_RECORD, SCHEDULING_DECISION
from fleetline.streams.processor import TransactionalProcessor
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics


@dataclass
class SliceResult:
    telemetry_sent: int
    states_sent: int
    malformed_sent: int
    clusters: list[dict[str, Any]]
    unhealthy_gpus: list[dict[str, Any]]
    half_way_clusters: list[dict[str, Any]]
    half_way_replay: dict[str, Any]
    processor_dead_letters: int
    sink_rows: int
    sink_dead_letters: int
    query_rows: list[tuple[Any, ...]]
    snapshots: list[str]
    api_calls: list[tuple[str, int]]
    audit: dict[str, Any]
    scheduling: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class RunningSlice:
    """The slice's processor and sink threads, started and stopped together."""

    settings: Settings
    topics: Topics
    codec: AvroCodec
    processor: ViewProcessor
    sink: HotSampleSink
    queries: QueryService
    chainer: TransactionalProcessor
    audit_sink: OffsetSink
    audit_table: AuditTable
    signer: Signer
    scheduler: SchedulerService
    mover: SimulatedDataMover
    scheduling_sinks: list[OffsetSink]
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def start(self, timeout_s: float = 60.0) -> None:
        self.queries.start()
        for name, target in (("resource-view", self.processor.run), ("hot-sink", self.sink.run),
                             ("audit-chain", self.chainer.run),
                             ("audit-sink", self.audit_sink.run),
                             ("scheduler", self.scheduler.run),
                             ("data-mover", self.mover.run),
                             *((f"{sink.destination.name}-sink", sink.run)
                               for sink in self.scheduling_sinks)):
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
        for ready in (self.processor.ready, self.sink.ready, self.chainer.ready,
                      self.audit_sink.ready, self.scheduler.processor.ready, self.mover.ready,
                      *(sink.ready for sink in self.scheduling_sinks)):
            if not ready.wait(timeout_s):
                self.close()
                raise StreamError(f"the slice's consumers got no partitions within {timeout_s}s")

    def _guard(self, target: Callable[[threading.Event], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target(self.stop)
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()

        return run

    def wait_for(self, processed: int, telemetry: int, timeout_s: float = 120.0) -> None:
        """Block until the processor has handled `processed` messages and the sink `telemetry`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.raise_errors()
            if self.processor.stats.messages >= processed and self.sink.stats.messages >= telemetry:
                return
            time.sleep(0.1)
        raise StreamError(
            f"timed out: processor handled {self.processor.stats.messages}/{processed}, "
            f"sink {self.sink.stats.messages}/{telemetry} messages"
        )

    def raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        self.queries.stop()
        self.raise_errors()


def view_snapshots(settings: Settings, topics: Topics) -> S3ViewSnapshots:
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    return S3ViewSnapshots(objects, f"views/{topics.prefix}/{APPLICATION_ID}")


def build_slice(settings: Settings, topics: Topics, codec: AvroCodec | None = None) -> RunningSlice:
    codec = codec or default_codec()
    kafka_clients.ensure_topics(settings.kafka, [*scheduler_topics(topics),
                                                 topics.changelog_spec(AUDIT_APP, "chain")])
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    snapshots = view_snapshots(settings, topics)
    processor = ViewProcessor(settings.kafka, topics, snapshots,
                              group_id=f"{topics.prefix}.{APPLICATION_ID}",
                              snapshot_interval_s=5.0)

    def facts_at(offsets: dict) -> Any:
        return observe(rebuild(settings.kafka, topics, offsets, snapshots).view)

    scheduler = SchedulerService(settings.kafka, topics, processor, facts_at,
                                 tick_interval_s=0.5)
    sink = HotSampleSink(
        kafka=settings.kafka,
        codec=codec,
        store=HotSampleStore(client, settings.clickhouse_database),
        topic=topics.telemetry,
        dead_letter_topic=topics.dead_letter,
        group_id=f"{topics.prefix}.hot-sink",
    )
    # The slice owns the embedded store; other processes (`fleetline sql`) query through it.
    queries = QueryService(client, settings.clickhouse_url, expand=expander(settings))
    signer = load_signer(settings.signing_key_path(), create=True)
    audit_table = AuditTable(client, settings.clickhouse_database)
    chainer = audit_chainer(settings.kafka, topics, signer, digest_every=10)
    audit_sink = OffsetSink(settings.kafka, codec, topics.audit_log, AUDIT_RECORD, audit_table,
                            topics.dead_letter, f"{topics.prefix}.audit-clickhouse")
    scheduling_sinks = [
        OffsetSink(settings.kafka, codec, topic, record, table, topics.dead_letter,
                   f"{topics.prefix}.{table.name}-sink")
        for topic, record, table in (
            (topics.decisions, SCHEDULING_DECISION,
             DecisionTable(client, settings.clickhouse_database)),
            (topics.allocations, ALLOCATION,
             AllocationTable(client, settings.clickhouse_database)))]
    return RunningSlice(settings, topics, codec, processor, sink, queries, chainer, audit_sink,
                        audit_table, signer, scheduler, SimulatedDataMover(settings.kafka, topics),
                        scheduling_sinks)


def exercise_api(running: RunningSlice) -> list[tuple[str, int]]:
    """Serve the HTTP API on a loopback port for a moment and call it as a tenant's viewer
    would, plus two calls that must be refused; every call lands in the audit log."""
    import json
    import secrets
    import socket
    import urllib.error
    import urllib.request

    import uvicorn

    from fleetline.api.auth import AuthConfig, Authenticator, token_digest
    from fleetline.api.http import create_app

    token = "fl_" + secrets.token_urlsafe(24)
    auth = Authenticator(AuthConfig.from_data({"tokens": [
        {"name": "viewer@acme", "sha256": token_digest(token), "role": "viewer",
         "tenant": "acme"}]}))
    emitter = KafkaAuditEmitter(running.settings.kafka, running.topics)
    app = create_app(running.processor, auth, emitter, running.audit_table)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    calls = []
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        for path, bearer in (("/v1/clusters", token), ("/v1/allocations?tenant=globex", token),
                             ("/v1/clusters", "fl_guess")):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                             headers={"Authorization": f"Bearer {bearer}"})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    json.loads(response.read())
                    calls.append((path, response.status))
            except urllib.error.HTTPError as exc:
                calls.append((path, exc.code))
    finally:
        server.should_exit = True
        thread.join(10)
        emitter.flush()
    return calls


def verify_audit(running: RunningSlice, events: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait for `events` audit events in ClickHouse, then verify the whole chain there."""
    keys = {running.signer.key_id: running.signer.private_key.public_key()}
    deadline = time.monotonic() + timeout_s
    records: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        records = list(running.audit_table.records())
        if sum(1 for r in records if r["event"]) >= events:
            break
        time.sleep(0.2)
    report = verify([export_entry(r, reveal_sensitive=True) for r in records], keys)
    return {"links": report.checked, "digests": report.digests, "ok": report.ok,
            "first_broken": report.first_broken, "unsigned_tail": report.unsigned_tail,
            "key_id": running.signer.key_id}


UTILISATION_QUERY = """
SELECT cluster_id, count() AS samples, uniqExact(node_id) AS nodes,
       round(avg(toFloat64(gpu_util_pct)), 2) AS avg_util_pct,
       round(toFloat64(max(power_w)), 1) AS max_power_w
FROM {db}.gpu_samples
WHERE ts >= fromUnixTimestamp64Milli({start_ms}::Int64, 'UTC')
GROUP BY cluster_id ORDER BY cluster_id
"""


def run_slice(
    settings: Settings,
    clusters: list[ClusterSpec],
    *,
    ticks: int,
    interval_ms: int,
    seed: int,
    start_ms: int,
    realtime: bool,
    topics: Topics | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> SliceResult:
    """Run the fleet for `ticks` intervals of event time and return what every stage saw."""
    topics = topics or Topics()
    timings: dict[str, float] = {}
    began = time.monotonic()
    running = build_slice(settings, topics)
    running.start()
    timings["pipeline_start_s"] = time.monotonic() - began
    simulator = FleetSimulator(clusters, seed=seed, interval_ms=interval_ms)
    # Scripted faults, like any other: just after half-way the last node loses power; from the
    # second interval the first cluster's first leaf switch drops RDMA packets (its 16 GPUs go
    # degraded), and at the third one GPU of the second cluster falls off the bus (XID 79).
    victim = simulator.nodes[-1]
    half = ticks // 2
    down_at = start_ms + (half + 1) * interval_ms
    simulator.faults.append(Fault("node_down", victim.node_id, down_at))
    simulator.faults.append(Fault("rdma_loss", simulator.nodes[0].leaf_switch,
                                  start_ms + 2 * interval_ms, value=0.02))
    second = next((n for n in simulator.nodes if n.cluster_id != clusters[0].cluster_id), None)
    if second is not None:
        simulator.faults.append(Fault("xid", f"{second.node_id}/3",
                                      start_ms + 3 * interval_ms, value=79))
    state_dir = Path(tempfile.mkdtemp(prefix="fleetline-agents-"))
    agent = FleetAgent.create(settings, running.codec, topics, simulator, state_dir,
                              commands=False)
    injector = kafka_clients.producer(settings.kafka)
    try:
        began = time.monotonic()
        for seq, cluster in enumerate(clusters, start=1):
            injector.produce(topics.clusters, key=cluster.cluster_id.encode(),
                             value=running.codec.encode("ClusterInfo",
                                                        cluster_info(cluster, seq, start_ms)))
        states = agent.start(start_ms)
        telemetry = 0
        submitted: set[str] = set()
        half_way_ms = 0
        for tick in range(1, ticks + 1):
            ts = start_ms + tick * interval_ms
            sent = agent.tick(ts)
            states += sent["states"]
            telemetry += sent["telemetry"]
            if ts == down_at:
                progress(f"t+{tick * interval_ms / 1000:.0f}s: {victim.node_id} went DOWN")
            if tick == 2:
                pipeline_jobs.set_tenants(settings, topics)
                wave = pipeline_jobs.first_wave([c.cluster_id for c in clusters])
                pipeline_jobs.submit_documents(settings, topics, wave)
                submitted |= pipeline_jobs.keys_of(wave)
                progress("t+2s: tenants acme and globex submitted a dataset, 8 jobs and a "
                         "service")
            if tick == 4:
                pipeline_jobs.submit_documents(settings, topics, pipeline_jobs.urgent())
                submitted |= pipeline_jobs.keys_of(pipeline_jobs.urgent())
                progress("t+4s: ops submitted a critical 2 x 8-GPU job")
            if tick == 1:
                # One malformed message, to show the dead-letter path end to end.
                injector.produce(topics.telemetry, key=b"garbage", value=b"\x00not avro at all")
                injector.flush(30)
            if tick == half:
                agent.flush()
                half_way_ms = int(time.time() * 1000)
                time.sleep(0.01)  # the next append is stamped after this moment
            if realtime:
                time.sleep(interval_ms / 1000)
                if tick % 5 == 0:
                    progress(_view_line(running.processor.read(view_read.cluster_capacity)))
        agent.flush()
        injector.flush(30)
        timings["produce_s"] = time.monotonic() - began
        began = time.monotonic()
        running.wait_for(processed=states + telemetry + 1 + len(clusters),
                         telemetry=telemetry + 1)
        pipeline_jobs.settle(settings, topics, running.scheduler, running.processor, submitted)
        timings["drain_s"] = time.monotonic() - began
        now = running.processor.read(view_read.cluster_capacity)
        unhealthy = running.processor.read(
            lambda v: [g for g in view_read.select_gpus(v) if g["health"] != "healthy"])
        rows = running.sink.store.client.query(
            UTILISATION_QUERY.format(db=settings.clickhouse_database, start_ms=start_ms)
        ).result_rows
        running.processor.snapshot()
        snapshots = running.processor.snapshots
        keys = [info.blob_key for part in sorted(running.processor.parts)
                for info in snapshots.list(part)[-1:]]
        # Time travel: the view as it stood half-way, from the newest snapshots before that
        # moment plus the log after them.
        began = time.monotonic()
        replayed = rebuild(settings.kafka, topics, offsets_at(settings.kafka, topics, half_way_ms),
                           snapshots)
        timings["replay_s"] = time.monotonic() - began
        api_calls = exercise_api(running)
        audit = verify_audit(running, len(api_calls))
        began = time.monotonic()
        scheduling = pipeline_jobs.summarize(settings, topics, running.scheduler, snapshots)
        scheduling["ready_queries"] = pipeline_jobs.ready_queries(
            settings, running.sink.store.client, running.scheduling_sinks,
            len(scheduling["decisions"]), start_ms)
        timings["decision_replay_s"] = time.monotonic() - began
    finally:
        agent.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        running.close()
    return SliceResult(
        telemetry_sent=telemetry,
        states_sent=states,
        malformed_sent=1,
        clusters=now,
        unhealthy_gpus=unhealthy,
        half_way_clusters=view_read.cluster_capacity(replayed.view),
        half_way_replay={"at_ms": half_way_ms, "folded": replayed.folded,
                         "from_snapshots": replayed.snapshot_positions,
                         "view_version": replayed.view.version},
        processor_dead_letters=running.processor.stats.dead_letters,
        sink_rows=running.sink.stats.rows,
        sink_dead_letters=running.sink.stats.dead_letters,
        query_rows=rows,
        snapshots=[f"s3://{snapshots.store.bucket}/{key}" for key in keys],
        api_calls=api_calls,
        audit=audit,
        scheduling=scheduling,
        timings=timings,
    )


def _view_line(clusters: list[dict[str, Any]]) -> str:
    return "  ".join(
        f"{c['cluster_id']}: {c['gpus']} GPUs, {c['idle']} idle, {c['degraded']} degraded, "
        f"{c['nodes_down']} nodes down" for c in clusters
    )
