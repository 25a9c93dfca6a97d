"""Every process reachable by address: the one setting (FLEETLINE_ADVERTISE_HOST) that names
where this host's processes listen and are reached, and `infra start --listen`."""

from __future__ import annotations

import dataclasses
import socket
import threading
from pathlib import Path

import pytest

from fleetline.agents.cluster.agent import ClusterAgent
from fleetline.cli.common import listen_host
from fleetline.config import KafkaSettings, Settings
from fleetline.errors import ConfigError
from fleetline.infra import LocalServices
from fleetline.streams.topics import Topics
from tests.support import TEST_ROOT

ROOTED = Settings(kafka=KafkaSettings(identity_root=TEST_ROOT))


def test_the_advertised_host_is_read_and_checked() -> None:
    assert Settings.from_env({}).advertise_host == "127.0.0.1"
    for good in ("10.77.1.2", "gpu-host-1.lab", "fd00::7"):
        assert Settings.from_env({"FLEETLINE_ADVERTISE_HOST": good}).advertise_host == good
    for bad, message in (
        ("0.0.0.0", "not the wildcard 0.0.0.0"),
        ("::", "not the wildcard ::"),
        ("a host", "an IP address or a host name, got 'a host'"),
        ("10.77.1", "an IP address or a host name"),
    ):
        with pytest.raises(ConfigError, match=message):
            Settings.from_env({"FLEETLINE_ADVERTISE_HOST": bad})


def test_a_flag_wins_over_the_setting(monkeypatch) -> None:
    monkeypatch.setenv("FLEETLINE_ADVERTISE_HOST", "127.0.0.3")
    assert listen_host(None) == "127.0.0.3"
    assert listen_host("127.0.0.4") == "127.0.0.4"


def test_the_cluster_agent_probes_and_starts_workloads_at_the_advertised_host(
    tmp_path: Path,
) -> None:
    # Any 127/8 address is this host's loopback on Linux: a stand-in for a lab address here.
    settings = dataclasses.replace(ROOTED, advertise_host="127.0.0.2")
    agent = ClusterAgent(settings, Topics("unit"), "lab-a", tmp_path)
    stop = threading.Event()
    server = agent.peers.serve(stop)
    try:
        host, port = str(agent.peers.probe_address).rsplit(":", 1)
        assert host == "127.0.0.2"
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            conn.sendall(b"PING lab-b\n")
            assert conn.recv(64).startswith(b"PONG lab-a")
    finally:
        stop.set()
        server.close()


def test_infra_listens_where_it_is_told(tmp_path: Path) -> None:
    settings = dataclasses.replace(ROOTED, cache_dir=tmp_path)
    services = LocalServices.from_settings(settings, listen="10.77.0.1")
    broker = services.kafka.first
    assert broker.bootstrap_servers == "10.77.0.1:19092"
    props = dict(
        line.split("=", 1) for line in broker.server_properties().splitlines() if "=" in line
    )
    assert props["listeners"].startswith("PLAINTEXT://10.77.0.1:19092,CONTROLLER://10.77.0.1:")
    assert props["advertised.listeners"] == "PLAINTEXT://10.77.0.1:19092"
    assert services.client_env() == {
        "FLEETLINE_KAFKA_BOOTSTRAP": "10.77.0.1:19092",
        "FLEETLINE_S3_ENDPOINT": "10.77.0.1:19000",
    }
