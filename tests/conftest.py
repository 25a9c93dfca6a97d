"""Fixtures: the real Kafka broker and S3 server (started here unless already running) and chdb.

Tests are grouped by kind: `unit/` (pure, no services, the whole folder in seconds),
`contract/` (one case per port, run against each real backend), `integration/` (real Kafka, S3
and chdb), `e2e/` (scenarios played on the whole stack) and `chaos/` (faults injected into a
replicated Kafka cluster and the processes; `make chaos` runs more rounds of each). Every test
outside `unit/` is marked `services`. Services run on their own ports (29092, 29000; the chaos
suite's three brokers from 28092) so a `fleetline run` on the default ports and a test run never
share a broker; they start only when a test asks for them.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetline.config import KafkaSettings, S3Settings, Settings
from fleetline.infra import LocalServices
from fleetline.observability import crashes
from fleetline.storage.clickhouse import connect

TEST_KAFKA = os.environ.get("FLEETLINE_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:29092")
TEST_S3 = os.environ.get("FLEETLINE_TEST_S3_ENDPOINT", "127.0.0.1:29000")


_NEED_SERVICES = ("contract", "integration", "e2e", "chaos")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    # pytest reports a crash of the test process on a copy of its stderr; the chdb engine the
    # tests open puts its own signal handlers first, and `reinstall` needs that copy to put
    # the report back in front of them. The crashing thread's stack only: CI shows the head of
    # a failed run's output and its tail, and among the threads of an in-process stack the
    # crashing one was cut off (the tail has its native frames: `make test`).
    from _pytest.faulthandler import fault_handler_stderr_fd_key

    if fault_handler_stderr_fd_key in config.stash:
        crashes.report_fatal_signals(config.stash[fault_handler_stderr_fd_key], all_threads=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(part in _NEED_SERVICES for part in Path(str(item.fspath)).parts):
            item.add_marker(pytest.mark.services)


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # chdb allows one data path per process, so the whole session shares one; tests isolate
    # themselves by database name.
    return tmp_path_factory.mktemp("chdb")


@pytest.fixture(scope="session")
def services(chdb_path: Path) -> Iterator[Settings]:
    base = Settings.from_env()
    settings = dataclasses.replace(
        base,
        kafka=KafkaSettings(TEST_KAFKA, base.kafka.client_overrides),
        s3=S3Settings(endpoint=TEST_S3, bucket="fleetline-test"),
        clickhouse_url=f"chdb://{chdb_path}",
    ).with_deployment_key()  # objects sealed, as `serve` seals them by default
    # The control plane's identity root, as `serve` makes it: the tests write as the control
    # plane, agents they start as themselves, and every fold checks who wrote what.
    settings = settings.with_identity_root()
    local = LocalServices.from_settings(settings)
    started = not all(local.status().values())
    if started:
        # Fresh data each session: no topic or object left from an earlier run can leak in.
        local.kafka.wipe()
        local.object_store.wipe()
        local.start()
    yield settings
    if started:
        local.stop()


@pytest.fixture
def settings(services: Settings) -> Settings:
    """Service settings with a database of this test's own."""
    return dataclasses.replace(services, clickhouse_database=f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def clickhouse(settings: Settings):
    return connect(settings.clickhouse_url)
