"""Shared test helpers: a pinned base time, small fleets, Kafka read-back."""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import Settings
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

# An identity root for tests that build settings by hand (the session's services use the
# deployment's own, as `serve` makes it).
TEST_ROOT = bytes(range(32))
BASE_MS = 1_796_000_000_000  # 2026-11-29T08:53:20Z, pinned so runs are comparable


def small_fleet(nodes: int = 2, seed: int = 11) -> FleetSimulator:
    return FleetSimulator(
        [ClusterSpec("c1", "eu-west", nodes), ClusterSpec("c2", "us-east", nodes)], seed=seed
    )


def make_publisher(settings: Settings, topics: Topics):
    """A telemetry publisher with a spool of its own in a scratch folder."""
    import tempfile
    from pathlib import Path

    from fleetline.agents.runtime import TelemetryPublisher
    from fleetline.agents.spool import DiskSpool
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec

    return TelemetryPublisher(
        kafka_clients.producer(settings.kafka),
        default_codec(),
        topics,
        DiskSpool(Path(tempfile.mkdtemp(prefix="spool-"))),
    )


def fresh_topics(partitions: int = 3) -> Topics:
    return Topics(prefix=f"test.{uuid.uuid4().hex[:10]}", node_partitions=partitions)


def read_all(
    settings: Settings,
    topic: str,
    expected: int,
    timeout_s: float = 30.0,
    committed_only: bool = True,
) -> list[Any]:
    """Read `expected` messages from the start of `topic` (fails the test if fewer arrive)."""
    consumer = Consumer(
        settings.kafka.client_config(
            **{
                "group.id": f"reader-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "isolation.level": "read_committed" if committed_only else "read_uncommitted",
            }
        )
    )
    consumer.subscribe([topic])
    messages = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error().str()
                continue
            messages.append(msg)
        # Linger briefly: more than `expected` arriving is a failure the caller should see.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                messages.append(msg)
    finally:
        consumer.close()
    assert len(messages) >= expected, f"only {len(messages)} of {expected} messages on {topic}"
    return messages


class Background:
    """Runs `target(stop_event)` in a thread; `stop()` ends it and re-raises what it raised."""

    def __init__(self, target) -> None:
        import threading

        self.stop_event = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                target(self.stop_event)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "background loop did not stop"
        if self.error is not None:
            raise self.error


def wait_until(
    condition, timeout_s: float = 60.0, what: str = "condition", every_s: float = 0.1
) -> None:
    """Until `condition()` is true, asking every `every_s` (the one place tests wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def after_now_ms() -> int:
    """A moment strictly after every broker timestamp so far and before every later one (the
    broker stamps in whole milliseconds: the clock must move past it on both sides)."""
    before = int(time.time() * 1000)
    wait_until(lambda: int(time.time() * 1000) > before, 1, "the clock", every_s=0.001)
    moment = int(time.time() * 1000)
    wait_until(lambda: int(time.time() * 1000) > moment, 1, "the clock", every_s=0.001)
    return moment


class Recorder:
    """Collects the API's audit events (the Kafka emitter is tested against the broker)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)


def first_occurrences(messages) -> dict[str, list[int]]:
    """Each node's sequence numbers in the order first seen (a repeat after a retry is not)."""
    by_node: dict[str, list[int]] = {}
    for msg in messages:
        record = default_codec().decode(msg.value()).record
        seqs = by_node.setdefault(record["node_id"], [])
        if record["seq"] not in seqs:
            seqs.append(record["seq"])
    return by_node
