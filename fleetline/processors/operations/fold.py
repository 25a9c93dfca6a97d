"""Automated operations as a fold of the operations log: repair tickets and power caps.

Each event on `<prefix>.ops` (one partition, one total order) is folded by `OpsFold.step`
into the fold's state and a list of effects: node commands (CORDON, UNCORDON, SET_POWER_CAP)
for the node agents, FENCE / UNFENCE requests for the scheduler (no placement there; drain what
runs through a checkpoint), ticket changes and audit records. It reads no clock: time is the
events' time, and what the fleet looked like is in the OBSERVE events themselves.

A ticket's life: a finding on a node with no ticket opens one (OPEN: cordon, fence), or
ESCALATED straight away when the node failed again within `refail_window_ms` of coming back
or tripped `flap_limit` times within `flap_window_ms` (flapping is damped: it stays out until a
person looks). An operator moves it IN_REPAIR, then REPAIRED, which starts the burn-in
(VERIFYING): the node must be observed for `burn_in_ms` with no finding at all. Then the ticket
is CLOSED and the node returned (UNCORDON, UNFENCE); a finding during the burn-in sends it
back IN_REPAIR with that evidence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.processors.operations.rules import Finding, settings_from

EVIDENCE_KEPT = 20  # findings kept on a ticket (the first ones and the latest)


class TicketState(StrEnum):
    OPEN = "OPEN"
    IN_REPAIR = "IN_REPAIR"
    VERIFYING = "VERIFYING"
    CLOSED = "CLOSED"
    ESCALATED = "ESCALATED"


ACTIVE = (TicketState.OPEN, TicketState.IN_REPAIR, TicketState.VERIFYING, TicketState.ESCALATED)
# What an operator may ask, from which states. REPAIRED starts the burn-in.
OPERATOR_MOVES: dict[str, tuple[TicketState, ...]] = {
    "IN_REPAIR": (TicketState.OPEN, TicketState.ESCALATED),
    "REPAIRED": (TicketState.OPEN, TicketState.IN_REPAIR, TicketState.ESCALATED),
    "ESCALATED": (TicketState.OPEN, TicketState.IN_REPAIR, TicketState.VERIFYING),
}


def check_move(ticket_id: str, state: str, move: str) -> None:
    """Refuse an operator's move the ticket's state does not allow, saying which would."""
    allowed = OPERATOR_MOVES.get(move)
    if allowed is None:
        raise InvalidEventError(
            f"ticket {ticket_id}: {move!r} is not one of {sorted(OPERATOR_MOVES)}"
        )
    if state not in allowed:
        raise InvalidEventError(
            f"ticket {ticket_id} is {state}; {move} needs one of "
            f"{', '.join(s.value for s in allowed)}"
        )


class OpsKind(StrEnum):
    OBSERVE = "OBSERVE"
    TICKET_UPDATE = "TICKET_UPDATE"
    OPS_POLICY = "OPS_POLICY"
    CAPACITY_REQUEST = "CAPACITY_REQUEST"
    RECOMMENDATION = "RECOMMENDATION"


@dataclass(frozen=True)
class OpsPolicy:
    """What operations does on its own, and its thresholds; each part can be switched off."""

    self_healing: bool = True
    power_capping: bool = True
    burn_in_ms: int = 600_000
    refail_window_ms: int = 7 * 86_400_000
    flap_window_ms: int = 86_400_000
    flap_limit: int = 3
    # Power: below `low_load` (share of a cluster's GPUs allocated) a node idle for `idle_ms`
    # is capped at `low_cap_w`; at or above `high_load`, or once it gets work, it is restored.
    low_load: float = 0.3
    high_load: float = 0.6
    low_cap_w: float = 300.0
    idle_ms: int = 60_000
    # Tuning: a checkpoint-interval recommendation is applied (the job's spec resubmitted with
    # it) when it differs from the current interval by at least `tune_min_change`.
    auto_tune_checkpoints: bool = False
    tune_min_change: float = 0.2

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> OpsPolicy:
        return settings_from(cls, data, "operations policy")


@dataclass
class Ticket:
    ticket_id: str
    node_id: str
    cluster_id: str
    rule: str
    severity: str
    summary: str
    state: TicketState
    opened_ms: int
    updated_ms: int
    seq: int = 0
    evidence: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)  # transitions, oldest first
    burn_in_until_ms: int | None = None
    reason: str = ""

    def as_data(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Ticket:
        return cls(**{**data, "state": TicketState(data["state"])})


@dataclass
class NodeOps:
    """What operations keeps per node: its load as last observed, its power cap, its trips."""

    cluster_id: str
    allocated: int = 0
    gpus: int = 0
    power_limit_w: float = 0.0
    idle_since_ms: int | None = None
    capped: bool = False
    restore_w: float | None = None  # the limit it had before operations capped it
    trips: list[int] = field(default_factory=list)  # when findings opened its tickets
    returned_ms: int | None = None  # when its last ticket closed

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> NodeOps:
        return cls(**data)


@dataclass(frozen=True)
class Command:
    """A node command for the agents' command topic."""

    command_id: str
    node_id: str
    cluster_id: str
    kind: str  # CORDON, UNCORDON, SET_POWER_CAP
    ts: int
    reason: str
    power_cap_w: float | None = None


@dataclass(frozen=True)
class SchedulerCall:
    """A request for the scheduler's log: FENCE or UNFENCE a node (`key`), or SUBMIT a job's
    tuned spec (`key` tenant/name)."""

    request_id: str
    kind: str
    key: str
    ts: int
    reason: str
    tenant: str = ""
    spec_json: str | None = None


@dataclass(frozen=True)
class TicketChanged:
    ticket: dict[str, Any]


@dataclass(frozen=True)
class Audited:
    """An automatic action, for the audit log: operation, target, why."""

    event_id: str
    ts: int
    operation: str
    target: str
    details: dict[str, str]


Effect = Command | SchedulerCall | TicketChanged | Audited


@dataclass
class OpsFold:
    policy: OpsPolicy = field(default_factory=OpsPolicy)
    tickets: dict[str, Ticket] = field(default_factory=dict)
    nodes: dict[str, NodeOps] = field(default_factory=dict)
    capacity_requests: list[dict[str, Any]] = field(default_factory=list)
    recommendations: list[dict[str, Any]] = field(default_factory=list)
    now_ms: int = 0
    position: int = -1
    dirty: set[str] = field(default_factory=set)

    # -- the step --------------------------------------------------------------------------

    def step(self, event: Mapping[str, Any], position: int) -> list[Effect]:
        self.position = position
        self.dirty.add("meta")
        self.now_ms = max(self.now_ms, event["ts"])
        out: list[Effect] = []
        payload = _payload(event)
        match event["kind"]:
            case OpsKind.OBSERVE:
                self._observe(payload, out)
            case OpsKind.TICKET_UPDATE:
                self._update(event, payload, out)
            case OpsKind.OPS_POLICY:
                self.policy = OpsPolicy.from_data(payload)
                out.append(self._audit("policy", "operations", {"policy": str(payload)}))
            case OpsKind.CAPACITY_REQUEST:
                self.capacity_requests = [*self.capacity_requests, dict(payload)][-100:]
                out.append(
                    self._audit(
                        "capacity_request",
                        f"{payload.get('cluster_id')}/{payload.get('model')}",
                        {k: str(v) for k, v in payload.items()},
                    )
                )
            case OpsKind.RECOMMENDATION:
                self._recommend(payload, out)
            case other:
                raise InvalidEventError(f"operations does not handle {other} events")
        return out

    # -- observing -------------------------------------------------------------------------

    def _observe(self, payload: Mapping[str, Any], out: list[Effect]) -> None:
        for node_id, load in sorted((payload.get("loads") or {}).items()):
            self._load(node_id, tuple(load))
        if payload.get("partial"):
            return  # loads only: the observation's findings come in its last part
        findings = [Finding.from_data(f) for f in payload.get("findings") or []]
        by_node: dict[str, list[Finding]] = {}
        for finding in findings:
            by_node.setdefault(finding.node_id, []).append(finding)
        if self.policy.self_healing:
            for node_id in sorted(by_node):
                self._found(node_id, by_node[node_id], out)
            self._burn_in(set(by_node), set(payload.get("skipped_clusters") or ()), out)
        if self.policy.power_capping:
            self._power(set(by_node), out)

    def _load(self, node_id: str, load: tuple[Any, ...]) -> None:
        cluster_id, allocated, gpus, limit = load
        node = self.nodes.get(node_id) or NodeOps(cluster_id)
        node.cluster_id, node.allocated, node.gpus = cluster_id, int(allocated), int(gpus)
        node.power_limit_w = float(limit)
        if node.allocated:
            node.idle_since_ms = None
        elif node.idle_since_ms is None:
            node.idle_since_ms = self.now_ms
        self.nodes[node_id] = node
        self.dirty.add(f"node:{node_id}")

    def active_ticket(self, node_id: str) -> Ticket | None:
        for ticket in self.tickets.values():
            if ticket.node_id == node_id and ticket.state in ACTIVE:
                return ticket
        return None

    def _found(self, node_id: str, findings: list[Finding], out: list[Effect]) -> None:
        worst = min(findings, key=lambda f: (f.severity != "CRITICAL", f.rule, f.summary))
        evidence = [{"ts": self.now_ms, **f.as_data()} for f in findings]
        ticket = self.active_ticket(node_id)
        if ticket is not None:
            if ticket.state == TicketState.VERIFYING:
                self._move(
                    ticket,
                    TicketState.IN_REPAIR,
                    f"burn-in failed: {worst.summary}",
                    "operations",
                    out,
                    evidence,
                )
            elif _new_evidence(ticket, evidence):
                ticket.evidence = _kept([*ticket.evidence, *evidence])
                self._changed(ticket, out)
            return
        node = self.nodes.get(node_id) or NodeOps(worst.cluster_id)
        self.nodes[node_id] = node
        p = self.policy
        node.trips = [t for t in node.trips if t > self.now_ms - p.flap_window_ms] + [self.now_ms]
        self.dirty.add(f"node:{node_id}")
        state, why = TicketState.OPEN, worst.summary
        if node.returned_ms is not None and self.now_ms - node.returned_ms < p.refail_window_ms:
            state = TicketState.ESCALATED
            why = (
                f"{worst.summary}; failed again {(self.now_ms - node.returned_ms) // 1000} s "
                "after it was returned: escalated, not returned"
            )
        elif len(node.trips) >= p.flap_limit:
            state = TicketState.ESCALATED
            why = (
                f"{worst.summary}; tripped {len(node.trips)} times in "
                f"{p.flap_window_ms // 1000} s (flapping): escalated"
            )
        ticket = Ticket(
            ticket_id=f"T{self.position:08d}-{node_id}",
            node_id=node_id,
            cluster_id=worst.cluster_id,
            rule=worst.rule,
            severity=worst.severity,
            summary=worst.summary,
            state=state,
            opened_ms=self.now_ms,
            updated_ms=self.now_ms,
            evidence=_kept(evidence),
            reason=why,
        )
        ticket.history.append(
            {"ts": self.now_ms, "from": None, "to": state.value, "by": "operations", "why": why}
        )
        self.tickets[ticket.ticket_id] = ticket
        self._changed(ticket, out)
        reason = f"ticket {ticket.ticket_id}: {worst.summary}"
        out.append(self._command(node_id, worst.cluster_id, "CORDON", reason, ticket.ticket_id))
        out.append(self._fence("FENCE", node_id, reason, ticket.ticket_id))
        out.append(
            self._audit(
                "cordon",
                node_id,
                {
                    "ticket": ticket.ticket_id,
                    "rule": worst.rule,
                    "severity": worst.severity,
                    "state": state.value,
                    "why": why,
                },
            )
        )

    def _burn_in(self, unwell: set[str], skipped: set[str], out: list[Effect]) -> None:
        for ticket_id in sorted(self.tickets):
            ticket = self.tickets[ticket_id]
            if ticket.state != TicketState.VERIFYING or ticket.burn_in_until_ms is None:
                continue
            node_id = ticket.node_id
            if node_id in unwell or self.now_ms < ticket.burn_in_until_ms:
                continue
            if ticket.cluster_id in skipped:
                continue  # its cluster is out of reach: no verdict on the node yet
            self._move(
                ticket,
                TicketState.CLOSED,
                f"burn-in passed: {self.policy.burn_in_ms // 1000} s with no finding",
                "operations",
                out,
            )
            node = self.nodes.get(node_id) or NodeOps(ticket.cluster_id)
            node.returned_ms = self.now_ms
            self.nodes[node_id] = node
            self.dirty.add(f"node:{node_id}")
            reason = f"ticket {ticket_id} closed: burn-in passed"
            out.append(self._command(node_id, ticket.cluster_id, "UNCORDON", reason, ticket_id))
            out.append(self._fence("UNFENCE", node_id, reason, ticket_id))
            out.append(self._audit("return", node_id, {"ticket": ticket_id, "why": reason}))

    def _power(self, unwell: set[str], out: list[Effect]) -> None:
        p = self.policy
        clusters: dict[str, list[int]] = {}
        for node in self.nodes.values():
            c = clusters.setdefault(node.cluster_id, [0, 0])
            c[0] += node.allocated
            c[1] += node.gpus
        for node_id in sorted(self.nodes):
            node = self.nodes[node_id]
            allocated, gpus = clusters[node.cluster_id]
            load = allocated / gpus if gpus else 0.0
            if node.capped and (node.allocated or load >= p.high_load):
                restore = node.restore_w or node.power_limit_w
                why = (
                    f"load returned: {node.allocated} GPUs allocated on the node, cluster "
                    f"{node.cluster_id} at {load:.0%}"
                )
                node.capped, node.restore_w = False, None
                out.append(self._cap(node_id, node.cluster_id, restore, why))
            elif (
                not node.capped
                and not node.allocated
                and load < p.low_load
                and node.idle_since_ms is not None
                and self.now_ms - node.idle_since_ms >= p.idle_ms
                and node_id not in unwell
                and self.active_ticket(node_id) is None
                and node.power_limit_w > p.low_cap_w
            ):
                why = (
                    f"low load: node idle {(self.now_ms - node.idle_since_ms) // 1000} s, "
                    f"cluster {node.cluster_id} at {load:.0%} (< {p.low_load:.0%})"
                )
                node.capped, node.restore_w = True, node.power_limit_w
                out.append(self._cap(node_id, node.cluster_id, p.low_cap_w, why))
            else:
                continue
            self.dirty.add(f"node:{node_id}")

    # -- tuning ----------------------------------------------------------------------------

    def _recommend(self, payload: Mapping[str, Any], out: list[Effect]) -> None:
        """Keep a recommendation (with its inputs) and apply it when the policy says so: a
        checkpoint interval far enough from the current one resubmits the job's spec."""
        try:
            job, kind = str(payload["job"]), str(payload["kind"])
            recommended, current = float(payload["recommended"]), payload.get("current")
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEventError(f"RECOMMENDATION: {exc!r}") from None
        document = payload.get("document")
        applied = (
            self.policy.auto_tune_checkpoints
            and kind == "checkpoint_interval"
            and isinstance(document, Mapping)
            and (
                current is None
                or abs(recommended - float(current)) >= self.policy.tune_min_change * float(current)
            )
        )
        kept = {k: v for k, v in payload.items() if k != "document"}
        self.recommendations = [*self.recommendations, {**kept, "applied": applied}][-200:]
        details = {"kind": kind, "recommended": str(recommended), "current": str(current)}
        out.append(self._audit("recommend", job, {**details, "applied": str(applied)}))
        if not applied:
            return
        assert isinstance(document, Mapping)
        spec = {**document["spec"], "checkpoint_interval_s": max(1, round(recommended))}
        tenant = str(document["metadata"]["tenant"])
        out.append(
            SchedulerCall(
                f"ops-{self.position}-SUBMIT-{job}",
                "SUBMIT",
                job,
                self.now_ms,
                str(payload.get("summary") or "tuned checkpoint interval"),
                tenant=tenant,
                spec_json=json.dumps(
                    {**document, "spec": spec}, sort_keys=True, separators=(",", ":")
                ),
            )
        )

    # -- operator updates -------------------------------------------------------------------

    def _update(
        self, event: Mapping[str, Any], payload: Mapping[str, Any], out: list[Effect]
    ) -> None:
        ticket = self.tickets.get(event["key"])
        if ticket is None:
            raise InvalidEventError(f"no ticket {event['key']!r}")
        move = str(payload.get("state", ""))
        check_move(ticket.ticket_id, ticket.state, move)
        note = str(payload.get("note") or "")
        actor = event.get("actor") or "operator"
        if move == "REPAIRED":
            ticket.burn_in_until_ms = self.now_ms + self.policy.burn_in_ms
            why = f"repaired{': ' + note if note else ''}; burn-in until {ticket.burn_in_until_ms}"
            self._move(ticket, TicketState.VERIFYING, why, actor, out)
        else:
            self._move(ticket, TicketState(move), note or move.lower(), actor, out)

    # -- effects ---------------------------------------------------------------------------

    def _move(
        self,
        ticket: Ticket,
        state: TicketState,
        why: str,
        by: str,
        out: list[Effect],
        evidence: list[dict[str, Any]] | None = None,
    ) -> None:
        ticket.history.append(
            {"ts": self.now_ms, "from": ticket.state.value, "to": state.value, "by": by, "why": why}
        )
        ticket.state, ticket.reason = state, why
        if state != TicketState.VERIFYING:
            ticket.burn_in_until_ms = None
        if evidence:
            ticket.evidence = _kept([*ticket.evidence, *evidence])
        self._changed(ticket, out)
        out.append(
            self._audit(
                f"ticket.{state.value.lower()}",
                ticket.node_id,
                {"ticket": ticket.ticket_id, "by": by, "why": why},
            )
        )

    def _changed(self, ticket: Ticket, out: list[Effect]) -> None:
        ticket.seq += 1
        ticket.updated_ms = self.now_ms
        self.dirty.add(f"ticket:{ticket.ticket_id}")
        out.append(TicketChanged(ticket.as_data()))

    def _command(self, node_id: str, cluster_id: str, kind: str, reason: str, tag: str) -> Command:
        return Command(
            f"ops-{self.position}-{kind}-{node_id}-{tag}",
            node_id,
            cluster_id,
            kind,
            self.now_ms,
            reason,
        )

    def _cap(self, node_id: str, cluster_id: str, watts: float, why: str) -> Command:
        command = replace(
            self._command(node_id, cluster_id, "SET_POWER_CAP", why, f"{watts:g}W"),
            power_cap_w=watts,
        )
        return command

    def _fence(self, kind: str, node_id: str, reason: str, tag: str) -> SchedulerCall:
        return SchedulerCall(
            f"ops-{self.position}-{kind}-{node_id}-{tag}", kind, node_id, self.now_ms, reason
        )

    def _audit(self, what: str, target: str, details: Mapping[str, str]) -> Audited:
        return Audited(
            f"ops-{self.position}-{what}-{target}",
            self.now_ms,
            f"ops.{what}",
            target,
            {k: str(v) for k, v in details.items()},
        )

    # -- as store records ------------------------------------------------------------------

    def drain_dirty(self) -> list[tuple[str, Any]]:
        keys, self.dirty = sorted(self.dirty), set()
        return [(k, self.record(k)) for k in keys]

    def record(self, key: str) -> Any:
        kind, _, name = key.partition(":")
        if kind == "ticket":
            t = self.tickets.get(name)
            return t.as_data() if t else None
        if kind == "node":
            n = self.nodes.get(name)
            return n.as_data() if n else None
        return {
            "policy": self.policy.as_data(),
            "now_ms": self.now_ms,
            "position": self.position,
            "capacity_requests": self.capacity_requests,
            "recommendations": self.recommendations,
        }

    def records(self) -> list[tuple[str, Any]]:
        keys = ["meta", *(f"ticket:{t}" for t in self.tickets), *(f"node:{n}" for n in self.nodes)]
        return [(k, self.record(k)) for k in sorted(keys)]

    @classmethod
    def from_records(cls, records: Mapping[str, Any]) -> OpsFold:
        fold = cls()
        meta = records.get("meta") or {}
        if meta.get("policy"):
            fold.policy = OpsPolicy.from_data(meta["policy"])
        fold.now_ms = meta.get("now_ms", 0)
        fold.position = meta.get("position", -1)
        fold.capacity_requests = list(meta.get("capacity_requests") or [])
        fold.recommendations = list(meta.get("recommendations") or [])
        for key, value in records.items():
            kind, _, name = key.partition(":")
            if value is None:
                continue
            if kind == "ticket":
                fold.tickets[name] = Ticket.from_data(value)
            elif kind == "node":
                fold.nodes[name] = NodeOps.from_data(value)
        return fold


def _payload(event: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        data = json.loads(event.get("payload_json") or "{}")
    except ValueError as exc:
        raise InvalidEventError(
            f"{event['kind']} {event.get('event_id')}: payload: {exc}"
        ) from None
    if not isinstance(data, Mapping):
        raise InvalidEventError(
            f"{event['kind']} {event.get('event_id')}: payload is not a mapping"
        )
    return data


def _new_evidence(ticket: Ticket, evidence: list[dict[str, Any]]) -> bool:
    """Whether the findings say something the ticket's latest evidence does not (a standing
    failure seen again every observation adds nothing)."""
    latest = {(e["rule"], e["summary"]) for e in ticket.evidence[-len(evidence) :]}
    return any((e["rule"], e["summary"]) not in latest for e in evidence)


def _kept(evidence: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(evidence) <= EVIDENCE_KEPT:
        return evidence
    half = EVIDENCE_KEPT // 2
    return [*evidence[:half], *evidence[-half:]]
