"""A cluster's health word is one rule: the API's capacity read (`view/read.cluster_capacity`) and
the scheduler's facts (`scheduling/capacity.observe`) say the same word of every cluster, whatever
its nodes' states, cordons, degraded, failed and busy GPUs."""

from __future__ import annotations

import random

from fleetline.agents.simulator import ClusterSpec
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.view.model import (
    CORDONED_LABEL,
    DEGRADED,
    ClusterHealth,
    NodeStatus,
    ResourceView,
)
from fleetline.processors.view.read import cluster_capacity
from tests.scheduling_support import fleet_view

CLUSTERS = [ClusterSpec("us-east-a", "us-east", 4), ClusterSpec("eu-west-a", "eu-west", 4)]


def words(view: ResourceView) -> tuple[dict[str, str], dict[str, str]]:
    api = {c["cluster_id"]: c["health"] for c in cluster_capacity(view)}
    scheduler = {cid: c.health for cid, c in observe(view).clusters.items()}
    return api, scheduler


def disturb(view: ResourceView, rng: random.Random) -> None:
    """Cordon, drain, take down or silence some nodes; degrade, fail or hand out some GPUs."""
    for node in view.nodes.values():
        roll = rng.random()
        if roll < 0.15:
            node.labels[CORDONED_LABEL] = "true"
        elif roll < 0.25:
            node.state = NodeStatus.DRAINING
        elif roll < 0.3:
            node.state = NodeStatus.DOWN
        elif roll < 0.35:
            node.state_ts = node.telemetry_ts = 0  # silent: out of reach at the watermark
        for gpu in node.gpus.values():
            roll = rng.random()
            if roll < 0.1:
                gpu.health = DEGRADED
            elif roll < 0.15:
                gpu.failed_at_ms = node.up_since_ms
                gpu.failure = "xid"
            if rng.random() < 0.3:
                view.gpu_owner[(node.node_id, gpu.index)] = "acme/busy"


def test_one_cordoned_node_reads_the_same_to_the_api_and_the_scheduler() -> None:
    view, _ = fleet_view(CLUSTERS)
    next(n for n in view.nodes.values() if n.cluster_id == "us-east-a").labels[CORDONED_LABEL] = (
        "true"
    )
    api, scheduler = words(view)
    # One node of four takes no new work: a quarter of the cluster's GPUs are not usable.
    assert api["us-east-a"] == scheduler["us-east-a"] == ClusterHealth.DEGRADED
    assert api["eu-west-a"] == scheduler["eu-west-a"] == ClusterHealth.HEALTHY


def test_a_busy_degraded_gpu_counts_the_same_to_both() -> None:
    view, _ = fleet_view(CLUSTERS)
    node = next(n for n in view.nodes.values() if n.cluster_id == "eu-west-a")
    for gpu in list(node.gpus.values())[:4]:
        gpu.health = DEGRADED
        view.gpu_owner[(node.node_id, gpu.index)] = "acme/busy"
    api, scheduler = words(view)
    assert api["eu-west-a"] == scheduler["eu-west-a"] == ClusterHealth.DEGRADED


def test_generated_fleets_read_the_same_word_to_the_api_and_the_scheduler() -> None:
    seen: set[str] = set()
    for seed in range(60):
        view, _ = fleet_view(CLUSTERS, seed=seed)
        disturb(view, random.Random(seed))
        api, scheduler = words(view)
        assert api == scheduler, seed
        seen |= set(api.values())
    # The generator reaches the words the nodes decide, not one of them only.
    assert {ClusterHealth.HEALTHY, ClusterHealth.DEGRADED} <= seen, seen


def test_only_healthy_and_degraded_clusters_take_work() -> None:
    takes = {h for h in ClusterHealth if h.takes_work}
    assert takes == {ClusterHealth.HEALTHY, ClusterHealth.DEGRADED}
