"""Cross-cluster placement of a training job: filters, weighted scorers, an explained decision.

`decide(view, job, policy)` is pure: it filters the clusters a job can run in (known,
reachable, not retired, and able to hold the whole gang on healthy topology, by
`place_training`), scores each on data locality, latency to the user's region, cost and fit,
plus the operator's cluster preference order, and returns a `Decision` that names the view
version and offsets it read and the scores of the alternatives. When the chosen cluster lacks
the job's dataset, the decision carries a `DatasetPrewarm` from the nearest replica.

Quotas, priorities, preemption, the desired-state events and the reconcile loop are still to
come (the scheduling issue); this is the placement core they will call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetline.processors.placement import Placement, Unplaceable, place_training
from fleetline.processors.specs import TrainingJob
from fleetline.processors.view import ResourceView
from fleetline.processors.view_read import cluster_capacity

GPU_POWER_KW = 0.7  # an H100 SXM at full load, for the energy part of a GPU-hour's cost


@dataclass(frozen=True)
class Weights:
    locality: float = 1.0
    latency: float = 0.5
    cost: float = 1.0
    fit: float = 0.5
    preference: float = 0.5


@dataclass(frozen=True)
class SchedulingPolicy:
    weights: Weights = field(default_factory=Weights)
    # Operator order, most preferred first (e.g. on-premises clusters, then cloud).
    cluster_preference: tuple[str, ...] = ()
    # Bandwidth between clusters for moving datasets, Gbit/s.
    interconnect_gbps: float = 10.0


@dataclass(frozen=True)
class DatasetPrewarm:
    dataset_id: str
    to_cluster: str
    from_cluster: str | None
    size_bytes: int
    estimated_s: float


@dataclass(frozen=True)
class ClusterScore:
    cluster_id: str
    total: float
    parts: dict[str, float]
    rejected: str | None = None


@dataclass(frozen=True)
class Decision:
    job: str
    outcome: str  # "Placed" or "Queued"
    cluster_id: str | None
    placement: Placement | None
    reason: str
    view_version: int
    offsets: dict[str, dict[int, int]]
    alternatives: tuple[ClusterScore, ...]
    prewarm: DatasetPrewarm | None = None


def _transfer_s(size_bytes: int, gbps: float) -> float:
    return size_bytes * 8 / (gbps * 1e9)


def decide(view: ResourceView, job: TrainingJob, policy: SchedulingPolicy,
           user_region: str | None = None) -> Decision:
    capacity = {c["cluster_id"]: c for c in cluster_capacity(view)}
    dataset = view.datasets.get(job.dataset) if job.dataset else None
    scored: list[tuple[ClusterScore, Placement | None]] = []
    costs: dict[str, float] = {}
    for cluster_id in sorted(capacity):
        c = capacity[cluster_id]
        if c["health"] in ("unreachable", "retired", "empty"):
            scored.append((ClusterScore(cluster_id, 0.0, {}, f"cluster is {c['health']}"), None))
            continue
        placed = place_training(view, cluster_id, job)
        if isinstance(placed, Unplaceable):
            scored.append((ClusterScore(cluster_id, 0.0, {}, placed.reason), None))
            continue
        info = view.clusters.get(cluster_id)
        price = (info.price_per_gpu_hour or 0.0) if info else 0.0
        energy = ((info.energy_price_per_kwh or 0.0) * (info.pue or 1.0) * GPU_POWER_KW
                  if info else 0.0)
        costs[cluster_id] = price + energy
        parts: dict[str, float] = {}
        if dataset is None or cluster_id in dataset.replicas:
            parts["locality"] = 1.0
        else:
            hours = _transfer_s(dataset.size_bytes, policy.interconnect_gbps) / 3600
            parts["locality"] = max(0.0, 1.0 - hours / 24)
        latency = (info.link_latency_ms.get(user_region) if info and user_region else None)
        parts["latency"] = 1.0 if latency is None else max(0.0, 1.0 - latency / 300.0)
        nodes = {ref[0] for ref in placed.gpus}
        sizes = {n: len(view.nodes[n].gpus) for n in nodes}
        taken = {n: sum(1 for ref in view.gpu_owner if ref[0] == n) for n in nodes}
        parts["fit"] = sum((taken[n] + sum(1 for r in placed.gpus if r[0] == n)) / sizes[n]
                           for n in nodes) / len(nodes)
        rank = (policy.cluster_preference.index(cluster_id)
                if cluster_id in policy.cluster_preference else None)
        parts["preference"] = 0.0 if rank is None else 1.0 / (rank + 1)
        scored.append((ClusterScore(cluster_id, 0.0, parts), placed))
    cheapest = min(costs.values(), default=0.0)
    w = policy.weights
    final: list[tuple[ClusterScore, Placement | None]] = []
    for score, placed in scored:
        if score.rejected is not None:
            final.append((score, placed))
            continue
        parts = dict(score.parts)
        cost = costs[score.cluster_id]
        parts["cost"] = 1.0 if cost <= 0 else (cheapest / cost if cheapest > 0 else 0.0)
        total = (w.locality * parts["locality"] + w.latency * parts["latency"]
                 + w.cost * parts["cost"] + w.fit * parts["fit"]
                 + w.preference * parts["preference"])
        final.append((ClusterScore(score.cluster_id, round(total, 6),
                                   {k: round(v, 6) for k, v in sorted(parts.items())}), placed))
    ranked = sorted(final, key=lambda sp: (sp[0].rejected is not None, -sp[0].total,
                                           sp[0].cluster_id))
    alternatives = tuple(s for s, _ in ranked)
    offsets = {t: dict(ps) for t, ps in view.offsets.items()}
    best, placement = ranked[0] if ranked else (None, None)
    if best is None or best.rejected is not None or placement is None:
        why = "; ".join(f"{s.cluster_id}: {s.rejected}" for s in alternatives) or "no clusters"
        return Decision(job.metadata.name, "Queued", None, None, why, view.version, offsets,
                        alternatives)
    prewarm = None
    if dataset is not None and best.cluster_id not in dataset.replicas:
        sources = sorted(dataset.replicas, key=lambda r: (
            (view.clusters[best.cluster_id].link_latency_ms.get(view.clusters[r].region, 1e9)
             if best.cluster_id in view.clusters and r in view.clusters else 1e9), r))
        prewarm = DatasetPrewarm(dataset.dataset_id, best.cluster_id,
                                 sources[0] if sources else None, dataset.size_bytes,
                                 _transfer_s(dataset.size_bytes, policy.interconnect_gbps))
    reason = (f"{best.cluster_id} scores {best.total} ("
              + ", ".join(f"{k} {v}" for k, v in best.parts.items()) + "); "
              + "; ".join(placement.reasons))
    return Decision(job.metadata.name, "Placed", best.cluster_id, placement, reason,
                    view.version, offsets, alternatives, prewarm)
