"""Effective training time ratio: a simulated week of one 16,384-GPU training job at the
interruption rates Meta published for Llama 3, through fleetline's view fold, health policy,
scheduler and checkpoint tuning.

The rates: 466 interruptions in 54 days of Llama 3 405B pre-training on 16,384 H100s (47
planned, 419 unexpected, by cause: "The Llama 3 Herd of Models", 2024, table 5). Each cause
reaches fleetline as it would on a real fleet: a GPU fault as the XID its driver raises (the
view's health policy fails the GPU), a host, NIC or switch fault as a node that stops reporting
(unreachable after the policy's silence), a software fault as the workload's non-zero exit (the
agent's FAILED report: retried in place), planned maintenance as a FENCE (the job checkpoints on
its way out). The job runs on 2,048 nodes of 8 GPUs with `--spare-nodes` more; a fault's node
is one of the job's, drawn when it happens; nothing is repaired within the week.

The time model, in event time: after each placement (or retry) the job restarts for
`--restart-s` (process start, checkpoint load, warm-up), then computes, stalling `--checkpoint-s`
for each checkpoint. A fault costs its detection (the telemetry interval and the scheduler's
tick for an XID, the health policy's silence for a node, none for an exit), the scheduler's
decision (its real step, timed), the restart, and the work since the checkpoint the scheduler
resumes the job from (its decision's `resume_from_checkpoint_ms`, checked against the
checkpoints the job reported). The same week of faults runs twice: at a fixed interval
(`--fixed-interval-min`) and at the interval fleetline's tuning recommends (Daly's, from the
job's failure rate and checkpoint cost). ETTR = productive compute / wall time.

    .venv/bin/python benchmarks/ettr.py [--days 7] [--seed 3] [--checkpoint-s 10]
        [--restart-s 60] [--fixed-interval-min 30] [--spare-nodes 64]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import fold_telemetry_records, report

from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator, cluster_info
from fleetline.processors.operations.tuning import checkpoint_interval
from fleetline.processors.scheduling.capacity import FleetFacts, observe
from fleetline.processors.scheduling.codec import new_request, submit_request
from fleetline.processors.scheduling.effects import Decision, Effect, WorkloadOrder
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.view.fold import apply
from fleetline.processors.view.model import HealthPolicy, ResourceView
from fleetline.streams.serde import default_codec

BASE_MS = 1_796_000_000_000
CLUSTER = "llama"
WORKERS = 2_048  # x 8 GPUs = 16,384
STUDY_DAYS = 54
# (cause, interruptions in the 54 days, how it reaches fleetline, the XID a GPU fault raises)
CAUSES: tuple[tuple[str, int, str, int], ...] = (
    ("faulty GPU", 148, "xid", 79),
    ("GPU HBM3 memory", 72, "xid", 48),
    ("software bug", 54, "exit", 0),
    ("network switch or cable", 35, "node", 0),
    ("host maintenance", 32, "node", 0),
    ("GPU SRAM memory", 19, "xid", 95),
    ("GPU system processor", 17, "xid", 119),
    ("NIC", 7, "node", 0),
    ("NCCL watchdog timeout", 7, "exit", 0),
    ("silent data corruption", 6, "exit", 0),
    ("GPU thermal interface and sensor", 6, "xid", 79),
    ("SSD", 3, "node", 0),
    ("power supply", 3, "node", 0),
    ("server chassis", 2, "node", 0),
    ("IO expansion board", 2, "node", 0),
    ("dependency", 2, "exit", 0),
    ("CPU", 2, "node", 0),
    ("system memory", 2, "node", 0),
    ("planned maintenance", 47, "drain", 0),
)
TELEMETRY_INTERVAL_S = 1.0  # the node agents' interval
TICK_S = 1.0  # the scheduler's ticker


@dataclass(frozen=True)
class Interruption:
    at_s: float  # from the start of the week
    cause: str
    how: str
    xid: int


def week_of_faults(days: float, seed: int) -> list[Interruption]:
    """Each cause a Poisson process at its published rate, over `days`."""
    rng = random.Random(seed)
    out = []
    horizon = days * 86_400
    for cause, count, how, xid in CAUSES:
        rate = count / (STUDY_DAYS * 86_400)
        t = rng.expovariate(rate)
        while t < horizon:
            out.append(Interruption(t, cause, how, xid))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda i: i.at_s)


@dataclass
class Week:
    """One week of the job under one checkpoint interval: the scheduler, the fleet, and the
    job's own clock of compute."""

    interval_s: float
    checkpoint_s: float
    restart_s: float
    nodes: int
    seed: int
    policy: HealthPolicy = field(default_factory=HealthPolicy)

    def __post_init__(self) -> None:
        spec = ClusterSpec(CLUSTER, "us-east", self.nodes, nodes_per_leaf=32)
        self.sim = FleetSimulator([spec], seed=1)
        self.codec = default_codec()
        self.view = ResourceView()
        self._fold("ClusterInfo", cluster_info(spec, 1, BASE_MS, ["us-east"]))
        for record in self.sim.initial_states(BASE_MS):
            self._fold("NodeState", record)
        self.facts: FleetFacts | None = None
        self.scheduler = Scheduler()
        self.position = 0
        self.rng = random.Random(self.seed)
        self.lost: dict[str, float] = {}  # cause -> seconds lost
        self.decision_s: list[float] = []
        self.downtime_s: list[float] = []  # fault -> the job ordered to run again
        self.mismatches = 0
        # The job's compute: saved (as of its last checkpoint) and where its current run began.
        self.saved_s = 0.0
        self.segment_start: float | None = None  # wall time its current run began (restart first)
        self.order: WorkloadOrder | None = None

    def _fold(self, kind: str, record: Any) -> None:
        apply(self.view, self.codec.decode(self.codec.encode(kind, record)))

    def _observe(self, at_s: float) -> FleetFacts:
        ts = BASE_MS + int(at_s * 1000)
        for record in self.sim.state_changes(ts):
            self._fold("NodeState", record)
        fold_telemetry_records(self.view, self.sim.telemetry(ts))
        self.facts = observe(self.view, self.facts)
        return self.facts

    def _step(self, request: dict[str, Any], facts: FleetFacts | None = None) -> list[Effect]:
        self.position += 1
        began = time.perf_counter()
        effects = self.scheduler.step(request, self.position, facts)
        self.decision_s.append(time.perf_counter() - began)
        for effect in effects:
            if isinstance(effect, WorkloadOrder) and effect.action == "RUN":
                self.order = effect
        return effects

    def _tick(self, at_s: float) -> list[Effect]:
        facts = self._observe(at_s)
        ts = BASE_MS + int(at_s * 1000)
        tick = new_request("TICK", "", "", ts, f"t{self.position}", view_offsets=facts.offsets)
        return self._step(tick, facts)

    def _report(self, at_s: float, phase: str, **fields: Any) -> list[Effect]:
        assert self.order is not None
        return self._step(
            new_request(
                "PROGRESS",
                self.order.job,
                self.order.tenant,
                BASE_MS + int(at_s * 1000),
                f"r{self.position}",
                phase=phase,
                cluster_id=self.order.cluster_id,
                epoch=self.order.epoch,
                attempt=self.order.attempt,
                **fields,
            )
        )

    # -- the job's compute clock --------------------------------------------------------------

    def _progress(self, at_s: float) -> tuple[float, float, float | None]:
        """At `at_s`: (compute saved, compute since that checkpoint, wall time of the last
        completed checkpoint of this run or None)."""
        if self.segment_start is None:
            return self.saved_s, 0.0, None
        elapsed = at_s - self.segment_start - self.restart_s
        if elapsed <= 0:
            return self.saved_s, 0.0, None
        cycle = self.interval_s + self.checkpoint_s
        done = int(elapsed // cycle)
        rest = elapsed - done * cycle
        unsaved = min(rest, self.interval_s)
        last = self.segment_start + self.restart_s + done * cycle if done else None
        return self.saved_s + done * self.interval_s, unsaved, last

    def _running(self, at_s: float) -> None:
        """A RUN order came: the job restarts now and reports running."""
        self.segment_start = at_s
        self._report(at_s, "RUNNING")

    # -- the week -------------------------------------------------------------------------------

    def run(self, faults: Sequence[Interruption], days: float) -> dict[str, Any]:
        horizon = days * 86_400
        self._tick(0.0)
        doc = {
            "apiVersion": "fleetline/v1",
            "kind": "TrainingJob",
            "metadata": {"name": "llama", "tenant": "research"},
            "spec": {
                "accelerator": "H100",
                "gpus_per_worker": 8,
                "workers": WORKERS,
                "parallelism": {"tensor": 8, "pipeline": 1, "data": WORKERS},
                "communication": "heavy",
                "priority_class": "critical",
                "checkpoint_interval_s": max(1, round(self.interval_s)),
                "retry": {"max_attempts": 1_000, "backoff_s": 1},
            },
        }
        self._step(submit_request(parse_spec(doc), doc, BASE_MS, "submit"))
        if self.order is None:
            raise SystemExit("the job was not placed at the start of the week")
        self._running(0.0)
        for fault in faults:
            self._interrupt(fault)
        saved, unsaved, _ = self._progress(horizon)
        productive = saved + unsaved
        return {
            "ettr": round(productive / horizon, 4),
            "productive_h": round(productive / 3600, 2),
            "checkpoint_stall_h": round(self._stalls(horizon) / 3600, 2),
            "lost_h_by_cause": {c: round(s / 3600, 3) for c, s in sorted(self.lost.items())},
            "lost_h": round(sum(self.lost.values()) / 3600, 2),
            "decision_ms_max": round(max(self.decision_s) * 1000, 1),
            # Detection (the health policy's), the retry's backoff, the scheduler's decision.
            "fault_to_order_s_mean": round(sum(self.downtime_s) / len(self.downtime_s), 2)
            if self.downtime_s
            else None,
            "resume_mismatches": self.mismatches,
        }

    def _stalls(self, horizon: float) -> float:
        """Checkpoint stalls: the wall time not computing what was kept, not lost to a fault,
        not the first start."""
        saved, unsaved, _ = self._progress(horizon)
        return max(0.0, horizon - saved - unsaved - sum(self.lost.values()) - self.restart_s)

    def _interrupt(self, fault: Interruption) -> None:
        t = fault.at_s
        saved, unsaved, last = self._progress(t)
        assert self.order is not None
        if last is not None:  # the agent reported each checkpoint; the last one is what counts
            self._report(last, "CHECKPOINT", checkpoint_ms=BASE_MS + int(last * 1000))
        job_nodes = sorted({n for n, _ in self.order.workers})
        node = self.rng.choice(job_nodes)
        if fault.how == "exit":
            detected = t
            lost_work = unsaved
            self._report(t, "FAILED", exit_code=1)
            # The retry comes due after the spec's backoff: the next tick orders it.
            effects: list[Effect] = []
            at = t
            while not any(isinstance(e, WorkloadOrder) and e.action == "RUN" for e in effects):
                at += TICK_S
                effects = self._tick(at)
            resumed_at = at
        else:
            if fault.how == "xid":
                gpu = self.rng.randrange(8)
                self.sim.add_fault(
                    Fault("xid", f"{node}/{gpu}", BASE_MS + int(t * 1000), None, fault.xid)
                )
                detected = t + TELEMETRY_INTERVAL_S + TICK_S
            elif fault.how == "node":
                self.sim.add_fault(Fault("node_down", node, BASE_MS + int(t * 1000), None))
                detected = t + self.policy.unreachable_after_ms / 1000 + TICK_S
            else:
                detected = t
            if fault.how == "drain":
                # Planned: the job checkpoints on its way out (one more stall), nothing is lost.
                self.saved_s, lost_work = saved + unsaved, 0.0
                ts = BASE_MS + int(t * 1000)
                effects = self._step(
                    new_request("FENCE", node, "", ts, f"f{self.position}", detail="maintenance")
                )
                detected = t + self.checkpoint_s
                effects += self._tick(detected)
            else:
                lost_work = unsaved
                effects = self._tick(detected)
            preempted = [e for e in effects if isinstance(e, Decision) and e.outcome == "PREEMPTED"]
            if not preempted:
                raise SystemExit(f"{fault.cause} on {node} at {t:.0f} s: the job was not moved")
            if fault.how != "drain" and last is not None:
                # The scheduler's resume point: the checkpoint the job last reported.
                self.mismatches += preempted[0].resume_from_checkpoint_ms != BASE_MS + int(
                    last * 1000
                )
            resumed_at = detected
            if not any(isinstance(e, WorkloadOrder) and e.action == "RUN" for e in effects):
                # No room: it would wait in the queue for capacity, none of which comes back
                # this week (give it more spare nodes).
                raise SystemExit(f"{fault.cause} at {t:.0f} s: no room left to resume the job")
        if fault.how != "drain":
            self.saved_s = saved
        self.downtime_s.append(resumed_at - t)
        cost = (resumed_at - t) + lost_work + self.restart_s
        self.lost[fault.cause] = self.lost.get(fault.cause, 0.0) + cost
        self._running(resumed_at)


def tuned_interval(checkpoint_s: float, days_of_history: float = STUDY_DAYS) -> tuple[float, str]:
    """The interval fleetline's tuning recommends for the job: its GPUs' failure rate as the
    study measured it, its checkpoint cost."""
    failures = sum(count for _, count, how, _ in CAUSES if how != "drain")
    gpu_hours = WORKERS * 8 * days_of_history * 24
    rec = checkpoint_interval("llama", WORKERS * 8, None, failures, gpu_hours, [checkpoint_s])
    assert rec is not None
    return rec.recommended, rec.summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--checkpoint-s", type=float, default=10.0, help="a checkpoint's stall")
    parser.add_argument("--restart-s", type=float, default=60.0, help="start to computing again")
    parser.add_argument("--fixed-interval-min", type=float, default=30.0)
    parser.add_argument("--spare-nodes", type=int, default=64)
    args = parser.parse_args()
    faults = week_of_faults(args.days, args.seed)
    interval, why = tuned_interval(args.checkpoint_s)
    out: dict[str, Any] = {
        "gpus": WORKERS * 8,
        "spare_gpus": args.spare_nodes * 8,
        "days": args.days,
        "interruptions": len(faults),
        "interruptions_by_kind": {
            how: sum(1 for f in faults if f.how == how) for how in ("xid", "node", "exit", "drain")
        },
        "checkpoint_stall_s": args.checkpoint_s,
        "restart_s": args.restart_s,
        "tuned_interval_min": round(interval / 60, 1),
        "tuned_because": why,
    }
    for name, seconds in (("fixed", args.fixed_interval_min * 60), ("tuned", interval)):
        nodes = WORKERS + args.spare_nodes
        week = Week(seconds, args.checkpoint_s, args.restart_s, nodes, args.seed)
        began = time.perf_counter()
        figures = week.run(faults, args.days)
        figures["simulated_in_s"] = round(time.perf_counter() - began, 1)
        out.update({f"{name}_{k}": v for k, v in figures.items()})
    out["ettr_target"] = ">= 0.98 (ByteRobust reports 0.97)"
    report("ettr", out)


if __name__ == "__main__":
    main()
