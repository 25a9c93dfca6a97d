"""Cross-cluster decisions: locality, prewarm, cost, operator preference, queueing with reasons."""

from __future__ import annotations

from fleetline.agents.simulator import ClusterSpec, cluster_info
from fleetline.processors.scheduling import SchedulingPolicy, Weights, decide
from tests.support import BASE_MS
from tests.test_placement import job
from tests.test_view import fold, scenario_events

CLUSTERS = [ClusterSpec("us-east-a", "us-east", 4), ClusterSpec("eu-west-a", "eu-west", 4),
            ClusterSpec("ap-south-a", "ap-south", 4)]


def fleet_view(seconds: int = 8, dataset_bytes: int = 100 * 10**12):
    events = [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS]
    events.append(("DatasetState", {"dataset_id": "corpus", "tenant": "acme", "seq": 1,
                                    "ts": BASE_MS, "size_bytes": dataset_bytes,
                                    "replicas": ["eu-west-a"], "deleted": False}))
    return fold(events + scenario_events(seconds=seconds))


def training(workers: int, dataset: str | None = "corpus"):
    spec = job(workers, 8, 8)
    return spec if dataset is None else type(spec)(**{**spec.__dict__, "dataset": dataset})


def test_the_cluster_holding_the_data_wins_when_the_job_fits_there():
    decision = decide(fleet_view(), training(2), SchedulingPolicy())
    assert decision.outcome == "Placed" and decision.cluster_id == "eu-west-a"
    assert decision.prewarm is None
    # eu-west-a has a degraded and a failed GPU: the gang avoids both nodes.
    assert {ref[0] for ref in decision.placement.gpus} == {"eu-west-a-n0000", "eu-west-a-n0003"}
    best, *others = decision.alternatives
    assert best.cluster_id == "eu-west-a" and best.parts["locality"] == 1.0
    assert all(o.total < best.total for o in others if o.rejected is None)


def test_a_prewarm_goes_ahead_of_a_job_placed_away_from_its_data():
    decision = decide(fleet_view(), training(3), SchedulingPolicy())
    assert decision.cluster_id == "ap-south-a"  # the only cluster with 3 clean nodes
    assert decision.prewarm is not None
    assert (decision.prewarm.dataset_id, decision.prewarm.from_cluster,
            decision.prewarm.to_cluster) == ("corpus", "eu-west-a", "ap-south-a")
    assert decision.prewarm.estimated_s == 100 * 10**12 * 8 / 10e9
    rejected = {s.cluster_id: s.rejected for s in decision.alternatives if s.rejected}
    assert set(rejected) == {"eu-west-a", "us-east-a"} and "2 have them" in rejected["eu-west-a"]


def test_without_data_the_cheapest_wins_unless_the_operator_prefers_another():
    view = fleet_view()
    cheap = decide(view, training(1, dataset=None), SchedulingPolicy())
    assert cheap.cluster_id == "ap-south-a"  # lowest price + energy x PUE
    preferred = decide(view, training(1, dataset=None), SchedulingPolicy(
        weights=Weights(preference=2.0), cluster_preference=("us-east-a",)))
    assert preferred.cluster_id == "us-east-a"


def test_a_job_no_cluster_can_hold_is_queued_with_every_reason():
    decision = decide(fleet_view(), training(5), SchedulingPolicy())
    assert decision.outcome == "Queued" and decision.placement is None
    for cluster in ("us-east-a", "eu-west-a", "ap-south-a"):
        assert f"{cluster}: needs 5 nodes" in decision.reason


def test_decisions_are_deterministic_and_name_what_they_read():
    view = fleet_view()
    view.advance("t", 0, 41)
    first = decide(view, training(2), SchedulingPolicy(), user_region="eu-west")
    again = decide(view, training(2), SchedulingPolicy(), user_region="eu-west")
    assert first == again
    assert first.view_version == view.version and first.offsets == {"t": {0: 42}}
    assert first.alternatives[0].parts["latency"] > first.alternatives[1].parts["latency"]
