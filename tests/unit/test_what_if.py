"""What-if replay: the request log folded again beside a change, compared decision by decision
and in the numbers that matter."""

from __future__ import annotations

import pytest

from fleetline.errors import ConfigError
from fleetline.identity.writers import CONTROL_PLANE_WRITER, Writer, WriterKind
from fleetline.processors.postmortem.whatif import Change, WhatIf, logged_runs
from fleetline.processors.scheduling.effects import WorkloadOrder
from tests.scheduling_support import THREE, Driver, fleet_view, training


def played() -> Driver:
    """Three clusters; six jobs of two tenants submitted a second apart, each reported running
    when ordered and finished some seconds later, a tick between each."""
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.tenant({"tenant": "acme", "quota": {"gpus": 64}})
    d.tenant({"tenant": "globex", "quota": {"gpus": 32}})
    runs: list[WorkloadOrder] = []
    for n in range(6):
        tenant = "acme" if n % 2 else "globex"
        for effect in d.submit(training(f"job-{n}", workers=1 + n % 2, tenant=tenant)):
            if isinstance(effect, WorkloadOrder) and effect.action == "RUN":
                runs.append(effect)
        d.tick(1)
    d.tick(5)
    for order in runs[:3]:
        d.report(order, "SUCCEEDED", exit_code=0)
    d.tick(1)
    return d


def fold(d: Driver, change: Change) -> dict:
    log = [request for request, _ in d.log]
    whatif = WhatIf(change, logged_runs(log))
    for position, (request, facts) in enumerate(d.log):
        writer = (
            Writer(WriterKind.CLUSTER, request["cluster_id"])
            if request["kind"] == "PROGRESS" and request.get("cluster_id")
            else CONTROL_PLANE_WRITER
        )
        whatif.step(request, position, writer, facts)
    logged = [
        {
            "job": e.job,
            "outcome": str(e.outcome),
            "placements": [{"cluster_id": p.cluster_id} for p in e.placements],
        }
        for e in d.decisions()
    ]
    return whatif.report(logged)


def test_with_nothing_changed_the_what_if_finds_no_difference_and_the_baseline_is_the_log():
    d = played()
    report = fold(d, Change.none())
    assert report["baseline_matches_log"] is True
    assert report["decisions"]["baseline"] == report["decisions"]["what_if"] == len(d.decisions())
    assert report["differences"] == 0 and report["diff"] == []
    assert set(report["deltas"].values()) == {0}
    assert report["outcomes"]["from_the_model"] == []
    assert report["numbers"]["baseline"]["gpu_hours"] > 0


def test_a_policy_that_prefers_another_cluster_shows_the_diff_and_the_deltas():
    d = played()
    where = {e.job: e.cluster_id for e in d.decisions(outcome="PLACED")}
    assert list(where.values()).count("eu-west-a") == 1, where  # the cheapest go first
    change = Change.parse(
        "policy=prefer.yaml",
        {"cluster_preference": ["eu-west-a"], "weights": {"preference": 100}},
    )
    report = fold(d, change)
    assert report["baseline_matches_log"] is True
    assert report["differences"] > 0
    moved = [x for x in report["diff"] if x["what_if"] and x["what_if"]["where"] == "eu-west-a"]
    assert len(moved) >= 2, report["diff"]
    assert all(x["logged"]["where"] != "eu-west-a" for x in moved)
    # Jobs it ordered elsewhere than the log ran from the model, said as such; the deltas
    # are what-if minus baseline for each number.
    assert set(report["outcomes"]["from_the_model"]) >= {x["job"] for x in moved}
    assert report["deltas"]["energy_cost"] == round(
        report["numbers"]["what_if"]["energy_cost"] - report["numbers"]["baseline"]["energy_cost"],
        4,
    )
    assert report["deltas"]["energy_cost"] != 0


def test_without_a_cluster_nothing_is_placed_there_and_more_waits():
    d = played()
    report = fold(d, Change.parse("without-cluster=us-east-a"))
    placed_there = [
        x for x in report["diff"] if x["what_if"] and "us-east-a" in x["what_if"]["where"]
    ]
    assert placed_there == []
    assert report["numbers"]["what_if"]["gpu_hours"] <= report["numbers"]["baseline"]["gpu_hours"]


@pytest.mark.parametrize(
    ("text", "data", "says"),
    [
        ("nonsense", None, "expected one of policy=FILE"),
        ("add-gpus=us-east-a", None, "NAME:N"),
        ("quota=acme:lots", None, "NAME:N"),
        ("policy=p.yaml", {"weights": {"no-such-scorer": 1}}, "policy file p.yaml"),
    ],
)
def test_a_bad_change_is_one_clear_error(text, data, says):
    with pytest.raises(ConfigError, match=says):
        Change.parse(text, data)


def test_more_gpus_in_a_cluster_place_what_waited_there():
    from fleetline.agents.simulator import ClusterSpec

    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 2, nodes_per_leaf=2)])
    d = Driver(view)
    for n in range(3):
        d.submit(training(f"job-{n}"))
        d.tick(1)
    assert d.last("acme/job-2").outcome == "QUEUED"
    report = fold(d, Change.parse("add-gpus=us-east-a:8"))
    (placed,) = [x for x in report["diff"] if x["job"] == "acme/job-2"]
    assert placed["logged"]["outcome"] == "QUEUED"
    assert (placed["what_if"]["outcome"], placed["what_if"]["where"]) == ("PLACED", "us-east-a")
    assert report["numbers"]["what_if"]["never_placed"] == 0
    assert report["numbers"]["baseline"]["never_placed"] == 1
