"""Properties over random fleets and random job streams: no GPU is ever allocated twice, no
quota is ever exceeded, usage always equals what the jobs hold, the same log always gives the same
decisions byte for byte, and a scheduler restored from its records mid-stream goes on exactly as
the one that never stopped."""

from __future__ import annotations

import json
import random

from fleetline.agents.simulator import ClusterSpec, Fault
from fleetline.processors.scheduling.capacity import CapacityIndex, indices_of, observe
from fleetline.processors.scheduling.codec import effect_record
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.tenancy import HOUR_MS
from fleetline.streams.serde import default_codec
from tests.scheduling_support import Driver, advance, dataset, fleet_view, service, training
from tests.support import BASE_MS

CODEC = default_codec()
TENANTS = ("alpha", "beta", "gamma")


def random_fleet(rng: random.Random):
    regions = ["eu-west", "us-east", "ap-south"]
    clusters = [
        ClusterSpec(
            f"c{i}", regions[i % 3], rng.randint(2, 8), nodes_per_leaf=rng.choice([1, 2, 4])
        )
        for i in range(rng.randint(1, 3))
    ]
    faults = []
    for _ in range(rng.randint(0, 4)):
        c = rng.choice(clusters)
        node = f"{c.cluster_id}-n{rng.randrange(c.nodes):04d}"
        at = BASE_MS + rng.randint(3, 60) * 1000
        kind = rng.choice(["xid", "node_down", "rdma_loss", "nvlink_errors"])
        if kind == "xid":
            faults.append(Fault("xid", f"{node}/{rng.randrange(8)}", at, None, 79))
        elif kind == "node_down":
            faults.append(Fault("node_down", node, at, at + rng.randint(5, 30) * 1000))
        elif kind == "rdma_loss":
            faults.append(Fault("rdma_loss", f"{c.cluster_id}-leaf000", at, None, 0.02))
        else:
            faults.append(Fault("nvlink_errors", f"{node}/{rng.randrange(8)}", at, None, 5))
    return clusters, faults


def random_job(rng: random.Random, n: int) -> dict:
    tenant = rng.choice(TENANTS)
    if rng.random() < 0.2:
        return service(
            f"s{n}",
            rng.randint(1, 3),
            rng.choice([1, 2, 4]),
            regions=tuple(rng.sample(["eu-west", "us-east", "ap-south"], 2)),
            tenant=tenant,
            priority=rng.choice(["high", "normal"]),
        )
    per_worker = rng.choice([1, 2, 4, 8])
    tensor = rng.choice([t for t in (1, 2, 4, 8) if t <= per_worker])
    workers = rng.randint(1, 4)
    extra = {"checkpoint_interval_s": rng.choice([60, 600])}
    if rng.random() < 0.3:
        extra["max_runtime"] = f"{rng.randint(1, 60)}m"
    if rng.random() < 0.2:
        extra["allow_split_across_clusters"] = True
    if rng.random() < 0.2:
        extra["elastic"] = {"min_workers": 1, "max_workers": workers}
    if rng.random() < 0.3:
        extra["dataset"] = f"d-{tenant}"
    return training(
        f"j{n}",
        workers,
        per_worker,
        tensor,
        tenant=tenant,
        priority=rng.choice(["critical", "high", "normal", "low", "best-effort"]),
        communication=rng.choice(["heavy", "moderate", "light"]),
        **extra,
    )


def check(s: Scheduler) -> None:
    owner: dict[tuple[str, int], str] = {}
    taken: dict[str, int] = {}
    gpus: dict[str, int] = {}
    per_cluster: dict[tuple[str, str], int] = {}
    for key, job in s.jobs.items():
        for cluster, nodes in job.allocation.items():
            for node, mask in nodes.items():
                for i in indices_of(mask):
                    assert (node, i) not in owner, f"{node}/{i}: {owner.get((node, i))} and {key}"
                    owner[(node, i)] = key
                taken[node] = taken.get(node, 0) | mask
                gpus[job.tenant] = gpus.get(job.tenant, 0) + mask.bit_count()
                per_cluster[(job.tenant, cluster)] = (
                    per_cluster.get((job.tenant, cluster), 0) + mask.bit_count()
                )
    assert s.index.taken == taken
    for tenant, usage in s.usage.items():
        assert usage.gpus == gpus.get(tenant, 0)
        assert {c: n for c, n in usage.cluster_gpus.items() if n} == {
            c: n for (t, c), n in per_cluster.items() if t == tenant and n
        }
        policy = s.tenants.get(tenant)
        if policy is None:
            continue
        q = policy.quota
        if q.gpus is not None:
            assert usage.gpus <= q.gpus
        for cluster, limit in q.cluster_gpus.items():
            assert usage.cluster_gpus.get(cluster, 0) <= limit
        if q.gpu_hours is not None:
            assert usage.consumed_gpu_ms + usage.committed_gpu_ms <= q.gpu_hours * HOUR_MS
        if q.storage_bytes is not None:
            assert usage.storage_bytes <= q.storage_bytes


def run_stream(seed: int, steps: int = 120) -> Driver:
    rng = random.Random(seed)
    clusters, faults = random_fleet(rng)
    view, sim = fleet_view(clusters, 2, faults, seed=seed)
    d = Driver(view)
    for tenant in TENANTS:
        cluster = rng.choice(clusters).cluster_id
        d.tenant(
            {
                "tenant": tenant,
                "share": rng.choice([1, 2]),
                "quota": {
                    "gpus": rng.choice([8, 16, 32, 64]),
                    "cluster_gpus": {cluster: rng.choice([8, 16])},
                    "gpu_hours": rng.choice([5, 50, 500]),
                    "storage_bytes": "400TB",
                },
                "reserved": {cluster: rng.choice([0, 8])},
            }
        )
        d.submit(
            dataset(
                f"d-{tenant}",
                f"{rng.randint(1, 100)}TB",
                [rng.choice(clusters).cluster_id],
                tenant=tenant,
            )
        )
    second = 2
    for n in range(steps):
        roll = rng.random()
        live = sorted(
            k
            for k, j in d.scheduler.jobs.items()
            if j.phase not in ("Succeeded", "Failed", "TimedOut", "Deleted", "Rejected")
        )
        if roll < 0.5 or not live:
            d.submit(random_job(rng, n))
        elif roll < 0.6:
            d.delete(rng.choice(live))
        elif roll < 0.7:
            job = d.job(rng.choice(live))
            d.progress(job.key, rng.choice(["CHECKPOINT", "SUCCEEDED", "FAILED"]), d.now_ms)
        elif roll < 0.75:
            tickets = [t for u in d.scheduler.usage.values() for t in u.prewarms]
            if tickets:
                name, _, cluster = rng.choice(sorted(tickets)).partition("@")
                d.dataset_ready(name, cluster, name.removeprefix("d-"))
        else:
            step = rng.randint(1, 8)
            advance(view, sim, second + 1, second + step)
            second += step
            d.tick(seconds=rng.choice([step, 600, 1800]), view=view)
            # The incremental observation and index equal ones built from scratch.
            scratch = observe(view)
            assert (scratch.nodes, scratch.lost, scratch.clusters) == (
                d.last_facts.nodes,
                d.last_facts.lost,
                d.last_facts.clusters,
            )
            fresh = CapacityIndex(scratch, dict(d.scheduler.index.taken))
            assert {c: b for c, b in fresh.buckets.items() if b} == {
                c: b for c, b in d.scheduler.index.buckets.items() if b
            }
            assert {c: n for c, n in fresh.counts.items() if n} == {
                c: n for c, n in d.scheduler.index.counts.items() if n
            }
        check(d.scheduler)
    return d


def encoded(effects) -> list[bytes]:
    return [CODEC.encode(*(lambda n, _k, r: (n, r))(*effect_record(e))) for e in effects]


def test_random_streams_never_double_book_or_exceed_a_quota():
    placed = preempted = 0
    for seed in range(12):
        d = run_stream(seed)
        placed += len(d.decisions(outcome="PLACED"))
        preempted += len(d.decisions(outcome="PREEMPTED"))
    # The streams exercised what they are meant to.
    assert placed > 100 and preempted > 5


def test_the_same_log_gives_the_same_decisions_byte_for_byte():
    d = run_stream(3, steps=80)
    again = Scheduler()
    effects = []
    for position, (request, facts) in enumerate(d.log):
        effects.extend(again.step(request, position, facts))
    assert encoded(effects) == encoded(d.effects)


def test_a_scheduler_restored_from_its_records_goes_on_exactly_as_before():
    d = run_stream(5, steps=90)
    for cut in (20, 45, 70):
        first = Scheduler()
        facts = None
        for position, (request, f) in enumerate(d.log[:cut]):
            first.step(request, position, f)
            facts = f if f is not None else facts
        records = {k: json.loads(json.dumps(v)) for k, v in first.records()}
        restored = Scheduler.from_records(records, facts or observe(d.view))
        assert Scheduler.view_offsets_of(records) == (facts.offsets if facts else {})
        rest_restored, rest_original = [], []
        for position, (request, f) in enumerate(d.log[cut:], start=cut):
            rest_restored.extend(restored.step(request, position, f))
            rest_original.extend(first.step(request, position, f))
        assert encoded(rest_restored) == encoded(rest_original)
