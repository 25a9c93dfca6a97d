"""The cross-cluster pipeline on its own: filters and scorers chosen by the policy, every
cluster's reason, and policies read from configuration."""

from __future__ import annotations

import pytest

from fleetline.agents.simulator import ClusterSpec
from fleetline.errors import ConfigError
from fleetline.processors.scheduling.capacity import CapacityIndex, observe
from fleetline.processors.scheduling.pipeline import (
    FILTERS,
    SCORERS,
    Context,
    JobRequest,
    rank_clusters,
)
from fleetline.processors.scheduling.placement import training_shape
from fleetline.processors.scheduling.policy import FILTER_NAMES, SCORER_NAMES, SchedulingPolicy
from fleetline.processors.scheduling.specs import TrainingJobSpec, parse_spec
from tests.scheduling_support import fleet_view, training

CLUSTERS = [
    ClusterSpec("us-east-a", "us-east", 4),
    ClusterSpec("eu-west-a", "eu-west", 4),
    ClusterSpec("ap-south-a", "ap-south", 4, model="NVIDIA H200"),
]


def test_a_policy_accepts_exactly_the_filters_and_scorers_the_pipeline_has():
    # The policy validates files by name without importing the pipeline's functions.
    assert set(FILTERS) == FILTER_NAMES
    assert set(SCORERS) == SCORER_NAMES


def ranked(
    policy: SchedulingPolicy, workers: int = 1, accelerator: str = "H100", region: str | None = None
):
    view, _ = fleet_view(CLUSTERS)
    spec = parse_spec(training("j", workers, accelerator=accelerator)).spec
    assert isinstance(spec, TrainingJobSpec)
    request = JobRequest("acme/j", "acme", training_shape(spec), 2, user_region=region)
    return rank_clusters(Context(CapacityIndex(observe(view)), policy, {}, {}, request))


def test_every_cluster_is_scored_or_rejected_with_its_reason():
    scores = {s.cluster_id: s for s in ranked(SchedulingPolicy(), workers=4)}
    assert scores["ap-south-a"].rejected == "has no h100 GPUs (it has nvidia h200 140 GiB)"
    assert scores["us-east-a"].rejected is None and scores["eu-west-a"].rejected is None
    too_big = {s.cluster_id: s.rejected for s in ranked(SchedulingPolicy(), workers=5)}
    assert too_big["us-east-a"].startswith("needs 5 nodes with 8 free healthy h100 GPUs")


def test_the_policy_chooses_the_filters_and_the_weights():
    latency_only = SchedulingPolicy(
        weights={
            "latency": 1.0,
            "cost": 0.0,
            "locality": 0.0,
            "fit": 0.0,
            "preference": 0.0,
            "spread": 0.0,
        }
    )
    best = ranked(latency_only, region="eu-west")[0]
    assert best.cluster_id == "eu-west-a" and set(best.parts) == {"latency"}
    cost_only = SchedulingPolicy(
        weights={
            "cost": 1.0,
            "latency": 0.0,
            "locality": 0.0,
            "fit": 0.0,
            "preference": 0.0,
            "spread": 0.0,
        }
    )
    assert ranked(cost_only, region="eu-west")[0].cluster_id == "us-east-a"
    # Without the accelerator filter the H200 cluster is a candidate until capacity says no.
    loose = SchedulingPolicy(filters=("reachable", "capacity"))
    scores = {s.cluster_id: s.rejected for s in ranked(loose, accelerator="H200")}
    assert scores["ap-south-a"] is None and "0 have them" in scores["us-east-a"]


def test_policies_come_from_configuration_and_name_their_digest():
    data = {
        "weights": {"locality": 3},
        "cluster_preference": ["eu-west-a"],
        "default_tenant": {"quota": {"gpus": 64}},
    }
    policy = SchedulingPolicy.from_data(data)
    assert policy.weights["locality"] == 3.0 and policy.weights["cost"] == 1.0
    assert policy.default_tenant is not None and policy.default_tenant.quota.gpus == 64
    assert SchedulingPolicy.from_data(policy.as_data()) == policy
    assert policy.digest() != SchedulingPolicy().digest()
    with pytest.raises(ConfigError, match="unknown filters"):
        SchedulingPolicy(filters=("reachable", "astrology"))
    with pytest.raises(ConfigError, match="unknown scorers"):
        SchedulingPolicy.from_data({"weights": {"vibes": 1}})
    with pytest.raises(ConfigError, match="unknown fields"):
        SchedulingPolicy.from_data({"weight": {}})
