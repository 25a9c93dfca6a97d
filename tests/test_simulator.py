"""The fleet simulator: deterministic from its seed, realistic ranges (no services)."""

from __future__ import annotations

from fleetline.agents.simulator import FleetSimulator, default_clusters
from fleetline.streams.events import check_telemetry
from tests.support import BASE_MS


def run(seed: int, ticks: int = 5) -> list[dict]:
    sim = FleetSimulator(default_clusters(3), seed=seed)
    out = sim.initial_states(BASE_MS)
    for tick in range(1, ticks + 1):
        out += sim.telemetry(BASE_MS + tick * 1000)
    return out


def test_same_seed_same_records() -> None:
    assert run(3) == run(3)


def test_different_seed_different_load() -> None:
    assert run(3) != run(4)


def test_every_record_is_in_range_and_sequenced_per_node() -> None:
    records = run(9, ticks=20)
    seqs: dict[str, list[int]] = {}
    for record in records:
        seqs.setdefault(record["node_id"], []).append(record["seq"])
        if "gpus" in record:
            check_telemetry(record)
            assert len(record["gpus"]) == 8
            assert len({g["gpu_uuid"] for g in record["gpus"]}) == 8
            for gpu in record["gpus"]:
                assert 0 <= gpu["fb_used_mib"] <= gpu["fb_total_mib"]
                assert 20 < gpu["temperature_c"] < 95
                assert gpu["nvlink_tx_bytes_per_s"] >= 0
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())
    assert len(seqs) == 9


def test_topology_groups_gpus_in_islands_and_leaves() -> None:
    sim = FleetSimulator(default_clusters(6), seed=1)
    state = sim.initial_states(BASE_MS)[0]
    assert state["topology"]["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    leaves = {n.leaf_switch for n in sim.nodes if n.cluster_id == "eu-west-a"}
    assert len(leaves) == 2  # 6 nodes, 4 per leaf


def test_a_down_node_stops_reporting() -> None:
    sim = FleetSimulator(default_clusters(2), seed=1)
    victim = sim.nodes[0].node_id
    state = sim.take_down(victim, BASE_MS, "psu failure")
    assert (state["state"], state["reason"]) == ("DOWN", "psu failure")
    assert victim not in {r["node_id"] for r in sim.telemetry(BASE_MS + 1000)}
