"""The serving part of `fleetline run`: a compressed day of an inference service.

The scenario's `serving_day` names a scheduling policy (its tidal pools), the specs to apply
(a long training job and a service whose replicas the cluster agents start as real
`fleetline workload serve` processes), and a day: `day_s` seconds, a peak rate and each
region's weight and clock offset. A router runs in this process; `demo/load.py` sends the
day's requests through it. Every `report_s` the story prints the hour, the rate per region,
the serving replicas and warm standbys per cluster, each cluster's inference pool (the tidal
boundary) and the training job's phase and step; at the end, every scaling decision's reason,
when the training was paused and resumed, and what the requests saw.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from fleetline.agents.router.server import start_router
from fleetline.app import Fleetline
from fleetline.config import Settings
from fleetline.demo.load import LoadPlan, LoadResult, run_load
from fleetline.demo.verdict import last_word
from fleetline.processors.scheduling.client import decisions_of, submit, submit_specs
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.streams.topics import Topics

# Phases a job does not leave.
ENDED = ("Deleted", "Failed", "Succeeded")


def _jobs(fleet: Fleetline) -> dict[str, dict[str, Any]]:
    assert fleet.scheduler is not None
    return {j["key"]: j for j in fleet.scheduler.jobs()}


def _gpus(job: Mapping[str, Any]) -> dict[str, int]:
    return {
        cluster: sum(int(mask).bit_count() for mask in nodes.values())
        for cluster, nodes in (job.get("allocation") or {}).items()
    }


def snapshot(fleet: Fleetline, service: str, training: str) -> dict[str, Any]:
    """Replicas per cluster by role, the inference pool per cluster, the training's state."""
    jobs = _jobs(fleet)
    serving: dict[str, int] = {}
    standby: dict[str, int] = {}
    pool: dict[str, int] = {}
    for job in jobs.values():
        if job.get("service") != service or job["phase"] in ENDED:
            continue
        for cluster, gpus in _gpus(job).items():
            pool[cluster] = pool.get(cluster, 0) + gpus
            counts = standby if job.get("role") == "standby" else serving
            if job["phase"] == "Running":
                counts[cluster] = counts.get(cluster, 0) + 1
    train = jobs.get(training) or {}
    return {
        "serving": serving,
        "standby": standby,
        "pool": pool,
        "training": {
            "phase": train.get("phase"),
            "clusters": sorted(train.get("allocation") or {}),
            "checkpoint_step": (train.get("actual") or {}).get("checkpoint_step"),
        },
    }


def serving_day(
    fleet: Fleetline,
    settings: Settings,
    topics: Topics,
    day: Mapping[str, Any],
    say: Callable[[str], None],
    router_settings: Settings | None = None,
) -> dict[str, Any]:
    """Play the day and return what happened (see the module's docstring). The router signs
    in to Kafka with `router_settings` (a secured broker's router principal; default the
    story's own) and writes its load reports as the router it is."""
    documents = list(day["apply"])
    service = next(
        f"{d['metadata']['tenant']}/{d['metadata']['name']}"
        for d in documents
        if d["kind"] == "InferenceService"
    )
    training = next(
        f"{d['metadata']['tenant']}/{d['metadata']['name']}"
        for d in documents
        if d["kind"] == "TrainingJob"
    )

    _end_the_story(fleet, settings, topics, say)
    submit(
        settings.kafka,
        topics,
        [
            new_request(
                "POLICY",
                "",
                "",
                int(time.time() * 1000),
                "serving-day-policy",
                actor="fleetline-run",
                spec_json=canonical_json(day.get("policy") or {}),
            )
        ],
    )
    submit_specs(
        settings.kafka,
        topics,
        [d for d in documents if d["kind"] == "TrainingJob"],
        "fleetline-run",
        int(time.time() * 1000),
    )
    # A fleet too small for the day's training (`fleetline run --nodes 2`) skips the day, and
    # so does a training that cannot start (its last failure is the reason, not the Placed
    # condition's older text).
    placed = _until(
        lambda: (_jobs(fleet).get(training) or {}).get("phase") in ("Running", "Queued", *ENDED),
        90,
    )
    job = _jobs(fleet).get(training) or {}
    if not placed or job.get("phase") == "Queued":
        why = (job.get("conditions") or {}).get("Placed", {}).get("reason", "not placed in 90s")
        say(f"no serving day: {training} does not fit this fleet ({why[:160]})")
        return {"skipped": f"{training} does not fit: {why}"}
    if job.get("phase") in ENDED:
        why = f"{training} ended {job['phase']} before it ran: {last_word(job)}"
        say(f"no serving day: {why[:200]}")
        return {"skipped": why}
    submit_specs(
        settings.kafka,
        topics,
        [d for d in documents if d["kind"] != "TrainingJob"],
        "fleetline-run",
        int(time.time() * 1000),
    )
    if not _until(lambda: snapshot(fleet, service, training)["serving"], 90):
        say(f"no serving day: no replica of {service} served within 90s")
        return {"skipped": f"no replica of {service} served within 90s"}
    router, stop, thread = start_router(router_settings or settings, topics)
    assert router.address is not None
    regions: dict[str, float] = {}
    offsets: dict[str, float] = {}
    for region, text in (day.get("regions") or {"eu-west": "1"}).items():
        weight, _, offset = str(text).partition("@")
        regions[region] = float(weight)
        offsets[region] = float(offset or 0)
    day_s = float(day.get("day_s", 60))
    plan = LoadPlan(
        router.address,
        service,
        regions,
        peak_rps=float(day.get("peak_rps", 40)),
        day_s=day_s,
        night=float(day.get("night", 0.05)),
        offset_h=offsets,
        # On into the next night, so that the replicas drain and training comes back.
        duration_s=day_s * float(day.get("days", 1.25)),
        ca_file=str(settings.tls.ca) if settings.tls else None,
    )
    result: list[LoadResult] = []
    loader = threading.Thread(target=lambda: result.append(asyncio.run(run_load(plan))))
    say(
        f"a compressed day of {day_s:g}s for {service}: requests from "
        + ", ".join(f"{r} (x{w:g}, {offsets[r]:+g}h)" for r, w in regions.items())
        + f" through the router at {router.address}"
    )
    began = time.monotonic()
    loader.start()
    timeline = []
    report_s = float(day.get("report_s", day_s / 12))
    try:
        while loader.is_alive():
            loader.join(report_s)
            t = time.monotonic() - began
            now = snapshot(fleet, service, training)
            timeline.append({"t_s": round(t, 1), **now})
            hour = (t / day_s * 24) % 24
            rates = ", ".join(f"{r} {plan.rate(r, t):.0f}/s" for r in regions)
            train = now["training"]
            step = train["checkpoint_step"]
            say(
                f"{int(hour):02d}:{int(hour % 1 * 60):02d} {rates} | serving "
                + (_per(now["serving"]) or "-")
                + (f" (+{_per(now['standby'])} warm)" if now["standby"] else "")
                + f" | inference pool {_per(now['pool']) or '-'} GPUs | {training} "
                + f"{train['phase']} in {', '.join(train['clusters']) or '-'}"
                + (f" (checkpoint step {step})" if step else "")
            )
    finally:
        stop.set()
        thread.join(10)
    load = result[0].summary(span_s=day_s) if result else {}
    decisions = decisions_of(settings.kafka, topics)
    scaled = [d["reason"] for d in decisions if d["job"] == service and d["outcome"] == "SCALED"]
    paused = [d for d in decisions if d["job"] == training and d["outcome"] == "PREEMPTED"]
    resumed = [
        d
        for d in decisions
        if d["job"] == training and d["outcome"] == "PLACED" and d["resume_from_checkpoint_ms"]
    ]
    for reason in scaled[1:]:
        say(f"  {reason[:220]}")
    say(
        f"{training}: paused {len(paused)}x for replicas, resumed {len(resumed)}x from its "
        f"checkpoint; requests: {load.get('requests')} sent, {load.get('failed')} failed, "
        f"{load.get('retried')} retried, p50 {load.get('p50_ms')} ms, p95 {load.get('p95_ms')} ms; "
        f"statuses {load.get('statuses')}; router {router.counters.as_data()}"
    )
    return {
        "service": service,
        "training": training,
        "timeline": timeline,
        "scaled": scaled,
        "paused": len(paused),
        "resumed": len(resumed),
        "load": {k: v for k, v in load.items() if k != "buckets"},
        "router": router.counters.as_data(),
    }


def _per(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(counts.items()))


def _end_the_story(
    fleet: Fleetline, settings: Settings, topics: Topics, say: Callable[[str], None]
) -> None:
    """The day begins on the morning after the story: its jobs still queued or holding GPUs
    are deleted (their workloads stopped by the cluster agents), so the day's training and
    service meet a fleet that only its faults and repairs still hold back."""
    left = sorted(key for key, job in _jobs(fleet).items() if job["phase"] not in ENDED)
    if not left:
        return
    now = int(time.time() * 1000)
    submit(
        settings.kafka,
        topics,
        [
            new_request(
                "DELETE",
                key,
                key.partition("/")[0],
                now,
                f"serving-day-ends-{key}",
                actor="fleetline-run",
            )
            for key in left
        ],
    )
    ended = _until(
        lambda: all((_jobs(fleet).get(key) or {}).get("phase") in ENDED for key in left), 60
    )
    say(
        f"the story's {len(left)} jobs still queued or running end before the day begins"
        + ("" if ended else " (not all seen deleted within 60s)")
    )


def _until(condition: Callable[[], Any], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False
