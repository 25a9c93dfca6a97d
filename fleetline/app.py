"""The composition root: settings and options -> the set of services one process runs.

`fleetline serve`, `fleetline run` and the tests all build their services here, so the wiring
of processors, sinks, stores and the API exists once. A service is anything with a name, a
`ready` event and `run(stop)`; adding one is one entry in `build`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from clickhouse_connect.driver.client import Client
from fastapi import FastAPI

from fleetline.agents.data_mover import DataMover
from fleetline.api.app import create_app
from fleetline.api.auth import Authenticator
from fleetline.api.ports import Append
from fleetline.config import Settings
from fleetline.errors import NotPermitted, StreamError
from fleetline.observability import metrics
from fleetline.processors.audit.chain import Signer, export_entry
from fleetline.processors.audit.runtime import (
    AuditEmitter,
    audit_chainer,
    audit_linker,
    load_signer,
)
from fleetline.processors.audit.runtime import changelog as audit_changelog
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.health.runtime import ClusterHealthService, signal_output
from fleetline.processors.health.runtime import changelog as health_changelog
from fleetline.processors.operations.fold import OpsPolicy
from fleetline.processors.operations.rules import HealingRules
from fleetline.processors.operations.runtime import (
    KafkaOperations,
    OpsService,
    recommendation_events,
)
from fleetline.processors.operations.runtime import changelog as ops_changelog
from fleetline.processors.postmortem.report import Scope
from fleetline.processors.replay import ViewHistory, observe_at
from fleetline.processors.scheduling.capacity import FleetFacts
from fleetline.processors.scheduling.client import changelog as scheduler_changelog
from fleetline.processors.scheduling.client import job_records, read_state
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.runtime import KafkaJobs, SchedulerService
from fleetline.processors.view import APPLICATION_ID as VIEW_APP
from fleetline.processors.view.runtime import ViewProcessor, dcgm_readings, declare_clusters
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.schemas.records import OpsEvent
from fleetline.storage.audit_store import AuditArchive, AuditTable
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.crypto import ObjectCipher, SealedObjectStore
from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
from fleetline.storage.log_sink import LogTable
from fleetline.storage.objects import ObjectStore
from fleetline.storage.operations_sink import EnergyPriceTable, TicketTable
from fleetline.storage.queries import ready_sql
from fleetline.storage.query_service import Expand, QueryResult, QueryService, query_client
from fleetline.storage.scheduling_sink import AllocationTable, DecisionTable, WorkloadEventTable
from fleetline.storage.sinks import Destination, RecordSink
from fleetline.storage.snapshots import SnapshotStore
from fleetline.storage.state_sink import NodeStateTable
from fleetline.storage.tiering.loop import TierLoop, tiered_stores
from fleetline.storage.tiering.macros import expander
from fleetline.storage.tiering.policy import LIFETIMES, DataClass
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.loop import Step, StreamLoop, deliver
from fleetline.streams.records import Offsets, Output
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics, TopicSpec

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the API server is imported only where it runs
    import uvicorn


class Service(Protocol):
    """Something a process runs in a thread of its own until `stop` is set."""

    @property
    def name(self) -> str: ...

    @property
    def ready(self) -> threading.Event: ...

    def run(self, stop: threading.Event) -> None: ...


@dataclass(frozen=True)
class Options:
    """What a process runs, beyond the settings every adapter takes (the `serve` flags)."""

    topics: Topics = field(default_factory=Topics)
    group: str = VIEW_APP  # the view's instances (and its snapshots' folder)
    instance_id: str = "0"
    snapshot_interval_s: float = 30.0
    scheduler: bool = True
    scheduler_policy: SchedulingPolicy | None = None
    tick_interval_s: float = 1.0
    # The view is split over several instances: each publishes its shards' capacity summaries
    # and the scheduler observes those (`serve --sharded`).
    sharded: bool = False
    summary_interval_s: float = 1.0
    audit: bool = True
    audit_digest_every: int = 100
    tier_every_s: float = 0.0  # 0: no tiering in this process
    # Every tiered table's lifetime (`storage/tiering/policy.LIFETIMES`).
    lifetimes: dict[str, DataClass] = field(default_factory=lambda: dict(LIFETIMES))
    data_mover: bool = True  # copies datasets for the scheduler's prewarms (agents/data_mover.py)
    cluster_health: bool = True  # the health fold and the control plane's clock
    health_policy: ClusterHealthPolicy = field(default_factory=ClusterHealthPolicy)
    clock_interval_s: float = 0.5
    # Automated operations: self-healing tickets and power caps (the fold's policy switches
    # each part off; `operations=False` runs none of it).
    operations: bool = True
    ops_policy: OpsPolicy | None = None
    healing_rules: HealingRules = field(default_factory=HealingRules)
    ops_interval_s: float = 1.0
    # How often the operations processor tunes the running training jobs from the stored
    # history (checkpoint interval, batch size) on its own (0: never).
    tune_every_s: float = 3600.0


def view_snapshots(settings: Settings, prefix: str, group: str = VIEW_APP) -> ViewSnapshots:
    """The view's snapshots of a topic prefix and view group, in the configured bucket (sealed
    when an object-encryption key is set, like every object fleetline writes itself)."""
    return ViewSnapshots(SnapshotStore(sealed_objects(settings), f"views/{prefix}/{group}"))


def sealed_objects(settings: Settings) -> SealedObjectStore:
    """The configured bucket, sealing what it writes when an object-encryption key is set."""
    store = ObjectStore.from_settings(settings.s3)
    store.ensure_bucket()
    cipher = (
        ObjectCipher.from_base64(settings.object_encryption_key)
        if settings.object_encryption_key
        else None
    )
    return SealedObjectStore(store, cipher)


def record_sink(
    settings: Settings,
    topics: Topics,
    name: str,
    topic: str,
    destination: Destination,
    convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> StreamLoop:
    """A loop (consumer group `<prefix>.<name>`) that stores every record of `topic` (the record
    its spec names) in `destination`."""
    step = RecordSink(default_codec(), topic, topics.record_of(topic), destination, convert)
    return StreamLoop(
        settings.kafka,
        f"{topics.prefix}.{name}",
        [topic],
        step,
        topics.dead_letter,
        max_messages=5000,
        max_wait_s=0.5,
    )


def sample_sink(
    settings: Settings,
    client: Client,
    topics: Topics,
    name: str | None = None,
    max_wait_s: float = 1.0,
) -> StreamLoop:
    """The loop that stores every GPU sample of `topics.telemetry` in ClickHouse's hot table."""
    step = HotSampleSink(
        default_codec(), HotSampleStore(client, settings.clickhouse_database), topics.telemetry
    )
    return StreamLoop(
        settings.kafka,
        name or f"{topics.prefix}.hot-sink",
        [topics.telemetry],
        step,
        topics.dead_letter,
        max_messages=50_000,
        max_wait_s=max_wait_s,
        # Decoding one batch while the previous one is inserted keeps both
        # cores busy.
        overlap=True,
    )


@dataclass
class Fleetline:
    """The services of one process, built by `build`, started and stopped together."""

    settings: Settings
    options: Options
    clickhouse: Client
    view: ViewProcessor
    samples: StreamLoop  # the hot GPU sample sink
    sinks: dict[str, StreamLoop]  # the other record sinks, by destination
    scheduler: SchedulerService | None = None
    chainer: StreamLoop | None = None
    linker: StreamLoop | None = None  # decisions, orders, workload transitions -> the chainer
    audit_table: AuditTable | None = None
    signer: Signer | None = None
    mover: DataMover | None = None
    health: ClusterHealthService | None = None
    operations: OpsService | None = None
    tiering: TierLoop | None = None
    queries: QueryService | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def topics(self) -> Topics:
        return self.options.topics

    @property
    def snapshots(self) -> ViewSnapshots:
        return self.view.snapshots

    @property
    def sample_sink(self) -> HotSampleSink:
        step: Step[Any] = self.samples.step
        assert isinstance(step, HotSampleSink)
        return step

    def services(self) -> list[Service]:
        optional: list[Service | None] = [
            self.scheduler,
            self.health,
            self.operations,
            self.chainer,
            self.linker,
            self.mover,
            self.tiering,
        ]
        return [
            self.view,
            self.samples,
            *self.sinks.values(),
            *(s for s in optional if s is not None),
        ]

    def start(self, ready_timeout_s: float | None = 60.0) -> Fleetline:
        """Start every service in a thread and (unless the timeout is None) wait until each
        has had its partitions assigned."""
        if self.queries is not None:
            self.queries.start()
        for service in self.services():
            thread = threading.Thread(target=self._guard(service), name=service.name, daemon=True)
            thread.start()
            self.threads.append(thread)
        for service in self.services() if ready_timeout_s is not None else ():
            if not service.ready.wait(ready_timeout_s):
                self.close()
                raise StreamError(f"{service.name} got no partitions within {ready_timeout_s:.0f}s")
        return self

    def _guard(self, service: Service) -> Callable[[], None]:
        def run() -> None:
            try:
                service.run(self.stop)
            # Thread boundary: a service that dies stops the process's other services, and its
            # error is raised again in the main thread (raise_errors).
            except BaseException as exc:
                log.exception("%s stopped", service.name)
                self.errors.append(exc)
                self.stop.set()

        return run

    def raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]

    def close(self, timeout_s: float = 60.0) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout_s)
        if self.queries is not None:
            self.queries.stop()
        self.raise_errors()

    def register_metrics(self) -> None:
        """The fleet's GPU gauges under DCGM names, from the view at each scrape (the loops'
        own series are counted as they run)."""
        readings = dcgm_readings(self.view)
        metrics.register_collector("dcgm", metrics.DcgmCollector(readings))

    @functools.cached_property
    def expand(self) -> Expand:
        """The tiers' macros as this process's queries expand them (made once)."""
        return expander(self.settings)

    def query(self, sql: str) -> QueryResult:
        """An analyst query on this process's store (allow-listed, bounded, tiers expanded)."""
        return query_client(
            self.clickhouse,
            sql,
            self.expand,
            self.settings.query_limits,
            database=self.settings.clickhouse_database,
        )

    def recommendations(self, ts: int) -> list[OpsEvent]:
        """The operations processor's own tuning round: recommendations for the running
        training jobs from the stored history, as the operations processor's."""
        jobs = job_records(
            self.scheduler.store
            if self.scheduler is not None
            else read_state(self.settings.kafka, self.topics)
        )
        return recommendation_events(lambda sql: self.query(sql).rows, jobs, ts, "operations")

    def api(self, authenticator: Authenticator, emitter: AuditEmitter) -> FastAPI:
        """The HTTP API over this process's view, scheduler, audit table and ClickHouse."""

        def sql(query: str) -> dict[str, Any]:
            result = self.query(query)
            return {"columns": result.columns, "rows": result.rows}

        def ready(name: str, since: str, until: str | None) -> dict[str, Any]:
            return sql(ready_sql(name, since, until))

        # What operators send the fleet through the API: cluster signals, node commands.
        producer = kafka_clients.producer(self.settings.kafka, {"linger.ms": 0})
        codec, sending = default_codec(), threading.Lock()

        def appender(to: Callable[[Mapping[str, Any]], Output], what: str) -> Append:
            def append(record: Mapping[str, Any]) -> int:
                with sending:
                    (offset,) = deliver(producer, [to(record)], what)
                return offset

            return append

        commands = self.topics.commands

        return create_app(
            self.view,
            authenticator,
            emitter,
            self.audit_table,
            sql,
            ready,
            jobs=KafkaJobs(
                self.settings.kafka,
                self.topics,
                self.scheduler,
                lambda offsets: observe_at(
                    self.settings.kafka, self.topics, offsets, self.snapshots
                ),
            ),
            operations=KafkaOperations(self.settings.kafka, self.topics, self.operations),
            max_body_bytes=self.settings.api_max_body_bytes,
            history=ViewHistory(self.settings.kafka, self.topics, self.snapshots),
            clusters=lambda records: declare_clusters(self.settings.kafka, self.topics, records),
            signals=appender(
                lambda r: signal_output(self.topics, r, codec), "the cluster signal log"
            ),
            commands=appender(
                lambda r: Output(
                    commands,
                    r["node_id"].encode(),
                    codec.encode(self.topics.record_of(commands), r),
                ),
                "the node command topic",
            ),
            postmortems=self.postmortem,
        )

    def postmortem(self, from_ms: int, to_ms: int, scope: Scope) -> dict[str, Any]:
        """The incident report of a window, from the log and this process's store's tiers
        (`fleetline postmortem`; ConfigError for a window it could say nothing true of)."""
        from fleetline.processors.postmortem.gather import incident_report, unread_cold

        if self.clickhouse is not None:
            unread_cold(self.clickhouse, self.settings, from_ms, to_ms)
        return incident_report(
            self.settings.kafka,
            self.topics,
            self.query,
            from_ms,
            to_ms,
            scope,
            audit_public_keys(self.settings),
        )


def audit_public_keys(settings: Settings) -> dict[str, Any]:
    """The keys the audit chain's digests are checked against: the configured verify keys, or
    this host's signing key's public half."""
    from fleetline.processors.audit.runtime import load_public_keys

    paths = list(settings.audit_verify_keys)
    if not paths and settings.signing_key_path().exists():
        paths = [settings.signing_key_path()]
    return load_public_keys(paths)


# The exactly-once folds' state changelogs (each declared by its processor), created at start.
CHANGELOGS = (scheduler_changelog, audit_changelog, health_changelog, ops_changelog)


# How long the control plane waits for just-granted ACLs to apply before it takes a refusal of
# its topics for an ACL that is not there.
GRANTS_APPLY_S = 15.0


def deployment_topics(topics: Topics) -> list[TopicSpec]:
    """Every topic of a deployment: the shared ones and the folds' changelogs (what `build`
    creates, and what a secured broker's ACLs cover)."""
    return [*topics.specs(), *(changelog(topics) for changelog in CHANGELOGS)]


def build(settings: Settings, options: Options) -> Fleetline:
    """Every service `options` asks for, wired to the configured Kafka, S3 and ClickHouse."""
    topics = options.topics
    kafka = settings.kafka
    specs = deployment_topics(topics)
    hidden = kafka_clients.ensure_topics(kafka, specs)
    deadline = time.monotonic() + GRANTS_APPLY_S
    while hidden and time.monotonic() < deadline:
        # ACLs granted a moment ago (`fleetline run` grants its prefix, then builds) reach the
        # brokers' authorizers through the metadata log a moment later: ask again meanwhile.
        time.sleep(0.5)
        hidden = kafka_clients.ensure_topics(kafka, [s for s in specs if s.name in hidden])
    if hidden:
        # Refused at start in one line, not as each service's traceback and a 500 per write.
        raise NotPermitted(
            f"Kafka at {kafka.bootstrap_servers} lets principal "
            f"{kafka.client_overrides.get('sasl.username')!r} neither create nor see "
            f"{len(hidden)} of the deployment's topics {topics.prefix}.* (first: {hidden[0]}); "
            "a secured broker grants a deployment's topics by prefix: on its host, "
            f"`fleetline infra start --secure --topic-prefix {topics.prefix}`"
        )
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    db = settings.clickhouse_database
    snapshots = view_snapshots(settings, topics.prefix, options.group)
    view = ViewProcessor(
        kafka,
        topics,
        snapshots,
        group_id=f"{topics.prefix}.{options.group}",
        instance_id=options.instance_id,
        snapshot_interval_s=options.snapshot_interval_s,
        summary_interval_s=options.summary_interval_s if options.sharded else None,
    )
    samples = sample_sink(settings, client, topics)
    # Every table a record topic is kept in: sink -> (its consumer group, the topic, the table).
    tables: dict[str, tuple[str, str, Destination]] = {
        "node-states": ("node-states", topics.node_state, NodeStateTable(client, db)),
        "decisions": ("decisions-sink", topics.decisions, DecisionTable(client, db)),
        "allocations": ("allocations-sink", topics.allocations, AllocationTable(client, db)),
        "workload-events": (
            "workload-events-sink",
            topics.workloads,
            WorkloadEventTable(client, db),
        ),
        "logs": ("logs-sink", topics.logs, LogTable(client, db)),
        "repair-tickets": ("repair-tickets-sink", topics.tickets, TicketTable(client, db)),
        # Energy price profiles ride on the scheduler's own log (ENERGY requests).
        "energy-prices": (
            "energy-prices-sink",
            topics.scheduler_requests,
            EnergyPriceTable(client, db),
        ),
    }
    sinks = {
        sink: record_sink(settings, topics, group, topic, destination)
        for sink, (group, topic, destination) in tables.items()
    }
    fleet = Fleetline(settings, options, client, view, samples, sinks)
    if options.scheduler:

        def facts_at(offsets: Offsets) -> FleetFacts:
            return observe_at(kafka, topics, offsets, snapshots)

        fleet.scheduler = SchedulerService(
            kafka,
            topics,
            view,
            facts_at,
            options.scheduler_policy,
            tick_interval_s=options.tick_interval_s,
            instance_id=options.instance_id,
            sharded=options.sharded,
        )
    if options.audit:
        fleet.signer = load_signer(settings.signing_key_path(), create=True)
        fleet.audit_table = AuditTable(client, db)
        fleet.chainer = audit_chainer(
            kafka, topics, fleet.signer, options.audit_digest_every, options.instance_id
        )
        fleet.linker = audit_linker(kafka, topics, options.instance_id)
        sinks["audit-clickhouse"] = record_sink(
            settings, topics, "audit-clickhouse", topics.audit_log, fleet.audit_table
        )
        sinks["audit-object-storage"] = record_sink(
            settings,
            topics,
            "audit-object-storage",
            topics.audit_log,
            AuditArchive(sealed_objects(settings), f"audit/{topics.prefix}"),
            convert=lambda r: export_entry(r, reveal_sensitive=True),
        )
    if options.cluster_health:
        fleet.health = ClusterHealthService(
            kafka,
            topics,
            options.health_policy,
            tick_interval_s=options.clock_interval_s,
            instance_id=options.instance_id,
        )
    if options.operations:
        fleet.operations = OpsService(
            kafka,
            topics,
            view,
            options.healing_rules,
            options.ops_policy,
            tick_interval_s=options.ops_interval_s,
            instance_id=options.instance_id,
            recommend=fleet.recommendations if options.tune_every_s > 0 else None,
            recommend_every_s=options.tune_every_s or 3600.0,
        )
    if options.data_mover:
        fleet.mover = DataMover(kafka, settings.s3, topics, object_key=settings.object_key())
    if options.tier_every_s:
        stores = tiered_stores(
            client, db, ObjectStore.from_settings(settings.s3), settings.s3, options.lifetimes
        )
        fleet.tiering = TierLoop(list(stores.values()), options.tier_every_s)
    # This process owns the embedded store; other processes (`fleetline sql`) query through it.
    fleet.queries = QueryService(
        client,
        settings.clickhouse_url,
        host=settings.advertise_host,
        expand=fleet.expand,
        limits=settings.query_limits,
        database=db,
    )
    return fleet


def api_server(
    app: FastAPI,
    host: str,
    port: int,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> uvicorn.Server:
    """The HTTP server of the API (`serve`, and the demo's check of it): run it with `.run()`,
    in a thread or not; it stops when `should_exit` is set."""
    import uvicorn

    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
        )
    )
