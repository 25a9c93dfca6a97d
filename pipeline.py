"""The end-to-end slice: simulated agents -> Kafka -> live view processor and ClickHouse sink.

This is the imperative shell that wires the pure parts together; the README's first command
runs it through `fleetline run`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator
from fleetline.config import Settings
from fleetline.errors import FleetlineError, StreamError
from fleetline.processors import live_view
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import QueryService
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.processor import TransactionalProcessor
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics


@dataclass
class SliceResult:
    telemetry_sent: int
    states_sent: int
    malformed_sent: int
    view: list[live_view.ClusterSummary]
    processor_dead_letters: int
    sink_rows: int
    sink_dead_letters: int
    query_rows: list[tuple[Any, ...]]
    snapshot_key: str
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class RunningSlice:
    """The slice's processor and sink threads, started and stopped together."""

    settings: Settings
    topics: Topics
    codec: AvroCodec
    processor: TransactionalProcessor
    handler: live_view.LiveViewHandler
    sink: HotSampleSink
    queries: QueryService
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def start(self, timeout_s: float = 60.0) -> None:
        self.queries.start()
        for name, target in (("live-view", self.processor.run), ("hot-sink", self.sink.run)):
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
        for ready in (self.processor.ready, self.sink.ready):
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


def build_slice(settings: Settings, topics: Topics, codec: AvroCodec | None = None) -> RunningSlice:
    codec = codec or default_codec()
    kafka_clients.ensure_topics(
        settings.kafka,
        [*topics.specs(), topics.changelog_spec(live_view.APPLICATION_ID, "nodes")],
    )
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    store = live_view.node_store(topics.changelog(live_view.APPLICATION_ID, "nodes"))
    handler = live_view.LiveViewHandler(codec, store)
    processor = TransactionalProcessor(
        kafka=settings.kafka,
        application_id=f"{topics.prefix}.{live_view.APPLICATION_ID}",
        inputs=[topics.telemetry, topics.node_state],
        handler=handler,
        dead_letter_topic=topics.dead_letter,
        stores=[store],
    )
    sink = HotSampleSink(
        kafka=settings.kafka,
        codec=codec,
        store=HotSampleStore(client, settings.clickhouse_database),
        topic=topics.telemetry,
        dead_letter_topic=topics.dead_letter,
        group_id=f"{topics.prefix}.hot-sink",
    )
    # The slice owns the embedded store; other processes (`fleetline sql`) query through it.
    queries = QueryService(client, settings.clickhouse_url)
    return RunningSlice(settings, topics, codec, processor, handler, sink, queries)


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
    # Half-way through, the last node loses power: a scripted fault, like any other.
    victim = simulator.nodes[-1]
    down_at = start_ms + (ticks // 2) * interval_ms
    simulator.faults.append(Fault("node_down", victim.node_id, down_at))
    state_dir = Path(tempfile.mkdtemp(prefix="fleetline-agents-"))
    agent = FleetAgent.create(settings, running.codec, topics, simulator, state_dir,
                              commands=False)
    injector = kafka_clients.producer(settings.kafka)
    try:
        began = time.monotonic()
        states = agent.start(start_ms)
        telemetry = 0
        for tick in range(1, ticks + 1):
            ts = start_ms + tick * interval_ms
            sent = agent.tick(ts)
            states += sent["states"]
            telemetry += sent["telemetry"]
            if ts == down_at:
                progress(f"t+{tick * interval_ms / 1000:.0f}s: {victim.node_id} went DOWN")
            if tick == 1:
                # One malformed message, to show the dead-letter path end to end.
                injector.produce(topics.telemetry, key=b"garbage", value=b"\x00not avro at all")
                injector.flush(30)
            if realtime:
                time.sleep(interval_ms / 1000)
                if tick % 5 == 0:
                    progress(_view_line(running.handler.view()))
        agent.flush()
        timings["produce_s"] = time.monotonic() - began
        began = time.monotonic()
        running.wait_for(processed=states + telemetry + 1, telemetry=telemetry + 1)
        timings["drain_s"] = time.monotonic() - began
        view = running.handler.view()
        rows = running.sink.store.client.query(
            UTILISATION_QUERY.format(db=settings.clickhouse_database, start_ms=start_ms)
        ).result_rows
        snapshot_key = save_view_snapshot(settings, topics, running)
    finally:
        agent.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        running.close()
    return SliceResult(
        telemetry_sent=telemetry,
        states_sent=states,
        malformed_sent=1,
        view=view,
        processor_dead_letters=running.processor.stats.dead_letters,
        sink_rows=running.sink.stats.rows,
        sink_dead_letters=running.sink.stats.dead_letters,
        query_rows=rows,
        snapshot_key=snapshot_key,
        timings=timings,
    )


def save_view_snapshot(settings: Settings, topics: Topics, running: RunningSlice) -> str:
    """Write the live view, with the processor's counters, to object storage and read it back."""
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    body = json.dumps(
        {
            "topics": topics.prefix,
            "clusters": live_view.view_as_dict(running.handler.view()),
            "nodes": [asdict(node) for _, node in running.handler.store.items()],
            "messages_processed": running.processor.stats.messages,
        },
        sort_keys=True,
    ).encode()
    key = f"snapshots/live-view/{topics.prefix}.json"
    objects.put(key, body, content_type="application/json")
    if objects.get(key) != body:
        raise FleetlineError(f"snapshot s3://{objects.bucket}/{key} did not read back intact")
    return f"s3://{objects.bucket}/{key}"


def _view_line(clusters: list[live_view.ClusterSummary]) -> str:
    return "  ".join(
        f"{c.cluster_id}: {c.gpus} GPUs, util {c.avg_gpu_util_pct}%, {c.nodes_down} down"
        for c in clusters
    )
