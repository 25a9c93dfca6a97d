"""The cluster health fold: silence moves time through clock ticks, peers are asked before a
cluster is declared lost, a broken link evicts nobody, a returning cluster is fenced and
flapping is damped."""

from __future__ import annotations

from typing import Any

from fleetline.processors.health.fold import ClusterHealthPolicy, HealthFold
from fleetline.processors.health.runtime import signal

T0 = 1_700_000_000_000


class Fleet:
    def __init__(self, *clusters: str, policy: ClusterHealthPolicy | None = None) -> None:
        self.fold = HealthFold(policy or ClusterHealthPolicy())
        self.position = 0
        self.now = T0
        self.events: list[dict[str, Any]] = []
        self.down: set[tuple[str, str]] = set()  # (from, to) probes that fail
        for c in clusters:
            self.beat(c, peers=clusters)

    def feed(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.fold.step(record, self.position)
        self.position += 1
        self.events += out
        return out

    def beat(self, cluster: str, peers: tuple[str, ...] | list[str] = ()) -> None:
        self.feed(
            signal(
                "HEARTBEAT",
                cluster,
                self.now,
                peers=[
                    {"cluster_id": p, "reachable": (cluster, p) not in self.down, "rtt_ms": 1.0}
                    for p in peers
                    if p != cluster
                ],
            )
        )

    def second(self, beating: list[str], peers: list[str]) -> None:
        """One second: two clock ticks, a heartbeat from each cluster still beating."""
        for _ in range(2):
            self.now += 500
            self.feed(signal("TICK", "", self.now))
        for c in beating:
            self.beat(c, peers)

    def state(self, cluster: str) -> str:
        return self.fold.clusters[cluster].state.value

    def kinds(self, cluster: str) -> list[tuple[str, str]]:
        return [(e["event"], e["state"]) for e in self.events if e["cluster_id"] == cluster]


ALL = ["a", "b", "c"]


def test_a_silent_cluster_its_peers_cannot_reach_is_lost_within_seconds() -> None:
    fleet = Fleet(*ALL)
    fleet.down = {("b", "a"), ("c", "a")}
    seconds = 0
    while fleet.state("a") != "UNHEALTHY":
        fleet.second(["b", "c"], ALL)
        seconds += 1
        assert seconds < 10, fleet.kinds("a")
    assert seconds <= 4  # 3 s of silence, judged at the next tick
    down = [e for e in fleet.events if e["event"] == "CLUSTER_DOWN"]
    assert [e["cluster_id"] for e in down] == ["a"]
    assert down[0]["peers_not_reaching"] == ["b", "c"] and not down[0]["peers_reaching"]
    assert "cannot reach it" in down[0]["reason"]
    assert ("HEALTH", "SUSPECT") in fleet.kinds("a")
    assert fleet.state("b") == fleet.state("c") == "HEALTHY"


def test_without_ticks_silence_moves_no_clock() -> None:
    fleet = Fleet(*ALL)
    for _ in range(20):
        fleet.beat("b", ALL)  # heartbeats at the same event time: no time passes
    assert fleet.state("a") == "HEALTHY"


def test_a_silent_cluster_its_peers_still_reach_is_suspect_until_isolated() -> None:
    policy = ClusterHealthPolicy(isolated_after_ms=10_000)
    fleet = Fleet(*ALL, policy=policy)
    for _ in range(6):
        fleet.second(["b", "c"], ALL)
    assert fleet.state("a") == "SUSPECT"  # silent to us, but b and c reach it
    for _ in range(6):
        fleet.second(["b", "c"], ALL)
    assert fleet.state("a") == "UNHEALTHY"
    assert "cut off from the control plane" in fleet.events[-1]["reason"]


def test_one_broken_link_between_two_clusters_evicts_neither() -> None:
    fleet = Fleet(*ALL)
    fleet.down = {("a", "b"), ("b", "a")}
    for _ in range(20):
        fleet.second(ALL, ALL)
    assert [fleet.state(c) for c in ALL] == ["HEALTHY"] * 3
    partitions = [e for e in fleet.events if e["event"] == "PARTITION"]
    assert {(e["cluster_id"], e["peer"], e["link_up"]) for e in partitions} == {
        ("a", "b", False),
        ("b", "a", False),
    }
    fleet.down = set()
    fleet.second(ALL, ALL)
    healed = [e for e in fleet.events if e["event"] == "PARTITION" and e["link_up"]]
    assert {(e["cluster_id"], e["peer"]) for e in healed} == {("a", "b"), ("b", "a")}


def test_a_returning_cluster_is_fenced_then_recovers_and_flapping_is_damped() -> None:
    policy = ClusterHealthPolicy(recover_after_ms=3_000, flap_backoff=2.0)
    fleet = Fleet(*ALL, policy=policy)
    for _ in range(5):
        fleet.second(["b", "c"], ["b", "c"])
    assert fleet.state("a") == "UNHEALTHY"
    fleet.second(ALL, ALL)
    assert fleet.state("a") == "RECOVERING"
    assert fleet.kinds("a")[-1] == ("FENCE", "RECOVERING")
    seconds = 0
    while fleet.state("a") != "HEALTHY":
        fleet.second(ALL, ALL)
        seconds += 1
    first_probation = seconds
    # Lost a second time within the window: the next probation is twice as long.
    for _ in range(5):
        fleet.second(["b", "c"], ["b", "c"])
    assert fleet.state("a") == "UNHEALTHY"
    fleet.second(ALL, ALL)
    seconds = 0
    while fleet.state("a") != "HEALTHY":
        fleet.second(ALL, ALL)
        seconds += 1
    assert seconds >= 2 * first_probation - 1
    assert first_probation >= 3


def test_the_fold_is_a_function_of_the_log_and_survives_its_store() -> None:
    fleet = Fleet(*ALL)
    fleet.down = {("b", "a"), ("c", "a")}
    for _ in range(3):
        fleet.second(["b", "c"], ALL)
    restored = HealthFold.from_data(fleet.fold.as_data())
    assert restored.as_data() == fleet.fold.as_data()
    fleet.fold = restored
    for _ in range(3):
        fleet.second(["b", "c"], ALL)
    assert fleet.state("a") == "UNHEALTHY"


def test_an_operator_cordons_a_whole_cluster() -> None:
    fleet = Fleet(*ALL)
    out = fleet.feed(signal("CORDON", "b", fleet.now, actor="ops", reason="maintenance"))
    assert out[0]["event"] == "CORDON" and out[0]["cordoned"] is True
    assert "maintenance" in out[0]["reason"] and "ops" in out[0]["reason"]


def test_a_cluster_whose_manager_does_not_answer_is_cordoned_until_it_answers() -> None:
    from fleetline.processors.health.fold import HealthFold

    fleet = Fleet("a", "b")
    error = "Slurm: squeue: Unable to contact slurm controller (connect failure)"
    out = fleet.feed(signal("HEARTBEAT", "a", fleet.now, reason=error))
    assert [(e["event"], e["cordoned"], e["reason"]) for e in out] == [
        ("CORDON", True, f"control unavailable: {error}")
    ]
    assert out[0]["state"] == "HEALTHY"  # it keeps its jobs: nothing moves
    assert fleet.feed(signal("HEARTBEAT", "a", fleet.now, reason=error)) == []  # said once
    # Its state survives the fold's store, and a heartbeat without a reason lifts it.
    fleet.fold = HealthFold.from_data(fleet.fold.as_data())
    back = fleet.feed(signal("HEARTBEAT", "a", fleet.now))
    assert [(e["event"], e["cordoned"], e["reason"]) for e in back] == [
        ("CORDON", False, "control answers again: takes new work")
    ]
