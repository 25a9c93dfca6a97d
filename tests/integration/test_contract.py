"""The published contract, used from another language: a Go consumer (contract/go-consumer,
franz-go and hamba/avro) that knows only the .avsc files and single-object encoding decodes
every message of live topics, old schema versions among them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.processors.scheduling.client import request_output
from fleetline.processors.scheduling.codec import new_request
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.loop import deliver
from fleetline.streams.records import Output
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS, fresh_topics

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = ROOT / "contract" / "go-consumer"
codec = default_codec()


def consumer_binary() -> Path:
    """Build the Go consumer (modules from the Go module proxy on first use)."""
    binary = ROOT / ".cache" / "bin" / "fleetline-go-consumer"
    binary.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=CONSUMER,
        check=True,
        env={**os.environ, "GOFLAGS": "-mod=readonly"},
        timeout=600,
    )
    return binary


def read_with_go(binary: Path, bootstrap: str, topic: str) -> tuple[dict, list[dict]]:
    schemas = str(ROOT / "fleetline" / "schemas")
    done = subprocess.run(
        [str(binary), "--brokers", bootstrap, "--topic", topic, "--print", "--schemas", schemas],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines and "summary" in lines[-1], (done.returncode, done.stderr)
    return lines[-1]["summary"], lines[:-1]


def test_a_go_consumer_decodes_every_message_of_live_topics(settings, tmp_path):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    simulator = FleetSimulator([ClusterSpec("go-1", "eu", 2)], seed=5)
    agents = FleetAgent.create(settings, codec, topics, simulator, tmp_path, commands=False)
    agents.start(BASE_MS)
    for tick in range(1, 6):
        agents.tick(BASE_MS + tick * 1000)
    agents.flush()
    agents.close()
    # The scheduler's request log, with a request in the schema's first version beside the
    # newest: a reader of the contract must decode both.
    producer = kafka_clients.producer(settings.kafka)
    requests = [
        new_request("SUBMIT", f"acme/j{i}", "acme", BASE_MS + i, f"r{i}", spec_json="{}")
        for i in range(3)
    ]
    outputs = [request_output(topics, r, codec) for r in requests]
    v1 = {f["name"] for f in codec.registry.version("SchedulerRequest", 1).source["fields"]}
    old = {k: v for k, v in requests[0].items() if k in v1}
    old_bytes = codec.encode("SchedulerRequest", old, version=1)
    outputs.append(Output(topics.scheduler_requests, b"acme/old", old_bytes))
    deliver(producer, outputs, "requests")

    binary = consumer_binary()
    telemetry, records = read_with_go(binary, settings.kafka.bootstrap_servers, topics.telemetry)
    assert telemetry["messages"] == 2 * 5 and telemetry["decoded"] == telemetry["messages"]
    assert telemetry["undecodable"] == 0
    decoded = {(r["record"]["node_id"], r["record"]["seq"]): r["record"] for r in records}
    assert {node for node, _ in decoded} == {n.node_id for n in simulator.nodes}
    first = next(iter(decoded.values()))
    assert len(first["gpus"]) == 8 and 0 <= first["gpus"][0]["gpu_util_pct"] <= 100

    state, _ = read_with_go(binary, settings.kafka.bootstrap_servers, topics.node_state)
    assert state["messages"] >= 2 and state["decoded"] == state["messages"]

    log, records = read_with_go(binary, settings.kafka.bootstrap_servers, topics.scheduler_requests)
    assert log["messages"] == log["decoded"] == 4, log
    assert log["by_schema"] == {"SchedulerRequest.v6": 3, "SchedulerRequest.v1": 1}
    assert [r["record"]["key"] for r in records[:3]] == ["acme/j0", "acme/j1", "acme/j2"]
