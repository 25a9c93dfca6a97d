"""Agent benchmarks: one process simulating 1,000 nodes x 8 GPUs at 1 Hz (does it keep up, and
at what CPU per node), and a 10,000-node (80,000-GPU) fleet pushed as fast as it goes.

Against the real local broker (started if it is not running). Prints the figures and writes
them to benchmarks/results/agents.json.

    .venv/bin/python benchmarks/agents.py [--nodes 1000] [--seconds 20] [--big-nodes 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from _common import local_services, report

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import Settings
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000


def fleet(nodes: int, clusters: int = 4) -> FleetSimulator:
    return FleetSimulator(
        [ClusterSpec(f"c{i}", f"region-{i}", nodes // clusters) for i in range(clusters)], seed=1
    )


def agent_for(settings: Settings, nodes: int, state_dir: Path) -> tuple[FleetAgent, Topics]:
    topics = Topics(prefix=f"bench.{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    agent = FleetAgent.create(
        settings,
        default_codec(),
        topics,
        fleet(nodes),
        state_dir,
        commands=True,
        spool_max_bytes=2**31,
    )
    return agent, topics


def paced(settings: Settings, nodes: int, seconds: int) -> dict[str, float]:
    """Real 1 Hz pacing: every interval's records are collected, spooled and sent in time?"""
    with tempfile.TemporaryDirectory() as scratch:
        agent, _ = agent_for(settings, nodes, Path(scratch))
        agent.start(BASE_MS)
        agent.flush()
        busy, late = [], 0
        cpu0 = time.process_time()
        began = time.monotonic()
        for tick in range(1, seconds + 1):
            start = time.monotonic()
            agent.tick(BASE_MS + tick * 1000)
            took = time.monotonic() - start
            busy.append(took)
            late += took > 1.0
            time.sleep(max(0.0, began + tick - time.monotonic()))
        agent.flush()
        cpu = time.process_time() - cpu0
        metrics = agent.spool_metrics()
        agent.close()
    return {
        "paced_nodes": nodes,
        "paced_seconds": seconds,
        "paced_tick_mean_s": sum(busy) / len(busy),
        "paced_tick_max_s": max(busy),
        "paced_late_ticks": late,
        "paced_cpu_cores_used": cpu / seconds,
        "paced_cpu_ms_per_node_interval": 1000 * cpu / (seconds * nodes),
        "paced_spool_records_left": sum(m["records"] for m in metrics.values()),
    }


def push(settings: Settings, nodes: int, ticks: int) -> dict[str, float]:
    """An 80,000-GPU fleet, unpaced: how fast the simulator + agent path fills Kafka."""
    with tempfile.TemporaryDirectory() as scratch:
        agent, _ = agent_for(settings, nodes, Path(scratch))
        agent.commands.close()
        agent.commands = None
        began = time.perf_counter()
        sent = 0
        for tick in range(1, ticks + 1):
            sent += agent.tick(BASE_MS + tick * 1000)["telemetry"]
        agent.flush(300)
        elapsed = time.perf_counter() - began
        agent.close()
    return {
        "push_nodes": nodes,
        "push_gpus": nodes * 8,
        "push_records": sent,
        "push_records_per_s": sent / elapsed,
        "push_gpu_samples_per_s": 8 * sent / elapsed,
        "push_seconds_per_fleet_interval": elapsed / ticks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--big-nodes", type=int, default=10_000)
    parser.add_argument("--big-ticks", type=int, default=3)
    args = parser.parse_args()
    settings = Settings.from_env()
    with local_services(settings) as settings:
        figures = {
            **paced(settings, args.nodes, args.seconds),
            **push(settings, args.big_nodes, args.big_ticks),
        }
    report("agents", figures)


if __name__ == "__main__":
    main()
