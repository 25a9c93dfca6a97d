"""Scheduler benchmark: the pure core's decisions/s and decision latency on an 80,000-GPU fleet
with a queue of 10,000 mixed jobs, placement quality, and submit-to-decision latency through
Kafka with the scheduler's exactly-once loop.

The fleet: 8 clusters in 4 regions, 1,250 nodes each (10,000 nodes, 80,000 GPUs), 16 nodes per
leaf switch, two NVLink islands of 4 GPUs per node, with a leaf losing RDMA packets (16 nodes
degraded), a few failed GPUs and a node down. The jobs (seeded): 70 % training of eight shapes
from 1 GPU to 16 workers x 8 GPUs (TP up to 8, PP up to 4, some with datasets, some elastic,
some splittable), 20 % inference services over one or two regions, 10 datasets; 10 tenants with
GPU and GPU-hour quotas; priorities from critical to best-effort. Together they ask for about
twice the fleet, so the queue, quotas and preemption all work.

    .venv/bin/python benchmarks/scheduler.py [--nodes 10000] [--jobs 10000] [--e2e-jobs 2000]
        [--e2e-rates 50,100,200] [--no-kafka]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable

from _common import fold_telemetry_records, report, serve_scheduler

from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator, cluster_info
from fleetline.processors.scheduling.capacity import FleetFacts, indices_of, observe
from fleetline.processors.scheduling.codec import (
    canonical_json,
    new_request,
    order_report,
    submit_request,
)
from fleetline.processors.scheduling.effects import Decision, WorkloadOrder
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.view.fold import apply
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.runtime import tune_gc_for_large_state
from fleetline.streams.serde import default_codec

BASE_MS = 1_796_000_000_000
REGIONS = ["eu-west", "us-east", "ap-south", "us-west"]
SHAPES = [  # (weight, workers, gpus per worker, tensor, pipeline)
    (15, 1, 1, 1, 1),
    (10, 1, 2, 2, 1),
    (15, 1, 4, 4, 1),
    (20, 1, 8, 8, 1),
    (15, 2, 8, 8, 1),
    (10, 4, 8, 8, 2),
    (10, 8, 8, 8, 4),
    (5, 16, 8, 8, 4),
]
PRIORITIES = [(5, "critical"), (20, "high"), (50, "normal"), (20, "low"), (5, "best-effort")]
# What the core decided at 10,000 nodes and 10,000 jobs (the defaults) before it was made faster:
# a change that makes it faster must leave every effect as it was, or explain the difference.
BASELINE_DECISION_DIGEST = "f896d363aef39e01aecd6c21fc7b734b80546a68a3c4ee8a21a2cbef2bbd0b77"


def effect_text(effect: object) -> str:
    """One effect as the digest reads it: its record where it has one, else its fields."""
    as_record = getattr(effect, "as_record", None)
    return canonical_json(as_record()) if as_record is not None else repr(effect)


def build_view(
    nodes: int,
    seed: int = 1,
    clusters_count: int = 8,
    keep: Callable[[str], bool] | None = None,
) -> ResourceView:
    """The fleet after two intervals (`keep`: only the nodes it accepts, as a view shard
    instance folds them)."""
    per_cluster = nodes // clusters_count
    clusters = [
        ClusterSpec(
            f"{REGIONS[i % 4]}-{chr(97 + i // 4)}",
            REGIONS[i % 4],
            per_cluster,
            model="NVIDIA H200" if i % 8 == 7 else "NVIDIA H100 80GB HBM3",
            nodes_per_leaf=16,
        )
        for i in range(clusters_count)
    ]
    # The full-size fleet's fault targets, folded into a smaller fleet's range.
    leaf = min(3, (per_cluster - 1) // 16)
    faults = [
        Fault("rdma_loss", f"{clusters[1].cluster_id}-leaf{leaf:03d}", BASE_MS, None, 0.02),
        Fault("xid", f"{clusters[0].cluster_id}-n{7 % per_cluster:04d}/3", BASE_MS, None, 79),
        Fault("xid", f"{clusters[2].cluster_id}-n{100 % per_cluster:04d}/0", BASE_MS, None, 79),
        Fault("node_down", f"{clusters[3].cluster_id}-n{42 % per_cluster:04d}", BASE_MS, None),
    ]
    sim = FleetSimulator(clusters, seed=seed, faults=faults)
    codec = default_codec()
    view = ResourceView()
    for c in clusters:
        apply(view, codec.decode(codec.encode("ClusterInfo", cluster_info(c, 1, BASE_MS, REGIONS))))
    wanted = keep or (lambda _: True)
    for record in sim.initial_states(BASE_MS):
        if wanted(record["node_id"]):
            apply(view, codec.decode(codec.encode("NodeState", record)))
    for t in (1, 2):
        ts = BASE_MS + t * 1000
        for record in sim.state_changes(ts):
            if wanted(record["node_id"]):
                apply(view, codec.decode(codec.encode("NodeState", record)))
        fold_telemetry_records(view, (r for r in sim.telemetry(ts) if wanted(r["node_id"])))
    return view


def _choice(rng: random.Random, weighted):
    return rng.choices([x[1:] if len(x) > 2 else x[1] for x in weighted], [x[0] for x in weighted])[
        0
    ]


def workload(jobs: int, seed: int = 7) -> list[dict]:
    """Spec documents: 10 datasets first, then `jobs` mixed jobs."""
    rng = random.Random(seed)
    tenants = [f"tenant{i:02d}" for i in range(10)]
    clusters = [f"{REGIONS[i % 4]}-{chr(97 + i // 4)}" for i in range(8)]
    docs: list[dict] = []
    for i in range(10):
        docs.append(
            {
                "apiVersion": "fleetline/v1",
                "kind": "Dataset",
                "metadata": {"name": f"corpus{i}", "tenant": tenants[i]},
                "spec": {
                    "size": f"{rng.choice([5, 20, 100])}TB",
                    "replicas": [rng.choice(clusters)],
                },
            }
        )
    for n in range(jobs):
        tenant = rng.choice(tenants)
        priority = _choice(rng, PRIORITIES)
        meta = {"name": f"job{n:05d}", "tenant": tenant}
        if rng.random() < 0.2:
            per_replica = rng.choice([1, 1, 2, 4])
            regions = rng.sample(REGIONS, rng.choice([1, 2]))
            docs.append(
                {
                    "apiVersion": "fleetline/v1",
                    "kind": "InferenceService",
                    "metadata": meta,
                    "spec": {
                        "model": "llm",
                        "accelerator": "H100",
                        "gpus_per_replica": per_replica,
                        "replicas": {"min": rng.randint(1, 4), "max": 8},
                        "latency_target_ms": 200,
                        "regions": regions,
                        "priority_class": "high" if priority == "critical" else priority,
                    },
                }
            )
            continue
        workers, per_worker, tensor, pipeline = _choice(rng, SHAPES)
        spec = {
            "accelerator": "H200" if rng.random() < 0.12 else "H100",
            "gpus_per_worker": per_worker,
            "workers": workers,
            "parallelism": {
                "tensor": tensor,
                "pipeline": pipeline,
                "data": workers * per_worker // (tensor * pipeline),
            },
            "communication": rng.choice(["heavy", "heavy", "moderate", "light"]),
            "priority_class": priority,
            "checkpoint_interval_s": rng.choice([600, 1800, 3600]),
            "max_runtime": f"{rng.choice([2, 8, 24, 72])}h",
            "region": rng.choice(REGIONS),
        }
        if rng.random() < 0.15:
            spec["dataset"] = f"corpus{tenants.index(tenant)}"
        if workers >= 4 and rng.random() < 0.3:
            spec["elastic"] = {"min_workers": workers // 2, "max_workers": workers}
        if workers >= 8 and rng.random() < 0.3:
            spec["allow_split_across_clusters"] = True
        docs.append(
            {"apiVersion": "fleetline/v1", "kind": "TrainingJob", "metadata": meta, "spec": spec}
        )
    return docs


def tenant_policies() -> list[dict]:
    return [
        {
            "tenant": f"tenant{i:02d}",
            "share": 2 if i < 2 else 1,
            "quota": {
                "gpus": 16_000 if i < 5 else 8_000,
                "gpu_hours": 2_000_000,
                "storage_bytes": "1PB",
                "bandwidth_gbps": 40,
            },
        }
        for i in range(10)
    ]


def submit_requests(docs: list[dict], start_ms: int) -> list[dict]:
    return [
        submit_request(parse_spec(doc), doc, start_ms + n, f"bench-{n}")
        for n, doc in enumerate(docs)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def quality(scheduler: Scheduler) -> dict[str, object]:
    """TP groups inside one NVLink island, pipeline replicas inside one leaf, fragmentation,
    quota violations."""
    tp_total = tp_inside = replicas_total = replicas_one_leaf = 0
    facts = scheduler.index.facts
    for job in scheduler.jobs.values():
        if not job.holds or job.kind != "TrainingJob":
            continue
        spec = job.spec
        tensor = min(spec.parallelism.tensor, spec.gpus_per_worker)
        for nodes in job.allocation.values():
            for node, mask in nodes.items():
                islands = facts.nodes[node].islands
                gpus = indices_of(mask)
                for g in range(0, len(gpus), tensor):
                    group = sum(1 << i for i in gpus[g : g + tensor])
                    tp_total += 1
                    tp_inside += any(group & island == group for island in islands) or tensor > max(
                        i.bit_count() for i in islands
                    )
        per_replica = max(
            1, spec.parallelism.tensor * spec.parallelism.pipeline // spec.gpus_per_worker
        )
        if per_replica > 1:
            decision_nodes = [n for nodes in job.allocation.values() for n in sorted(nodes)]
            leaves = [facts.nodes[n].leaf for n in decision_nodes]
            for r in range(0, len(leaves), per_replica):
                replicas_total += 1
                replicas_one_leaf += len(set(leaves[r : r + per_replica])) == 1
    violations = 0
    for tenant, usage in scheduler.usage.items():
        policy = scheduler.tenants.get(tenant)
        if policy and policy.quota.gpus is not None and usage.gpus > policy.quota.gpus:
            violations += 1
        if (
            policy
            and policy.quota.gpu_hours is not None
            and (
                usage.consumed_gpu_ms + usage.committed_gpu_ms > policy.quota.gpu_hours * 3_600_000
            )
        ):
            violations += 1
    frag = scheduler.index.fragmentation()
    owned = sum(j.gpus for j in scheduler.jobs.values())
    total = sum(n.present.bit_count() for n in facts.nodes.values())
    return {
        "tp_groups_in_one_nvlink_island": round(tp_inside / tp_total, 4) if tp_total else 1,
        "tp_groups": tp_total,
        "pipeline_replicas_in_one_leaf": round(replicas_one_leaf / replicas_total, 4)
        if replicas_total
        else 1,
        "gpus_allocated": owned,
        "gpus_in_fleet": total,
        "allocated_share": round(owned / total, 4),
        "free_healthy_gpus": frag["free_gpus"],
        "fragmentation_free_gpus_on_partly_used_nodes": frag["fragmentation"],
        "quota_violations": violations,
    }


def running_report(order: WorkloadOrder, ts: int) -> dict:
    return order_report(order, "RUNNING", ts, f"run-{order.job}-{order.epoch}")


def core(
    nodes: int,
    jobs: int,
    clusters: int = 8,
    observe_with: Callable[[ResourceView], FleetFacts] = observe,
) -> dict[str, object]:
    """The pure core over the fleet, observed by `observe_with` (the view itself, or the
    summaries its shards would publish)."""
    tune_gc_for_large_state()
    began = time.perf_counter()
    view = build_view(nodes, clusters_count=clusters)
    built = time.perf_counter() - began
    began = time.perf_counter()
    facts = observe_with(view)
    observed = time.perf_counter() - began
    scheduler = Scheduler()
    position = 0
    start = BASE_MS + 10_000
    tick = new_request("TICK", "", "", start, "tick-0", view_offsets=facts.offsets)
    began = time.perf_counter()
    scheduler.step(tick, position, facts)
    first_tick = time.perf_counter() - began
    for policy in tenant_policies():
        position += 1
        scheduler.step(
            new_request(
                "TENANT_POLICY",
                policy["tenant"],
                policy["tenant"],
                start,
                f"p{position}",
                spec_json=canonical_json(policy),
            ),
            position,
        )
    latencies: list[float] = []
    outcomes: dict[str, int] = {}
    digest = hashlib.sha256()
    gc.collect()
    gc.freeze()
    requests = submit_requests(workload(jobs), start + 1000)
    midway: dict[str, object] = {}
    began = time.perf_counter()
    for n, request in enumerate(requests):
        position += 1
        t0 = time.perf_counter()
        effects = scheduler.step(request, position)
        latencies.append(time.perf_counter() - t0)
        for e in effects:
            if isinstance(e, Decision):
                outcomes[e.outcome] = outcomes.get(e.outcome, 0) + 1
        # The cluster agents report every started job running (their requests are not what is
        # measured, so they are folded off the clock).
        paused = time.perf_counter()
        for e in effects:
            digest.update(effect_text(e).encode())
        for e in effects:
            if isinstance(e, WorkloadOrder) and e.action == "RUN":
                position += 1
                for reported in scheduler.step(running_report(e, start + 1000), position):
                    digest.update(effect_text(reported).encode())
        began += time.perf_counter() - paused
        if n == len(requests) // 4:
            # Fragmentation means something while the fleet still has room.
            paused = time.perf_counter()
            frag = scheduler.index.fragmentation()
            midway = {
                "quarter_way_allocated_share": round(
                    sum(j.gpus for j in scheduler.jobs.values()) / (nodes * 8), 4
                ),
                "quarter_way_free_healthy_gpus": frag["free_gpus"],
                "quarter_way_fragmentation": frag["fragmentation"],
            }
            began += time.perf_counter() - paused
    wall = time.perf_counter() - began
    # A reconcile pass over the full queue, as every TICK runs it.
    position += 1
    t0 = time.perf_counter()
    ticked = scheduler.step(
        new_request("TICK", "", "", start + 60_000, "tick-1", view_offsets=facts.offsets),
        position,
        facts,
    )
    tick_s = time.perf_counter() - t0
    for e in ticked:
        digest.update(effect_text(e).encode())
    decision_digest = digest.hexdigest()
    at_baseline_size = (nodes, jobs, clusters) == (10_000, 10_000, 8)
    # A rebuild of the scheduler from its store's records (JSON, as the changelog holds them):
    # what every offset gap in the request log cost before fold steps stopped taking a gap
    # (transaction markers) for a lost state, and what a restore after an assignment or an
    # abort costs now, past reading the changelog.
    records = {k: json.loads(canonical_json(v)) for k, v in scheduler.records()}
    t0 = time.perf_counter()
    Scheduler.from_records(records, facts)
    rebuild_s = time.perf_counter() - t0
    figures: dict[str, object] = {
        "nodes": nodes,
        "gpus": nodes * 8,
        "clusters": clusters,
        "requests": len(latencies),
        "build_view_s": round(built, 2),
        "observe_view_s": round(observed, 3),
        "first_tick_s": round(first_tick, 3),
        "core_requests_per_s": round(len(latencies) / wall, 1),
        "core_requests_per_s_target": ">= 2000 (at 80,000 GPUs, 10,000 queued)",
        "core_decision_events_per_s": round(sum(outcomes.values()) / wall, 1),
        "core_latency_p50_ms": round(statistics.median(latencies) * 1000, 3),
        "core_latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "core_latency_p99_ms_target": "< 10",
        "core_latency_max_ms": round(max(latencies) * 1000, 3),
        "tick_with_full_queue_s": round(tick_s, 3),
        "state_records": len(records),
        "rebuild_from_store_s": round(rebuild_s, 3),
        "queued_after_submissions": len(scheduler.queue()),
        "decision_digest": decision_digest,
        "decisions_as_baseline": (
            decision_digest == BASELINE_DECISION_DIGEST if at_baseline_size else None
        ),
        **{f"decisions_{k.lower()}": v for k, v in sorted(outcomes.items())},
        **midway,
        **quality(scheduler),
    }
    return figures


def e2e(nodes: int, jobs: int, rate: float) -> dict[str, object]:
    """Submit-to-decision latency through Kafka: requests appended at `rate` per second by this
    process, the scheduler's exactly-once loop (transactions, changelog) in another, decisions
    read back read_committed here; latency = decision seen - request sent."""
    import multiprocessing
    import threading

    from _common import local_services

    from fleetline.config import Settings
    from fleetline.processors.scheduling.client import send
    from fleetline.processors.scheduling.runtime import scheduler_topics
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.topics import Topics

    settings = Settings.from_env()
    with local_services(settings) as settings:
        topics = Topics(prefix=f"bench.sched.{uuid.uuid4().hex[:8]}")
        kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
        context = multiprocessing.get_context("spawn")
        started, stop = context.Event(), context.Event()
        server = context.Process(
            target=serve_scheduler,
            args=(build_view, (nodes,), topics.prefix, started, stop),
            daemon=True,
        )
        server.start()
        assert started.wait(180), "the scheduler did not start"
        producer = kafka_clients.producer(settings.kafka, {"linger.ms": 0})
        for policy in tenant_policies():
            send(
                producer,
                topics,
                new_request(
                    "TENANT_POLICY",
                    policy["tenant"],
                    policy["tenant"],
                    int(time.time() * 1000),
                    uuid.uuid4().hex,
                    spec_json=canonical_json(policy),
                ),
            )
        producer.flush(10)
        docs = workload(jobs)
        sent: dict[str, float] = {}
        seen: dict[str, float] = {}
        done = threading.Event()

        def read_decisions() -> None:
            consumer = kafka_clients.consumer(settings.kafka, f"bench-{uuid.uuid4().hex}")
            consumer.subscribe([topics.decisions])
            try:
                while not done.is_set() and len(seen) < len(docs):
                    for msg in consumer.consume(1000, 0.005):
                        if msg.error():
                            continue
                        key = msg.key().decode()
                        if key in sent and key not in seen:
                            seen[key] = time.perf_counter()
            finally:
                consumer.close()

        reader = threading.Thread(target=read_decisions, daemon=True)
        reader.start()
        time.sleep(2.0)  # the reader's assignment
        requests = [submit_request(parse_spec(doc), doc, 0, uuid.uuid4().hex) for doc in docs]
        began = time.perf_counter()
        for n, request in enumerate(requests):
            wait = began + n / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            request["ts"] = int(time.time() * 1000)
            sent[request["key"]] = time.perf_counter()
            send(producer, topics, request)
            producer.poll(0)
        producer.flush(30)
        reader.join(120)
        done.set()
        stop.set()
        server.join(60)
        latencies = [seen[k] - sent[k] for k in seen]
    tag = f"e2e_{rate:g}_per_s"
    return {
        f"{tag}_submitted": len(docs),
        f"{tag}_decided": len(seen),
        f"{tag}_latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
        f"{tag}_latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        f"{tag}_latency_p99_ms_target": "< 250 (at 200 submissions/s)",
        f"{tag}_latency_max_ms": round(max(latencies) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--e2e-jobs", type=int, default=2_000)
    parser.add_argument(
        "--e2e-rates",
        default="50,100,200",
        help="request rates (per second) to measure end to end, comma-separated",
    )
    parser.add_argument("--no-kafka", action="store_true", help="the pure core only")
    args = parser.parse_args()
    figures = core(args.nodes, args.jobs)
    if not args.no_kafka:
        gc.unfreeze()
        for rate in (float(r) for r in args.e2e_rates.split(",")):
            figures.update(e2e(args.nodes, args.e2e_jobs, rate))
    report("scheduler", figures)


if __name__ == "__main__":
    main()
