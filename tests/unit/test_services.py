"""Inference services in the scheduler: replicas as jobs, the autoscaler (SERVICE_LOAD),
warm standbys, region order, tidal pools; and the router's pure choice."""

from __future__ import annotations

import pytest

from fleetline.agents.router.routing import Registry, RoutingPolicy, choose, load_report, weights
from fleetline.agents.simulator import ClusterSpec
from fleetline.errors import InvalidEventError
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.services import ServiceLoad
from tests.scheduling_support import Driver, fleet_view, service, training

# One 8-GPU node in each region.
TWO = [ClusterSpec("eu-a", "eu-west", 1), ClusterSpec("us-a", "us-east", 1)]
AUTOSCALING = {
    "target_utilisation": 0.5,
    "scale_out_cooldown": 2,
    "scale_in_cooldown": 10,
    "hysteresis": 0.3,
}


def chat(**extra) -> dict:
    doc = service(
        "chat",
        1,
        regions=("eu-west", "us-east"),
        autoscaling={**AUTOSCALING, **extra.pop("autoscaling", {})},
        workload={},
        **extra,
    )
    doc["spec"]["replicas"] = {"min": 1, "max": 6}
    return doc


def pools(share: float) -> SchedulingPolicy:
    return SchedulingPolicy.from_data(
        {
            "inference_pools": {"*": {"max_share": share}},
            "cluster_preference": ["eu-a", "us-a"],
            "weights": {"preference": 100},
        }
    )


def serving(d: Driver) -> dict[str, str]:
    """Serving replica -> its cluster."""
    return {
        k: min(j.allocation)
        for k, j in d.scheduler.jobs.items()
        if j.service == "acme/chat"
        and j.role == "serving"
        and j.holds
        and j.phase.value == "Running"
    }


def test_a_service_starts_its_minimum_and_a_warm_standby_each_a_job():
    view, _ = fleet_view(TWO)
    d = Driver(view)
    d.submit(chat(autoscaling={"warm_standby": 1}))
    assert d.last("acme/chat").outcome == "SCALED"
    r0, r1 = d.job("acme/chat.r0"), d.job("acme/chat.r1")
    assert (r0.role, r1.role) == ("serving", "standby")
    assert r0.document["metadata"]["labels"]["fleetline/role"] == "serving"
    assert d.job("acme/chat").phase == "Running"
    assert d.job("acme/chat").actual["standby"] == 1


def test_load_over_target_promotes_the_standby_in_place_and_places_a_new_one():
    view, _ = fleet_view(TWO)
    d = Driver(view)
    d.submit(chat(autoscaling={"warm_standby": 1}))
    d.tick(1)
    effects = d.load("acme/chat", utilisation=0.9)
    decision = d.last("acme/chat")
    assert decision.outcome == "SCALED"
    assert decision.reason.startswith("scale out 1 -> 2 serving replicas: utilisation")
    assert "promoted acme/chat.r1 from warm standby" in decision.reason
    # The standby's cluster is told its new role under the same epoch and attempt: no restart.
    promoted = next(e for e in effects if isinstance(e, WorkloadOrder) and e.job == "acme/chat.r1")
    assert promoted.action == "RUN" and promoted.attempt == 1
    assert '"fleetline/role":"serving"' in promoted.spec_json
    assert d.job("acme/chat.r2").role == "standby"  # topped up behind it
    # Still over target, but within the scale-out cool-down: nothing more.
    d.tick(1)
    d.load("acme/chat", utilisation=0.9)
    assert len(d.decisions("acme/chat", "SCALED")) == 2
    d.tick(2)
    d.load("acme/chat", utilisation=0.9)
    assert len(d.decisions("acme/chat", "SCALED")) == 3


def test_several_routers_loads_add_up_and_a_silent_router_drops_out():
    view, _ = fleet_view(TWO)
    d = Driver(view)
    d.submit(chat())
    d.tick(1)
    # Each of two routers kept the one replica 30 % busy: under the 50 % target alone, 60 %
    # together.
    d.load("acme/chat", router="a", utilisation=0.3, requests=40)
    assert len(d.decisions("acme/chat", "SCALED")) == 1  # the start only
    d.load("acme/chat", router="b", utilisation=0.3, requests=60, latency_ms={"p95": 90.0})
    decision = d.last("acme/chat")
    assert decision.reason.startswith("scale out 1 -> 2 serving replicas: utilisation")
    assert "100 requests in 1s" in decision.reason
    load = d.job("acme/chat").scaling["load"]
    assert load["router"] == "a+b" and load["utilisation"] == 0.6
    assert load["latency_ms"]["p95"] == 90.0  # the worst router's
    # Router b goes quiet: two of its windows later only a's reports count.
    d.tick(3)
    d.load("acme/chat", router="a", utilisation=0.2, requests=40)
    load = d.job("acme/chat").scaling["load"]
    assert load["router"] == "a" and load["utilisation"] == 0.2
    assert sorted(d.job("acme/chat").scaling["routers"]) == ["a"]


def test_scale_out_fills_the_home_region_up_to_its_pool_then_the_next_region():
    view, _ = fleet_view(TWO)
    d = Driver(view, pools(0.5))
    d.submit(chat())
    for _ in range(6):
        d.tick(3)
        d.load("acme/chat", utilisation=0.95)
    where = sorted(serving(d).values())
    # 4 of eu-a's 8 GPUs (its pool's bound), then us-east.
    assert where == ["eu-a"] * 4 + ["us-a"] * 2
    assert len(serving(d)) == 6  # max_replicas
    reasons = " ".join(d.last(f"acme/chat.r{i}").reason for i in range(6))
    assert "inference pool full" not in reasons  # every replica was placed
    d.tick(3)
    d.load("acme/chat", utilisation=0.95)
    assert len(serving(d)) == 6


def test_a_scale_out_preempts_lower_priority_training_through_a_checkpoint_and_gives_it_back():
    view, _ = fleet_view(TWO)
    d = Driver(view, pools(0.5))
    d.submit(training("train", per_worker=6, tensor=2, priority="low", checkpoint_interval_s=60))
    d.submit(training("other", per_worker=4, tensor=4, priority="low"))
    assert min(d.job("acme/train").allocation) == "eu-a"
    assert min(d.job("acme/other").allocation) == "us-a"
    d.submit(chat())
    d.tick(3)
    # 1 x 0.95 / 0.5: one more; r1 takes eu-a's last free GPU.
    d.load("acme/chat", utilisation=0.95)
    assert d.job("acme/train").phase == "Running"
    d.tick(3)
    d.load("acme/chat", utilisation=0.95)  # 2 x 0.95 / 0.5: two more, the training's GPUs
    preempted = d.last("acme/train")
    assert preempted.outcome == "PREEMPTED" and "preempted by acme/chat.r2" in preempted.reason
    assert d.job("acme/train").phase == "Queued"
    stop = [
        e
        for e in d.effects
        if isinstance(e, WorkloadOrder) and e.job == "acme/train" and e.action == "STOP"
    ][-1]
    assert stop.final_checkpoint  # it stops at a checkpoint
    assert sorted(serving(d).values()) == ["eu-a"] * 4  # its pool's bound
    # Night: the load falls; replicas drain one per cool-down, down to the minimum.
    for _ in range(8):
        d.tick(6)
        d.load("acme/chat", requests=5, utilisation=0.05, latency_ms={"p95": 25.0})
    assert len(serving(d)) == 1
    ins = [x for x in d.decisions("acme/chat", "SCALED") if x.reason.startswith("scale in")]
    assert len(ins) == 3 and "under target by 30% for" in ins[0].reason
    d.tick(1)
    back = d.last("acme/train")
    assert back.outcome == "PLACED" and back.cluster_id == "eu-a"
    assert back.resume_from_checkpoint_ms is not None


def test_scale_in_waits_out_its_hysteresis_and_cool_down_and_keeps_the_minimum():
    view, _ = fleet_view(TWO)
    d = Driver(view)
    d.submit(chat())
    for _ in range(2):
        d.tick(3)
        d.load("acme/chat", utilisation=0.95)
    assert len(serving(d)) == 4  # 1 -> 2 -> 4: in proportion to the utilisation
    # Under target, but not by the hysteresis: stays.
    for _ in range(5):
        d.tick(5)
        d.load("acme/chat", utilisation=0.4)
    assert len(serving(d)) == 4
    d.tick(1)
    d.load("acme/chat", utilisation=0.1)  # low from here
    d.tick(5)
    d.load("acme/chat", utilisation=0.1)
    assert len(serving(d)) == 4  # low for 5 s of a 10 s cool-down
    d.tick(5)
    d.load("acme/chat", utilisation=0.1)
    assert len(serving(d)) == 3
    for _ in range(6):
        d.tick(11)
        d.load("acme/chat", utilisation=0.0, requests=0, latency_ms={})
    assert len(serving(d)) == 1  # min


def test_the_autoscaler_replays_to_the_same_decisions():
    view, _ = fleet_view(TWO)
    d = Driver(view, pools(0.5))
    d.submit(chat(autoscaling={"warm_standby": 1}))
    for u in (0.9, 0.9, 0.95, 0.2, 0.1, 0.1, 0.05, 0.05):
        d.tick(4)
        d.load("acme/chat", utilisation=u)
    again = Scheduler(pools(0.5))
    replayed = []
    for position, (request, facts) in enumerate(d.log):
        replayed.extend(again.step(request, position, facts))
    assert replayed == d.effects


def test_a_malformed_service_load_is_refused_with_its_reason():
    with pytest.raises(InvalidEventError, match="lacks or mistypes"):
        ServiceLoad.from_data({"window_ms": 1000})
    with pytest.raises(InvalidEventError, match="must be a mapping"):
        ServiceLoad.from_data([1, 2])


# -- the router's choice ---------------------------------------------------------------------


def endpoint(replica: str, cluster: str, state: str = "READY", ts: int = 10_000, **extra):
    return {
        "replica": replica,
        "service": "acme/chat",
        "tenant": "acme",
        "cluster_id": cluster,
        "region": {"eu-a": "eu-west", "us-a": "us-east"}[cluster],
        "epoch": 1,
        "attempt": 1,
        "ts": ts,
        "state": state,
        "address": f"http://127.0.0.1/{replica}",
        "heartbeat_ms": 500,
        "concurrency": 4,
        "inflight": 0,
        "queue": 0,
        "latency_p50_ms": 20.0,
        **extra,
    }


def registry(*records) -> Registry:
    r = Registry()
    r.apply_cluster({"cluster_id": "eu-a", "region": "eu-west", "link_latency_ms": {"us-east": 80}})
    r.apply_cluster({"cluster_id": "us-a", "region": "us-east", "link_latency_ms": {"eu-west": 80}})
    for record in records:
        r.apply(record)
    return r


def test_the_router_picks_the_nearest_ready_replica_until_its_queue_outweighs_the_link():
    policy = RoutingPolicy()
    reg = registry(endpoint("acme/chat.r0", "eu-a"), endpoint("acme/chat.r1", "us-a"))
    pick = choose(reg, "acme/chat", "eu-west", 10_100, policy, {}, {}, {})
    assert pick is not None and pick.replica == "acme/chat.r0"
    assert choose(reg, "acme/chat", "us-east", 10_100, policy, {}, {}, {}).replica.endswith("r1")
    # 20 ms x (1 + 20 waiting / 4 slots) = 120 ms here against 80 + 20 ms over there.
    busy = choose(reg, "acme/chat", "eu-west", 10_100, policy, {}, {"acme/chat.r0": 20}, {})
    assert busy.replica == "acme/chat.r1"
    shown = weights(reg, reg.routable("acme/chat", 10_100, policy), "eu-west", policy, {}, {})
    assert [w.replica for w in shown] == ["acme/chat.r0", "acme/chat.r1"]
    assert shown[1].link_ms == 80


def test_the_router_routes_only_fresh_ready_replicas_and_skips_failed_or_tried_ones():
    policy = RoutingPolicy()
    reg = registry(
        endpoint("acme/chat.r0", "eu-a", state="WARM"),
        endpoint("acme/chat.r1", "eu-a", state="STARTING"),
        endpoint("acme/chat.r2", "eu-a", state="DRAINING"),
        endpoint("acme/chat.r3", "eu-a", ts=1_000),  # silent for 9 s of 0.5 s heartbeats
        endpoint("acme/chat.r4", "us-a"),
    )
    assert [e.replica for e in reg.routable("acme/chat", 10_100, policy)] == ["acme/chat.r4"]
    assert choose(reg, "acme/chat", "eu-west", 10_100, policy, {}, {}, {}).replica.endswith("r4")
    assert choose(reg, "acme/chat", None, 10_100, policy, {}, {}, {}, ["acme/chat.r4"]) is None
    avoid = {"acme/chat.r4": 11_000}
    assert choose(reg, "acme/chat", None, 10_100, policy, {}, {}, avoid) is None
    assert choose(reg, "acme/chat", None, 11_000, policy, {}, {}, avoid) is not None
    # An older run's record never replaces a newer one.
    reg.apply(endpoint("acme/chat.r4", "us-a", state="GONE", epoch=0, ts=20_000))
    assert reg.endpoints["acme/chat.r4"].state == "READY"


def test_a_load_report_says_utilisation_and_percentiles_of_the_window():
    report = load_report("r", 1000, [10.0, 20.0, 30.0, 40.0], {"eu-west": 4}, 1, 2000.0, 8, 3)
    assert report["requests"] == 4 and report["utilisation"] == 0.25
    assert report["latency_ms"] == {"p50": 20.0, "p95": 40.0, "p99": 40.0}
    assert ServiceLoad.from_data(report).queue == 3


# -- GPU shares ------------------------------------------------------------------------------


def small(replicas: int, share: float = 0.25) -> dict:
    doc = service("small", replicas, regions=("eu-west",))
    doc["spec"]["gpus_per_replica"] = share
    return doc


def gpu_of(d: Driver, key: str) -> tuple[str, int]:
    ((node, mask),) = d.job(key).allocation["eu-a"].items()
    return node, mask.bit_length() - 1


def test_small_replicas_pack_into_shares_of_one_gpu_and_training_never_shares():
    view, _ = fleet_view([ClusterSpec("eu-a", "eu-west", 1)])
    d = Driver(view)
    d.submit(small(6))
    gpus = [gpu_of(d, f"acme/small.r{i}") for i in range(6)]
    assert len(set(gpus[:4])) == 1 and gpus[4] == gpus[5] != gpus[0]  # 4 x 2/8, then the next
    assert "beside acme/small.r0" in d.last("acme/small.r1").reason
    # The two shared GPUs are taken whole for training: 6 left of the node's 8.
    d.submit(training("t7", per_worker=7, tensor=1))
    assert d.last("acme/t7").outcome == "QUEUED"
    d.submit(training("t6", per_worker=6, tensor=2))
    assert d.last("acme/t6").outcome == "PLACED"
    assert not {gpu_of(d, "acme/t6")} & set(gpus)
    # Shares record their eighths on the allocation log (for the view).
    shares = [
        e.share_eighths
        for e in d.effects
        if type(e).__name__ == "AllocationChange" and e.job.startswith("acme/small")
    ]
    assert shares == [2] * 6


def test_a_shared_gpu_is_free_again_only_when_its_last_replica_leaves():
    view, _ = fleet_view([ClusterSpec("eu-a", "eu-west", 1)])
    d = Driver(view)
    d.submit(small(2, 0.5))
    assert gpu_of(d, "acme/small.r0") == gpu_of(d, "acme/small.r1")
    d.submit(training("t7", per_worker=7, tensor=1))
    assert d.last("acme/t7").outcome == "PLACED"  # 7 whole GPUs beside the shared one
    d.delete("acme/t7")
    d.delete("acme/small.r1")  # one replica leaves; its GPU stays the other's
    d.submit(training("t8", per_worker=8, tensor=8))
    assert d.last("acme/t8").outcome == "QUEUED"
    d.delete("acme/small")  # the last one leaves
    d.tick(1)
    assert d.last("acme/t8").outcome == "PLACED"


def test_the_view_holds_shares_of_a_gpu_up_to_the_whole_of_it():
    from fleetline.processors.view.fold import apply
    from fleetline.processors.view.model import ResourceView
    from fleetline.streams.serde import default_codec

    view, codec = ResourceView(), default_codec()

    def alloc(job: str, kind: str, share: int | None, seq: int = 1) -> None:
        record = {
            "job_id": job,
            "tenant": "acme",
            "seq": seq,
            "ts": 1,
            "kind": kind,
            "cluster_id": "c",
            "gpus": [{"node_id": "n", "gpu_index": 0}],
            "priority": 3,
            "reason": None,
            "share_eighths": share,
        }
        apply(view, codec.decode(codec.encode("Allocation", record)))

    for job in ("a", "b", "c"):
        alloc(job, "ALLOCATED", 2)
    with pytest.raises(InvalidEventError, match="already allocated"):
        alloc("whole", "ALLOCATED", None)  # a whole-GPU job never lands on a shared GPU
    with pytest.raises(InvalidEventError, match="would pass eight eighths"):
        alloc("d", "ALLOCATED", 4)
    alloc("d", "ALLOCATED", 2)
    alloc("a", "RELEASED", 2, seq=2)
    assert view.gpu_owner[("n", 0)] == "b"  # still taken by the others
    for job in ("b", "c", "d"):
        alloc(job, "RELEASED", 2, seq=2)
    assert ("n", 0) not in view.gpu_owner


def test_a_replica_share_is_applied_as_mps_limits_or_time_slicing_and_said():
    from fleetline.agents.cluster.sharing import gpu_sharing

    env, note = gpu_sharing([("n0", (3,))], 0.25, lambda index: 81_920, mps=False)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert note.startswith("GPU share 0.25 of n0/3: time-sliced")
    env, note = gpu_sharing([("n0", (3,))], 0.5, lambda index: None, mps=True)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env and "no memory limit" in note
    assert gpu_sharing([("n0", (3, 4))], 2, lambda index: 1, mps=True) == ({}, "")
