"""A node agent's sends never time out: the producer behind its spool is built without a
message timeout, which would let librdkafka send records queued behind a timed-out one ahead of
it (see `agents/runtime.SENDS`). Both agents that spool (a host's node agent, the simulated
fleet's) are built here with the producer factory recorded; nothing is sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.node import NodeAgent, NodeIdentity
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import KafkaSettings, Settings
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.support import TEST_ROOT

SETTINGS = Settings(kafka=KafkaSettings("127.0.0.1:1", identity_root=TEST_ROOT))


class Unread:
    """A node's devices, never read."""

    def close(self) -> None:
        pass


@pytest.fixture
def producer_configs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    made: list[dict[str, Any]] = []
    real = kafka_clients.producer

    def recording(kafka: KafkaSettings, config: Any = None, **kwargs: Any) -> Any:
        made.append(dict(config or {}))
        return real(kafka, config, **kwargs)

    monkeypatch.setattr(kafka_clients, "producer", recording)
    return made


def test_a_host_s_node_agent_never_times_out_a_send(producer_configs, tmp_path: Path) -> None:
    agent = NodeAgent.create(
        SETTINGS,
        default_codec(),
        Topics("sends"),
        NodeIdentity("c1", "eu-west", "n1"),
        Unread(),  # nothing is collected here
        tmp_path,
        commands=False,
    )
    try:
        assert [c.get("message.timeout.ms") for c in producer_configs] == [0]
    finally:
        agent.close()


def test_the_simulated_fleet_s_agent_never_times_out_a_send(producer_configs, tmp_path) -> None:
    simulator = FleetSimulator(
        [ClusterSpec("c1", "eu-west", 1), ClusterSpec("c2", "us-east", 1)], seed=1
    )
    agent = FleetAgent.create(
        SETTINGS, default_codec(), Topics("sends"), simulator, tmp_path, commands=False
    )
    try:
        assert [c.get("message.timeout.ms") for c in producer_configs] == [0, 0]
    finally:
        agent.close()
