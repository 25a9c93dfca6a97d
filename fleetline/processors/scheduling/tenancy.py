"""Tenants: quotas, reserved capacity, fair-share weights and what each tenant uses.

Quotas are hard limits checked at admission, so usage never passes the quota in force:
- `gpus`: GPUs held at once, fleet-wide; `cluster_gpus`: the same per cluster.
- `gpu_hours`: a budget. A training job reserves `GPUs x max runtime` when it starts (Slurm's
  GrpTRESRunMins idea) and is stopped at its limit, so what is consumed plus what running jobs
  may still consume never passes the budget; an early finish returns the unused part.
  Inference services run open-ended and are bounded by the GPU quotas alone.
- `storage_bytes`: dataset bytes times replicas, including replicas being prewarmed.
- `bandwidth_gbps`: cross-cluster dataset moves a tenant's prewarms may run at once.
`reserved` holds GPUs of a cluster for the tenant: other tenants may only use what is left after
every other tenant's unused reservation. `share` weighs the tenant in fair share among tenants of
equal priority (the tenant using the least GPUs per unit of share goes first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from fleetline.errors import InvalidEventError
from fleetline.processors.scheduling.specs import parse_size

PRIORITIES = {"critical": 4, "high": 3, "normal": 2, "low": 1, "best-effort": 0}
HOUR_MS = 3_600_000


Whole = Annotated[StrictInt, Field(ge=0)]
Amount = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


def _storage(value: Any) -> int | None:
    if value is None:
        return None
    size = parse_size(value)
    if size is None:
        raise PydanticCustomError(
            "size", "is not a size (bytes, or like 500TB), got {value}", {"value": repr(value)}
        )
    return size


class Quota(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: Whole | None = Field(default=None, description="GPUs held at once, fleet-wide")
    cluster_gpus: Mapping[str, Whole] = Field(
        default_factory=dict, description="GPUs held at once, per cluster"
    )
    gpu_hours: Amount | None = Field(
        default=None, description="a budget: consumed plus what running jobs may still consume"
    )
    storage_bytes: Annotated[int | None, BeforeValidator(_storage)] = Field(
        default=None, description="dataset bytes x replicas, prewarms included"
    )
    bandwidth_gbps: Amount | None = Field(
        default=None, description="cross-cluster dataset moves at once"
    )


class TenantTerms(BaseModel):
    """What a tenant's policy sets: its quotas, the GPUs reserved for it per cluster, and its
    fair-share weight among tenants of equal priority."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quota: Quota = Quota()
    reserved: Mapping[str, Whole] = Field(default_factory=dict)
    share: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] = 1.0


class TenantPolicy(TenantTerms):
    """A tenant's terms, named."""

    tenant: Annotated[str, Field(strict=True, min_length=1)]

    def as_data(self) -> dict[str, Any]:
        q = self.quota
        return {
            "tenant": self.tenant,
            "share": self.share,
            "reserved": dict(sorted(self.reserved.items())),
            "quota": {
                "gpus": q.gpus,
                "cluster_gpus": dict(sorted(q.cluster_gpus.items())),
                "gpu_hours": q.gpu_hours,
                "storage_bytes": q.storage_bytes,
                "bandwidth_gbps": q.bandwidth_gbps,
            },
        }

    @classmethod
    def from_data(cls, data: Any) -> TenantPolicy:
        """From a mapping (an event's JSON or an operator's YAML); InvalidEventError names
        every field that is wrong."""
        if not isinstance(data, Mapping):
            raise InvalidEventError(f"a tenant policy must be a mapping, got {data!r}")
        try:
            return cls.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as exc:
            tenant = data.get("tenant") or "?"
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: "
                f"{'unknown field' if e['type'] == 'extra_forbidden' else e['msg']}"
                for e in exc.errors()
            )
            raise InvalidEventError(f"tenant policy {tenant}: {problems}") from None


@dataclass(slots=True)
class TenantUsage:
    """What a tenant holds now; the scheduler keeps it as it allocates and releases."""

    gpus: int = 0
    cluster_gpus: dict[str, int] = field(default_factory=dict)
    consumed_gpu_ms: int = 0  # finished training work, charged at its actual length
    committed_gpu_ms: int = 0  # running training jobs, charged at GPUs x their time limit
    storage_bytes: int = 0
    prewarms: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (Gbit/s, until)

    def bandwidth_gbps(self) -> float:
        return sum(self.prewarms[k][0] for k in sorted(self.prewarms))

    def as_data(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "cluster_gpus": dict(sorted(self.cluster_gpus.items())),
            "consumed_gpu_ms": self.consumed_gpu_ms,
            "committed_gpu_ms": self.committed_gpu_ms,
            "storage_bytes": self.storage_bytes,
            "prewarms": {k: list(v) for k, v in sorted(self.prewarms.items())},
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> TenantUsage:
        return cls(
            data["gpus"],
            dict(data["cluster_gpus"]),
            data["consumed_gpu_ms"],
            data["committed_gpu_ms"],
            data["storage_bytes"],
            {k: (float(v[0]), int(v[1])) for k, v in data["prewarms"].items()},
        )


@dataclass(frozen=True, slots=True)
class Request:
    """What an admission asks of a tenant's quota: GPUs in all, and per cluster where known."""

    gpus: int = 0
    gpus_by_cluster: Mapping[str, int] = field(default_factory=dict)
    gpu_ms: int = 0  # GPUs x time limit, for training jobs
    storage_bytes: int = 0
    bandwidth_gbps: float = 0.0


def quota_block(policy: TenantPolicy | None, usage: TenantUsage, request: Request) -> str | None:
    """Why the request would pass the tenant's quota, or None when it fits."""
    if policy is None:
        return None
    q = policy.quota
    tenant = policy.tenant
    asked = request.gpus
    if q.gpus is not None and usage.gpus + asked > q.gpus:
        return (
            f"quota: tenant {tenant} holds {usage.gpus} of its {q.gpus} GPUs, this needs "
            f"{asked} more"
        )
    for cluster, n in sorted(request.gpus_by_cluster.items()):
        limit = q.cluster_gpus.get(cluster)
        held = usage.cluster_gpus.get(cluster, 0)
        if limit is not None and held + n > limit:
            return (
                f"quota: tenant {tenant} holds {held} of its {limit} GPUs in {cluster}, "
                f"this needs {n} more"
            )
    if q.gpu_hours is not None and request.gpu_ms:
        budget = q.gpu_hours * HOUR_MS
        spoken = usage.consumed_gpu_ms + usage.committed_gpu_ms
        if spoken + request.gpu_ms > budget:
            return (
                f"quota: tenant {tenant} has used or committed "
                f"{spoken / HOUR_MS:.1f} of its {q.gpu_hours:g} GPU-hours, this job "
                f"reserves {request.gpu_ms / HOUR_MS:.1f} (GPUs x max runtime)"
            )
    if (
        q.storage_bytes is not None
        and request.storage_bytes
        and usage.storage_bytes + request.storage_bytes > q.storage_bytes
    ):
        return (
            f"quota: tenant {tenant} stores {usage.storage_bytes} of its {q.storage_bytes} "
            f"bytes, this needs {request.storage_bytes} more"
        )
    if (
        q.bandwidth_gbps is not None
        and request.bandwidth_gbps
        and usage.bandwidth_gbps() + request.bandwidth_gbps > q.bandwidth_gbps + 1e-9
    ):
        return (
            f"quota: tenant {tenant} moves data at {usage.bandwidth_gbps():g} of its "
            f"{q.bandwidth_gbps:g} Gbit/s"
        )
    return None


def reserved_for_others(
    policies: Mapping[str, TenantPolicy],
    usage: Mapping[str, TenantUsage],
    tenant: str,
    cluster: str,
) -> int:
    """GPUs of `cluster` held back for other tenants' unused reservations."""
    held = 0
    for other, policy in policies.items():
        if other == tenant:
            continue
        want = policy.reserved.get(cluster, 0)
        if want:
            used = usage[other].cluster_gpus.get(cluster, 0) if other in usage else 0
            held += max(0, want - used)
    return held


def fair_share_key(
    policies: Mapping[str, TenantPolicy], usage: Mapping[str, TenantUsage], tenant: str
) -> float:
    """Lower goes first among equal priorities: GPUs held per unit of share."""
    share = policies[tenant].share if tenant in policies else 1.0
    held = usage[tenant].gpus if tenant in usage else 0
    return held / share
