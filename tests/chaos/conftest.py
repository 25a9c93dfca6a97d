"""The chaos suite's cluster: three real Kafka brokers (KRaft, replication 3,
min.insync.replicas 2) on loopback ports of their own, started once for the suite and wiped
after. The S3 server and chdb are the session's (tests/conftest.py).

`make test` runs one round of each fault; `make chaos` sets FLEETLINE_CHAOS=full, which runs
more rounds and the tests marked `chaos_full`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator

import pytest

from fleetline.agents.simulator import default_clusters
from fleetline.config import S3Settings, Settings
from fleetline.infra import KafkaCluster, LocalServices
from fleetline.infra.lab import Lab, LabHost

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
    cluster.wipe()  # kills the brokers: their data goes, no controlled shutdown is owed


@pytest.fixture
def replicated(settings: Settings, kafka_cluster: KafkaCluster) -> Iterator[Settings]:
    """The test's settings pointed at the three brokers (each one is a bootstrap server)."""
    for index, broker in enumerate(kafka_cluster.brokers):
        if not broker.process.answers():  # an earlier test left it down
            kafka_cluster.restart(index)
    yield dataclasses.replace(
        settings,
        kafka=dataclasses.replace(
            settings.kafka, bootstrap_servers=kafka_cluster.bootstrap_servers
        ),
    )


# The lab's own: a test's lab never touches an operator's ("fl", 10.77/16), nor test_lab.py's.
LAB_NAME, LAB_SUBNET = "flc", "10.78.0.0/16"
LAB_KAFKA_PORT, LAB_S3_PORT = 27092, 27000


@dataclasses.dataclass(frozen=True)
class LabServices:
    """A lab up, with Kafka and S3 on its control address, and the settings that reach them."""

    settings: Settings
    host: LabHost
    lab: Lab


@pytest.fixture(scope="module")
def lab(services: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServices]:
    """A lab of three cluster hosts (eu-west-a, us-east-a, ap-south-a: the simulator's first
    three) with a Kafka broker and the S3 server of its own on the lab's control address.
    Needs root (skipped without)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the lab needs root and iproute2")
    host = LabHost(tmp_path_factory.mktemp("lab"), LAB_NAME)
    made = host.up(Lab.plan([c.cluster_id for c in default_clusters(1, 3)], LAB_SUBNET, LAB_NAME))
    settings = dataclasses.replace(
        services,
        kafka=dataclasses.replace(
            services.kafka, bootstrap_servers=f"{made.control}:{LAB_KAFKA_PORT}"
        ),
        s3=S3Settings(endpoint=f"{made.control}:{LAB_S3_PORT}", bucket="fleetline-lab"),
        advertise_host=made.control,
    )
    local = LocalServices.from_settings(settings)
    try:
        local.kafka.wipe()
        local.object_store.wipe()
        local.start()
        yield LabServices(settings, host, made)
    finally:
        host.down(grace_s=5)
        # Its data goes next: no controlled shutdown, which waited a minute for a controller
        # on the lab address just taken down.
        for index in range(len(local.kafka.brokers)):
            local.kafka.kill(index)
        local.object_store.stop()
        local.kafka.wipe()
        local.object_store.wipe()
