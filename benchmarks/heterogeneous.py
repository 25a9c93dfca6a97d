"""Heterogeneous fleet benchmark: the task-aware choice of chip against first-fit, on one job
stream through the scheduler's pure core.

The fleet (simulated, one model per cluster, priced per GPU-hour as its operator would declare):
ap-south-a H200 at 2.90, eu-west-a H100 at 2.40, eu-west-b A100 at 1.20, us-east-a MI300X at
2.10, us-east-b SimNPU at 0.90 (three vendors, five models; 8 nodes each). The jobs (seeded):
training of 1 to 4 workers x 8 chips, in bf16 (60 %), fp8 (25 %), int8 (10 %) or fp32 (5 %),
each with its size (PFLOP per step, steps) and, for half of them, a deadline at 1.5-4x its run
time on H100s after its submission; they arrive at random, about one every three minutes, so the
fleet runs near full and the queue works.

Each policy schedules the same stream through `Scheduler.step`, requests as the log carries
them: a job runs for its estimated time on the chips it got (the accelerator catalogue's peak in
its precision x its share of peak: the same model the task-aware scorer uses, so the simulation
measures the choice, not the estimate's error), and its cluster reports it done.

- first-fit: no scorer; the first cluster by name whose filters pass (precision included).
- gpu-hour cost: today's default weights with the jobs' sizes hidden (the cheapest GPU-hour).
- task-aware: the default weights with the sizes: the cheapest whole run that meets the
  deadline (`processors/scheduling/estimate.py`).

Printed per policy: total cost, mean and p95 job completion time (submit to done), deadline
misses, and the chips' share of the work; written to benchmarks/results/heterogeneous.json.

    .venv/bin/python benchmarks/heterogeneous.py [--jobs 300] [--seed 7]
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import random
import statistics
import time
from typing import Any

from _common import fold_telemetry_records, progress_report, report

from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import Decision, WorkloadOrder
from fleetline.processors.scheduling.estimate import WorkSize, estimate
from fleetline.processors.scheduling.policy import DEFAULT_WEIGHTS, SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.accelerators import Accelerator
from fleetline.processors.view.catalogue import builtin
from fleetline.processors.view.fold import apply
from fleetline.processors.view.model import ResourceView
from fleetline.streams.serde import default_codec

BASE_MS = 1_796_000_000_000
FLEET = [
    ("ap-south-a", "ap-south", "NVIDIA H200", 2.90),
    ("eu-west-a", "eu-west", "NVIDIA H100 80GB HBM3", 2.40),
    ("eu-west-b", "eu-west", "NVIDIA A100-SXM4-80GB", 1.20),
    ("us-east-a", "us-east", "AMD Instinct MI300X", 2.10),
    ("us-east-b", "us-east", "SimNPU N1 64GB", 0.90),
]
PRECISIONS = [(60, "bf16"), (25, "fp8"), (10, "int8"), (5, "fp32")]
H100 = Accelerator("nvidia", "h100-80gb-hbm3", 81559)


def fleet_view(nodes: int) -> ResourceView:
    codec = default_codec()
    specs = [ClusterSpec(c, region, nodes, model=model) for c, region, model, _ in FLEET]
    view = ResourceView()
    for spec, (_, _, _, price) in zip(specs, FLEET, strict=True):
        info = cluster_info(spec, 1, BASE_MS)
        info.update(price_per_gpu_hour=price, energy_price_per_kwh=0.0)
        apply(view, codec.decode(codec.encode("ClusterInfo", info)))
    sim = FleetSimulator(specs, seed=1)
    for record in sim.initial_states(BASE_MS):
        apply(view, codec.decode(codec.encode("NodeState", record)))
    fold_telemetry_records(view, sim.telemetry(BASE_MS + 1000))
    return view


def job_stream(
    count: int, seed: int, mean_gap_s: float, deadline_share: float = 0.5
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    jobs = []
    at_ms = BASE_MS + 10_000
    for n in range(count):
        at_ms += int(rng.expovariate(1 / mean_gap_s) * 1000)
        precision = rng.choices([p for _, p in PRECISIONS], [w for w, _ in PRECISIONS])[0]
        workers = rng.choice([1, 1, 2, 2, 4])
        work = WorkSize(
            pflop_per_step=round(10 ** rng.uniform(-0.3, 1.3), 3),
            steps=rng.randrange(200, 4000, 100),
            precision=precision,
        )
        reference = estimate(work, H100, workers * 8, 1.0, at_ms, builtin())
        assert reference is not None
        deadline_ms = (
            at_ms + int(reference.run_s * rng.uniform(1.5, 4.0) * 1000)
            if rng.random() < deadline_share
            else None
        )
        jobs.append(
            {
                "name": f"j{n:04d}",
                "at_ms": at_ms,
                "workers": workers,
                "work": WorkSize(work.pflop_per_step, work.steps, precision, deadline_ms),
            }
        )
    return jobs


def document(job: dict[str, Any], sized: bool) -> dict[str, Any]:
    work: WorkSize = job["work"]
    spec: dict[str, Any] = {
        "gpus_per_worker": 8,
        "workers": job["workers"],
        "parallelism": {"tensor": 8, "pipeline": 1},
        "communication": "heavy",
        "precision": work.precision,
    }
    if sized:
        spec["work"] = {"pflop_per_step": work.pflop_per_step, "steps": work.steps}
        if work.deadline_ms is not None:
            deadline = dt.datetime.fromtimestamp(work.deadline_ms / 1000, dt.UTC)
            spec["work"]["deadline"] = deadline.isoformat()
    return {
        "apiVersion": "fleetline/v1",
        "kind": "TrainingJob",
        "metadata": {"name": job["name"], "tenant": "acme"},
        "spec": spec,
    }


def run(
    view: ResourceView, jobs: list[dict[str, Any]], policy: SchedulingPolicy, sized: bool
) -> dict[str, Any]:
    """The stream through the scheduler; each job runs its estimated time on its chips."""
    scheduler = Scheduler(policy)
    facts = observe(view)
    prices = {c: price for c, _, _, price in FLEET}
    position = 0
    events: list[tuple[int, int, str, Any]] = [
        (job["at_ms"], n, "submit", job) for n, job in enumerate(jobs)
    ]
    heapq.heapify(events)
    by_key = {f"acme/{job['name']}": job for job in jobs}
    done: dict[str, dict[str, Any]] = {}
    sequence = len(jobs)
    decisions = 0
    started = time.perf_counter()

    def feed(request: dict[str, Any]) -> None:
        nonlocal position, sequence, decisions
        for effect in scheduler.step(request, position, facts):
            if isinstance(effect, Decision):
                decisions += 1
            if isinstance(effect, WorkloadOrder) and effect.action == "RUN":
                job = by_key[effect.job]
                nodes = [node for node, _ in effect.workers]
                kind = view.nodes[nodes[0]].accelerator
                gpus = sum(len(g) for _, g in effect.workers)
                ran = estimate(job["work"], kind, gpus, prices[effect.cluster_id], 0, builtin())
                assert ran is not None, (effect.job, kind)
                finish = request["ts"] + int(ran.run_s * 1000)
                job.update(start_ms=request["ts"], order=effect)
                done[effect.job] = {
                    "kind": kind.model,
                    "cost": ran.cost,
                    "finish_ms": finish,
                    "gpu_h": gpus * ran.run_s / 3600,
                }
                sequence += 1
                heapq.heappush(events, (finish, sequence, "finish", effect))
                position += 1
                scheduler.step(progress_report(effect, "RUNNING", request["ts"]), position, facts)
        position += 1

    feed(new_request("TICK", "", "", BASE_MS, "r-start", view_offsets=facts.offsets))
    while events:
        now, _, what, payload = heapq.heappop(events)
        if what == "submit":
            feed(
                new_request(
                    "SUBMIT",
                    f"acme/{payload['name']}",
                    "acme",
                    now,
                    f"s{position}",
                    spec_json=canonical_json(document(payload, sized)),
                )
            )
        else:
            feed(progress_report(payload, "SUCCEEDED", now))
        feed(new_request("TICK", "", "", now, f"t{position}", view_offsets=facts.offsets))
    seconds = time.perf_counter() - started
    unfinished = [k for k in by_key if k not in done]
    completion_h = [
        (done[k]["finish_ms"] - by_key[k]["at_ms"]) / 3_600_000 for k in by_key if k in done
    ]
    with_deadline = [k for k in by_key if by_key[k]["work"].deadline_ms is not None]
    missed = [
        k
        for k in with_deadline
        if k not in done or done[k]["finish_ms"] > by_key[k]["work"].deadline_ms
    ]
    gpu_h: dict[str, float] = {}
    for result in done.values():
        gpu_h[result["kind"]] = gpu_h.get(result["kind"], 0.0) + result["gpu_h"]
    total = sum(gpu_h.values()) or 1.0
    return {
        "total_cost": sum(r["cost"] for r in done.values()),
        "mean_completion_h": statistics.fmean(completion_h),
        "p95_completion_h": statistics.quantiles(completion_h, n=20)[-1],
        "deadline_misses": len(missed),
        "jobs_with_deadline": len(with_deadline),
        "unfinished": len(unfinished),
        "gpu_hours_by_chip": {k: round(v / total, 3) for k, v in sorted(gpu_h.items())},
        "decisions": decisions,
        "scheduler_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=8, help="nodes per cluster")
    parser.add_argument("--mean-gap-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--deadline-share", type=float, default=0.5, help="the share of jobs with a deadline"
    )
    args = parser.parse_args()
    view = fleet_view(args.nodes)
    jobs = job_stream(args.jobs, args.seed, args.mean_gap_s, args.deadline_share)
    policies = {
        "first-fit": (SchedulingPolicy(weights={}), True),
        "gpu-hour cost": (SchedulingPolicy(), False),
        "task-aware": (SchedulingPolicy(weights=dict(DEFAULT_WEIGHTS)), True),
    }
    results = {}
    for name, (policy, sized) in policies.items():
        results[name] = run(view, [dict(j) for j in jobs], policy, sized)
    header = f"{'policy':16} {'cost':>10} {'mean JCT h':>11} {'p95 JCT h':>10} {'missed':>12}"
    print(header)
    for name, r in results.items():
        print(
            f"{name:16} {r['total_cost']:10.1f} {r['mean_completion_h']:11.2f} "
            f"{r['p95_completion_h']:10.2f} {r['deadline_misses']:5} of {r['jobs_with_deadline']:4}"
            f"   {r['gpu_hours_by_chip']}"
        )
    aware, first = results["task-aware"], results["first-fit"]
    report(
        "heterogeneous",
        {
            "fleet": ", ".join(f"{c} {m} at {p}" for c, _, m, p in FLEET),
            "nodes_per_cluster": args.nodes,
            "jobs": args.jobs,
            "seed": args.seed,
            "deadline_share": args.deadline_share,
            **{
                f"{name} {key}": value
                for name, r in results.items()
                for key, value in r.items()
                if key != "gpu_hours_by_chip"
            },
            **{f"{name} gpu_hours_by_chip": r["gpu_hours_by_chip"] for name, r in results.items()},
            "task-aware cost vs first-fit": aware["total_cost"] / first["total_cost"],
            "task-aware mean JCT vs first-fit": aware["mean_completion_h"]
            / first["mean_completion_h"],
        },
    )


if __name__ == "__main__":
    main()
