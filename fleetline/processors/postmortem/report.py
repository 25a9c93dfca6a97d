"""An incident report, built from what the log and the tiers hold of a window: the faults and
when each was detected (by which fold or rule, how long after), every action that followed
with its actor and reason (the audit chain's events), the impact on each job that moved, the
audit chain verified with its signed digests named, and series to plot.

Pure and deterministic: the shell (`gather.py`) reads the records; the same records and window
give the same report, byte for byte as `canonical` JSON. Nothing here reads a clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetline.errors import ConfigError

Row = dict[str, Any]

# Audit operations that are reads, not actions: a postmortem lists what changed things.
_READS = ("api.GET ", "sql.", "data.")


@dataclass(frozen=True)
class Scope:
    """What the report is about: the whole fleet, or one cluster, job, node or service."""

    cluster: str | None = None
    job: str | None = None
    node: str | None = None
    service: str | None = None
    # A tenant's postmortem (the API's, for a caller held to a tenant): the fleet's faults and
    # the tenant's own jobs, actions and services; no dead letters (they may hold anything).
    tenant: str | None = None

    def as_data(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def words(self) -> str:
        named = self.as_data()
        return ", ".join(f"{k} {v}" for k, v in named.items()) or "the whole fleet"


@dataclass
class IncidentLog:
    """What the shell read of one window (each list ordered as read; the report sorts)."""

    from_ms: int
    to_ms: int
    scope: Scope = field(default_factory=Scope)
    health: list[Row] = field(default_factory=list)  # ClusterHealth records (emergency topic)
    node_states: list[Row] = field(default_factory=list)  # $node_states rows
    xids: list[Row] = field(default_factory=list)  # first sample per (node, gpu, xid)
    tickets: list[Row] = field(default_factory=list)  # $tickets rows
    decisions: list[Row] = field(default_factory=list)  # $decisions rows
    workloads: list[Row] = field(default_factory=list)  # $workloads rows
    dead_letters: list[Row] = field(default_factory=list)  # {ts_ms, application, topic, reason}
    audit_events: list[Row] = field(default_factory=list)  # chained events in the window
    audit: Mapping[str, Any] = field(default_factory=dict)  # the chain's verification
    utilisation: list[Row] = field(default_factory=list)  # {t_ms, cluster_id, util, gpus, bad}
    services: list[Row] = field(default_factory=list)  # routers' SERVICE_LOAD records
    tiers: list[str] = field(default_factory=list)  # the tiers the window's rows came from


def canonical(report: Mapping[str, Any]) -> str:
    """The report as JSON, byte-identical for the same report."""
    return json.dumps(report, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def build(log: IncidentLog) -> dict[str, Any]:
    """The report of `log`'s window (`canonical` gives its JSON)."""
    faults = _faults(log)
    jobs = _job_impacts(log, faults)
    actions = _actions(log)
    report = {
        "window": {"from_ms": log.from_ms, "to_ms": log.to_ms, "scope": log.scope.as_data()},
        "summary": _summary(log, faults, jobs, actions),
        "faults": faults,
        "actions": actions,
        "impact": {"jobs": jobs, "services": _services(log)},
        "audit": dict(log.audit),
        "dead_letters": [
            dict(d)
            for d in sorted(log.dead_letters, key=lambda d: (d["ts_ms"], d["topic"]))
            if log.scope.tenant is None
        ],
        "series": _series(log, jobs),
        "tiers": sorted(set(log.tiers)),
    }
    # As its JSON reads back (tuples as lists, ...): the report tools get is this one.
    out: dict[str, Any] = json.loads(canonical(report))
    return out


def _in_scope(log: IncidentLog, cluster: str | None = None, node: str | None = None) -> bool:
    s = log.scope
    if s.cluster is not None and cluster is not None and cluster != s.cluster:
        return False
    return not (s.node is not None and node is not None and node != s.node)


def _faults(log: IncidentLog) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cut: set[str] = set()
    for h in sorted(log.health, key=lambda h: (h["ts"], h["cluster_id"], h["seq"])):
        if not _in_scope(log, h["cluster_id"]):
            continue
        if h["event"] == "CLUSTER_DOWN" or (h["event"] == "HEALTH" and h["state"] == "UNHEALTHY"):
            silent = h.get("silent_ms") or 0
            if any(f["subject"] == h["cluster_id"] and f["detected_ms"] == h["ts"] for f in out):
                continue
            out.append(
                _fault(
                    "cluster_lost",
                    h["cluster_id"],
                    h["ts"] - silent,
                    f"last heard {silent / 1000:g} s before it was declared lost",
                    h["ts"],
                    f"cluster health fold: {h['reason']}",
                )
            )
        elif h["event"] == "PARTITION" and h.get("link_up") is False:
            # Each end reports a broken link: one fault per link, from its first report.
            link = " <-> ".join(sorted((h["cluster_id"], str(h.get("peer")))))
            if link in cut:
                continue
            cut.add(link)
            out.append(
                _fault(
                    "link_cut",
                    link,
                    h["ts"] - (h.get("silent_ms") or 0),
                    h["reason"],
                    h["ts"],
                    "cluster health fold (peers' reports)",
                )
            )
    seen_down: set[str] = set()
    for n in sorted(log.node_states, key=lambda n: (n["ts_ms"], n["node_id"], n.get("seq", 0))):
        node = n["node_id"]
        if n["state"] == "UP":
            seen_down.discard(node)
            continue
        if n["state"] != "DOWN" or node in seen_down or not _in_scope(log, n["cluster_id"], node):
            continue
        seen_down.add(node)
        detected, by = _detection(log, node, n["ts_ms"], ("node_silent", "node_down"))
        out.append(
            _fault("node_down", node, n["ts_ms"], n.get("reason") or "reported DOWN", detected, by)
        )
    for x in sorted(log.xids, key=lambda x: (x["first_ms"], x["node_id"], x["gpu_index"])):
        node = x["node_id"]
        if not _in_scope(log, x["cluster_id"], node):
            continue
        detected, by = _detection(log, node, x["first_ms"], ("gpu_failed", "xid"))
        out.append(
            _fault(
                "xid",
                f"{node}/{x['gpu_index']}",
                x["first_ms"],
                f"XID {x['xid']} in the GPU's telemetry",
                detected,
                by,
            )
        )
    return sorted(out, key=lambda f: (f["at_ms"], f["kind"], f["subject"]))


def _fault(
    kind: str, subject: str, at_ms: int, what: str, detected_ms: int | None, by: str | None
) -> dict[str, Any]:
    return {
        "kind": kind,
        "subject": subject,
        "at_ms": at_ms,
        "what": what,
        "detected_ms": detected_ms,
        "detected_by": by,
        "detection_s": None if detected_ms is None else round((detected_ms - at_ms) / 1000, 3),
    }


def _detection(
    log: IncidentLog, node: str, since_ms: int, rules: tuple[str, ...]
) -> tuple[int | None, str | None]:
    """When the fault on `node` was first acted on: a repair ticket a rule opened for it, or a
    decision that names it (moving a job off it), whichever came first."""
    found: list[tuple[int, str]] = []
    for t in log.tickets:
        if (
            t["node_id"] == node
            and t["opened_ms"] >= since_ms
            and t["state"] == "OPEN"
            and (t["rule"] in rules or not rules)
        ):
            found.append((t["opened_ms"], f"operations rule {t['rule']}: ticket {t['ticket_id']}"))
    for d in log.decisions:
        if d["ts_ms"] >= since_ms and node in d["reason"] and d["outcome"] == "PREEMPTED":
            found.append(
                (d["ts_ms"], f"scheduler decision {d['decision_id']}: {d['reason'][:160]}")
            )
    if not found:
        return None, None
    return min(found)


def _actions(log: IncidentLog) -> list[dict[str, Any]]:
    out = []
    for e in log.audit_events:
        op = e["operation"]
        if op.startswith(_READS) or not (log.from_ms <= e["ts"] <= log.to_ms):
            continue
        details = e.get("details") or {}
        if log.scope.job is not None and e["target"] != log.scope.job:
            continue
        if log.scope.tenant is not None and e.get("tenant") != log.scope.tenant:
            continue
        cluster = details.get("cluster_id") or details.get("clusters")
        if log.scope.cluster is not None and cluster and log.scope.cluster not in str(cluster):
            continue
        out.append(
            {
                "at_ms": e["ts"],
                "actor": e["actor"],
                "operation": op,
                "target": e["target"],
                "outcome": e["outcome"],
                "reason": details.get("reason") or details.get("detail") or "",
                "where": cluster or "",
                "event_id": e["event_id"],
            }
        )
    return sorted(out, key=lambda a: (a["at_ms"], a["event_id"]))


def _job_impacts(log: IncidentLog, faults: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each job that left a cluster or node in the window: every move (from one run to the
    next), what it redid, how long from the fault to running again, from which checkpoint;
    and the job's totals."""
    by_job: dict[str, list[Row]] = {}
    for w in sorted(log.workloads, key=lambda w: (w["ts_ms"], w["epoch"], w["attempt"])):
        by_job.setdefault(w["job"], []).append(w)
    out = []
    for job in sorted(by_job):
        if log.scope.job is not None and job != log.scope.job:
            continue
        if log.scope.tenant is not None and by_job[job][0]["tenant"] != log.scope.tenant:
            continue
        events = by_job[job]
        runs: list[tuple[int, str, int]] = []  # (epoch, cluster, its first RUNNING's ts)
        for w in events:
            if w["event"] == "RUNNING" and (not runs or runs[-1][0] != w["epoch"]):
                runs.append((w["epoch"], w["cluster_id"], w["ts_ms"]))
        if len(runs) < 2:
            continue
        if log.scope.cluster is not None and log.scope.cluster not in {c for _, c, _ in runs}:
            continue
        moves = [
            _move(log, job, events, faults, runs[i], runs[i + 1]) for i in range(len(runs) - 1)
        ]
        lost_s = sum(
            float(d.get("lost_gpu_s") or 0)
            for d in log.decisions
            if d["job"] == job and d["outcome"] == "PREEMPTED"
        )
        out.append(
            {
                "job": job,
                "ran_in": [c for _, c, _ in runs],
                "moves": moves,
                "steps_redone": sum(m["steps_redone"] or 0 for m in moves),
                "gpu_hours_lost": round(lost_s / 3600, 4),
                "fenced": sorted({w["cluster_id"] for w in events if w["event"] == "FENCED"}),
            }
        )
    return out


def _move(
    log: IncidentLog,
    job: str,
    events: Sequence[Row],
    faults: Sequence[Mapping[str, Any]],
    run: tuple[int, str, int],
    then: tuple[int, str, int],
) -> dict[str, Any]:
    (epoch, cluster, began), (next_epoch, next_cluster, ran_again) = run, then
    steps = [
        int(w["step"])
        for w in events
        if w["epoch"] == epoch and w["event"] == "PROGRESS" and w.get("step") is not None
    ]
    resumed = next(
        (w for w in events if w["event"] == "RESTORED" and w["epoch"] == next_epoch), None
    )
    # Why it moved: the scheduler's decision to move it, and the fault that decision answered
    # (its cluster lost; a node or GPU the decision names).
    decision = next(
        (
            d
            for d in sorted(log.decisions, key=lambda d: (d["ts_ms"], d["decision_id"]))
            if d["job"] == job and d["outcome"] == "PREEMPTED" and began <= d["ts_ms"] <= ran_again
        ),
        None,
    )
    fault = next(
        (
            f
            for f in faults
            if f["at_ms"] <= ran_again
            and (
                (f["kind"] == "cluster_lost" and f["subject"] == cluster and f["at_ms"] >= began)
                or (
                    f["kind"] in ("xid", "node_down")
                    and decision is not None
                    and f["subject"].split("/")[0] in decision["reason"]
                )
            )
        ),
        None,
    )
    cause_ms = fault["at_ms"] if fault is not None else decision["ts_ms"] if decision else None
    last = max(steps, default=None)
    at = int(resumed["step"]) if resumed is not None and resumed.get("step") is not None else 0
    return {
        "from": cluster,
        "to": next_cluster,
        "fault": None if fault is None else f"{fault['kind']} {fault['subject']}",
        "decision": None if decision is None else decision["reason"][:200],
        "last_step_before": last,
        "resumed_at_step": at,
        "steps_redone": None if last is None else max(last - at, 0),
        "recovery_s": None if cause_ms is None else round((ran_again - cause_ms) / 1000, 3),
        "checkpoint": None if resumed is None else resumed.get("checkpoint_uri"),
    }


def _services(log: IncidentLog) -> list[dict[str, Any]]:
    by: dict[str, list[Row]] = {}
    for s in log.services:
        if log.scope.service is not None and s["key"] != log.scope.service:
            continue
        if log.scope.tenant is not None and not s["key"].startswith(f"{log.scope.tenant}/"):
            continue
        by.setdefault(s["key"], []).append(s)
    out = []
    for key in sorted(by):
        loads = sorted(by[key], key=lambda s: s["ts"])
        requests = sum(int(s.get("requests") or 0) for s in loads)
        failed = sum(int(s.get("failed") or 0) for s in loads)
        p95 = sorted(float((s.get("latency_ms") or {}).get("p95") or 0) for s in loads)
        out.append(
            {
                "service": key,
                "requests": requests,
                "failed": failed,
                "p50_of_p95_ms": p95[len(p95) // 2] if p95 else None,
                "max_p95_ms": p95[-1] if p95 else None,
                "rate": [[s["ts"], int(s.get("requests") or 0)] for s in loads],
                "p95": [
                    [s["ts"], float((s.get("latency_ms") or {}).get("p95") or 0)] for s in loads
                ],
            }
        )
    return out


def _series(log: IncidentLog, jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    util: dict[str, list[list[float]]] = {}
    healthy: dict[str, list[list[float]]] = {}
    for u in sorted(log.utilisation, key=lambda u: (u["t_ms"], u["cluster_id"])):
        if not _in_scope(log, u["cluster_id"]):
            continue
        util.setdefault(u["cluster_id"], []).append([u["t_ms"], round(float(u["util"]), 2)])
        healthy.setdefault(u["cluster_id"], []).append([u["t_ms"], int(u["gpus"]) - int(u["bad"])])
    progress: dict[str, list[list[Any]]] = {}
    wanted = {j["job"] for j in jobs}
    for w in sorted(log.workloads, key=lambda w: (w["ts_ms"], w["epoch"])):
        if (
            w["job"] in wanted
            and w["event"] in ("PROGRESS", "RESTORED")
            and w.get("step") is not None
        ):
            progress.setdefault(w["job"], []).append([w["ts_ms"], int(w["step"]), w["cluster_id"]])
    health: dict[str, list[list[Any]]] = {}
    for h in sorted(log.health, key=lambda h: (h["ts"], h["seq"])):
        if h["event"] in ("HEALTH", "CLUSTER_DOWN") and _in_scope(log, h["cluster_id"]):
            health.setdefault(h["cluster_id"], []).append([h["ts"], h["state"]])
    return {"utilisation": util, "usable_gpus": healthy, "progress": progress, "health": health}


def _summary(
    log: IncidentLog,
    faults: Sequence[Mapping[str, Any]],
    jobs: Sequence[Mapping[str, Any]],
    actions: Sequence[Mapping[str, Any]],
) -> str:
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    said = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(kinds.items())) or "no faults"
    undetected = sum(1 for f in faults if f["detected_ms"] is None)
    audit = log.audit
    chain = (
        "the audit chain verified"
        if audit.get("ok")
        else f"the audit chain BROKEN ({audit.get('first_broken')})"
        if audit
        else "the audit chain not checked"
    )
    return (
        f"{said} in {log.scope.words()}"
        + (f" ({undetected} never detected)" if undetected else "")
        + f"; {len(actions)} actions followed; {len(jobs)} job(s) moved, "
        f"{sum(j['steps_redone'] or 0 for j in jobs)} steps redone, "
        f"{sum(j['gpu_hours_lost'] for j in jobs):.3f} GPU-hours lost; {chain}"
    )


def check(log: IncidentLog) -> None:
    """ConfigError, in one line, for a window the report could say nothing true of: no
    events at all, or a scope that names a cluster, job, node or service the window never
    saw."""
    seen_anything = any(
        (
            log.health,
            log.node_states,
            log.xids,
            log.tickets,
            log.decisions,
            log.workloads,
            log.audit_events,
            log.utilisation,
            log.services,
        )
    )
    if not seen_anything:
        raise ConfigError(
            f"no events between {log.from_ms} and {log.to_ms} (ms): nothing to report "
            "(is the window right, and are its tiers in place?)"
        )
    s = log.scope
    clusters = {
        str(r.get("cluster_id"))
        for rows in (log.node_states, log.xids, log.workloads, log.utilisation, log.health)
        for r in rows
    } | {c for d in log.decisions for c in d.get("clusters") or ()}
    if s.cluster is not None and s.cluster not in clusters:
        raise ConfigError(f"cluster {s.cluster!r} has no records in the window")
    jobs = {d["job"] for d in log.decisions} | {w["job"] for w in log.workloads}
    if s.job is not None and s.job not in jobs:
        raise ConfigError(f"job {s.job!r} has no decisions or workload events in the window")
    nodes = {
        str(r.get("node_id")) for rows in (log.node_states, log.xids, log.tickets) for r in rows
    }
    if s.node is not None and s.node not in nodes:
        raise ConfigError(f"node {s.node!r} has no records in the window")
    if s.service is not None and s.service not in jobs | {x["key"] for x in log.services}:
        raise ConfigError(f"service {s.service!r} has no records in the window")
