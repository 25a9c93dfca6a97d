"""`fleetline router --processes N`: N router processes on one port (SO_REUSEPORT), each
answering the connections the kernel gives it, all ended together."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid

import pytest

from fleetline.config import Settings
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.topics import Topics
from tests.services import service_env
from tests.support import wait_until

pytestmark = pytest.mark.services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(port: int) -> dict | None:
    """One fresh connection's answer (None while nothing answers or it is not synced)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def test_router_processes_share_one_port_and_end_together(services: Settings, tmp_path) -> None:
    topics = Topics(prefix=f"test.router.{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(services.kafka, topics.specs())
    port = free_port()
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115
    router = subprocess.Popen(
        [
            sys.executable, "-m", "fleetline.cli", "router", "--processes", "2",
            "--port", str(port), "--host", "127.0.0.1", "--open", "--no-report",
            "--topic-prefix", topics.prefix,
        ],
        env={**os.environ, **service_env(services)},
        stdout=log,
        stderr=log,
    )  # fmt: skip
    try:
        names: set[str] = set()

        def both_answer() -> bool:
            answer = health(port)
            if answer is not None and answer.get("synced"):
                names.add(answer["router"])
            return len(names) == 2

        # Each new connection is given to one of the two by the kernel: both are seen.
        wait_until(both_answer, 60, "both router processes to answer on the one port")
        assert "router: 2 processes on port" in (tmp_path / "router.log").read_text()
    finally:
        router.send_signal(signal.SIGTERM)
        code = router.wait(30)
    assert code == 0, (tmp_path / "router.log").read_text()
    assert health(port) is None  # no process left on the port


def test_several_router_processes_need_a_fixed_port(services: Settings) -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "fleetline.cli", "router", "--processes", "2", "--port", "0",
         "--open"],
        env={**os.environ, **service_env(services)},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert answer.returncode != 0
    assert "--processes above 1 needs a fixed --port" in answer.stderr
