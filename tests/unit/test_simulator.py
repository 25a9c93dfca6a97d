"""The fleet simulator: deterministic from its seed, realistic ranges (no services)."""

from __future__ import annotations

import pytest

from fleetline.agents.simulator import Fault, FleetSimulator, default_clusters, load_faults
from fleetline.errors import ConfigError
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
    assert seqs and all(s == list(range(1, len(s) + 1)) for s in seqs.values())
    assert len(seqs) == 9


def test_topology_groups_gpus_in_islands_and_leaves() -> None:
    sim = FleetSimulator(default_clusters(6), seed=1)
    state = sim.initial_states(BASE_MS)[0]
    assert state["topology"]["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    leaves = {n.leaf_switch for n in sim.nodes if n.cluster_id == "eu-west-a"}
    assert len(leaves) == 3  # 6 nodes, 2 per leaf: 16 GPUs behind each leaf
    assert state["topology"]["nvlink_peers"]["5"] == [4, 6, 7]


def test_a_down_node_stops_reporting() -> None:
    sim = FleetSimulator(default_clusters(2), seed=1)
    victim = sim.nodes[0].node_id
    state = sim.take_down(victim, BASE_MS, "psu failure")
    assert (state["state"], state["reason"]) == ("DOWN", "psu failure")
    assert victim not in {r["node_id"] for r in sim.telemetry(BASE_MS + 1000)}


SCRIPT = """
- {kind: nvlink_errors, target: eu-west-a-n0000/3, at_s: 2, for_s: 3, value: 5}
- {kind: rdma_loss, target: us-east-a-leaf000, at_s: 2, value: 0.02}
- {kind: xid, target: eu-west-a-n0001/0, at_s: 3, value: 79}
- {kind: ecc_dbe, target: eu-west-a-n0001/1, at_s: 3}
- {kind: node_down, target: us-east-a-n0003, at_s: 2, for_s: 2}
- {kind: cluster_link_loss, target: ap-south-a, at_s: 1, for_s: 3}
"""


def scripted() -> FleetSimulator:
    return FleetSimulator(default_clusters(4), seed=5, faults=load_faults(SCRIPT, BASE_MS))


def ticks(sim: FleetSimulator, n: int) -> dict[int, dict[str, dict]]:
    out = {}
    for tick in range(1, n + 1):
        ts = BASE_MS + tick * 1000
        sim.state_changes(ts)
        out[tick] = {r["node_id"]: r for r in sim.telemetry(ts)}
    return out


def test_nvlink_fault_degrades_one_gpu_for_its_window() -> None:
    seen = ticks(scripted(), 6)
    errors = [seen[t]["eu-west-a-n0000"]["gpus"][3]["nvlink_errors_total"] for t in range(1, 7)]
    assert errors == [0, 5, 10, 15, 15, 15]  # cumulative counter, rising only while active
    assert seen[3]["eu-west-a-n0000"]["gpus"][2]["nvlink_errors_total"] == 0


def test_leaf_switch_rdma_loss_degrades_its_16_gpus() -> None:
    seen = ticks(scripted(), 3)
    lossy = [
        (node_id, g["gpu_index"])
        for node_id, r in seen[3].items()
        for g in r["gpus"]
        if g["rdma_packet_loss_ratio"] == 0.02
    ]
    assert len(lossy) == 16
    assert {node_id for node_id, _ in lossy} == {"us-east-a-n0000", "us-east-a-n0001"}


def test_xid_and_double_bit_ecc_are_events_raised_once() -> None:
    seen = ticks(scripted(), 5)
    xids = [seen[t]["eu-west-a-n0001"]["gpus"][0]["xid_codes"] for t in range(1, 6)]
    assert xids == [[], [], [79], [], []]
    dbe = [seen[t]["eu-west-a-n0001"]["gpus"][1]["ecc_dbe_total"] for t in range(1, 6)]
    assert dbe == [0, 0, 1, 1, 1]


def test_node_down_and_recovery_are_state_changes() -> None:
    sim = scripted()
    changes = {t: sim.state_changes(BASE_MS + t * 1000) for t in range(1, 6)}
    assert [(c["node_id"], c["state"]) for c in changes[2]] == [("us-east-a-n0003", "DOWN")]
    assert [(c["node_id"], c["state"]) for c in changes[4]] == [("us-east-a-n0003", "UP")]
    assert changes[1] == changes[3] == changes[5] == []


def test_cluster_link_loss_cuts_the_cluster_off_for_its_window() -> None:
    sim = scripted()
    up = [sim.link_up("ap-south-a-n0002", BASE_MS + t * 1000) for t in range(0, 6)]
    assert up == [True, False, False, False, True, True]
    assert sim.link_up("eu-west-a-n0002", BASE_MS + 2000)


def test_scripted_runs_are_deterministic() -> None:
    assert ticks(scripted(), 6) == ticks(scripted(), 6)


def test_power_cap_limits_power_and_clocks() -> None:
    sim = FleetSimulator(default_clusters(1), seed=2)
    sim.set_power_limit("eu-west-a-n0000", 300.0)
    gpus = sim.telemetry(BASE_MS)[0]["gpus"]
    assert len(gpus) == 8
    assert all(g["power_w"] <= 300.0 and g["power_limit_w"] == 300.0 for g in gpus)
    assert gpus[0]["sm_clock_mhz"] < 1980


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("- {kind: meteor, target: x}", "kind must be one of"),
        ("- {kind: node_down}", "target is required"),
        ("- {kind: node_down, target: x, at_s: soon}", "could not convert"),
        ("- {kind: node_down, target: x, colour: red}", "unknown fields"),
        ("- just a string", "expected a mapping"),
    ],
)
def test_bad_fault_scripts_are_named(script: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_faults(script, BASE_MS)


def test_fault_targets_must_exist() -> None:
    with pytest.raises(ConfigError, match="no such target"):
        FleetSimulator(
            default_clusters(1), seed=1, faults=[Fault("rdma_loss", "nowhere-leaf", BASE_MS)]
        )


def test_the_shipped_scenario_fits_the_default_fleet() -> None:
    from pathlib import Path

    script = Path(__file__).parent.parent / "scenarios" / "degraded-fabric.yaml"
    sim = FleetSimulator(default_clusters(4), seed=7, faults=load_faults(script, BASE_MS))
    seen = ticks(sim, 12)
    lossy = sum(g["rdma_packet_loss_ratio"] == 0.02 for r in seen[6].values() for g in r["gpus"])
    assert lossy == 16
    assert not sim.link_up("ap-south-a-n0000", BASE_MS + 12_000)


def test_training_is_steady_and_inference_follows_the_day() -> None:
    sim = FleetSimulator(default_clusters(8), seed=4)
    hour = 3600 * 1000
    day_start = (BASE_MS // (24 * hour)) * 24 * hour
    night = {
        (r["node_id"], g["gpu_index"]): g["gpu_util_pct"]
        for r in sim.telemetry(day_start + 3 * hour)
        for g in r["gpus"]
    }
    afternoon = {
        (r["node_id"], g["gpu_index"]): g["gpu_util_pct"]
        for r in sim.telemetry(day_start + 15 * hour)
        for g in r["gpus"]
    }
    training = [(n.node_id, i) for n in sim.nodes for i, b in enumerate(n.load_bias) if b >= 0.6]
    inference = [(n.node_id, i) for n in sim.nodes for i, b in enumerate(n.load_bias) if b < 0.6]
    mean = lambda keys, d: sum(d[k] for k in keys) / len(keys)  # noqa: E731
    assert mean(training, night) > 80 and mean(training, afternoon) > 80
    assert mean(inference, afternoon) > 2 * mean(inference, night)
