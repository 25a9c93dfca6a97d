"""Cluster health as a fold of the cluster signal log: heartbeats, clock ticks and cordons.

A heartbeat that carries a reason says the cluster's own manager (Slurm) cannot be used: the
cluster is cordoned while it says so (a CORDON event, "control unavailable: ..."), which keeps
what runs there and places nothing new, and uncordoned when a heartbeat comes without one.

A cluster moves HEALTHY -> SUSPECT (silent for `suspect_after_ms`) -> UNHEALTHY (silent for
`lost_after_ms` *and* no peer reaches it, or silent for `isolated_after_ms` whatever its peers
say) -> RECOVERING (heard again; everything it ran before is fenced) -> HEALTHY (heard without a
gap for `recover_after_ms`, longer for each loss within `flap_window_ms`: flapping is damped).

Time is the broker's (each signal's LogAppendTime; never an agent's clock): the control plane's
clock ticks are events on the same single partition as the heartbeats, so silence moves time,
and a replay of the log sees the same ticks in the same order and declares the same clusters
lost at the same positions. A broken link between two clusters (each reports the other
unreachable while both heartbeat) is a PARTITION event and evicts neither. Nothing here reads
a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.identity.authority import signal_refusal
from fleetline.identity.writers import CONTROL_PLANE_WRITER, Writer, WriterRefused


class HealthState(StrEnum):
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"  # silent a moment: keeps its jobs, takes no new ones
    UNHEALTHY = "UNHEALTHY"  # lost: out of the pool, its jobs move
    RECOVERING = "RECOVERING"  # back, on probation: fenced, takes no new work yet


@dataclass(frozen=True)
class ClusterHealthPolicy:
    suspect_after_ms: int = 1_500
    lost_after_ms: int = 3_000
    isolated_after_ms: int = 30_000
    recover_after_ms: int = 3_000
    peer_report_fresh_ms: int = 3_000
    flap_window_ms: int = 600_000
    flap_backoff: float = 2.0  # recovery takes this much longer per earlier loss in the window

    def as_data(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> ClusterHealthPolicy:
        return cls(**{k: type(getattr(cls(), k))(v) for k, v in data.items()})


@dataclass
class ClusterRecord:
    cluster_id: str
    state: HealthState = HealthState.HEALTHY
    since_ms: int = 0
    heard_ms: int = 0  # the fold's time at its last heartbeat
    incarnation: str = ""
    cordoned: bool = False
    losses: list[int] = field(default_factory=list)  # when it was declared lost, in the window
    # What this cluster last said of each peer: peer -> (reachable, fold time of the report).
    sees: dict[str, tuple[bool, int]] = field(default_factory=dict)
    # Why its own manager (Slurm) cannot be used, as its heartbeats say; None while it can.
    control: str | None = None

    @property
    def takes_no_work(self) -> bool:
        """Cordoned by an operator, or its manager does not answer: what runs there stays,
        nothing new is placed there."""
        return self.cordoned or self.control is not None


@dataclass
class HealthFold:
    """The fold's state: every cluster's record, the broken links, the time and the position."""

    policy: ClusterHealthPolicy = field(default_factory=ClusterHealthPolicy)
    clusters: dict[str, ClusterRecord] = field(default_factory=dict)
    broken: set[tuple[str, str]] = field(default_factory=set)
    now_ms: int = 0
    position: int = -1

    def step(
        self,
        signal: Mapping[str, Any],
        position: int,
        writer: Writer = CONTROL_PLANE_WRITER,
        appended_ms: int | None = None,
    ) -> list[dict[str, Any]]:
        """Fold one ClusterSignal at log `position`, written by `writer` (as the gate
        established it) and appended by the broker at `appended_ms`; the ClusterHealth records
        it causes. A signal its writer may not send raises WriterRefused and changes nothing.

        Time is the broker's: its append time of each signal (the topic stamps LogAppendTime),
        or, for a signal that carries none, the control plane's own clock. Never an agent's:
        one heartbeat from an agent whose clock runs 40 s ahead would otherwise make every
        other cluster look silent for 40 s."""
        refusal = signal_refusal(writer, signal["kind"], signal["cluster_id"])
        if refusal is not None:
            raise WriterRefused(writer.header, refusal)
        self.position = position
        if appended_ms is not None:
            self.now_ms = max(self.now_ms, appended_ms)
        elif writer.is_control_plane:
            self.now_ms = max(self.now_ms, int(signal["ts"]))
        out: list[dict[str, Any]] = []
        match signal["kind"]:
            case "TICK":
                for cluster_id in sorted(self.clusters):
                    self._judge(self.clusters[cluster_id], out)
            case "HEARTBEAT":
                self._heartbeat(signal, out)
            case "CORDON" | "UNCORDON":
                record = self._record(signal["cluster_id"])
                record.cordoned = signal["kind"] == "CORDON"
                who = signal.get("actor") or "an operator"
                why = signal.get("reason") or "no reason given"
                out.append(
                    self._event(
                        "CORDON",
                        record,
                        record.state,
                        f"{signal['kind'].lower()}ed by {who}: {why}",
                    )
                )
            case other:
                raise InvalidEventError(f"the health fold does not handle {other} signals")
        return out

    # -- the rules ------------------------------------------------------------------------------

    def _record(self, cluster_id: str) -> ClusterRecord:
        if not cluster_id:
            raise InvalidEventError("a cluster signal without a cluster id")
        record = self.clusters.get(cluster_id)
        if record is None:
            record = self.clusters[cluster_id] = ClusterRecord(
                cluster_id, since_ms=self.now_ms, heard_ms=self.now_ms
            )
        return record

    def _heartbeat(self, signal: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        new = signal["cluster_id"] not in self.clusters
        record = self._record(signal["cluster_id"])
        record.heard_ms = self.now_ms
        record.incarnation = signal.get("incarnation") or record.incarnation
        for peer in signal.get("peers") or ():
            if peer["cluster_id"] != record.cluster_id:
                record.sees[peer["cluster_id"]] = (bool(peer["reachable"]), self.now_ms)
        if new:
            out.append(self._event("HEALTH", record, "UNKNOWN", "first heartbeat"))
        elif record.state == HealthState.SUSPECT:
            self._move(record, HealthState.HEALTHY, "heard again", out)
        elif record.state == HealthState.UNHEALTHY:
            self._move(
                record,
                HealthState.RECOVERING,
                "heard again after being declared lost; what it ran before is fenced",
                out,
            )
            out.append(self._event("FENCE", record, record.state, out[-1]["reason"]))
        self._links(record, out)
        control = signal.get("reason") or None
        if control != record.control:
            record.control = control
            said = (
                f"control unavailable: {control}"
                if control
                else "control answers again: takes new work"
            )
            out.append(self._event("CORDON", record, record.state, said))

    def _links(self, record: ClusterRecord, out: list[dict[str, Any]]) -> None:
        """A link is broken while either end says it cannot reach the other."""
        for peer, (reachable, _) in sorted(record.sees.items()):
            if peer not in self.clusters:
                continue
            pair = (min(record.cluster_id, peer), max(record.cluster_id, peer))
            other = self.clusters[peer].sees.get(record.cluster_id)
            broken = not reachable or (other is not None and not other[0])
            if broken == (pair in self.broken):
                continue
            (self.broken.add if broken else self.broken.discard)(pair)
            why = (
                f"{record.cluster_id} cannot reach {peer}"
                if broken
                else f"{record.cluster_id} and {peer} reach each other again"
            )
            for end, far in ((pair[0], pair[1]), (pair[1], pair[0])):
                event = self._event("PARTITION", self.clusters[end], self.clusters[end].state, why)
                event["peer"], event["link_up"] = far, not broken
                out.append(event)

    def _judge(self, record: ClusterRecord, out: list[dict[str, Any]]) -> None:
        p = self.policy
        silent = self.now_ms - record.heard_ms
        if record.state == HealthState.HEALTHY and silent > p.suspect_after_ms:
            self._move(record, HealthState.SUSPECT, f"no heartbeat for {silent / 1000:.1f}s", out)
        elif record.state == HealthState.SUSPECT and silent > p.lost_after_ms:
            reaching, not_reaching = self._peers_of(record.cluster_id)
            if not reaching:
                cannot = f"; {', '.join(not_reaching)} cannot reach it" if not_reaching else ""
                self._lose(record, f"silent for {silent / 1000:.1f}s{cannot}", out)
            elif silent > p.isolated_after_ms:
                self._lose(
                    record,
                    f"silent for {silent / 1000:.1f}s though {', '.join(reaching)} still "
                    "reach it: cut off from the control plane",
                    out,
                )
        elif record.state == HealthState.RECOVERING:
            if silent > p.suspect_after_ms:
                self._lose(record, f"silent again while recovering ({silent / 1000:.1f}s)", out)
            elif self.now_ms - record.since_ms >= self._probation_ms(record):
                self._move(
                    record,
                    HealthState.HEALTHY,
                    f"heard without a gap for {(self.now_ms - record.since_ms) / 1000:.1f}s",
                    out,
                )

    def _probation_ms(self, record: ClusterRecord) -> int:
        recent = [t for t in record.losses if self.now_ms - t <= self.policy.flap_window_ms]
        record.losses = recent
        extra = max(0, len(recent) - 1)
        return int(self.policy.recover_after_ms * self.policy.flap_backoff**extra)

    def _lose(self, record: ClusterRecord, reason: str, out: list[dict[str, Any]]) -> None:
        record.losses.append(self.now_ms)
        self._move(record, HealthState.UNHEALTHY, reason, out)
        out.append(self._event("CLUSTER_DOWN", record, record.state, reason))

    def _peers_of(self, cluster_id: str) -> tuple[list[str], list[str]]:
        """Healthy peers whose fresh reports say they reach / cannot reach the cluster."""
        reaching: list[str] = []
        not_reaching: list[str] = []
        for peer_id in sorted(self.clusters):
            peer = self.clusters[peer_id]
            seen = peer.sees.get(cluster_id)
            if (
                peer_id == cluster_id
                or peer.state != HealthState.HEALTHY
                or seen is None
                or self.now_ms - seen[1] > self.policy.peer_report_fresh_ms
            ):
                continue
            (reaching if seen[0] else not_reaching).append(peer_id)
        return reaching, not_reaching

    def _move(
        self, record: ClusterRecord, state: HealthState, reason: str, out: list[dict[str, Any]]
    ) -> None:
        before = record.state
        record.state, record.since_ms = state, self.now_ms
        event = self._event("HEALTH", record, before, reason)
        out.append(event)

    def _event(
        self, kind: str, record: ClusterRecord, previous: str, reason: str
    ) -> dict[str, Any]:
        reaching, not_reaching = self._peers_of(record.cluster_id)
        return {
            "event": kind,
            "cluster_id": record.cluster_id,
            "seq": self.position,
            "ts": self.now_ms,
            "state": record.state.value,
            "previous": str(previous),
            "since_ms": record.since_ms,
            "cordoned": record.takes_no_work,
            "reason": reason,
            "silent_ms": self.now_ms - record.heard_ms,
            "peers_reaching": reaching,
            "peers_not_reaching": not_reaching,
            "peer": None,
            "link_up": None,
        }

    # -- as data (the processor's store) ------------------------------------------------------

    def as_data(self) -> dict[str, Any]:
        return {
            "policy": self.policy.as_data(),
            "now_ms": self.now_ms,
            "position": self.position,
            "broken": sorted(list(pair) for pair in self.broken),
            "clusters": {
                c: {
                    "state": r.state.value,
                    "since_ms": r.since_ms,
                    "heard_ms": r.heard_ms,
                    "incarnation": r.incarnation,
                    "cordoned": r.cordoned,
                    "losses": r.losses,
                    "sees": {p: list(v) for p, v in sorted(r.sees.items())},
                    "control": r.control,
                }
                for c, r in sorted(self.clusters.items())
            },
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> HealthFold:
        fold = cls(ClusterHealthPolicy.from_data(data["policy"]))
        fold.now_ms, fold.position = data["now_ms"], data["position"]
        fold.broken = {(a, b) for a, b in data["broken"]}
        for cluster_id, r in data["clusters"].items():
            fold.clusters[cluster_id] = ClusterRecord(
                cluster_id,
                HealthState(r["state"]),
                r["since_ms"],
                r["heard_ms"],
                r["incarnation"],
                r["cordoned"],
                list(r["losses"]),
                {p: (bool(v[0]), int(v[1])) for p, v in r["sees"].items()},
                r.get("control"),  # absent from states folded before it was kept
            )
        return fold
