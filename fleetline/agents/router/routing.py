"""The router's decisions, pure: the registry as a fold of ReplicaEndpoint records, which
replica a request goes to, and what a window of traffic says to the autoscaler.

A request goes to the ready replica with the lowest expected latency:

    link RTT (client region -> replica's cluster)
      + service time x (1 + (queue + requests this router has in flight there) / slots)

where the service time is what this router measured of that replica (a moving average), else
what the replica reports (its p50), else the policy's default. A replica that failed a request
is passed over for `failure_backoff_ms`. Only READY replicas whose record is fresh (younger than
`expire_beats` of their heartbeats) are routed: a standby (WARM), one still loading (STARTING),
one draining or gone never gets a request. Ties go to the replica with fewer requests in flight,
then by name, so the choice is deterministic; `weights` shows every term for `explain`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fleetline.errors import ConfigError
from fleetline.streams.events import CLUSTER_INFO, REPLICA_ENDPOINT


@dataclass(frozen=True)
class RoutingPolicy:
    """How the router weighs replicas and retries (`fleetline router --policy FILE`)."""

    link_weight: float = 1.0  # x the RTT from the client's region
    queue_weight: float = 1.0  # x the service time per queued request per slot
    default_service_ms: float = 20.0  # a replica nothing is known of yet
    unknown_link_ms: float = 50.0  # a region pair no ClusterInfo names
    ewma: float = 0.2  # weight of the newest latency in a replica's moving average
    expire_beats: int = 4  # heartbeats of silence after which a replica is dropped
    failure_backoff_ms: int = 1000  # a replica that failed a request is passed over this long
    retries: int = 2  # further replicas one request may try after an error
    retry_budget_ratio: float = 0.2  # retries earned per request (the budget's refill)
    retry_budget_min: int = 10  # retries always allowed in a burst
    timeout_ms: int = 5000  # one try's limit
    report_ms: int = 1000  # how often the load of each service goes to the autoscaler

    def __post_init__(self) -> None:
        if self.retries < 0 or not 0 <= self.retry_budget_ratio <= 1 or self.expire_beats < 1:
            raise ConfigError(
                "routing policy: retries >= 0, 0 <= retry_budget_ratio <= 1, expire_beats >= 1"
            )

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RoutingPolicy:
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise ConfigError(f"routing policy: unknown fields {sorted(unknown)}")
        values: dict[str, Any] = {}
        try:
            for k, v in data.items():
                values[k] = int(v) if known[k] == "int" else float(v)
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"routing policy: {exc}") from None

    def as_data(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Endpoint:
    """A replica as the registry's latest record has it."""

    replica: str
    service: str
    cluster_id: str
    region: str | None
    state: str
    address: str | None
    epoch: int
    attempt: int
    ts: int
    heartbeat_ms: int
    concurrency: int
    inflight: int
    queue: int
    latency_p50_ms: float | None

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> Endpoint:
        return cls(
            r["replica"],
            r["service"],
            r["cluster_id"],
            r.get("region"),
            r["state"],
            r.get("address"),
            int(r["epoch"]),
            int(r["attempt"]),
            int(r["ts"]),
            int(r["heartbeat_ms"]),
            int(r.get("concurrency") or 0),
            int(r.get("inflight") or 0),
            int(r.get("queue") or 0),
            r.get("latency_p50_ms"),
        )

    def fresh(self, now_ms: int, policy: RoutingPolicy) -> bool:
        return now_ms - self.ts <= self.heartbeat_ms * policy.expire_beats


@dataclass
class Registry:
    """The latest record of each replica (a newer run of a replica replaces an older one)."""

    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    # cluster -> region -> RTT ms, and cluster -> region, from ClusterInfo
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)

    def apply(self, record: Mapping[str, Any]) -> None:
        endpoint = Endpoint.from_record(record)
        current = self.endpoints.get(endpoint.replica)
        if current is None or (endpoint.epoch, endpoint.attempt, endpoint.ts) >= (
            current.epoch,
            current.attempt,
            current.ts,
        ):
            self.endpoints[endpoint.replica] = endpoint

    def fold(self, name: str, record: Mapping[str, Any]) -> None:
        """One record of the registry's topics (ReplicaEndpoint, ClusterInfo); others pass."""
        if name == REPLICA_ENDPOINT:
            self.apply(record)
        elif name == CLUSTER_INFO:
            self.apply_cluster(record)

    def apply_cluster(self, record: Mapping[str, Any]) -> None:
        self.links[record["cluster_id"]] = dict(record.get("link_latency_ms") or {})
        self.regions[record["cluster_id"]] = record["region"]

    def routable(self, service: str, now_ms: int, policy: RoutingPolicy) -> list[Endpoint]:
        return [
            e
            for e in self.endpoints.values()
            if e.service == service and e.state == "READY" and e.address and e.fresh(now_ms, policy)
        ]

    def services(self) -> list[str]:
        return sorted({e.service for e in self.endpoints.values()})

    def link_ms(self, cluster_id: str, region: str | None, policy: RoutingPolicy) -> float:
        if region is None:
            return 0.0
        if self.regions.get(cluster_id) == region:
            return self.links.get(cluster_id, {}).get(region, 0.5)
        return self.links.get(cluster_id, {}).get(region, policy.unknown_link_ms)


@dataclass(frozen=True)
class Weight:
    """One replica's expected latency for one client region, term by term."""

    replica: str
    cluster_id: str
    expected_ms: float
    link_ms: float
    service_ms: float
    waiting: int  # queued there + this router's requests in flight there
    slots: int

    def as_data(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "cluster_id": self.cluster_id,
            "expected_ms": round(self.expected_ms, 3),
            "link_ms": self.link_ms,
            "service_ms": round(self.service_ms, 3),
            "waiting": self.waiting,
            "slots": self.slots,
        }


def weights(
    registry: Registry,
    endpoints: Iterable[Endpoint],
    client_region: str | None,
    policy: RoutingPolicy,
    observed_ms: Mapping[str, float],
    inflight: Mapping[str, int],
) -> list[Weight]:
    """Every endpoint's expected latency, best first (ties: fewer in flight, then name)."""
    out = []
    for e in endpoints:
        service_ms = observed_ms.get(e.replica) or e.latency_p50_ms or policy.default_service_ms
        slots = max(e.concurrency, 1)
        waiting = e.queue + inflight.get(e.replica, 0)
        link = registry.link_ms(e.cluster_id, client_region, policy)
        expected = policy.link_weight * link + service_ms * (
            1 + policy.queue_weight * waiting / slots
        )
        out.append(Weight(e.replica, e.cluster_id, expected, link, service_ms, waiting, slots))
    out.sort(key=lambda w: (w.expected_ms, inflight.get(w.replica, 0), w.replica))
    return out


def choose(
    registry: Registry,
    service: str,
    client_region: str | None,
    now_ms: int,
    policy: RoutingPolicy,
    observed_ms: Mapping[str, float],
    inflight: Mapping[str, int],
    avoid: Mapping[str, int],
    tried: Iterable[str] = (),
) -> Endpoint | None:
    """The replica the next try goes to, or None when no ready one is left to try."""
    skip = set(tried)
    candidates = [
        e
        for e in registry.routable(service, now_ms, policy)
        if e.replica not in skip and avoid.get(e.replica, 0) <= now_ms
    ]
    if not candidates:
        return None
    best = weights(registry, candidates, client_region, policy, observed_ms, inflight)[0]
    return next(e for e in candidates if e.replica == best.replica)


def percentile(ordered: list[float], p: float) -> float:
    """The nearest-rank percentile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * p / 100) - 1))]


def load_report(
    router: str,
    window_ms: int,
    latencies_ms: list[float],
    by_region: Mapping[str, int],
    errors: int,
    busy_slot_ms: float,
    slots: int,
    queue: int,
) -> dict[str, Any]:
    """A SERVICE_LOAD payload: the window's requests, their latency percentiles, and the
    share of the serving replicas' slots this router kept busy."""
    ordered = sorted(latencies_ms)
    return {
        "router": router,
        "window_ms": window_ms,
        "requests": len(ordered),
        "errors": errors,
        "by_region": dict(sorted(by_region.items())),
        "latency_ms": {f"p{p}": round(percentile(ordered, p), 3) for p in (50, 95, 99)}
        if ordered
        else {},
        "utilisation": round(busy_slot_ms / (window_ms * slots), 4) if slots and window_ms else 0.0,
        "queue": queue,
    }
