"""The scheduler's pure core: one test per rule, through requests as the log carries them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetline.agents.simulator import ClusterSpec, Fault
from fleetline.errors import InvalidEventError
from fleetline.processors.scheduling.effects import (
    AllocationChange,
    DatasetRecord,
    PrewarmOrder,
    WorkloadOrder,
)
from fleetline.processors.scheduling.policy import DEFAULT_WEIGHTS, SchedulingPolicy
from fleetline.processors.scheduling.state import Phase
from tests.scheduling_support import (
    THREE,
    Driver,
    advance,
    dataset,
    fleet_view,
    service,
    training,
)
from tests.support import BASE_MS


def one_cluster(nodes: int = 4, faults=(), nodes_per_leaf: int = 2, seconds: int = 2):
    return fleet_view(
        [ClusterSpec("us-east-a", "us-east", nodes, nodes_per_leaf=nodes_per_leaf)], seconds, faults
    )


def test_a_communication_heavy_job_avoids_the_sixteen_gpus_of_a_lossy_leaf():
    view, _ = one_cluster(faults=[Fault("rdma_loss", "us-east-a-leaf000", BASE_MS, None, 0.02)])
    d = Driver(view)
    d.submit(training("heavy", workers=2))
    placed = d.last("acme/heavy")
    assert placed.outcome == "PLACED"
    assert d.nodes_of("acme/heavy") == {"us-east-a-n0002", "us-east-a-n0003"}
    assert "no degraded GPUs (communication-heavy)" in placed.reason
    d.submit(training("heavy2", workers=2))
    queued = d.last("acme/heavy2")
    assert queued.outcome == "QUEUED" and "healthy h100 GPUs" in queued.reason
    # A light job may use the degraded GPUs.
    d.submit(training("light", workers=2, communication="light"))
    assert d.last("acme/light").outcome == "PLACED"
    assert d.nodes_of("acme/light") == {"us-east-a-n0000", "us-east-a-n0001"}


def test_tensor_parallel_groups_land_in_one_nvlink_island():
    view, _ = one_cluster()
    d = Driver(view)
    d.submit(training("tp4", workers=3, per_worker=4, tensor=4))
    placement = d.last("acme/tp4").placement
    assert "inside one NVLink island" in d.last("acme/tp4").reason
    for worker in placement.workers:
        assert {i for _, i in worker} in ({0, 1, 2, 3}, {4, 5, 6, 7})
    # A 2-GPU TP group fills the island already half used before an empty one (best fit).
    d.submit(training("tp2", per_worker=2, tensor=2))
    (worker,) = d.last("acme/tp2").placement.workers
    used = {ref for w in placement.workers for ref in w}
    node = worker[0][0]
    assert any(ref[0] == node for ref in used)


def test_pipeline_replicas_stay_under_one_leaf_and_data_parallel_spreads():
    view, _ = one_cluster(nodes=12, nodes_per_leaf=4)
    d = Driver(view)
    # Half of every leaf is busy, so no leaf holds the 4-worker gang whole.
    for leaf in range(3):
        d.submit(training(f"busy{leaf}", workers=2, priority="high"))
    busy = {n for leaf in range(3) for n in d.nodes_of(f"acme/busy{leaf}")}
    assert len(busy) == 6
    d.submit(training("pp", workers=4, per_worker=8, tensor=8, pipeline=2))
    decision = d.last("acme/pp")
    assert decision.outcome == "PLACED", decision.reason
    workers = decision.placement.workers
    leaf = {n: f"leaf{int(n[-4:]) // 4}" for n in (w[0][0] for w in workers)}
    ranks = [w[0][0] for w in workers]
    # Ranks 0-1 are one pipeline replica, 2-3 the other: each under one leaf.
    assert leaf[ranks[0]] == leaf[ranks[1]] and leaf[ranks[2]] == leaf[ranks[3]]
    assert "pipeline replicas of 2 workers under one leaf" in decision.reason


def test_quota_exhaustion_queues_with_the_reason_and_a_release_admits():
    view, _ = one_cluster()
    d = Driver(view)
    d.tenant({"tenant": "acme", "quota": {"gpus": 16}})
    d.submit(training("a", workers=2))
    d.submit(training("b", workers=1))
    queued = d.last("acme/b")
    assert queued.outcome == "QUEUED"
    assert queued.reason == "quota: tenant acme holds 16 of its 16 GPUs, this needs 8 more"
    assert d.job("acme/b").conditions["Placed"]["reason"] == queued.reason
    d.delete("acme/a")
    assert d.last("acme/a").outcome == "RELEASED"
    assert d.last("acme/b").outcome == "PLACED"
    # More than the quota could ever allow is rejected, not queued for ever.
    d.submit(training("huge", workers=3))
    assert d.last("acme/huge").outcome == "REJECTED"
    assert "can never fit" in d.last("acme/huge").reason


def test_gpu_hour_budgets_reserve_the_time_limit_and_stop_jobs_at_it():
    view, _ = one_cluster()
    d = Driver(view)
    d.tenant({"tenant": "acme", "quota": {"gpu_hours": 100}})
    d.submit(training("first", max_runtime="10h"))
    d.submit(training("second", max_runtime="10h"))
    assert d.last("acme/first").outcome == "PLACED"
    second = d.last("acme/second")
    assert second.outcome == "QUEUED" and "80.0 of its 100 GPU-hours" in second.reason
    d.tick(seconds=10 * 3600)
    assert d.last("acme/first").reason == "reached its max runtime"
    assert d.job("acme/first").phase == "TimedOut"
    usage = d.scheduler.usage["acme"]
    assert usage.consumed_gpu_ms == 80 * 3600_000 and usage.committed_gpu_ms == 0
    assert d.job("acme/second").phase == "Queued"
    # An early finish gives back what the job did not use.
    d.tenant({"tenant": "acme", "quota": {"gpu_hours": 200}})
    assert d.last("acme/second").outcome == "PLACED"
    d.tick(seconds=3600)
    d.progress("acme/second", "SUCCEEDED")
    assert usage.consumed_gpu_ms == 88 * 3600_000


def test_preemption_takes_the_victim_losing_least_work_and_frees_a_whole_island():
    view, _ = one_cluster(nodes=1)
    d = Driver(view)
    hour = 3600_000
    # Two low-priority jobs, one per NVLink island; both checkpoint every 30 minutes.
    d.submit(training("old", per_worker=4, tensor=4, priority="low", checkpoint_interval_s=1800))
    d.tick(seconds=40 * 60)  # "old" last checkpointed at 30 min: 10 min of work at risk
    d.submit(training("new", per_worker=4, tensor=4, priority="low", checkpoint_interval_s=1800))
    d.tick(seconds=25 * 60)  # now old: 5 min since its 60-min checkpoint; new: 25 min
    d.submit(training("urgent", per_worker=4, tensor=4, priority="critical"))
    preempted = d.decisions(outcome="PREEMPTED")
    assert [p.job for p in preempted] == ["acme/old"]
    victim = preempted[0]
    assert victim.preempted_by == "acme/urgent"
    assert victim.lost_gpu_s == 4 * 5 * 60
    assert victim.resume_from_checkpoint_ms == d.job("acme/old").resume_from_ms
    assert victim.resume_from_checkpoint_ms == BASE_MS + 10_000 + hour
    placed = d.last("acme/urgent")
    assert placed.outcome == "PLACED" and placed.victims == ("acme/old",)
    assert {i for _, i in placed.placement.workers[0]} in ({0, 1, 2, 3}, {4, 5, 6, 7})
    assert d.job("acme/old").phase == "Queued" and d.job("acme/new").phase == "Running"
    # The same priority never preempts: another low job waits behind "new".
    d.submit(training("peer", per_worker=4, tensor=4, priority="low"))
    assert d.last("acme/peer").outcome == "QUEUED"
    assert d.job("acme/new").phase == "Running"


def test_a_job_that_reports_its_checkpoints_resumes_from_the_last_one_it_reported():
    view, _ = one_cluster(nodes=1)
    d = Driver(view)
    d.submit(training("steady", per_worker=8, tensor=8, priority="low", checkpoint_interval_s=60))
    (order,) = [e for e in d.effects if isinstance(e, WorkloadOrder) and e.action == "RUN"]
    started = d.now_ms
    # Its first checkpoint after 10 s of start-up and a 60 s interval; the next would have
    # been due at 140 s, but a job is preempted at 150 s before that one was written.
    d.tick(seconds=70)
    d.report(order, "CHECKPOINT", checkpoint_ms=started + 70_000)
    d.tick(seconds=80)
    d.submit(training("urgent", per_worker=8, tensor=8, priority="critical"))
    (preempted,) = d.decisions(outcome="PREEMPTED")
    # Not the 120 s its interval alone implies (it has no checkpoint from then).
    assert preempted.resume_from_checkpoint_ms == started + 70_000
    assert preempted.lost_gpu_s == 8 * 80


def test_preemption_frees_whole_nodes_under_one_leaf_for_a_gang():
    view, _ = one_cluster(nodes=4)
    d = Driver(view)
    for i in range(8):
        d.submit(training(f"low{i}", per_worker=4, tensor=4, priority="low"))
        d.tick(seconds=60)
    d.submit(training("gang", workers=2, priority="high"))
    placed = d.last("acme/gang")
    assert placed.outcome == "PLACED"
    assert len(placed.placement.leaves) == 1
    assert len(placed.victims) == 4  # two whole nodes, nothing more
    # The leaf whose jobs started last (the least work since a checkpoint) was freed.
    assert placed.victims == ("acme/low4", "acme/low5", "acme/low6", "acme/low7")
    assert placed.placement.leaves == ("us-east-a-leaf001",)
    lost = {p.job: p.lost_gpu_s for p in d.decisions(outcome="PREEMPTED")}
    assert lost == {"acme/low4": 960.0, "acme/low5": 720.0, "acme/low6": 480.0, "acme/low7": 240.0}


def test_a_job_away_from_its_data_waits_for_the_copy_holding_no_gpus():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(dataset("corpus", "100TB", ["eu-west-a"]))
    assert d.last("dataset:corpus").outcome == "ACCEPTED"
    # Another tenant's job goes to its own data in eu-west-a and fills the cluster.
    d.submit(dataset("logs", "10TB", ["eu-west-a"], tenant="other"))
    d.submit(training("fill", workers=4, tenant="other", dataset="logs"))
    assert d.job("other/fill").allocation.keys() == {"eu-west-a"}
    d.submit(training("train", workers=2, dataset="corpus"))
    decision = d.last("acme/train")
    assert decision.outcome == "QUEUED" and decision.prewarm is not None
    target = decision.prewarm.to_cluster
    assert target != "eu-west-a"
    assert (decision.prewarm.dataset_id, decision.prewarm.from_cluster) == ("corpus", "eu-west-a")
    assert decision.prewarm.estimated_s == 100 * 10**12 * 8 / 10e9
    assert f"waiting for data in {target}: 0 % of corpus before it is placed" in decision.reason
    orders = [e for e in d.effects if isinstance(e, PrewarmOrder)]
    assert [o.prewarm for o in orders] == [decision.prewarm]
    assert orders[0].prefix == "datasets/acme/corpus/"
    # No GPU is bound while the data moves: nothing allocated, nothing counted.
    job = d.job("acme/train")
    assert job.phase == "Queued" and not job.allocation
    assert d.scheduler.usage["acme"].gpus == 0
    assert job.conditions["DataReady"]["status"] is False
    # The mover's progress shows on the job; passes and ticks neither place it nor order the
    # copy again.
    d.dataset_progress("corpus", target, {"copied_bytes": 42, "total_bytes": 100})
    assert job.queued_reason == f"waiting for data in {target}: 42 % of corpus"
    d.tick(seconds=30)
    assert job.phase == "Queued" and not job.allocation
    assert len([e for e in d.effects if isinstance(e, PrewarmOrder)]) == 1
    # The copy is done: the job is placed where its data now is.
    d.dataset_ready("corpus", target)
    placed = d.last("acme/train")
    assert placed.outcome == "PLACED" and placed.cluster_id == target and not placed.prewarms
    assert job.phase in ("Starting", "Running") and job.allocation.keys() == {target}
    assert job.conditions["DataReady"]["status"] is True
    record = [e for e in d.effects if isinstance(e, DatasetRecord)][-1]
    assert set(record.replicas) == {"eu-west-a", target}


def test_a_copy_that_leaves_its_region_masks_the_dataset_s_sensitive_fields():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    records = dataset("records", "100TB", ["eu-west-a"])
    records["spec"]["sensitive_fields"] = ["patient", "email"]
    d.submit(records)
    d.submit(dataset("logs", "10TB", ["eu-west-a"], tenant="other"))
    d.submit(training("fill", workers=4, tenant="other", dataset="logs"))
    d.submit(training("train", workers=2, dataset="records"))
    (order,) = [e for e in d.effects if isinstance(e, PrewarmOrder)]
    assert order.prewarm.to_cluster != "eu-west-a"  # another region: masked on the way
    assert order.mask_fields == ("patient", "email")


def test_a_job_that_may_preempt_evicts_where_its_data_is_rather_than_copy_it():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(dataset("corpus", "100TB", ["eu-west-a"]))
    d.submit(dataset("logs", "10TB", ["eu-west-a"], tenant="other"))
    d.submit(training("fill", workers=4, tenant="other", priority="low", dataset="logs"))
    assert d.job("other/fill").allocation.keys() == {"eu-west-a"}
    d.submit(training("urgent", workers=2, priority="high", dataset="corpus"))
    placed = d.last("acme/urgent")
    assert placed.outcome == "PLACED" and placed.cluster_id == "eu-west-a"
    assert not placed.prewarms and placed.victims == ("other/fill",)
    assert not [e for e in d.effects if isinstance(e, PrewarmOrder)]


def test_a_failed_copy_says_why_and_is_ordered_again_when_the_dataset_is_applied_again():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(dataset("corpus", "100TB", ["eu-west-a"]))
    d.submit(dataset("logs", "10TB", ["eu-west-a"], tenant="other"))
    d.submit(training("fill", workers=4, tenant="other", dataset="logs"))
    assert d.job("other/fill").allocation.keys() == {"eu-west-a"}
    d.submit(training("train", workers=2, dataset="corpus"))
    target = d.last("acme/train").prewarm.to_cluster
    d.dataset_progress("corpus", target, {"error": "shard-3: its digest did not match"})
    job = d.job("acme/train")
    assert job.queued_reason is not None
    assert (
        "the copy of corpus@" in job.queued_reason and "digest did not match" in job.queued_reason
    )
    assert "apply dataset corpus again" in job.queued_reason
    assert d.scheduler.usage["acme"].prewarms == {}  # its bandwidth given back
    d.tick(seconds=30)
    assert not job.allocation and len([e for e in d.effects if isinstance(e, PrewarmOrder)]) == 1
    # Mended and applied again: ordered afresh.
    d.submit(dataset("corpus", "100TB", ["eu-west-a"]))
    d.tick(seconds=1)
    assert len([e for e in d.effects if isinstance(e, PrewarmOrder)]) == 2
    # A report that makes no sense is refused, naming what is wrong.
    with pytest.raises(InvalidEventError, match="copied_bytes <= total_bytes"):
        d.dataset_progress("corpus", target, {"copied_bytes": 5, "total_bytes": 1})


def test_data_locality_wins_when_the_job_fits_where_the_data_is():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(dataset("corpus", "100TB", ["eu-west-a"]))
    d.submit(training("train", workers=2, dataset="corpus"))
    decision = d.last("acme/train")
    assert decision.cluster_id == "eu-west-a" and not decision.prewarms
    best, *others = decision.alternatives
    assert best.cluster_id == "eu-west-a" and best.parts["locality"] == 1.0
    feasible = [o for o in others if o.rejected is None]
    assert feasible and all(o.total < best.total for o in feasible)


def test_a_dataset_s_residency_keeps_its_data_and_its_jobs_in_its_regions():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    resident = dataset("patients", "10TB", ["eu-west-a"])
    resident["spec"] |= {"residency": ["eu-west"], "sensitivity": "restricted"}
    d.submit(resident)
    assert d.last("dataset:patients").outcome == "ACCEPTED"
    # Placed where the data may be, never prewarmed elsewhere, whatever scores higher.
    d.submit(training("study", workers=1, dataset="patients"))
    decision = d.last("acme/study")
    assert decision.cluster_id == "eu-west-a" and not decision.prewarms
    outside = {a.cluster_id: a for a in decision.alternatives if a.by == "residency"}
    assert set(outside) == {"us-east-a", "ap-south-a"}
    assert "dataset patients stays in eu-west (its residency); region us-east is outside" in (
        outside["us-east-a"].rejected or ""
    )
    # eu-west-a full: the next job waits there rather than moving the data out.
    d.submit(training("big", workers=4, dataset="patients"))
    queued = d.last("acme/big")
    assert queued.outcome == "QUEUED" and not queued.prewarms
    # A replica outside the residency, or a job asking for another region: refused, the
    # field named.
    stray = dataset("stray", "1TB", ["us-east-a"])
    stray["spec"]["residency"] = ["eu-west"]
    d.submit(stray)
    refused = d.last("dataset:stray")
    assert refused.outcome == "REJECTED" and refused.reason.startswith("spec.replicas: ")
    d.submit(training("far", workers=1, dataset="patients", region="us-east"))
    far = d.last("acme/far")
    assert far.outcome == "REJECTED" and far.reason.startswith("spec.region: us-east is outside")


def test_without_data_the_cheapest_wins_unless_the_operator_prefers_another():
    view, _ = fleet_view(THREE)
    cheap = Driver(view)
    cheap.submit(training("j"))
    assert cheap.last("acme/j").cluster_id == "ap-south-a"
    preferred = Driver(
        view,
        SchedulingPolicy(
            weights={**DEFAULT_WEIGHTS, "preference": 2.0}, cluster_preference=("us-east-a",)
        ),
    )
    preferred.submit(training("j"))
    assert preferred.last("acme/j").cluster_id == "us-east-a"


def test_a_job_on_a_node_that_goes_down_migrates_from_its_checkpoint():
    faults = [Fault("node_down", "us-east-a-n0000", BASE_MS + 20_000, None)]
    view, sim = one_cluster(faults=faults)
    d = Driver(view)
    d.submit(training("j", checkpoint_interval_s=5))
    assert d.nodes_of("acme/j") == {"us-east-a-n0000"}
    advance(view, sim, 3, 22)
    effects = d.tick(seconds=12, view=view)
    preempted = [e for e in effects if getattr(e, "outcome", None) == "PREEMPTED"]
    assert len(preempted) == 1 and preempted[0].reason.startswith("fault: us-east-a-n0000 is DOWN")
    assert preempted[0].resume_from_checkpoint_ms == BASE_MS + 20_000
    placed = d.last("acme/j")
    assert placed.outcome == "PLACED" and "resumes from its checkpoint" in placed.reason
    assert d.nodes_of("acme/j") != {"us-east-a-n0000"}
    released = [e for e in effects if isinstance(e, AllocationChange) and e.kind == "RELEASED"]
    assert [e.job for e in released] == ["acme/j"]


def test_fair_share_alternates_tenants_of_equal_priority():
    view, _ = one_cluster(nodes=4)
    d = Driver(view)
    d.submit(training("blocker", workers=4, tenant="ops", priority="high"))
    for i in range(4):
        d.submit(training(f"a{i}", tenant="alpha"))
    for i in range(4):
        d.submit(training(f"b{i}", tenant="beta"))
    d.delete("ops/blocker")
    placed = [e.job for e in d.decisions(outcome="PLACED") if e.job != "ops/blocker"]
    assert placed == ["alpha/a0", "beta/b0", "alpha/a1", "beta/b1"]


def test_reserved_capacity_is_held_for_its_tenant():
    view, _ = one_cluster(nodes=4)
    d = Driver(view)
    d.tenant({"tenant": "vip", "reserved": {"us-east-a": 16}})
    d.submit(training("a", workers=2, tenant="other"))
    d.submit(training("b", workers=1, tenant="other"))
    blocked = d.last("other/b")
    assert blocked.outcome == "QUEUED" and "16 of them reserved for other tenants" in blocked.reason
    d.submit(training("mine", workers=2, tenant="vip"))
    assert d.last("vip/mine").outcome == "PLACED"


def test_a_job_that_allows_it_is_split_across_clusters_by_pipeline_replicas():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(training("big", workers=8, tensor=8, pipeline=2))
    assert d.last("acme/big").outcome == "QUEUED"
    d.submit(training("split", workers=8, tensor=8, pipeline=2, allow_split_across_clusters=True))
    decision = d.last("acme/split")
    assert decision.outcome == "PLACED" and len(decision.placements) >= 2
    assert sum(len(p.workers) for p in decision.placements) == 8
    assert all(len(p.workers) % 2 == 0 for p in decision.placements)


def test_a_split_job_is_ordered_to_run_in_every_cluster_it_holds_with_global_ranks():
    view, _ = fleet_view(THREE)
    d = Driver(view, agents=False)
    d.submit(training("split", workers=8, tensor=8, pipeline=2, allow_split_across_clusters=True))
    decision = d.last("acme/split")
    held = {p.cluster_id: len(p.workers) for p in decision.placements}
    (order,) = [e for e in d.effects if isinstance(e, WorkloadOrder) and e.job == "acme/split"]
    root = min(held)
    assert order.cluster_id == root and order.parts[0][0] == root
    assert {c: len(w) for c, _, w in order.parts} == held
    firsts = [first for _, first, _ in order.parts]
    assert firsts == [sum(len(w) for _, _, w in order.parts[:i]) for i in range(len(order.parts))]
    assert order.workers == order.parts[0][2]
    # Rank 0's part speaks for the job's running and its end; a failure anywhere fails it.
    other = order.parts[1][0]
    d.report(replace(order, cluster_id=other), "SUCCEEDED")
    assert d.job("acme/split").phase == Phase.STARTING
    d.report(order, "RUNNING")
    assert d.job("acme/split").phase == Phase.RUNNING
    d.report(replace(order, cluster_id=other), "FAILED", exit_code=75)
    job = d.job("acme/split")
    assert (job.phase, job.attempt) == (Phase.STARTING, order.attempt + 1)  # retried whole


def test_an_elastic_job_starts_with_fewer_workers_when_that_is_all_there_is():
    view, _ = one_cluster(nodes=4)
    d = Driver(view)
    d.submit(training("e", workers=6, pipeline=1, elastic={"min_workers": 2, "max_workers": 6}))
    decision = d.last("acme/e")
    assert decision.outcome == "PLACED" and decision.reason.startswith("elastic: 4 of 6")
    assert d.job("acme/e").workers == 4


def test_a_service_places_each_replica_as_a_job_in_its_home_region_first():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    d.submit(service("chat", replicas=4, per_replica=2, regions=("eu-west", "us-east")))
    decision = d.last("acme/chat")
    assert decision.outcome == "SCALED" and "4 serving replica(s)" in decision.reason
    placed = [d.last(f"acme/chat.r{i}") for i in range(4)]
    assert all(p.outcome == "PLACED" for p in placed)
    assert {p.cluster_id for p in placed} == {"eu-west-a"}  # the home region had room
    assert all(d.job(f"acme/chat.r{i}").service == "acme/chat" for i in range(4))
    d.submit(service("far", replicas=1, regions=("mars",)))
    assert d.last("acme/far.r0").outcome == "QUEUED"
    assert "is not one of mars" in d.last("acme/far.r0").reason


def test_a_single_gpu_replica_may_use_a_degraded_gpu():
    view, _ = one_cluster(
        nodes=2, faults=[Fault("rdma_loss", "us-east-a-leaf000", BASE_MS, None, 0.02)]
    )
    d = Driver(view)
    d.submit(service("small", replicas=1, per_replica=1, regions=("us-east",)))
    assert d.last("acme/small.r0").outcome == "PLACED"
    d.submit(service("sharded", replicas=1, per_replica=2, regions=("us-east",)))
    assert d.last("acme/sharded.r0").outcome == "QUEUED"


def test_bad_specs_and_mismatched_keys_are_rejected_with_the_reason():
    view, _ = one_cluster()
    d = Driver(view)
    bad = training("x", workers=2)
    bad["spec"]["parallelism"]["data"] = 5
    d.submit(bad)
    assert d.last("acme/x").outcome == "REJECTED"
    assert "tensor x pipeline x data is 40" in d.last("acme/x").reason
    request = d._request(
        "SUBMIT",
        "evil/x",
        "evil",
        spec_json='{"apiVersion": "fleetline/v1", "kind": "TrainingJob"}',
    )
    d.feed(request)
    assert d.last("evil/x").outcome == "REJECTED"


def test_applying_the_same_spec_again_changes_nothing_and_a_priority_change_keeps_gpus():
    view, _ = one_cluster()
    d = Driver(view)
    d.submit(training("j"))
    before = list(d.effects)
    assert d.submit(training("j")) == []
    d.submit(training("j", priority="high"))
    assert d.job("acme/j").priority == 3 and d.job("acme/j").holds
    assert d.effects[len(before) :] == []
    d.submit(training("j", workers=2))
    outcomes = [e.outcome for e in d.decisions("acme/j")]
    assert outcomes[-2:] == ["RELEASED", "PLACED"] and len(d.nodes_of("acme/j")) == 2


def test_a_job_raised_in_priority_while_running_is_preempted_as_its_new_priority():
    view, _ = one_cluster(nodes=1)
    d = Driver(view)
    d.submit(training("raised", per_worker=8, tensor=8, priority="low"))
    d.submit(training("raised", per_worker=8, tensor=8, priority="critical"))
    assert d.job("acme/raised").holds
    # A high job may evict low ones, not a critical one: it waits.
    d.submit(training("urgent", per_worker=8, tensor=8, priority="high"))
    assert d.last("acme/urgent").outcome == "QUEUED"
    assert d.decisions(outcome="PREEMPTED") == []
    # Lowered again, it yields to the high job.
    d.submit(training("raised", per_worker=8, tensor=8, priority="low"))
    d.tick()
    assert [p.job for p in d.decisions(outcome="PREEMPTED")] == ["acme/raised"]
    assert d.job("acme/urgent").holds


def test_a_priority_raised_in_the_same_millisecond_as_a_search_is_not_read_stale():
    view, _ = one_cluster(nodes=2, nodes_per_leaf=2)
    d = Driver(view)
    for name, priority in (
        ("low1", "low"),
        ("crit1", "critical"),
        ("low2", "low"),
        ("crit2", "critical"),
    ):
        d.submit(training(name, per_worker=4, tensor=4, priority=priority))
    nodes = {n for name in ("low1", "crit1") for n in d.job(f"acme/{name}").allocation["us-east-a"]}
    assert len(nodes) == 1  # each node: a low job beside a critical one
    # A search that finds nothing to evict (no node frees 8 GPUs) ...
    d.submit(training("wide", per_worker=8, tensor=8, priority="high"))
    assert d.last("acme/wide").outcome == "QUEUED"
    # ... then, in the same millisecond, low1 is raised above the high jobs, and a high job
    # that fits by evicting one low job takes low2 (low1 sorts first by name: a search that
    # read the first one's victims again would evict it).
    d.submit(training("low1", per_worker=4, tensor=4, priority="critical"))
    d.submit(training("narrow", per_worker=4, tensor=4, priority="high"))
    assert [p.job for p in d.decisions(outcome="PREEMPTED")] == ["acme/low2"]
    assert d.job("acme/low1").holds


def test_a_service_s_replicas_keep_their_gpus_at_its_new_priority():
    view, _ = fleet_view([ClusterSpec("eu-west-a", "eu-west", 1)], 2, ())
    d = Driver(view)
    d.submit(service("chat", 8, priority="low"))
    assert sum(1 for j in d.scheduler.jobs.values() if j.service and j.holds) == 8
    d.submit(service("chat", 8, priority="critical"))
    d.submit(training("urgent", per_worker=8, tensor=8, priority="high"))
    assert d.last("acme/urgent").outcome == "QUEUED"
    assert d.decisions(outcome="PREEMPTED") == []


def test_cordon_keeps_new_work_off_a_node_and_uncordon_returns_it():
    from fleetline.agents.commands import NodeControl, apply_command, control_labels
    from fleetline.processors.view.read import cluster_capacity
    from tests.fleet_events import fold

    view, sim = one_cluster(nodes=2)
    control = {n.node_id: NodeControl() for n in sim.nodes}
    seq = iter(range(10_000, 20_000))

    def command(node_id: str, kind: str, at_s: int) -> None:
        decision = apply_command(control[node_id], {"command_id": f"{kind}{at_s}", "kind": kind})
        assert decision.outcome == "APPLIED"
        control[node_id] = decision.control
        node = next(n for n in sim.nodes if n.node_id == node_id)
        record = sim.node_state(
            node,
            BASE_MS + at_s * 1000,
            decision.control.state,
            labels=control_labels(decision.control),
        )
        fold([("NodeState", {**record, "seq": next(seq)})], view)

    command("us-east-a-n0000", "CORDON", 3)
    (capacity,) = cluster_capacity(view)
    assert capacity["nodes_cordoned"] == 1 and capacity["unavailable"] == 8
    d = Driver(view)
    d.submit(training("first"))
    d.submit(training("second"))
    assert d.nodes_of("acme/first") == {"us-east-a-n0001"}
    assert d.last("acme/second").outcome == "QUEUED"
    # Cordoning the node a job runs on keeps it running: no new work, nothing evicted.
    command("us-east-a-n0001", "CORDON", 4)
    effects = d.tick(seconds=1, view=view)
    assert not [e for e in effects if getattr(e, "outcome", None) == "PREEMPTED"]
    assert d.nodes_of("acme/first") == {"us-east-a-n0001"}
    # UNCORDON returns the node; it is also the way back from DRAIN.
    command("us-east-a-n0000", "DRAIN", 5)
    d.tick(seconds=1, view=view)
    assert d.last("acme/second").outcome == "QUEUED"
    command("us-east-a-n0000", "UNCORDON", 6)
    assert control["us-east-a-n0000"].state == "UP"
    d.tick(seconds=1, view=view)
    assert d.last("acme/second").outcome == "PLACED"
    assert d.nodes_of("acme/second") == {"us-east-a-n0000"}


def test_a_federated_job_runs_one_participant_in_each_region_of_its_data():
    view, _ = fleet_view(THREE)
    d = Driver(view)
    patients = dataset("patients", "10TB", ["eu-west-a", "us-east-a"])
    patients["spec"] |= {"residency": ["eu-west", "us-east"], "sensitivity": "restricted"}
    d.submit(patients)
    job = training("fed", workers=1, dataset="patients")
    job["spec"]["federated"] = {"rounds": 3, "local_steps": 20}
    d.submit(job)
    placed = d.last("acme/fed")
    assert placed.outcome == "PLACED", placed.reason
    assert {p.cluster_id for p in placed.placements} == {"eu-west-a", "us-east-a"}
    assert not placed.prewarms and not [e for e in d.effects if isinstance(e, PrewarmOrder)]
    assert "one participant in each region its data lives in, eu-west (eu-west-a), us-east " in (
        placed.reason
    )
    # One RUN order names both participants, rank 0 in the first cluster by name.
    (order,) = [e for e in d.effects if isinstance(e, WorkloadOrder) and e.job == "acme/fed"]
    assert [p[0] for p in order.parts] == ["eu-west-a", "us-east-a"]
    # No room in one region: the job waits rather than train without it.
    d.submit(training("fill", workers=4, tenant="other", priority="high"))
    d.submit(training("fill2", workers=4, tenant="other", priority="high"))
    second = training("fed2", workers=1, dataset="patients")
    second["spec"]["federated"] = {"rounds": 1, "local_steps": 1}
    d.submit(second)
    queued = d.last("acme/fed2")
    assert queued.outcome == "QUEUED" and "federated: no room in " in queued.reason
    # Over a dataset that declares no residency: refused at apply, the field named.
    d.submit(dataset("open", "1TB", ["eu-west-a"]))
    third = training("fed3", workers=1, dataset="open")
    third["spec"]["federated"] = {"rounds": 1, "local_steps": 1}
    d.submit(third)
    refused = d.last("acme/fed3")
    assert refused.outcome == "REJECTED"
    assert refused.reason.startswith("spec.federated: dataset open declares no residency")
