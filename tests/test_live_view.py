"""The live view's pure fold and per-cluster summary (no services)."""

from __future__ import annotations

import pytest

from fleetline.errors import InvalidEventError
from fleetline.processors.view.summary import NodeSummary, apply, summarize
from fleetline.streams.serde import Decoded, default_codec
from tests.support import BASE_MS, small_fleet

codec = default_codec()


def event(name: str, record: dict) -> Decoded:
    return codec.decode(codec.encode(name, record))


def fold(events: list[Decoded]) -> dict[str, NodeSummary]:
    nodes: dict[str, NodeSummary] = {}
    for e in events:
        node_id = e.record["node_id"]
        nodes[node_id] = apply(nodes.get(node_id), e)
    return nodes


def test_telemetry_sets_gpu_count_and_utilisation() -> None:
    fleet = small_fleet(nodes=1)
    record = fleet.telemetry(BASE_MS)[0]
    node = apply(None, event("NodeTelemetry", record))
    assert node.gpus == 8
    assert node.util_sum == pytest.approx(sum(g["gpu_util_pct"] for g in record["gpus"]), abs=1e-3)
    assert (node.state, node.last_seq, node.last_ts) == ("UP", record["seq"], BASE_MS)


def test_duplicate_and_stale_events_change_nothing() -> None:
    fleet = small_fleet(nodes=1)
    first = event("NodeTelemetry", fleet.telemetry(BASE_MS)[0])
    second = event("NodeTelemetry", fleet.telemetry(BASE_MS + 1000)[0])
    node = apply(apply(None, first), second)
    assert apply(node, second) is node  # redelivered
    assert apply(node, first) is node  # late, older seq


def test_down_node_is_counted_and_excluded_from_utilisation() -> None:
    fleet = small_fleet(nodes=2)
    events = [event("NodeState", r) for r in fleet.initial_states(BASE_MS)]
    events += [event("NodeTelemetry", r) for r in fleet.telemetry(BASE_MS + 1000)]
    victim = fleet.nodes[0]
    events.append(event("NodeState", fleet.take_down(victim.node_id, BASE_MS + 2000, "psu")))
    nodes = fold(events)
    c1 = next(c for c in summarize(nodes.values()) if c.cluster_id == "c1")
    survivor = nodes[fleet.nodes[1].node_id]
    assert (c1.nodes, c1.nodes_down, c1.gpus) == (2, 1, 16)
    assert c1.avg_gpu_util_pct == pytest.approx(survivor.util_sum / 8, abs=0.01)
    assert nodes[victim.node_id].state == "DOWN"


def test_cluster_with_every_node_down_has_no_average() -> None:
    fleet = small_fleet(nodes=1)
    events = [event("NodeState", fleet.take_down(n.node_id, BASE_MS, "maintenance"))
              for n in fleet.nodes]
    assert all(c.avg_gpu_util_pct is None for c in summarize(fold(events).values()))


def test_out_of_range_utilisation_is_invalid_input() -> None:
    record = small_fleet(nodes=1).telemetry(BASE_MS)[0]
    record["gpus"][2]["gpu_util_pct"] = 140.0
    with pytest.raises(InvalidEventError, match=r"gpu 2: gpu_util_pct 140\.0 is outside 0-100"):
        apply(None, event("NodeTelemetry", record))


def test_events_the_view_does_not_fold_are_loud() -> None:
    sample = small_fleet(nodes=1).telemetry(BASE_MS)[0]["gpus"][0]
    with pytest.raises(InvalidEventError, match="does not fold"):
        apply(None, Decoded(codec.registry.latest("GpuSample"), 1,
                            {**sample, "seq": 1, "node_id": "x"}))


def test_summary_is_sorted_by_cluster_and_deterministic() -> None:
    fleet = small_fleet(nodes=3)
    events = [event("NodeTelemetry", r) for r in fleet.telemetry(BASE_MS)]
    assert [c.cluster_id for c in summarize(fold(events).values())] == ["c1", "c2"]
    assert summarize(fold(events).values()) == summarize(reversed(list(fold(events).values())))
