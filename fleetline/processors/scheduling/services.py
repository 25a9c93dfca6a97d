"""Inference services as event handlers: replicas as jobs, and the autoscaler.

A service's own job holds no GPUs. Each replica is a job of its own (`<service>.r<n>`, kind
InferenceReplica): placed as one gang, ordered to its cluster, retried, migrated off faults and
preempted like any job, so everything the cluster layer does for training it does for serving.
A replica is "serving" (the router may send it requests) or "standby" (loaded and kept warm,
not routed; `autoscaling.warm_standby` of them): a scale-out promotes a standby first, by
ordering its cluster again with the new role (the same epoch and attempt: the process is not
restarted), and places a new standby behind it.

The autoscaler folds SERVICE_LOAD requests (what a router measured over a window: requests
by client region, latency percentiles, the replicas' utilisation and queues; several routers'
latest reports summed, `merged`) and decides, from
those events alone, when to add replicas (as soon as a target is passed, once the replicas
already on their way serve and the scale-out cool-down has passed) and when to drain one (when
every measure has stayed `hysteresis` under its target for the scale-in cool-down, and the rest
would stay under the utilisation target). A new replica tries the region its demand comes from
first, then the service's other regions in order. Each decision is a SCALED decision on the
service with its inputs in the reason; a replay of the log makes the same ones.

Tidal pools follow: replicas have a service's priority (high by default), above training, so a
scale-out preempts lower-priority training through a final checkpoint (within each cluster's
`inference_pools` bound), and a drained replica's GPUs go back to the queue, where the
preempted training is placed again and resumes from that checkpoint.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.processors.scheduling.decide import attempt, release
from fleetline.processors.scheduling.decisions import decide
from fleetline.processors.scheduling.effects import EffectLog, Outcome
from fleetline.processors.scheduling.orders import run_order
from fleetline.processors.scheduling.specs import InferenceServiceSpec
from fleetline.processors.scheduling.state import (
    TERMINAL,
    Condition,
    Job,
    Phase,
    SchedulerState,
)

SERVING, STANDBY = "serving", "standby"
REPLICA_KIND = "InferenceReplica"
ROLE_LABEL, SERVICE_LABEL = "fleetline/role", "fleetline/service"


@dataclass(frozen=True)
class ServiceLoad:
    """One router's measure of a service over a window (a SERVICE_LOAD request's payload)."""

    router: str
    window_ms: int
    requests: int
    errors: int
    by_region: Mapping[str, int]
    latency_ms: Mapping[str, float]  # "p50", "p95", "p99" of the window's requests
    utilisation: float  # busy share of the serving replicas' request slots
    queue: float  # requests waiting at the serving replicas, in all

    @classmethod
    def from_data(cls, data: Any) -> ServiceLoad:
        if not isinstance(data, Mapping):
            raise InvalidEventError("a service load must be a mapping")
        try:
            return cls(
                str(data.get("router", "")),
                int(data["window_ms"]),
                int(data["requests"]),
                int(data.get("errors", 0)),
                {str(r): int(n) for r, n in (data.get("by_region") or {}).items()},
                {str(p): float(v) for p, v in (data.get("latency_ms") or {}).items()},
                float(data["utilisation"]),
                float(data.get("queue", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEventError(f"a service load lacks or mistypes {exc}") from None

    def as_data(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "window_ms": self.window_ms,
            "requests": self.requests,
            "errors": self.errors,
            "by_region": dict(sorted(self.by_region.items())),
            "latency_ms": dict(sorted(self.latency_ms.items())),
            "utilisation": self.utilisation,
            "queue": self.queue,
        }


# A router's last report counts toward a service's load while it is younger than this many of
# its own windows: a router that stopped reporting (gone, or cut off) drops out of the sum.
ROUTER_FRESH_WINDOWS = 2


def merged(reports: list[ServiceLoad]) -> ServiceLoad:
    """Several routers' measures of one service over about the same window, as one (one
    report: itself). Requests, errors and their client regions add up, and so do the shares of
    the replicas' slots each router kept busy; each latency percentile is the worst router's,
    which is at least the whole's (no more than 1 % of all requests can be slower than every
    router's p99); the queue is the replicas' own, which every router sees alike."""
    if len(reports) == 1:
        return reports[0]
    regions: dict[str, int] = {}
    latency: dict[str, float] = {}
    for r in reports:
        for region, n in r.by_region.items():
            regions[region] = regions.get(region, 0) + n
        for name, ms in r.latency_ms.items():
            latency[name] = max(latency.get(name, 0.0), ms)
    return ServiceLoad(
        "+".join(r.router for r in reports),
        max(r.window_ms for r in reports),
        sum(r.requests for r in reports),
        sum(r.errors for r in reports),
        regions,
        latency,
        round(sum(r.utilisation for r in reports), 4),
        max(r.queue for r in reports),
    )


def _spec(service: Job) -> InferenceServiceSpec:
    spec = service.spec
    assert isinstance(spec, InferenceServiceSpec)
    return spec


def replicas_of(s: SchedulerState, service: Job, role: str | None = None) -> list[Job]:
    """The service's live replicas (of one role), in index order."""
    found = [s.jobs[k] for k in service.scaling.get("replicas", ()) if k in s.jobs]
    return [r for r in found if r.phase not in TERMINAL and (role is None or r.role == role)]


def region_order(spec: InferenceServiceSpec, load: Mapping[str, Any] | None) -> list[str]:
    """The service's regions, the one most of its requests come from first (ties and no
    load: the order the spec names them, its home region first)."""
    demand = (load or {}).get("by_region") or {}
    return sorted(spec.regions, key=lambda r: (-demand.get(r, 0), spec.regions.index(r)))


def _document(service: Job, role: str) -> dict[str, Any]:
    document = copy.deepcopy(service.document)
    labels = document.setdefault("metadata", {}).setdefault("labels", {})
    labels[SERVICE_LABEL] = service.name
    labels[ROLE_LABEL] = role
    return document


def start(s: SchedulerState, out: EffectLog, service: Job) -> None:
    """A service accepted: its minimum serving replicas and its warm standbys, each placed."""
    spec = _spec(service)
    service.phase = Phase.STARTING
    service.scaling = {
        "replicas": [],
        "next": service.scaling.get("next", 0),
        "last_out_ms": None,
        "low_since_ms": None,
        "load": None,
    }
    a = spec.autoscaling
    service.condition(Condition.ADMITTED, True, "accepted", s.now_ms)
    decide(
        s,
        out,
        service,
        Outcome.SCALED,
        f"{spec.min_replicas} serving replica(s) (min {spec.min_replicas}, max "
        f"{spec.max_replicas}) and {a.warm_standby} warm standby, "
        f"regions in order {', '.join(spec.regions)}",
    )
    for _ in range(spec.min_replicas):
        add_replica(s, out, service, SERVING)
    for _ in range(a.warm_standby):
        add_replica(s, out, service, STANDBY)
    refresh(s, service)


def add_replica(s: SchedulerState, out: EffectLog, service: Job, role: str) -> Job:
    """A new replica job of the service, tried at once (it queues like any job if no region
    has room)."""
    n = service.scaling.get("next", 0)
    service.scaling["next"] = n + 1
    key, name = f"{service.key}.r{n}", f"{service.name}.r{n}"
    before = s.jobs.get(key)  # a replica of an earlier service of that name: its epochs go on
    replica = Job(
        key,
        service.tenant,
        name,
        REPLICA_KIND,
        _document(service, role),
        service.priority,
        s.position,
        s.now_ms,
        alloc_seq=before.alloc_seq if before else 0,
        entered_trace=service.entered_trace,
        service=service.key,
        role=role,
        scaling={"regions": region_order(_spec(service), service.scaling.get("load"))},
    )
    s.jobs[key] = replica
    service.scaling.setdefault("replicas", []).append(key)
    s.dirty.add(f"job:{key}")
    s.dirty.add(f"job:{service.key}")
    replica.condition(Condition.ADMITTED, True, f"a {role} replica of {service.key}", s.now_ms)
    attempt(s, out, replica, None)
    return replica


def update(
    s: SchedulerState,
    out: EffectLog,
    service: Job,
    document: dict[str, Any],
    spec: InferenceServiceSpec,
    priority: int,
) -> None:
    """A changed service spec: every replica takes the new document; if what a replica is
    (GPUs, accelerator, regions, workload, serving) changed, each is placed again, else they
    keep their GPUs; the serving count is brought within the new bounds."""
    old = _spec(service)
    service.set_spec(document, spec, priority)
    scaling_only = {
        "priority_class": "high",
        "autoscaling": spec.autoscaling,
        "replicas": spec.replicas,
    }
    keeps = old.model_copy(update=scaling_only) == spec.model_copy(update=scaling_only)
    for replica in replicas_of(s, service):
        s.respec(replica, _document(service, replica.role or SERVING), spec, priority)
        s.dirty.add(f"job:{replica.key}")
        if not keeps and replica.holds:
            release(s, out, replica, Outcome.RELEASED, "the service spec changed; placing again")
            replica.phase, replica.queued_reason = Phase.QUEUED, None
    serving = replicas_of(s, service, SERVING)
    for _ in range(spec.min_replicas - len(serving)):
        add_replica(s, out, service, SERVING)
    for replica in serving[spec.max_replicas :]:
        _drain(s, out, replica, f"the service's max_replicas is now {spec.max_replicas}")
    s.dirty.add(f"job:{service.key}")
    s.pass_wanted = True
    refresh(s, service)


def delete(s: SchedulerState, out: EffectLog, service: Job, why: str) -> None:
    for replica in replicas_of(s, service):
        _drain(s, out, replica, why)
    refresh(s, service)


def _drain(s: SchedulerState, out: EffectLog, replica: Job, reason: str) -> None:
    """Stop a replica (it finishes the requests it holds: its STOP lets it exit cleanly)."""
    if replica.holds:
        release(s, out, replica, Outcome.RELEASED, reason)
    else:
        decide(s, out, replica, Outcome.RELEASED, reason)
    replica.phase = Phase.DELETED
    replica.condition(Condition.FINISHED, True, reason, s.now_ms)
    s.dirty.add(f"job:{replica.key}")


def refresh(s: SchedulerState, service: Job) -> None:
    """The service's phase and actual state from its replicas'."""
    if service.phase in TERMINAL:
        return
    serving = replicas_of(s, service, SERVING)
    standby = replicas_of(s, service, STANDBY)
    running = [r for r in serving if r.phase == Phase.RUNNING]
    actual = {
        "state": "Serving" if running else "Starting",
        "serving": len(serving),
        "running": len(running),
        "standby": len(standby),
        "standby_running": sum(r.phase == Phase.RUNNING for r in standby),
        "clusters": sorted({c for r in running for c in r.allocation}),
        "since_ms": service.actual.get("since_ms", s.now_ms),
    }
    if {k: v for k, v in actual.items() if k != "since_ms"} != {
        k: v for k, v in service.actual.items() if k != "since_ms"
    }:
        actual["since_ms"] = s.now_ms
        service.actual = actual
        s.dirty.add(f"job:{service.key}")
    phase = Phase.RUNNING if running else Phase.STARTING
    if phase != service.phase:
        service.phase = phase
        service.condition(
            Condition.RUNNING,
            bool(running),
            f"{len(running)} of {len(serving)} serving replicas running",
            s.now_ms,
        )
        s.dirty.add(f"job:{service.key}")


def tick(s: SchedulerState, out: EffectLog) -> None:
    """Keep every service at its replica counts: a replica that failed for good (its retries
    spent) is replaced, and finished replicas leave the service's list."""
    for key in sorted(k for k, j in s.jobs.items() if j.is_service and j.phase not in TERMINAL):
        service = s.jobs[key]
        spec = _spec(service)
        live = [k for k in service.scaling.get("replicas", ()) if k in s.jobs]
        kept = [k for k in live if s.jobs[k].phase not in TERMINAL]
        if kept != service.scaling.get("replicas"):
            service.scaling["replicas"] = kept
            s.dirty.add(f"job:{key}")
        serving = replicas_of(s, service, SERVING)
        for _ in range(spec.min_replicas - len(serving)):
            add_replica(s, out, service, SERVING)
        for _ in range(spec.autoscaling.warm_standby - len(replicas_of(s, service, STANDBY))):
            add_replica(s, out, service, STANDBY)
        refresh(s, service)


def service_load(s: SchedulerState, out: EffectLog, key: str, payload: Any) -> None:
    """Fold one load report and decide whether to scale (see the module's docstring)."""
    service = s.jobs.get(key)
    report = ServiceLoad.from_data(payload)
    if service is None or not service.is_service or service.phase in TERMINAL:
        return  # a report on a service deleted meanwhile
    # Every router measures only the requests it routed: the service's load is the sum of the
    # routers' latest reports, each while it is fresh.
    routers = {
        name: data
        for name, data in (service.scaling.get("routers") or {}).items()
        if s.now_ms - data["ts"] <= ROUTER_FRESH_WINDOWS * data["window_ms"]
    }
    routers[report.router] = {**report.as_data(), "ts": s.now_ms}
    service.scaling["routers"] = dict(sorted(routers.items()))
    load = merged([ServiceLoad.from_data(data) for _, data in sorted(routers.items())])
    service.scaling["load"] = {**load.as_data(), "ts": s.now_ms}
    s.dirty.add(f"job:{key}")
    spec = _spec(service)
    a = spec.autoscaling
    serving = replicas_of(s, service, SERVING)
    running = sum(r.phase == Phase.RUNNING for r in serving)
    if running == 0:
        return  # nothing serves yet: nothing to measure a replica count by
    latency = load.latency_ms.get(f"p{a.latency_percentile}")
    queue_each = load.queue / running
    inputs = (
        f"{load.requests} requests in {load.window_ms / 1000:g}s"
        + (f" ({_shares(load.by_region)})" if load.by_region else "")
        + f", utilisation {load.utilisation:.2f} (target {a.target_utilisation:.2f}), "
        + (
            f"p{a.latency_percentile} {latency:.0f} ms (target {spec.latency_target_ms:g} ms), "
            if latency is not None
            else ""
        )
        + f"queue {queue_each:.1f} per replica (target {a.target_queue_per_replica:g})"
    )
    want, over = len(serving), []
    if load.utilisation > a.target_utilisation:
        want = max(want, math.ceil(running * load.utilisation / a.target_utilisation))
        over.append("utilisation")
    if latency is not None and load.requests and latency > spec.latency_target_ms:
        want = max(want, running + 1)
        over.append("latency")
    if queue_each > a.target_queue_per_replica:
        want = max(want, running + 1)
        over.append("queue")
    want = min(want, spec.max_replicas)
    if over:
        service.scaling["low_since_ms"] = None
        last = service.scaling.get("last_out_ms")
        if (
            want <= len(serving)
            or running < len(serving)  # replicas on their way: measure again once they serve
            or (last is not None and s.now_ms - last < a.scale_out_cooldown * 1000)
        ):
            return
        why = f"{' and '.join(over)} over target: {inputs}"
        scale_out(s, out, service, want - len(serving), why)
        return
    h = 1 - a.hysteresis
    low = (
        load.utilisation < a.target_utilisation * h
        and (latency is None or latency < spec.latency_target_ms * h)
        and queue_each <= a.target_queue_per_replica * h
        # the others would still be under the utilisation target without one replica
        and load.utilisation * running / max(running - 1, 1) < a.target_utilisation
    )
    if not low or len(serving) <= spec.min_replicas:
        if service.scaling.get("low_since_ms") is not None:
            service.scaling["low_since_ms"] = None
        return
    since = service.scaling.get("low_since_ms")
    if since is None:
        service.scaling["low_since_ms"] = s.now_ms
        return
    if s.now_ms - since < a.scale_in_cooldown * 1000:
        return
    scale_in(
        s,
        out,
        service,
        f"under target by {a.hysteresis:.0%} for {(s.now_ms - since) / 1000:.0f}s: {inputs}",
    )
    service.scaling["low_since_ms"] = s.now_ms


def _shares(by_region: Mapping[str, int]) -> str:
    total = sum(by_region.values()) or 1
    return ", ".join(f"{r} {n / total:.0%}" for r, n in sorted(by_region.items()))


def scale_out(s: SchedulerState, out: EffectLog, service: Job, more: int, why: str) -> None:
    """`more` serving replicas: warm standbys promoted first (running ones first), then new
    replicas placed; standbys are topped up behind them."""
    before = len(replicas_of(s, service, SERVING))
    done: list[str] = []
    standby = sorted(
        replicas_of(s, service, STANDBY),
        key=lambda r: (r.phase != Phase.RUNNING, service.scaling["replicas"].index(r.key)),
    )
    for replica in standby[:more]:
        replica.role = SERVING
        replica.document = _document(service, SERVING)
        s.dirty.add(f"job:{replica.key}")
        if replica.ordered_cluster is not None:
            out.add(run_order(s, replica, "promoted from warm standby to serving"))
        done.append(f"promoted {replica.key} from warm standby")
    for _ in range(more - len(done)):
        replica = add_replica(s, out, service, SERVING)
        where = (
            f"placed in {', '.join(sorted(replica.allocation))}"
            if replica.holds
            else "queued: " + (replica.queued_reason or "no room yet")
        )
        done.append(f"new {replica.key} ({where})")
    service.scaling["last_out_ms"] = s.now_ms
    decide(
        s,
        out,
        service,
        Outcome.SCALED,
        f"scale out {before} -> {before + more} serving replicas: {why}; " + "; ".join(done),
    )
    for _ in range(_spec(service).autoscaling.warm_standby - len(replicas_of(s, service, STANDBY))):
        add_replica(s, out, service, STANDBY)
    refresh(s, service)


def scale_in(s: SchedulerState, out: EffectLog, service: Job, why: str) -> None:
    """Drain one serving replica: one not running yet if any, else one in the region with the
    least of the service's demand, there the one sharing its node least, then the newest."""
    serving = replicas_of(s, service, SERVING)
    load = service.scaling.get("load") or {}
    order = region_order(_spec(service), load)

    def keep_score(r: Job) -> tuple[bool, int, int, int]:
        regions = [s.facts.clusters[c].region for c in r.allocation if c in s.facts.clusters]
        rank = min((order.index(g) for g in regions if g in order), default=len(order))
        # GPUs others hold on its nodes: draining the replica that shares its node least gives
        # training whole nodes back soonest.
        shared = sum(
            s.jobs[other].allocation.get(cluster, {}).get(node, 0).bit_count()
            for cluster, nodes in r.allocation.items()
            for node in nodes
            for other in s.node_jobs.get(node, ())
            if other != r.key
        )
        return (
            r.phase == Phase.RUNNING,
            -rank,
            shared,
            -service.scaling["replicas"].index(r.key),
        )

    victim = min(serving, key=keep_score)
    decide(
        s,
        out,
        service,
        Outcome.SCALED,
        f"scale in {len(serving)} -> {len(serving) - 1} serving replicas: {why}; "
        f"draining {victim.key}",
    )
    _drain(s, out, victim, f"scale-in of {service.key}: {why}")
    refresh(s, service)
