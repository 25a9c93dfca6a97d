"""Events of a simulated fleet for tests: the degraded-fabric scenario's records, folded or as
the consumer would see them."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import Message

from fleetline.agents.simulator import ClusterSpec, FleetSimulator, load_faults
from fleetline.processors.view.fold import apply
from fleetline.processors.view.model import ResourceView
from fleetline.streams.partitioner import partition_for
from fleetline.streams.serde import Decoded, default_codec
from fleetline.streams.topics import Topics
from tests.support import BASE_MS

SCENARIO = Path(__file__).parent / "scenarios" / "degraded-fabric.yaml"
CODEC = default_codec()
TOPICS = Topics(prefix="unit", node_partitions=3)


def scenario_fleet() -> FleetSimulator:
    clusters = [
        ClusterSpec("us-east-a", "us-east", 4),
        ClusterSpec("eu-west-a", "eu-west", 4),
        ClusterSpec("ap-south-a", "ap-south", 4),
    ]
    return FleetSimulator(clusters, seed=7, faults=load_faults(SCENARIO, BASE_MS))


def scenario_events(seconds: int = 60) -> list[tuple[str, dict]]:
    """(record name, record) in the order an agent emits them, ticks of one second."""
    sim = scenario_fleet()
    events = [("NodeState", r) for r in sim.initial_states(BASE_MS)]
    for t in range(1, seconds + 1):
        ts = BASE_MS + t * 1000
        events += [("NodeState", r) for r in sim.state_changes(ts)]
        events += [
            ("NodeTelemetry", r)
            for r in sim.telemetry(ts)
            if sim.cluster_link_up(r["cluster_id"], ts)
        ]
    return events


def decoded(name: str, record: dict) -> Decoded:
    return CODEC.decode(CODEC.encode(name, record))


def fold(events, view: ResourceView | None = None) -> ResourceView:
    view = view or ResourceView()
    for name, record in events:
        apply(view, decoded(name, record))
    return view


def messages(events, partitions: int = 3) -> list[Message]:
    """The events as the consumer would see them: per topic and partition, in offset order."""
    next_offset: dict[tuple[str, int], int] = {}
    out = []
    for name, record in events:
        topic = TOPICS.telemetry if name == "NodeTelemetry" else TOPICS.node_state
        key = record["node_id"].encode()
        partition = partition_for(key, partitions)
        offset = next_offset.get((topic, partition), 0)
        next_offset[(topic, partition)] = offset + 1
        out.append(
            Message(
                topic=topic,
                partition=partition,
                offset=offset,
                key=key,
                value=CODEC.encode(name, record),
            )
        )
    return out


def allocation(
    job: str, kind: str, gpus: list[tuple[str, int]], seq: int, tenant: str = "t1"
) -> tuple[str, dict]:
    return (
        "Allocation",
        {
            "job_id": job,
            "tenant": tenant,
            "seq": seq,
            "ts": BASE_MS + seq,
            "kind": kind,
            "cluster_id": "us-east-a",
            "priority": 1,
            "reason": None,
            "gpus": [{"node_id": n, "gpu_index": i} for n, i in gpus],
        },
    )
