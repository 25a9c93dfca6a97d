"""Nodes as `fleetline agent nvml` runs them (NVML faked at the library boundary only: no
simulator labels, only what the driver and the operator say) receive work through `fleetline
serve`: a job placed by model, one with no accelerator placed on whatever is free, and the ones
nothing in the fleet can hold waiting with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetline.agents.node import NodeAgent, NodeIdentity, operator_labels
from fleetline.agents.simulator import ClusterSpec, cluster_info
from fleetline.cli import main
from fleetline.config import Settings
from fleetline.processors.scheduling.client import decisions_of, submit
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.fake_nvml import hgx_collector
from tests.scheduling_support import training
from tests.services import produce, serve_command, service_env, submits
from tests.support import BASE_MS, fresh_topics, wait_until

pytestmark = pytest.mark.services
LAB = ClusterSpec("lab-a", "eu-west", 2)


@contextmanager
def nvml_nodes(settings: Settings, topics: Topics, state_dir: Path) -> Iterator[list[NodeAgent]]:
    """Two node agents as `agent nvml` builds them, one on an H100 board and one on an A100
    board, sampling every 200 ms until the block ends."""
    agents = [
        NodeAgent.create(
            settings,
            default_codec(),
            topics,
            NodeIdentity(
                LAB.cluster_id,
                LAB.region,
                node_id,
                leaf_switch="lab-a-leaf0",
                spine_switch="lab-a-spine0",
                labels=operator_labels({"rack": "r1"}),
            ),
            hgx_collector(device, memory_gib),
            state_dir / node_id,
            interval_ms=200,
            commands=False,
        )
        for node_id, device, memory_gib in (
            ("gpu-host-1", "NVIDIA H100 80GB HBM3", 80),
            ("gpu-host-2", "NVIDIA A100-SXM4-40GB", 40),
        )
    ]
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    try:
        yield agents
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        for agent in agents:
            agent.close()


def latest_decisions(settings: Settings, topics: Topics, into: dict[str, dict]) -> dict:
    """Each job's latest decision, updated in `into`."""
    into.update({d["job"]: d for d in decisions_of(settings.kafka, topics)})
    return into


def test_nvml_shaped_nodes_receive_jobs_through_serve(settings, tmp_path, monkeypatch, capsys):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    produce(settings, topics, [("ClusterInfo", cluster_info(LAB, 1, BASE_MS))])
    env = service_env(settings, tmp_path / "chdb")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    log_path = tmp_path / "serve.log"
    with nvml_nodes(settings, topics, tmp_path / "agents"), log_path.open("w") as log:
        serve = subprocess.Popen(
            serve_command(topics.prefix, f"v-{uuid.uuid4().hex[:8]}", "--tick-interval", "0.3"),
            env={**os.environ, **env},
            stdout=log,
            stderr=log,
        )
        try:
            jobs = {
                # Placed first, by family: only the H100 board has it.
                "acme/by-family": training("by-family", accelerator="H100"),
                # No model named: the A100 board, the only one left.
                "acme/any-model": training("any-model", accelerator=None),
                # Nothing in the fleet has 200 GB GPUs, nor an "H1000": both wait.
                "acme/big-memory": training("big-memory", accelerator=None, min_gpu_memory_gb=200),
                "acme/typo": training("typo", accelerator="H1000"),
            }
            latest: dict[str, dict] = {}

            def settled(key: str) -> bool:
                """Placed, or waiting for a reason about the nodes (not for a first look at
                the fleet: a job that arrives before the view's first tick waits a moment)."""
                decision = latest_decisions(settings, topics, latest).get(key)
                return decision is not None and (
                    decision["outcome"] == "PLACED" or "lab-a:" in decision["reason"]
                )

            for key, document in jobs.items():
                # One at a time: the second takes what the first left.
                submit(settings.kafka, topics, submits(document))
                try:
                    wait_until(lambda key=key: settled(key), 90, what=key, every_s=0.3)
                except AssertionError:
                    raise AssertionError(
                        f"{key}: {latest.get(key)}; serve: {log_path.read_text()[-3000:]}"
                    ) from None
            assert latest["acme/by-family"]["outcome"] == "PLACED", latest["acme/by-family"]
            assert latest["acme/any-model"]["outcome"] == "PLACED", latest["acme/any-model"]
            nodes = {
                key: {w["node_id"] for p in latest[key]["placements"] for w in p["workers"]}
                for key in ("acme/by-family", "acme/any-model")
            }
            assert nodes == {"acme/by-family": {"gpu-host-1"}, "acme/any-model": {"gpu-host-2"}}
            big, typo = latest["acme/big-memory"], latest["acme/typo"]
            assert big["outcome"] == typo["outcome"] == "QUEUED", (big, typo)
            assert "lab-a: has no GPUs with 200+ GB (it has" in big["reason"], big["reason"]
            assert "did you mean h100?" in typo["reason"], typo["reason"]

            # What a person reads: the model, vendor and memory it was placed on.
            capsys.readouterr()
            prefix = ["--topic-prefix", topics.prefix]
            assert main(["explain", "acme/any-model", *prefix]) == 0
            explained = capsys.readouterr().out
            assert "on nvidia a100-sxm4-40gb 40 GiB" in explained, explained
            capsys.readouterr()
            assert main(["view", "nodes", "--json", "--no-snapshots", *prefix]) == 0
            seen = {n["node_id"]: n for n in json.loads(capsys.readouterr().out)}
            assert seen["gpu-host-2"]["accelerator"] == {
                "vendor": "nvidia",
                "model": "a100-sxm4-40gb",
                "family": "a100",
                "name": "NVIDIA A100-SXM4-40GB",
                "memory_mib": 40 * 1024,
            }
            assert seen["gpu-host-1"]["labels"] == {"rack": "r1", "cordoned": "false"}
        finally:
            serve.terminate()
            serve.wait(60)
        assert serve.returncode == 0, log_path.read_text()[-3000:]
