"""The cluster control layer's pure parts: the scheduler orders its cluster and learns actual
state (Running only when the cluster says so, stale epochs ignored, failed attempts retried
with backoff then reported), jobs leave a cluster the health fold declared lost with their
fence, and the cluster agent's reconcile plan starts each run once and stops what no order
wants."""

from __future__ import annotations

from typing import Any

from fleetline.agents.cluster.reconcile import Actual, Order, Start, Stop, plan
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view import read as view_read
from fleetline.processors.view.fold import apply
from fleetline.streams.serde import default_codec
from tests.scheduling_support import THREE, Driver, fleet_view, training
from tests.support import BASE_MS

CODEC = default_codec()


def orders(d: Driver, job: str | None = None) -> list[WorkloadOrder]:
    return [e for e in d.effects if isinstance(e, WorkloadOrder) and (job is None or e.job == job)]


def small(name: str, **spec: Any) -> dict:
    return training(name, per_worker=4, tensor=4, **spec)


def test_a_job_is_running_only_when_its_cluster_says_so_and_stale_epochs_are_ignored():
    view, _ = fleet_view(THREE)
    d = Driver(view, agents=False)
    d.submit(small("train"))
    job = d.job("acme/train")
    assert job.phase == "Starting"
    (run,) = orders(d)
    assert run.action == "RUN" and run.attempt == 1 and run.epoch == job.alloc_seq
    assert run.cluster_id == next(iter(job.allocation))
    assert len(run.workers) == 1 and len(run.workers[0][1]) == 4
    assert len(run.trace_id) == 32 and int(run.trace_id, 16) >= 0
    assert run.spec_json is not None and '"train"' in run.spec_json
    stale = WorkloadOrder(**{**run.__dict__, "epoch": run.epoch - 1})
    d.report(stale, "RUNNING")
    assert job.phase == "Starting" and job.stale_reports == 1
    d.report(run, "RUNNING", detail="pid 42")
    assert job.phase == "Running" and job.actual["state"] == "Running"
    assert job.conditions["Running"]["status"] is True
    d.report(run, "CHECKPOINT", step=200, checkpoint_ms=d.now_ms)
    assert job.checkpoint_step == 200
    d.report(run, "SUCCEEDED", exit_code=0)
    assert job.phase == "Succeeded" and job.actual["state"] == "Succeeded"
    stop = orders(d)[-1]
    assert stop.action == "STOP" and stop.epoch == run.epoch and not stop.final_checkpoint


def test_failed_attempts_are_retried_with_backoff_then_the_job_fails_with_the_reason():
    view, _ = fleet_view(THREE)
    d = Driver(view, agents=False)
    d.submit(small("crash", retry={"max_attempts": 3, "backoff_s": 2, "exit_codes": [3, 4]}))
    job = d.job("acme/crash")
    first = orders(d)[-1]
    d.report(first, "FAILED", exit_code=3, detail="no such file")
    assert job.phase == "Starting" and job.attempt == 2
    assert "attempt 1 failed with exit code 3: no such file" in job.conditions["Running"]["reason"]
    d.tick(seconds=1)
    assert len(orders(d)) == 1  # the backoff (2 s) has not passed
    d.tick(seconds=1.5)
    second = orders(d)[-1]
    assert (second.action, second.attempt, second.epoch) == ("RUN", 2, first.epoch)
    d.report(first, "FAILED", exit_code=3)  # attempt 1 again: stale, ignored
    assert job.attempt == 2
    d.report(second, "FAILED", exit_code=4)
    d.tick(seconds=3.9)  # twice the backoff
    assert len(orders(d)) == 2
    d.tick(seconds=0.2)
    third = orders(d)[-1]
    assert third.attempt == 3
    d.report(third, "FAILED", exit_code=3, detail="still no such file")
    assert job.phase == "Failed"
    released = d.last("acme/crash")
    assert released.outcome == "RELEASED"
    assert "attempt 3 failed with exit code 3: still no such file; no retry left" in released.reason
    # An exit code the policy does not retry fails the job at once.
    d.submit(small("oom", retry={"max_attempts": 3, "exit_codes": [3]}))
    d.report(orders(d, "acme/oom")[-1], "FAILED", exit_code=137)
    assert d.job("acme/oom").phase == "Failed"
    assert "exit code 137 does not retry" in d.last("acme/oom").reason


def health(cluster: str, state: str, seq: int) -> tuple[str, dict]:
    return (
        "ClusterHealth",
        {
            "event": "CLUSTER_DOWN" if state == "UNHEALTHY" else "HEALTH",
            "cluster_id": cluster,
            "seq": seq,
            "ts": BASE_MS + 5_000,
            "state": state,
            "previous": "HEALTHY",
            "since_ms": BASE_MS + 5_000,
            "cordoned": False,
            "reason": "silent for 4.0s; us-east-a cannot reach it",
            "silent_ms": 4000,
            "peers_reaching": [],
            "peers_not_reaching": ["us-east-a"],
            "peer": None,
            "link_up": None,
        },
    )


def fold_into(view, *events: tuple[str, dict]) -> None:
    for name, record in events:
        apply(view, CODEC.decode(CODEC.encode(name, record)))


def test_a_lost_cluster_s_jobs_resume_elsewhere_behind_a_fence():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(small("train"))
    first = orders(d)[-1]
    lost = first.cluster_id
    d.report(first, "CHECKPOINT", step=300, checkpoint_ms=d.now_ms)
    fold_into(view, health(lost, "UNHEALTHY", 10))
    d.tick(seconds=1, view=view)
    job = d.job("acme/train")
    preempted = d.decisions("acme/train", "PREEMPTED")[-1]
    assert f"cluster {lost} lost" in preempted.reason and "cannot reach it" in preempted.reason
    stop, run = orders(d)[-2:]
    assert (stop.action, stop.cluster_id, stop.final_checkpoint) == ("STOP", lost, False)
    assert run.action == "RUN" and run.cluster_id != lost and run.epoch > first.epoch
    assert run.resume_from == (run.cluster_id, lost) and run.resume_step == 300
    assert job.phase == "Running" and next(iter(job.allocation)) == run.cluster_id
    # The lost cluster's copy still speaks: it is not heard.
    d.report(first, "CHECKPOINT", step=900, checkpoint_ms=d.now_ms)
    d.report(first, "FAILED", exit_code=1)
    assert job.checkpoint_step == 300 and job.phase == "Running" and job.stale_reports == 2
    # Nothing new lands in a suspect or recovering cluster either.
    fold_into(view, health(run.cluster_id, "SUSPECT", 11))
    d.tick(seconds=1, view=view)
    d.submit(small("other"))
    assert d.job("acme/other").allocation.keys().isdisjoint({lost, run.cluster_id})


def order(job: str = "acme/j", cluster: str = "a", epoch: int = 5, attempt: int = 1, **kw):
    fields = {
        "job": job,
        "tenant": "acme",
        "kind": "TrainingJob",
        "action": "RUN",
        "cluster_id": cluster,
        "epoch": epoch,
        "attempt": attempt,
        "ts": 1,
        "reason": "",
        "trace_id": "0" * 32,
        "spec": None,
        "workers": (("n1", (0, 1)),),
        "resume_from": (cluster,),
        "resume_step": None,
        "final_checkpoint": False,
    }
    return Order(**{**fields, **kw})


def test_the_agent_starts_a_run_once_and_stops_what_no_order_wants():
    want = {"acme/j": order()}
    assert plan("a", want, {}) == [Start(want["acme/j"])]
    running = {"acme/j": [Actual("acme/j", 5, 1, alive=True)]}
    assert plan("a", want, running) == []
    exited = {"acme/j": [Actual("acme/j", 5, 1, alive=False)]}
    assert plan("a", want, exited) == []  # exited: never started twice for one attempt
    assert plan("a", want, {}, may_start=False) == []  # fenced: nothing new
    # The job moved to another cluster under a new epoch: the copy here is fenced.
    moved = {"acme/j": order(cluster="b", epoch=6)}
    (stop,) = plan("a", moved, running)
    assert isinstance(stop, Stop) and stop.fenced and "moved on to epoch 6 in b" in stop.reason
    # Stopped by the scheduler with a final checkpoint.
    stopped = {"acme/j": order(action="STOP", final_checkpoint=True, reason="preempted by x")}
    (stop,) = plan("a", stopped, running)
    assert stop.final_checkpoint and not stop.fenced and stop.reason == "preempted by x"
    # A new attempt: the old one is stopped first, started only once it is gone.
    retry = {"acme/j": order(attempt=2)}
    (stop,) = plan("a", retry, running)
    assert isinstance(stop, Stop) and stop.run_id == (5, 1)
    stopping = {"acme/j": [Actual("acme/j", 5, 1, alive=True, stopping=True)]}
    assert plan("a", retry, stopping) == []
    assert plan("a", retry, exited) == [Start(retry["acme/j"])]
    # Something running that no order names.
    (stop,) = plan("a", {}, running)
    assert stop.reason == "no order names it"


def test_only_checkpoints_behind_the_fence_may_be_resumed_from():
    resumed = order(epoch=7, resume_step=300)
    assert resumed.admits(7, 900)  # this epoch's own (an earlier attempt)
    assert resumed.admits(5, 300) and resumed.admits(6, 250)
    assert not resumed.admits(5, 350)  # written by a copy after it was fenced
    assert not resumed.admits(8, 10)
    assert not order(epoch=7).admits(6, 10)  # nothing accepted yet: start afresh


def test_the_view_shows_a_cluster_s_declared_health_and_keeps_it_in_snapshots():
    view, _ = fleet_view(THREE)
    fold_into(view, health("eu-west-a", "UNHEALTHY", 3))
    partition = health("eu-west-a", "UNHEALTHY", 4)
    partition[1].update(event="PARTITION", peer="us-east-a", link_up=False)
    fold_into(view, partition)
    clusters = {c["cluster_id"]: c for c in view_read.cluster_capacity(view)}
    lost = clusters["eu-west-a"]
    assert lost["health"] == "lost" and lost["control"]["state"] == "UNHEALTHY"
    assert lost["control"]["broken_links"] == ["us-east-a"]
    assert "cannot reach it" in lost["control"]["reason"]
    assert clusters["us-east-a"]["health"] == "healthy" and clusters["us-east-a"]["control"] is None
    again = view_codec.from_data(view_codec.to_data(view))
    assert again.cluster_health == view.cluster_health
    assert observe(view).clusters["eu-west-a"].health == "lost"
