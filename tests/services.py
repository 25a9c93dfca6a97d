"""Helpers for tests against the real services: producing events, running a view processor,
snapshot stores, scheduler requests, an audit recorder."""

from __future__ import annotations

import base64
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fleetline.config import Settings
from fleetline.processors.replay import log_bounds
from fleetline.processors.scheduling.codec import submit_request
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.view.fold import compose
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.runtime import ViewProcessor
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.storage.objects import Objects
from fleetline.storage.snapshots import SnapshotStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.support import wait_until

CODEC = default_codec()


def snapshot_store(
    settings: Settings, root: str | None = None, objects: Objects | None = None
) -> ViewSnapshots:
    """Snapshots under a fresh root of the test bucket, sealed with the settings' key as the
    processes under test seal them (through `objects` when given)."""
    if objects is None:
        from fleetline.app import sealed_objects

        objects = sealed_objects(settings)
    return ViewSnapshots(
        SnapshotStore(objects, root or f"views/test-{uuid.uuid4().hex[:8]}", keep=5)
    )


def produce(settings: Settings, topics: Topics, events: Iterable[tuple[str, dict]]) -> int:
    producer = kafka_clients.producer(settings.kafka)
    count = 0
    for name, record in events:
        topic, key = {
            "NodeTelemetry": (topics.telemetry, "node_id"),
            "NodeState": (topics.node_state, "node_id"),
            "Allocation": (topics.allocations, "job_id"),
            "ClusterInfo": (topics.clusters, "cluster_id"),
        }[name]
        producer.produce(topic, key=record[key].encode(), value=CODEC.encode(name, record))
        producer.poll(0)
        count += 1
    assert producer.flush(30) == 0
    return count


def caught_up(
    settings: Settings, topics: Topics, processors: list[ViewProcessor], timeout_s: float = 60
) -> dict:
    _, end = log_bounds(settings.kafka, topics)

    def reached() -> bool:
        offsets = compose(p.read(lambda v: _copy_offsets(v)) for p in processors).offsets
        return all(
            offsets.get(t, {}).get(p, 0) >= o for t, ps in end.items() for p, o in ps.items()
        )

    wait_until(reached, timeout_s, what=f"the view to reach {end}")
    return end


def _copy_offsets(view: ResourceView) -> ResourceView:
    out = ResourceView(policy=view.policy)
    out.offsets = {t: dict(ps) for t, ps in view.offsets.items()}
    return out


@contextmanager
def running(processor: ViewProcessor) -> Iterator[ViewProcessor]:
    stop = threading.Event()
    thread = threading.Thread(target=processor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert processor.ready.wait(60), "no partitions assigned"
        yield processor
    finally:
        stop.set()
        thread.join(60)
        assert not thread.is_alive()


def submits(*documents: dict) -> list[dict]:
    return [
        submit_request(parse_spec(d), d, int(time.time() * 1000), uuid.uuid4().hex, "tester")
        for d in documents
    ]


# A `serve` killed and started again (or a shard instance lost) hands its partitions on after
# this long, not librdkafka's 45 s: what a test of a kill waits for is the work moving, not the
# session running out.
KILLED_MEMBER_SESSION_MS = 10_000


def service_env(
    settings: Settings, chdb_dir: Path | None = None, killed_members: bool = False
) -> dict[str, str]:
    """The FLEETLINE_* settings that point a `fleetline` command at the test services (with
    `killed_members`, for a test that kills a consumer group's member: its session shortened)."""
    env = {
        "FLEETLINE_KAFKA_BOOTSTRAP": settings.kafka.bootstrap_servers,
        "FLEETLINE_S3_ENDPOINT": settings.s3.endpoint,
        "FLEETLINE_S3_BUCKET": settings.s3.bucket,
        "FLEETLINE_S3_ACCESS_KEY": settings.s3.access_key,
        "FLEETLINE_S3_SECRET_KEY": settings.s3.secret_key,
    }
    if settings.object_encryption_key:
        env["FLEETLINE_OBJECT_ENCRYPTION_KEY"] = settings.object_encryption_key
    if settings.kafka.identity_root:
        # The deployment's identity root, as a host of the control plane is given it: the
        # records this test writes as the control plane are the child processes' too.
        env["FLEETLINE_IDENTITY_ROOT_KEY"] = base64.b64encode(settings.kafka.identity_root).decode()
    if chdb_dir is not None:
        env["FLEETLINE_CLICKHOUSE_URL"] = f"chdb://{chdb_dir}"
    if killed_members:
        env["FLEETLINE_KAFKA_SESSION_TIMEOUT_MS"] = str(KILLED_MEMBER_SESSION_MS)
    return env


def serve_command(
    prefix: str,
    group: str,
    *flags: str,
    audit: bool = False,
    verbose: bool = False,
    data_mover: bool = False,
    api_port: int | None = None,
) -> list[str]:
    """`fleetline serve` as a child process: the view and the scheduler, without tiering
    unless `flags` ask for more, without the API unless `api_port` (FLEETLINE_AUTH_CONFIG set),
    without the audit linker and chainer unless `audit`, and without the data mover unless
    `data_mover`; logging at INFO with `verbose`."""
    return [
        sys.executable,
        "-m",
        "fleetline.cli",
        *(("-v",) if verbose else ()),
        "serve",
        *(("--port", str(api_port)) if api_port else ("--no-api",)),
        *(() if audit else ("--no-audit",)),
        *(() if data_mover else ("--no-data-mover",)),
        "--tier-every",
        "0",
        "--topic-prefix",
        prefix,
        "--group",
        group,
        *flags,
    ]


# Who the test API knows: subject -> (role, tenant); each one's token is `fl_<subject>`.
PRINCIPALS = {
    "ops": ("platform-admin", None),
    "ana": ("tenant-admin", "acme"),
    "uma": ("user", "acme"),
    "gus": ("user", "globex"),
    "vic": ("viewer", "acme"),
    "aud": ("auditor", None),
}


def auth_config(principals: dict[str, tuple[str, str | None]] = PRINCIPALS) -> dict:
    """An auth config (FLEETLINE_AUTH_CONFIG's content) with a token `fl_<subject>` each."""
    from fleetline.api.auth import token_digest

    return {
        "tokens": [
            {"name": name, "sha256": token_digest(f"fl_{name}"), "role": role, "tenant": tenant}
            for name, (role, tenant) in principals.items()
        ]
    }


@contextmanager
def serving_api(fleet) -> Iterator[str]:
    """A built fleet's API on a free loopback port, with the PRINCIPALS' tokens: its URL."""
    from fleetline.api.auth import AuthConfig, Authenticator
    from fleetline.processors.audit.runtime import KafkaAuditEmitter

    emitter = KafkaAuditEmitter(fleet.settings.kafka, fleet.topics)
    app = fleet.api(Authenticator(AuthConfig.from_data(auth_config())), emitter)
    try:
        with serving(app) as url:
            yield url
    finally:
        emitter.flush()


@contextmanager
def serving(app) -> Iterator[str]:
    """An API app served on a free loopback port in a thread: its URL."""
    from fleetline.app import api_server

    port = free_port()
    server = api_server(app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the API to listen")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def signed_in(monkeypatch, url: str, subject: str = "ops") -> None:
    """The CLI's writes go to `url` as `subject` (FLEETLINE_SERVER / FLEETLINE_TOKEN)."""
    monkeypatch.setenv("FLEETLINE_SERVER", url)
    monkeypatch.setenv("FLEETLINE_TOKEN", f"fl_{subject}")


@contextmanager
def started(fleet):
    """A built fleet, started and closed after."""
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()
