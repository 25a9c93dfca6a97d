"""The node agents' disk full: their state folder (spool, sequence numbers) on a real 2 MiB
filesystem filled to the last byte while they stream. They go on collecting and sending, the
records they could not spool reach Kafka from memory, every node's sequence has no gap, and
once there is room again the spool writes to disk again and a restarted agent carries on.

The filesystem is a tmpfs mounted for the test (root only); where mounting is refused (not
root, permission denied) the test is skipped with the command and its error; any other mount
failure fails it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.processors.replay import log_bounds
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS, fresh_topics, read_all

codec = default_codec()
CLUSTERS = [ClusterSpec("eu-west-a", "eu-west", 3), ClusterSpec("us-east-a", "us-east", 3)]


@pytest.fixture
def small_disk(tmp_path: Path):
    mount_point = tmp_path / "agent"
    mount_point.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        why = f"`{' '.join(command)}` failed: {done.stderr.strip()}"
        refused = os.geteuid() != 0 or any(
            words in done.stderr.lower() for words in ("permission denied", "only root")
        )
        if refused:  # not root here, or a sandbox that forbids mounts: the host's limit
            pytest.skip(f"blocked: {why}")
        pytest.fail(why)  # any other failure is ours to see
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def fill_up(disk: Path) -> Path:
    """Write a ballast file until the filesystem refuses another byte."""
    ballast = disk / "ballast"
    with ballast.open("wb", buffering=0) as handle:
        chunk = b"\0" * 4096
        try:
            while True:
                handle.write(chunk)
        except OSError:
            pass
        try:
            while True:
                handle.write(b"\0")
        except OSError:
            pass
    return ballast


def sequences(settings, topics) -> dict[str, list[int]]:
    _, end = log_bounds(settings.kafka, topics)
    by_node: dict[str, list[int]] = {}
    for topic in topics.node_topics:
        for msg in read_all(settings, topic, sum(end[topic].values()), timeout_s=90):
            record = codec.decode(msg.value()).record
            by_node.setdefault(record["node_id"], []).append(record["seq"])
    return by_node


def test_a_full_disk_loses_no_record_and_the_spool_recovers(settings, small_disk) -> None:
    topics = fresh_topics(partitions=3)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())

    def agent() -> FleetAgent:
        return FleetAgent.create(
            settings,
            codec,
            topics,
            FleetSimulator(CLUSTERS, seed=4),
            small_disk,
            commands=False,
        )

    fleet = agent()
    tick = 0

    def stream(ticks: int) -> None:
        nonlocal tick
        for _ in range(ticks):
            tick += 1
            fleet.tick(BASE_MS + tick * 1000)
        fleet.flush(60)

    fleet.start(BASE_MS)
    stream(3)
    ballast = fill_up(small_disk)
    stream(40)  # every segment write and sequence save now finds the disk full
    spools = [p.spool for p in fleet.publishers.values()]
    assert all(s.disk_full for s in spools) and sum(s.unspooled for s in spools) >= 40
    assert fleet.sequences is not None and fleet.sequences.unsaved >= 40
    assert all(len(s) == 0 for s in spools)  # everything acknowledged from memory
    seen = sequences(settings, topics)
    assert len(seen) == 6
    for node_id, seqs in seen.items():  # a node's telemetry and states share its sequence
        assert sorted(set(seqs)) == list(range(1, max(seqs) + 1)), node_id
        assert max(seqs) > tick, node_id  # its start and every interval
    before_room = {n: max(s) for n, s in seen.items()}

    ballast.unlink()  # room again
    stream(70)  # past the spool's retry interval
    assert not any(s.disk_full for s in spools)
    fleet.close()
    fleet = agent()  # a restart carries on from what it saved once there was room
    stream(3)
    fleet.close()
    for node_id, seqs in sequences(settings, topics).items():
        assert sorted(set(seqs)) == list(range(1, max(seqs) + 1)), node_id
        assert max(seqs) > before_room[node_id] + 70, node_id
