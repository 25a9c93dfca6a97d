"""The chaos suite's cluster: three real Kafka brokers (KRaft, replication 3,
min.insync.replicas 2) on loopback ports of their own, started once for the suite and wiped
after. The S3 server and chdb are the session's (tests/conftest.py).

`make test` runs one round of each fault; `make chaos` sets FLEETLINE_CHAOS=full, which runs
more rounds and the tests marked `chaos_full`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from fleetline.config import KafkaSettings, Settings
from fleetline.infra import KafkaCluster

CLUSTER_PORT = int(os.environ.get("FLEETLINE_TEST_KAFKA_CLUSTER_PORT", "28092"))
FULL = os.environ.get("FLEETLINE_CHAOS", "").lower() == "full"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FULL:
        return
    skip = pytest.mark.skip(reason="runs in `make chaos` (FLEETLINE_CHAOS=full)")
    for item in items:
        if "chaos_full" in item.keywords:
            item.add_marker(skip)


def rounds(fast: int, full: int) -> int:
    """How many times a fault is injected: `fast` in `make test`, `full` in `make chaos`."""
    return full if FULL else fast


@pytest.fixture(scope="session")
def kafka_cluster(services: Settings) -> Iterator[KafkaCluster]:
    cluster = KafkaCluster.on_loopback(services.cache_dir, "127.0.0.1", CLUSTER_PORT, 3)
    cluster.wipe()
    cluster.start()
    yield cluster
    for index in range(len(cluster.brokers)):
        cluster.kill(index)  # its data goes next: no need for a controlled shutdown
    cluster.wipe()


@pytest.fixture
def replicated(settings: Settings, kafka_cluster: KafkaCluster) -> Iterator[Settings]:
    """The test's settings pointed at the three brokers (each one is a bootstrap server)."""
    for index, broker in enumerate(kafka_cluster.brokers):
        if not broker.process.answers():  # an earlier test left it down
            kafka_cluster.restart(index)
    yield dataclasses.replace(
        settings,
        kafka=KafkaSettings(kafka_cluster.bootstrap_servers, settings.kafka.client_overrides),
    )
