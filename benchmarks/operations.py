"""Operations benchmark: energy-aware scheduling over a simulated week, against the same
workload without the energy term; and the demand forecast's back-test on a simulated year.

Observation (pure): what the operations ticker costs on 10,000 nodes x 8 GPUs, a full scan
of every GPU's readings (every 5 s) and a tick that judges silence and GPU health from the
per-node-epoch cache (every second); the view is held for each.

Energy (pure cores, no services): three clusters in three regions, each with a daily
electricity price curve and renewable share by the hour in its local time (ENERGY requests).
The same week of jobs is scheduled twice by the scheduler's fold, fed TICKs every 15 minutes
and each job's SUCCEEDED when its runtime is up: once with the energy scorer and deferrable
jobs honoured, once with the energy weight 0 and no job deferrable. Measured: energy cost and
renewable share of the GPU energy, completed GPU-hours and missed deadlines of each run.
The fault-to-cordon and fault-to-running times are measured on the real stack by
`tests/e2e/test_operations.py` (printed with -s), since they are Kafka hops, not CPU.

    .venv/bin/python benchmarks/operations.py [--jobs-per-hour 3] [--seed 1] [--nodes 10000]
"""

from __future__ import annotations

import argparse
import random
import time
from datetime import UTC, datetime
from typing import Any

from _common import progress_report, report, simulated_view

from fleetline.agents.simulator import ClusterSpec
from fleetline.processors.operations import rules as healing
from fleetline.processors.operations.forecast import back_test, simulated_demand
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.scheduling.energy import GPU_POWER_KW, HOUR_MS
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.model import ResourceView

BASE_MS = 1_796_000_000_000
STEP_MS = 15 * 60_000
WEEK_H = 168
# cluster, region, UTC offset (h), PUE
SITES = (
    ("us-east-a", "us-east", -5, 1.35),
    ("eu-west-a", "eu-west", 0, 1.25),
    ("ap-south-a", "ap-south", 5, 1.50),
)


def _profile(cluster: str, offset: int) -> dict[str, Any]:
    """Local time: cheap at night, a morning and an evening peak; solar around noon."""
    price, renewable = [], []
    for utc in range(24):
        local = (utc + offset) % 24
        p = 0.08 if local < 6 else 0.22 if 17 <= local < 21 else 0.15
        price.append(p)
        renewable.append(round(max(0.0, 0.7 - abs(local - 13) * 0.12), 3) + 0.1)
    return {"cluster_id": cluster, "price_per_kwh": price, "renewable_share": renewable}


def _view() -> ResourceView:
    return simulated_view([ClusterSpec(c, r, 8) for c, r, _, _ in SITES], BASE_MS)


def _workload(
    jobs_per_hour: float, seed: int, start_ms: int
) -> list[tuple[int, dict[str, Any], int, int | None]]:
    """(submit time, spec, runtime ms, deadline ms or None) for a week of submissions."""
    rng = random.Random(seed)
    out = []
    for hour in range(WEEK_H - 24):
        for n in range(rng.randint(0, int(2 * jobs_per_hour))):
            runtime_h = rng.choice((1, 2, 3, 4))
            deferrable = rng.random() < 0.6
            at = start_ms + hour * HOUR_MS + rng.randrange(0, HOUR_MS, STEP_MS)
            deadline = at + (runtime_h + 12) * HOUR_MS if deferrable else None
            spec: dict[str, Any] = {
                "accelerator": "H100",
                "gpus_per_worker": 8,
                "workers": 1,
                "max_runtime": f"{runtime_h + 1}h",
            }
            if deadline is not None:
                spec["deferrable"] = {
                    "deadline": datetime.fromtimestamp(deadline / 1000, UTC).isoformat(),
                    "expected_runtime": f"{runtime_h}h",
                }
            doc = {
                "kind": "TrainingJob",
                "metadata": {"name": f"j{hour:03d}-{n}", "tenant": "acme"},
                "spec": spec,
            }
            out.append((at, doc, runtime_h * HOUR_MS, deadline))
    return out


def run_week(
    energy: bool, jobs_per_hour: float, seed: int, renewable_weight: float = 0.5
) -> dict[str, float]:
    view = _view()
    facts = observe(view)
    start = (BASE_MS // (24 * HOUR_MS) + 1) * 24 * HOUR_MS  # a midnight UTC
    work = _workload(jobs_per_hour, seed, start)
    scheduler = Scheduler()
    position = 0

    def feed(request: dict[str, Any]) -> list[Any]:
        nonlocal position
        effects = scheduler.step(request, position, facts if request["kind"] == "TICK" else None)
        position += 1
        return effects

    policy = {"weights": {"energy": 1.0 if energy else 0.0}, "renewable_weight": renewable_weight}
    feed(new_request("POLICY", "", "", start, "p", spec_json=canonical_json(policy)))
    profiles = {c: _profile(c, off) for c, _, off, _ in SITES}
    for cluster, profile in profiles.items():
        feed(
            new_request(
                "ENERGY", cluster, "", start, f"e-{cluster}", spec_json=canonical_json(profile)
            )
        )
    pue = {c: p for c, _, _, p in SITES}
    runtime = {doc["metadata"]["name"]: r for _, doc, r, _ in work}
    deadlines = {doc["metadata"]["name"]: d for _, doc, _, d in work}
    running: dict[str, tuple[WorkloadOrder, int]] = {}
    finished: dict[str, int] = {}
    cost = kwh = green = 0.0
    pending = sorted(work, key=lambda w: w[0])
    now = start
    end = start + (WEEK_H + 48) * HOUR_MS
    while now < end and (pending or running or len(finished) < len(work)):
        while pending and pending[0][0] <= now:
            _, doc, _, _ = pending.pop(0)
            if not energy:
                doc = {**doc, "spec": {k: v for k, v in doc["spec"].items() if k != "deferrable"}}
            name = doc["metadata"]["name"]
            effects = feed(
                new_request(
                    "SUBMIT",
                    f"acme/{name}",
                    "acme",
                    now,
                    f"s-{name}",
                    spec_json=canonical_json(doc),
                )
            )
            _start(effects, running, now, feed)
        for name, (order, began) in list(running.items()):
            if now - began >= runtime[name]:
                del running[name]
                finished[name] = now
                effects = feed(progress_report(order, "SUCCEEDED", now))
                _start(effects, running, now, feed)
        effects = feed(new_request("TICK", "", "", now, f"t{now}", view_offsets=facts.offsets))
        _start(effects, running, now, feed)
        # The energy the running jobs draw in this step, priced where they run.
        hour = (now // HOUR_MS) % 24
        for order, _ in running.values():
            profile = profiles[order.cluster_id]
            step_kwh = GPU_POWER_KW * 8 * STEP_MS / HOUR_MS * pue[order.cluster_id]
            kwh += step_kwh
            cost += step_kwh * profile["price_per_kwh"][hour]
            green += step_kwh * profile["renewable_share"][hour]
        now += STEP_MS
    missed = sum(1 for n, d in deadlines.items() if d is not None and finished.get(n, end) > d)
    return {
        "jobs": len(work),
        "completed": len(finished),
        "completed_gpu_hours": sum(runtime[n] for n in finished) * 8 / HOUR_MS,
        "energy_kwh": kwh,
        "energy_cost": cost,
        "renewable_share": green / kwh if kwh else 0.0,
        "missed_deadlines": missed,
    }


def _start(
    effects: list[Any], running: dict[str, tuple[WorkloadOrder, int]], now: int, feed: Any
) -> None:
    """The cluster agents, as a test's: every RUN order runs at once (reported RUNNING)."""
    for e in effects:
        if isinstance(e, WorkloadOrder) and e.action == "RUN":
            running[e.job.split("/", 1)[1]] = (e, now)
            _start(feed(progress_report(e, "RUNNING", now)), running, now, feed)


def observation_cost(nodes: int) -> dict[str, float]:
    clusters = [
        ClusterSpec(f"c{i:02d}", f"r{i % 5}", nodes // 10, nodes_per_leaf=16) for i in range(10)
    ]
    view = simulated_view(clusters, BASE_MS)
    rules = healing.HealingRules()
    full = []
    for _ in range(5):
        began = time.perf_counter()
        seen = healing.observe(view, rules)
        full.append(time.perf_counter() - began)
    limits = {n: load[3] for n, load in seen.loads.items()}
    cache: dict[str, Any] = {}
    healing.observe(view, rules, False, limits, cache)
    cheap = []
    for _ in range(5):
        began = time.perf_counter()
        healing.observe(view, rules, False, limits, cache)
        cheap.append(time.perf_counter() - began)
    return {
        "observe_gpus": sum(len(n.gpus) for n in view.nodes.values()),
        "observe_full_scan_ms (every 5 s)": 1000 * sorted(full)[2],
        "observe_tick_ms (every 1 s)": 1000 * sorted(cheap)[2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs-per-hour", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=10_000)
    args = parser.parse_args()
    began = time.perf_counter()
    observed = observation_cost(args.nodes)
    blind = run_week(False, args.jobs_per_hour, args.seed)
    figures: dict[str, object] = {
        "week_jobs": blind["jobs"],
        "without_energy_completed_gpu_hours": blind["completed_gpu_hours"],
        "without_energy_cost": blind["energy_cost"],
        "without_energy_renewable_share": blind["renewable_share"],
        "without_energy_missed_deadlines": blind["missed_deadlines"],
    }
    # The policy's dial between cheaper and greener: how much a renewable hour discounts a kWh
    # (0.8, the default; 0, price alone; 1, a fully renewable hour is free).
    for label, weight in (("default", 0.8), ("price_only", 0.0), ("greenest", 1.0)):
        run = run_week(True, args.jobs_per_hour, args.seed, renewable_weight=weight)
        saving = 100 * (1 - run["energy_cost"] / blind["energy_cost"])
        figures |= {
            f"{label}_completed_gpu_hours (= without)": run["completed_gpu_hours"],
            f"{label}_cost": run["energy_cost"],
            f"{label}_cost_saving_pct": saving,
            f"{label}_renewable_share": run["renewable_share"],
            f"{label}_missed_deadlines (target 0)": run["missed_deadlines"],
        }
    year = simulated_demand(52, seed=args.seed)
    test = back_test(year)
    figures |= observed
    figures |= {
        "forecast_year_smape_pct": test.model_smape,
        "seasonal_naive_year_smape_pct (model must be lower)": test.baseline_smape,
        "forecast_interval_coverage (90 % nominal)": test.coverage,
        "wall_s": time.perf_counter() - began,
    }
    report("operations", figures)


if __name__ == "__main__":
    main()
