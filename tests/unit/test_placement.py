"""Topology-aware gang placement inside a cluster, as a pure function of the view."""

from __future__ import annotations

import random

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.processors.scheduling.placement import Placement, Unplaceable
from fleetline.processors.scheduling.specs import parse_specs
from fleetline.processors.view.fold import apply
from tests.fleet_events import allocation, decoded, fold, scenario_events
from tests.scheduling_support import place_training
from tests.support import BASE_MS


def job(
    workers: int,
    per_worker: int,
    tensor: int,
    communication: str = "heavy",
    name: str = "j",
    accelerator: str = "H100",
):
    (spec,) = parse_specs(f"""
kind: TrainingJob
metadata: {{name: {name}, tenant: acme}}
spec:
  accelerator: {accelerator}
  gpus_per_worker: {per_worker}
  workers: {workers}
  parallelism: {{tensor: {tensor}, pipeline: 1, data: {workers * per_worker // tensor}}}
  communication: {communication}
""")
    return spec.spec


def test_a_communication_heavy_job_avoids_the_gpus_behind_a_lossy_leaf():
    view = fold(scenario_events(seconds=10))  # RDMA loss on us-east-a-leaf000 (n0000, n0001)
    placed = place_training(view, "us-east-a", job(2, 8, 8))
    assert isinstance(placed, Placement)
    assert {ref[0] for ref in placed.gpus} == {"us-east-a-n0002", "us-east-a-n0003"}
    assert placed.leaves == ("us-east-a-leaf001",)
    assert "no degraded GPUs (communication-heavy)" in placed.reasons
    # Three such workers cannot fit without the degraded leaf: all or nothing.
    blocked = place_training(view, "us-east-a", job(3, 8, 8))
    assert isinstance(blocked, Unplaceable) and "2 have them" in blocked.reason
    # A light job may use degraded GPUs.
    assert isinstance(place_training(view, "us-east-a", job(3, 8, 8, "light")), Placement)


def test_tensor_parallel_groups_sit_inside_one_nvlink_island():
    view = fold(scenario_events(seconds=2))
    placed = place_training(view, "eu-west-a", job(3, 4, 4))
    assert isinstance(placed, Placement)
    islands = [{0, 1, 2, 3}, {4, 5, 6, 7}]
    for worker in placed.workers:
        assert len({ref[0] for ref in worker}) == 1
        assert any({ref[1] for ref in worker} == island for island in islands)


def test_partly_used_nodes_are_filled_first():
    view = fold(scenario_events(seconds=2))
    fold([allocation("other", "ALLOCATED", [("eu-west-a-n0003", i) for i in range(4)], 1)], view)
    placed = place_training(view, "eu-west-a", job(1, 4, 4))
    assert isinstance(placed, Placement)
    assert placed.gpus == tuple(("eu-west-a-n0003", i) for i in range(4, 8))


def test_wrong_accelerator_and_unknown_cluster_are_refused_with_the_reason():
    view = fold(scenario_events(seconds=2))
    refused = place_training(view, "eu-west-a", job(1, 8, 8, accelerator="MI300X"))
    assert isinstance(refused, Unplaceable) and "mi300x GPUs" in refused.reason
    assert "no nodes" in place_training(view, "mars-1", job(1, 8, 8)).reason


def test_random_job_streams_never_double_book_a_gpu():
    rng = random.Random(7)
    sim = FleetSimulator([ClusterSpec("c1", "r1", 12)], seed=3)
    view = fold(
        [("NodeState", r) for r in sim.initial_states(BASE_MS)]
        + [("NodeTelemetry", r) for r in sim.telemetry(BASE_MS + 1000)]
    )
    placed_jobs = 0
    for i in range(60):
        per_worker = rng.choice([1, 2, 4, 8])
        tensor = rng.choice([t for t in (1, 2, 4, 8) if t <= per_worker])
        result = place_training(
            view,
            "c1",
            job(rng.randint(1, 3), per_worker, tensor, rng.choice(["heavy", "light"]), f"j{i}"),
        )
        if isinstance(result, Unplaceable):
            continue
        refs = result.gpus
        assert len(set(refs)) == len(refs)
        assert not set(refs) & set(view.gpu_owner)
        # The fold refuses a double booking: this would raise if placement ever proposed one.
        apply(view, decoded(*allocation(f"j{i}", "ALLOCATED", list(refs), 1)))
        placed_jobs += 1
        if rng.random() < 0.3 and view.allocations:
            victim = sorted(view.allocations)[0]
            apply(view, decoded(*allocation(victim, "RELEASED", [], 2)))
    assert placed_jobs > 10
    assert len(view.gpu_owner) == sum(len(a.gpus) for a in view.allocations.values())
