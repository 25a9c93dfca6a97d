"""The scheduling policy: which filters run, each scorer's weight, and the pass limits.

It enters the scheduler's state only as a `POLICY` request in the log, so a replay uses it from
the same point; every decision names its digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetline.errors import ConfigError, FleetlineError
from fleetline.processors.scheduling.tenancy import TenantPolicy

# Filters whose verdict does not depend on the tenant: a gang they rule out everywhere is ruled
# out for every tenant until capacity changes.
FLEET_FILTERS = frozenset({"reachable", "accelerator", "region", "capacity", "pool"})
# Every filter and scorer the pipeline (pipeline.py) has, by the name a policy file uses.
FILTER_NAMES = frozenset(
    {"reachable", "accelerator", "region", "quota", "reservation", "capacity", "bandwidth", "pool"}
)
SCORER_NAMES = frozenset(
    {"locality", "latency", "cost", "fit", "preference", "spread", "energy", "work"}
)
DEFAULT_FILTERS = (
    "reachable",
    "accelerator",
    "region",
    "quota",
    "reservation",
    "capacity",
    "bandwidth",
    "pool",
)
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "locality": 1.0,
    "latency": 0.5,
    "cost": 1.0,
    "fit": 0.5,
    "preference": 0.5,
    "spread": 1.0,
    "energy": 1.0,
    # Only for jobs that say their size (`work`): the most work per cost that meets the
    # deadline, weighed above the cluster-level cost it refines.
    "work": 3.0,
}


@dataclass(frozen=True)
class InferencePool:
    """A cluster's tidal boundary: inference replicas may hold at most `max_share` of its GPUs
    (the rest stays training's), and training leaves `min_gpus` of them to inference (free or
    serving), so a scale-out always finds room there."""

    max_share: float = 1.0
    min_gpus: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.max_share <= 1 or self.min_gpus < 0:
            raise ConfigError(
                f"inference pool: max_share must be in [0, 1] and min_gpus >= 0, got "
                f"{self.max_share}, {self.min_gpus}"
            )

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> InferencePool:
        unknown = set(data) - {"max_share", "min_gpus"}
        if unknown:
            raise ConfigError(f"inference pool: unknown fields {sorted(unknown)}")
        return cls(float(data.get("max_share", 1.0)), int(data.get("min_gpus", 0)))


@dataclass(frozen=True)
class SchedulingPolicy:
    filters: tuple[str, ...] = DEFAULT_FILTERS
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    # Operator order, most preferred first (e.g. on-premises clusters, then cloud).
    cluster_preference: tuple[str, ...] = ()
    # Bandwidth between clusters for moving datasets, Gbit/s.
    interconnect_gbps: float = 10.0
    default_max_runtime_s: int = 24 * 3600
    alternatives: int = 5
    preemption: bool = True
    # Preemption compares the victims of this many of the best-scored clusters where eviction
    # makes room (each costs a walk over the cluster's jobs); 1: the best such cluster.
    preemption_clusters: int = 1
    # Placement attempts (preemption included) one queue pass may make; the rest of the queue
    # waits for the next pass. Bounds how long a pass holds the request log up.
    pass_attempts: int = 64
    # ... of which at most this many may look for victims to preempt (each walks a cluster).
    pass_preemptions: int = 8
    default_tenant: TenantPolicy | None = None
    # Energy: how much a fully renewable hour discounts a kWh's price (0: price alone), how
    # much cheaper a later window must be for a deferrable job to wait for it, and the margin
    # a deferred start keeps before the latest start that meets the deadline.
    renewable_weight: float = 0.8
    energy_min_saving: float = 0.05
    deferral_slack_s: int = 900
    # Tidal pools, by cluster ("*": every other cluster): see InferencePool.
    inference_pools: Mapping[str, InferencePool] = field(default_factory=dict)

    def pool_of(self, cluster_id: str) -> InferencePool:
        return self.inference_pools.get(cluster_id) or self.inference_pools.get(
            "*", _NO_POOL_BOUNDS
        )

    def __post_init__(self) -> None:
        unknown = [f for f in self.filters if f not in FILTER_NAMES]
        if unknown:
            raise ConfigError(
                f"scheduling policy: unknown filters {unknown}; known: {sorted(FILTER_NAMES)}"
            )
        unknown = [s for s in self.weights if s not in SCORER_NAMES]
        if unknown:
            raise ConfigError(
                f"scheduling policy: unknown scorers {unknown}; known: {sorted(SCORER_NAMES)}"
            )

    def as_data(self) -> dict[str, Any]:
        return {
            "filters": list(self.filters),
            "weights": dict(sorted(self.weights.items())),
            "cluster_preference": list(self.cluster_preference),
            "interconnect_gbps": self.interconnect_gbps,
            "default_max_runtime_s": self.default_max_runtime_s,
            "alternatives": self.alternatives,
            "preemption": self.preemption,
            "preemption_clusters": self.preemption_clusters,
            "pass_attempts": self.pass_attempts,
            "pass_preemptions": self.pass_preemptions,
            "default_tenant": (self.default_tenant.as_data() if self.default_tenant else None),
            "renewable_weight": self.renewable_weight,
            "energy_min_saving": self.energy_min_saving,
            "deferral_slack_s": self.deferral_slack_s,
            **(
                {
                    "inference_pools": {
                        c: {"max_share": p.max_share, "min_gpus": p.min_gpus}
                        for c, p in sorted(self.inference_pools.items())
                    }
                }
                if self.inference_pools
                else {}
            ),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> SchedulingPolicy:
        known = {
            "filters",
            "weights",
            "cluster_preference",
            "interconnect_gbps",
            "default_max_runtime_s",
            "alternatives",
            "preemption",
            "preemption_clusters",
            "pass_attempts",
            "pass_preemptions",
            "default_tenant",
            "renewable_weight",
            "energy_min_saving",
            "deferral_slack_s",
            "inference_pools",
        }
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"scheduling policy: unknown fields {sorted(unknown)}")
        base = cls()
        default_tenant = data.get("default_tenant")
        try:
            return cls(
                filters=tuple(data.get("filters", base.filters)),
                # Named weights replace the defaults one by one; a weight of 0 turns a scorer off.
                weights={
                    **DEFAULT_WEIGHTS,
                    **{str(k): float(v) for k, v in (data.get("weights") or {}).items()},
                },
                cluster_preference=tuple(data.get("cluster_preference", ())),
                interconnect_gbps=float(data.get("interconnect_gbps", base.interconnect_gbps)),
                default_max_runtime_s=int(
                    data.get("default_max_runtime_s", base.default_max_runtime_s)
                ),
                alternatives=int(data.get("alternatives", base.alternatives)),
                preemption=bool(data.get("preemption", base.preemption)),
                preemption_clusters=int(data.get("preemption_clusters", base.preemption_clusters)),
                pass_attempts=int(data.get("pass_attempts", base.pass_attempts)),
                pass_preemptions=int(data.get("pass_preemptions", base.pass_preemptions)),
                default_tenant=(
                    TenantPolicy.from_data({"tenant": "*", **default_tenant})
                    if default_tenant
                    else None
                ),
                renewable_weight=float(data.get("renewable_weight", base.renewable_weight)),
                energy_min_saving=float(data.get("energy_min_saving", base.energy_min_saving)),
                deferral_slack_s=int(data.get("deferral_slack_s", base.deferral_slack_s)),
                inference_pools={
                    str(c): InferencePool.from_data(p)
                    for c, p in (data.get("inference_pools") or {}).items()
                },
            )
        except (TypeError, ValueError, FleetlineError) as exc:
            raise ConfigError(f"scheduling policy: {exc}") from None

    def digest(self) -> str:
        text = json.dumps(self.as_data(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


_NO_POOL_BOUNDS = InferencePool()
