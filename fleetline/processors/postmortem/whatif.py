"""What another policy or fleet would have done: the recorded request log folded twice in
lockstep, once as it was (the baseline, which `replay --decisions` checks against the log byte
for byte) and once with one change, and the two compared decision by decision and in the
numbers that matter (queue wait per tenant and priority, GPU-hours, utilisation, preemptions,
deadline misses, energy cost).

The changes: `policy=FILE` (every POLICY request, and the start, take the file's policy);
`without-cluster=C` (C is gone from every observation); `add-gpus=C:N` (C has N more GPUs, as
nodes like its first); `quota=TENANT:N` (the tenant's GPU quota is N).

What depends on the future comes from the log where the job ran as it did in the log: a
cluster agent's report reaches the changed scheduler only while the job is ordered to the same
cluster, epoch and attempt there as in the baseline. Where it ran elsewhere or at another time
its reports come from a stated model: running as soon as it is ordered to run, and ending (as
it ended in the log, with the same exit code) as long after that as its logged run lasted; a
job that never ended in the log does not end. Each job's outcome says which it came from.

Pure: no clock, no I/O; the shell reads the log and the views (decision_replay.py).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleetline.errors import ConfigError, FleetlineError
from fleetline.identity.writers import Writer, WriterKind
from fleetline.processors.scheduling.capacity import FleetFacts
from fleetline.processors.scheduling.codec import canonical_json, order_report
from fleetline.processors.scheduling.effects import Decision, WorkloadOrder
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.specs import TrainingJobSpec
from fleetline.processors.scheduling.state import Job
from fleetline.processors.scheduling.tenancy import TenantPolicy

CHANGES = ("policy", "without-cluster", "add-gpus", "quota")
# The stated power model for energy cost: a GPU held draws this much (W), times its cluster's
# PUE, at its cluster's price per kWh.
GPU_WATTS = 700.0


@dataclass(frozen=True)
class Change:
    """One change to the fleet or the policy; `none()` changes nothing."""

    kind: str = "none"
    cluster: str | None = None
    gpus: int = 0
    tenant: str | None = None
    policy: SchedulingPolicy | None = None
    said: str = "nothing changed"

    @classmethod
    def none(cls) -> Change:
        return cls()

    @classmethod
    def parse(cls, text: str, policy_data: Mapping[str, Any] | None = None) -> Change:
        """`policy=FILE` (its data read by the shell and given here), `without-cluster=C`,
        `add-gpus=C:N`, `quota=TENANT:N`; ConfigError in one line otherwise."""
        kind, sep, value = text.partition("=")
        if not sep or kind not in CHANGES or not value:
            raise ConfigError(
                f"--what-if {text!r}: expected one of policy=FILE, without-cluster=C, "
                "add-gpus=C:N, quota=TENANT:N"
            )
        if kind == "policy":
            if policy_data is None:
                raise ConfigError(f"--what-if {text!r}: the policy file was not read")
            try:
                policy = SchedulingPolicy.from_data(policy_data)
            except ConfigError as exc:
                raise ConfigError(f"--what-if policy file {value}: {exc}") from None
            return cls("policy", policy=policy, said=f"policy from {value}")
        if kind == "without-cluster":
            return cls("without-cluster", cluster=value, said=f"without cluster {value}")
        name, sep, number = value.rpartition(":")
        if not sep or not name or not number.isdigit():
            raise ConfigError(f"--what-if {text!r}: expected {kind}=NAME:N, N a whole number")
        if kind == "add-gpus":
            if int(number) == 0:
                raise ConfigError(f"--what-if {text!r}: add at least one GPU")
            return cls(
                "add-gpus", cluster=name, gpus=int(number), said=f"{number} more GPUs in {name}"
            )
        return cls(
            "quota", tenant=name, gpus=int(number), said=f"tenant {name} quota {number} GPUs"
        )

    def facts(self, facts: FleetFacts) -> FleetFacts:
        """The observation as the changed fleet would have made it."""
        if self.kind == "without-cluster":
            return replace(
                facts,
                nodes={n: f for n, f in facts.nodes.items() if f.cluster_id != self.cluster},
                lost={
                    n: g
                    for n, g in facts.lost.items()
                    if (seen := facts.nodes.get(n)) is None or seen.cluster_id != self.cluster
                },
                clusters={c: f for c, f in facts.clusters.items() if c != self.cluster},
                memo={},
                node_cache={},
                summary_cache={},
            )
        if self.kind == "add-gpus":
            like = next(
                (f for _, f in sorted(facts.nodes.items()) if f.cluster_id == self.cluster), None
            )
            if like is None:
                return facts
            per_node = like.present.bit_count() or 1
            added = {}
            for i in range(-(-self.gpus // per_node)):
                # Like the cluster's first node: its GPUs and NVLink islands (the last node
                # added may have fewer, the lowest of them).
                gpus = min(per_node, self.gpus - i * per_node)
                mask = like.present
                while mask.bit_count() > gpus:
                    mask &= ~(1 << (mask.bit_length() - 1))
                node = f"{self.cluster}-what-if-{i:04d}"
                added[node] = replace(
                    like,
                    node_id=node,
                    leaf=f"{self.cluster}-what-if-leaf",
                    present=mask,
                    healthy=mask,
                    degraded=0,
                    islands=tuple(isle & mask for isle in like.islands if isle & mask),
                    status="UP",
                    schedulable=True,
                )
            return replace(
                facts, nodes={**facts.nodes, **added}, memo={}, node_cache={}, summary_cache={}
            )
        return facts

    def request(self, request: Mapping[str, Any]) -> Mapping[str, Any]:
        """The request as the changed log would hold it."""
        if self.kind == "policy" and request["kind"] == "POLICY" and self.policy is not None:
            return {**request, "spec_json": canonical_json(self.policy.as_data())}
        if self.kind == "quota" and request["kind"] == "TENANT_POLICY":
            data = json.loads(request["spec_json"] or "null")
            if isinstance(data, dict) and data.get("tenant") == self.tenant:
                quota = {**(data.get("quota") or {}), "gpus": self.gpus}
                return {**request, "spec_json": canonical_json({**data, "quota": quota})}
        return request

    def start(self, scheduler: Scheduler) -> None:
        """What the change sets before the first request."""
        if self.kind == "quota" and self.tenant is not None:
            scheduler.tenants[self.tenant] = TenantPolicy.from_data(
                {"tenant": self.tenant, "quota": {"gpus": self.gpus}}
            )


@dataclass(frozen=True)
class Ran:
    """How a job's run ended in the log: how long after it was reported running, how."""

    duration_ms: int
    phase: str  # SUCCEEDED or FAILED
    exit_code: int | None = None


def logged_runs(requests: Sequence[Mapping[str, Any]]) -> dict[str, Ran]:
    """Each job's last run that ended, from the cluster agents' reports in the log."""
    started: dict[tuple[str, Any], int] = {}
    out: dict[str, Ran] = {}
    for r in requests:
        if r["kind"] != "PROGRESS":
            continue
        key = (r["key"], r.get("epoch"))
        phase = r.get("phase")
        if phase == "RUNNING":
            started.setdefault(key, r["ts"])
        elif phase in ("SUCCEEDED", "FAILED") and key in started:
            out[r["key"]] = Ran(r["ts"] - started[key], phase, r.get("exit_code"))
    return out


@dataclass
class Side:
    """One of the two folds and what it is measured by."""

    scheduler: Scheduler
    decisions: list[Decision] = field(default_factory=list)
    submitted: dict[str, int] = field(default_factory=dict)
    placed: dict[str, int] = field(default_factory=dict)
    ended: dict[str, int] = field(default_factory=dict)
    gpu_ms: float = 0.0
    energy_cost: float = 0.0
    last_ms: int | None = None
    gpus_seen: int = 0

    def held(self) -> dict[str, int]:
        """GPUs held now, per cluster that holds any."""
        out = {}
        for cluster, by in self.scheduler.priority_gpus.items():
            if gpus := sum(by.values()):
                out[cluster] = gpus
        return out

    def advance(self, to_ms: int, lo: int, hi: int) -> None:
        """Integrate what was held from the last moment to `to_ms`, inside [lo, hi]."""
        if self.last_ms is not None:
            a, b = max(self.last_ms, lo), min(to_ms, hi)
            if b > a:
                clusters = self.scheduler.facts.clusters
                for cluster, gpus in self.held().items():
                    self.gpu_ms += gpus * (b - a)
                    c = clusters.get(cluster)
                    if c is not None:
                        kwh = gpus * GPU_WATTS / 1000 * (b - a) / 3_600_000 * (c.pue or 1.0)
                        self.energy_cost += kwh * c.energy_price_per_kwh
        self.last_ms = to_ms if self.last_ms is None else max(self.last_ms, to_ms)


class WhatIf:
    """The lockstep fold: `step` each logged request, then `report`."""

    def __init__(
        self,
        change: Change,
        runs: Mapping[str, Ran],
        from_ms: int | None = None,
        to_ms: int | None = None,
    ) -> None:
        self.change = change
        self.runs = runs
        self.from_ms = from_ms if from_ms is not None else -(2**62)
        self.to_ms = to_ms if to_ms is not None else 2**62
        self.base = Side(Scheduler())
        self.changed = Side(Scheduler(change.policy))
        change.start(self.changed.scheduler)
        # Modelled reports not yet due: (due, n, request, cluster).
        self.pending: list[tuple[int, int, dict[str, Any], str]] = []
        self.modelled: set[str] = set()
        self.reports_from_log: set[str] = set()
        self.reports_dropped = 0
        self.requests = 0
        self._n = 0

    def step(
        self,
        request: Mapping[str, Any],
        position: int,
        writer: Writer,
        facts: FleetFacts | None,
    ) -> None:
        self.requests += 1
        self._deliver_due(request["ts"], position)
        deliver = True
        if request["kind"] == "PROGRESS" and not writer.is_control_plane:
            # Judged before the baseline folds it (a report that ends a run changes the order).
            key = request["key"]
            if (
                _order(self.base.scheduler.jobs.get(key))
                == _order(self.changed.scheduler.jobs.get(key))
                and key not in self.modelled
            ):
                self.reports_from_log.add(key)
            else:
                deliver = False
                self.reports_dropped += 1
        base_effects = self._fold(self.base, request, position, writer, facts)
        changed_request = self.change.request(request)
        if deliver:
            changed_facts = self.change.facts(facts) if facts is not None else None
            effects = self._fold(self.changed, changed_request, position, writer, changed_facts)
            self._model(effects, base_effects, position)

    def _fold(
        self,
        side: Side,
        request: Mapping[str, Any],
        position: int,
        writer: Writer,
        facts: FleetFacts | None,
    ) -> list[Any]:
        # What was held until this request is held up to its time: only the control plane's
        # requests move the scheduler's clock, to their own time (Scheduler.step).
        clock = side.scheduler.now_ms
        side.advance(
            max(clock, request["ts"]) if writer.is_control_plane else clock,
            self.from_ms,
            self.to_ms,
        )
        try:
            effects = side.scheduler.step(request, position, facts, writer)
        except FleetlineError:
            return []  # the live loop dead-lettered it (the baseline's replay says so)
        if facts is not None:
            side.gpus_seen = sum(
                (n.healthy | n.degraded).bit_count() for n in side.scheduler.facts.nodes.values()
            )
        if request["kind"] == "SUBMIT" and writer.is_control_plane:
            side.submitted.setdefault(request["key"], request["ts"])
        if request["kind"] == "PROGRESS" and request.get("phase") in ("SUCCEEDED", "FAILED"):
            side.ended.setdefault(request["key"], request["ts"])
        for e in effects:
            if isinstance(e, Decision):
                side.decisions.append(e)
                if e.outcome == "PLACED":
                    side.placed.setdefault(e.job, e.ts)
        return effects

    def _model(self, effects: Sequence[Any], base_effects: Sequence[Any], position: int) -> None:
        """Reports for runs the changed scheduler ordered otherwise than the baseline."""
        base_orders = {
            (o.job, o.cluster_id, o.epoch, o.attempt)
            for o in base_effects
            if isinstance(o, WorkloadOrder) and o.action == "RUN"
        }
        for order in effects:
            if not isinstance(order, WorkloadOrder) or order.action != "RUN":
                continue
            same = (order.job, order.cluster_id, order.epoch, order.attempt) in base_orders
            base_job = self.base.scheduler.jobs.get(order.job)
            if same or (
                _order(base_job) == (order.cluster_id, order.epoch, order.attempt)
                and order.job not in self.modelled
            ):
                continue
            self.modelled.add(order.job)
            self._queue(order, "RUNNING", order.ts, None)
            ran = self.runs.get(order.job)
            if ran is not None:
                self._queue(order, ran.phase, order.ts + ran.duration_ms, ran.exit_code)
        self._deliver_due(None, position)

    def _queue(self, order: WorkloadOrder, phase: str, due: int, code: int | None) -> None:
        request = order_report(
            order, phase, due, f"what-if-{order.job}-{order.epoch}-{order.attempt}-{phase}", code
        )
        self._n += 1
        heapq.heappush(self.pending, (due, self._n, request, order.cluster_id))

    def _deliver_due(self, before_ms: int | None, position: int) -> None:
        """Modelled reports due by `before_ms` (None: those due now, at the changed clock)."""
        limit = self.changed.scheduler.now_ms if before_ms is None else before_ms
        while self.pending and self.pending[0][0] <= limit:
            _, _, request, cluster = heapq.heappop(self.pending)
            writer = Writer(WriterKind.CLUSTER, cluster)
            self._fold(self.changed, request, position, writer, None)

    def report(self, logged: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The per-decision diff and the deltas. `logged`: the log's decision records, to
        say whether the baseline made exactly them."""
        diff = _diff(self.base.decisions, self.changed.decisions, self.from_ms, self.to_ms)
        out: dict[str, Any] = {
            "change": self.change.said,
            "requests": self.requests,
            "decisions": {
                "baseline": len(self.base.decisions),
                "what_if": len(self.changed.decisions),
            },
            "differences": len(diff),
            "diff": diff[:500],
            "numbers": {
                "baseline": _numbers(self.base, self.from_ms, self.to_ms),
                "what_if": _numbers(self.changed, self.from_ms, self.to_ms),
            },
            "outcomes": {
                "from_the_log": sorted(self.reports_from_log - self.modelled),
                "from_the_model": sorted(self.modelled),
                "model": (
                    "a job ordered otherwise than in the log runs as soon as it is ordered and "
                    "ends as its logged run ended, as long after; one that never ended in the "
                    "log does not end"
                ),
                "reports_not_delivered": self.reports_dropped,
            },
        }
        if logged is not None:
            mine = [_said(d) for d in self.base.decisions]
            theirs = [
                (
                    d["job"],
                    d["outcome"],
                    ",".join(p["cluster_id"] for p in d.get("placements") or []),
                )
                for d in logged
            ]
            out["baseline_matches_log"] = mine == theirs
        base, what = out["numbers"]["baseline"], out["numbers"]["what_if"]
        out["deltas"] = {
            k: round(what[k] - base[k], 4)
            for k in sorted(base)
            if isinstance(base[k], int | float) and isinstance(what.get(k), int | float)
        }
        said: dict[str, Any] = json.loads(json.dumps(out, sort_keys=True))
        return said


def _order(job: Job | None) -> tuple[str | None, int, int] | None:
    if job is None:
        return None
    return (job.ordered_cluster, job.epoch, job.attempt)


def _said(d: Decision) -> tuple[str, str, str]:
    return (d.job, str(d.outcome), ",".join(p.cluster_id for p in d.placements))


def _diff(
    base: Sequence[Decision], changed: Sequence[Decision], lo: int, hi: int
) -> list[dict[str, Any]]:
    """Each job's decisions in the window, aligned in order: every pair that differs in
    outcome or place, and every decision one side made that the other did not."""
    by_job: dict[str, tuple[list[Decision], list[Decision]]] = {}
    for d in base:
        if lo <= d.ts <= hi:
            by_job.setdefault(d.job, ([], []))[0].append(d)
    for d in changed:
        if lo <= d.ts <= hi:
            by_job.setdefault(d.job, ([], []))[1].append(d)
    out = []
    for job in sorted(by_job):
        mine, theirs = by_job[job]
        for i in range(max(len(mine), len(theirs))):
            a = mine[i] if i < len(mine) else None
            b = theirs[i] if i < len(theirs) else None
            if a is not None and b is not None and _said(a) == _said(b):
                continue
            out.append(
                {
                    "job": job,
                    "n": i,
                    "logged": None if a is None else _words(a),
                    "what_if": None if b is None else _words(b),
                }
            )
    return out


def _words(d: Decision) -> dict[str, Any]:
    return {
        "outcome": str(d.outcome),
        "where": ",".join(p.cluster_id for p in d.placements),
        "ts": d.ts,
        "reason": d.reason[:200],
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _numbers(side: Side, lo: int, hi: int) -> dict[str, Any]:
    s = side.scheduler
    end = min(s.now_ms, hi)
    waits: dict[str, list[float]] = {}
    never = 0
    for key, submitted in side.submitted.items():
        if not lo <= submitted <= hi:
            continue
        job = s.jobs.get(key)
        if job is None or job.is_service:
            continue
        placed = side.placed.get(key)
        if placed is None:
            never += 1
        wait = ((placed if placed is not None else end) - submitted) / 1000
        for group in (f"tenant {job.tenant}", f"priority {job.priority}"):
            waits.setdefault(group, []).append(wait)
    misses = 0
    for key, job in s.jobs.items():
        spec = job.spec if job.kind == "TrainingJob" else None
        if not isinstance(spec, TrainingJobSpec):
            continue
        deadline = spec.work.deadline_ms(job.submitted_ms) if spec.work is not None else None
        if deadline is None or not lo <= deadline <= hi:
            continue
        ended = side.ended.get(key)
        if ended is None or ended > deadline:
            misses += 1
    span_h = max(end - max(lo, min(side.submitted.values(), default=end)), 1) / 3_600_000
    gpu_hours = side.gpu_ms / 3_600_000
    out: dict[str, Any] = {
        "gpu_hours": round(gpu_hours, 4),
        "utilisation": round(gpu_hours / (side.gpus_seen * span_h), 4) if side.gpus_seen else 0.0,
        "preemptions": sum(
            1 for d in side.decisions if d.outcome == "PREEMPTED" and lo <= d.ts <= hi
        ),
        "preempted_by_priority": sum(
            1
            for d in side.decisions
            if d.outcome == "PREEMPTED" and d.preempted_by and lo <= d.ts <= hi
        ),
        "deadline_misses": misses,
        "energy_cost": round(side.energy_cost, 4),
        "never_placed": never,
        "placed": sum(1 for k, t in side.placed.items() if lo <= t <= hi),
    }
    for group, values in sorted(waits.items()):
        out[f"queue_wait_p50_s {group}"] = round(_percentile(values, 0.5) or 0.0, 3)
        out[f"queue_wait_p95_s {group}"] = round(_percentile(values, 0.95) or 0.0, 3)
    return out
