"""What would make a queued job fit: every queued job of the default scenario gets the
constraint that binds it and a change that, made, places it."""

from __future__ import annotations

from fleetline.demo.scenario import load
from fleetline.processors.postmortem.fit import what_would_fit
from fleetline.processors.scheduling.state import Phase
from tests.scheduling_support import Driver, advance, fleet_view, training
from tests.support import BASE_MS


def play_default() -> Driver:
    """The default scenario's scheduling as `fleetline run` plays it: its fleet, faults,
    tenants and specs, tick by tick."""
    scenario = load("default")
    clusters = [p.spec for p in scenario.clusters]
    view, sim = fleet_view(clusters, seconds=1, seed=scenario.seed)
    sim.faults = scenario.faults_in(sim, BASE_MS)
    d = Driver(view)
    for t in range(2, scenario.ticks + 1):
        advance(view, sim, t, t)
        for event in scenario.events:
            if scenario.tick_of(event.at) != t:
                continue
            for policy in event.tenant_policies:
                d.tenant(dict(policy))
            for document in event.apply:
                d.submit(dict(document))
        d.tick(1, view)
    return d


def test_every_queued_job_of_the_default_scenario_gets_a_binding_and_a_change_that_places_it():
    d = play_default()
    queued = [j.key for j in d.scheduler.queue()]
    assert queued, "the default scenario leaves jobs queued (the test needs some)"
    fits = what_would_fit(d.scheduler)
    assert [f.job for f in fits] == queued
    for fit in fits:
        assert fit.binding and fit.why, fit
        assert fit.change is not None and fit.checked and fit.places_in, fit
    # The state is as it was: asking again gives the same answers, nothing got placed.
    assert what_would_fit(d.scheduler) == fits
    assert [j.key for j in d.scheduler.queue()] == queued


def test_a_quota_bound_job_is_offered_the_quota_it_lacks_and_that_places_it():
    view, _ = fleet_view([p.spec for p in load("default").clusters])
    d = Driver(view)
    d.tenant({"tenant": "acme", "quota": {"gpus": 16}})
    d.submit(training("a", workers=2))
    d.submit(training("b", workers=1))
    (fit,) = what_would_fit(d.scheduler)
    assert (fit.job, fit.binding, fit.checked) == ("acme/b", "quota", True)
    assert fit.change == "tenant acme quota +8 GPUs (16 -> 24)"
    assert d.scheduler.jobs["acme/b"].phase == Phase.QUEUED
    assert d.scheduler.tenants["acme"].quota.gpus == 16


def test_a_capacity_bound_job_is_offered_the_fewest_gpus_freed_from_the_lowest_priority():
    from fleetline.agents.simulator import ClusterSpec

    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 2, nodes_per_leaf=2)])
    d = Driver(view)
    d.submit(training("low", workers=1, priority="low"))
    d.submit(training("mid", workers=1, priority="normal"))
    d.submit(training("next", workers=1, priority="low"))
    (fit,) = what_would_fit(d.scheduler)
    assert fit.job == "acme/next" and fit.binding == "capacity"
    assert fit.change is not None and fit.change.startswith("8 GPUs freed in us-east-a")
    assert "acme/low" in fit.change and "acme/mid" not in fit.change
    assert d.scheduler.jobs["acme/low"].holds and not d.scheduler.jobs["acme/next"].holds
