"""Cross-cluster placement: a composable pipeline of filters and weighted scorers.

Every filter and scorer is a small pure function of a `Context` (the capacity index, the tenants,
the request) and a cluster; the policy names which filters run and each scorer's weight, so an
operator chooses the pipeline in configuration. `rank_clusters` returns every cluster's score
parts or its rejection reason; `place_job` turns the best into a placement (a gang in one
cluster, a gang split across clusters by whole pipeline replicas when the job allows it, or
service replicas spread over the allowed regions), reserves it in the index, and names the
dataset prewarms it needs. Nothing here reads a clock: time is the `now` the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetline.processors.scheduling.capacity import (
    CapacityIndex,
    ClusterFacts,
    DatasetFacts,
    FleetFacts,
    Gang,
    GangShape,
    computes,
    one_kind,
)
from fleetline.processors.scheduling.energy import GPU_POWER_KW, EnergyProfile, effective_price
from fleetline.processors.scheduling.estimate import (
    Estimate,
    Measured,
    WorkSize,
    best,
    estimate,
)
from fleetline.processors.scheduling.placement import Placement, refs_by_node, to_placement
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.tenancy import (
    Request,
    TenantPolicy,
    TenantUsage,
    quota_block,
    reserved_for_others,
)
from fleetline.processors.view.accelerators import did_you_mean


@dataclass(frozen=True)
class DatasetPrewarm:
    dataset_id: str
    to_cluster: str
    from_cluster: str | None
    size_bytes: int
    estimated_s: float
    rate_gbps: float


@dataclass(frozen=True, slots=True)
class ClusterScore:
    cluster_id: str
    total: float
    parts: dict[str, float]
    rejected: str | None = None
    # The filter that ruled the cluster out (not part of the decision record).
    by: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One placement as the pipeline sees it."""

    job: str
    tenant: str
    shape: GangShape
    priority: int
    dataset: DatasetFacts | None = None
    regions: tuple[str, ...] = ()  # allowed regions (services); empty: anywhere
    user_region: str | None = None  # where latency is measured to
    gpu_ms: int = 0  # GPU-hour quota reservation, training only
    spread: Mapping[str, int] = field(default_factory=dict)  # replicas already per cluster
    # Tidal pools (policy.inference_pools): a replica's GPUs left under each bounded cluster's
    # inference share; a training job's GPUs each cluster keeps for inference.
    pool_room: Mapping[str, int] | None = None
    pool_keep: Mapping[str, int] | None = None
    data_only: bool = False  # only clusters that hold its dataset (no copy)
    work: WorkSize | None = None  # its size, for the estimate on each kind of chip
    resumes_on: str | None = None  # the chip model its checkpoint must resume on


@dataclass(slots=True)
class Context:
    index: CapacityIndex
    policy: SchedulingPolicy
    tenants: Mapping[str, TenantPolicy]
    usage: Mapping[str, TenantUsage]
    request: JobRequest
    cheapest: float = 0.0
    now_ms: int = 0
    energy: Mapping[str, EnergyProfile] = field(default_factory=dict)
    greenest: float = 0.0  # the lowest effective energy price in the fleet now
    # With a work size: each cluster's best estimate, and the least cost among them.
    estimates: dict[str, Estimate] = field(default_factory=dict)
    cheapest_work: float = 0.0
    # Measured shares of peak, by `measured_key` (the scheduler's own, not a copy).
    measured: Mapping[str, Measured] = field(default_factory=dict)

    @property
    def tenant_policy(self) -> TenantPolicy | None:
        return self.tenants.get(self.request.tenant, self.policy.default_tenant)

    def cluster(self, cluster_id: str) -> ClusterFacts | None:
        return self.index.facts.clusters.get(cluster_id)

    def moves_data(self, cluster_id: str) -> bool:
        d = self.request.dataset
        return d is not None and cluster_id not in d.replicas

    def usage_of(self) -> TenantUsage:
        return self.usage.get(self.request.tenant) or TenantUsage()


def cost_per_gpu_hour(cluster: ClusterFacts) -> float:
    return cluster.price_per_gpu_hour + cluster.energy_price_per_kwh * cluster.pue * GPU_POWER_KW


def transfer_s(size_bytes: int, gbps: float) -> float:
    return size_bytes * 8 / (gbps * 1e9)


Filter = Callable[[Context, str], str | None]
Scorer = Callable[[Context, str], float]


def _reachable(ctx: Context, cluster_id: str) -> str | None:
    c = ctx.cluster(cluster_id)
    if c is None:
        return "the cluster is not in the view"
    if not c.health.takes_work:
        return f"cluster is {c.health}" + (f" ({c.health_reason})" if c.health_reason else "")
    return None


def _accelerator(ctx: Context, cluster_id: str) -> str | None:
    if ctx.index.takes(cluster_id, ctx.request.shape):
        return None
    shape = ctx.request.shape
    models = ctx.index.models(cluster_id)
    known = ctx.index.facts.catalogue
    if not models:
        return "has no GPUs"
    present = " and ".join(sorted(m.describe() for m in models))
    # A name no node anywhere has is a typo more often than a model yet to arrive.
    fleet = ctx.index.all_models()
    hints = "".join(
        did_you_mean(name, fleet)
        for name in shape.accelerators
        if not any(name in m.names for m in fleet)
    )
    if ctx.request.resumes_on:
        hints += (
            f" (its checkpoint was written on {ctx.request.resumes_on}; `portable: true` lets "
            "it resume on another chip)"
        )
    precision = shape.precision
    if precision and not any(computes(m, precision, known) for m in fleet):
        hints += f" (no chip in the fleet computes {precision}, as the accelerator catalogue says)"
    return f"has no {shape.wants()} (it has {present}){hints}"


def _region(ctx: Context, cluster_id: str) -> str | None:
    regions = ctx.request.regions
    c = ctx.cluster(cluster_id)
    if regions and (c is None or c.region not in regions):
        return f"region {c.region if c else '?'} is not one of {', '.join(regions)}"
    return None


def _quota(ctx: Context, cluster_id: str) -> str | None:
    r = ctx.request
    return quota_block(
        ctx.tenant_policy,
        ctx.usage_of(),
        Request(r.shape.gpus, {cluster_id: r.shape.gpus}, r.gpu_ms),
    )


def _reservation(ctx: Context, cluster_id: str) -> str | None:
    held = reserved_for_others(ctx.tenants, ctx.usage, ctx.request.tenant, cluster_id)
    if not held:
        return None
    shape = ctx.request.shape
    free = ctx.index.free_gpus(cluster_id, shape)
    if free - held < shape.gpus:
        return f"{free} free GPUs, {held} of them reserved for other tenants; needs {shape.gpus}"
    return None


def _capacity(ctx: Context, cluster_id: str) -> str | None:
    shape = ctx.request.shape
    kinds = ctx.index.fitting_kinds(cluster_id, shape)
    if len(kinds) <= 1 and sum(kinds.values()) >= shape.workers:
        return None
    gang = ctx.index.select_gang(cluster_id, shape)
    return gang if isinstance(gang, str) else None


def _bandwidth(ctx: Context, cluster_id: str) -> str | None:
    if not ctx.moves_data(cluster_id):
        return None
    d = ctx.request.dataset
    assert d is not None
    policy = ctx.tenant_policy
    rate = _prewarm_rate(ctx)
    if rate <= 0:
        return "needs the dataset moved and the tenant has no bandwidth quota left"
    return quota_block(
        policy, ctx.usage_of(), Request(storage_bytes=d.size_bytes, bandwidth_gbps=rate)
    )


def _prewarm_rate(ctx: Context) -> float:
    policy = ctx.tenant_policy
    rate = ctx.policy.interconnect_gbps
    if policy is not None and policy.quota.bandwidth_gbps is not None:
        rate = min(rate, policy.quota.bandwidth_gbps - ctx.usage_of().bandwidth_gbps())
    return max(rate, 0.0)


def _pool(ctx: Context, cluster_id: str) -> str | None:
    r, shape = ctx.request, ctx.request.shape
    if r.pool_room is not None:
        room = r.pool_room.get(cluster_id)
        if room is not None and room < shape.gpus:
            return f"inference pool full: {max(room, 0)} GPU(s) left under its bound"
    if r.pool_keep:
        keep = r.pool_keep.get(cluster_id, 0)
        if keep:
            free = ctx.index.free_gpus(cluster_id, shape)
            if free - keep < shape.gpus:
                return (
                    f"{free} free GPUs, {keep} of them kept for the inference pool; "
                    f"needs {shape.gpus}"
                )
    return None


def _data_here(ctx: Context, cluster_id: str) -> str | None:
    """With `data_only`, a cluster without the dataset is out (a placement that preempts
    rather than copies)."""
    d = ctx.request.dataset
    if not ctx.request.data_only or d is None or cluster_id in d.replicas:
        return None
    return f"dataset {d.dataset_id} is not here (preempting where it is, not copying it)"


def _residency(ctx: Context, cluster_id: str) -> str | None:
    """A dataset's residency: its data never goes to a cluster outside its regions. Not a
    policy's to switch off (always the first check)."""
    d = ctx.request.dataset
    if d is None or not d.residency:
        return None
    c = ctx.cluster(cluster_id)
    if c is not None and c.region in d.residency:
        return None
    return (
        f"dataset {d.dataset_id} stays in {', '.join(d.residency)} (its residency); "
        f"region {c.region if c else '?'} is outside"
    )


FILTERS: dict[str, Filter] = {
    "reachable": _reachable,
    "accelerator": _accelerator,
    "region": _region,
    "quota": _quota,
    "reservation": _reservation,
    "capacity": _capacity,
    "bandwidth": _bandwidth,
    "pool": _pool,
}


def _locality(ctx: Context, cluster_id: str) -> float:
    d = ctx.request.dataset
    if d is None or cluster_id in d.replicas:
        return 1.0
    # Halves after an hour of transfer: a job that must wait hours for its data loses to one
    # that can start now, unless the latter costs far more.
    hours = transfer_s(d.size_bytes, ctx.policy.interconnect_gbps) / 3600
    return 1.0 / (1.0 + hours)


def _latency(ctx: Context, cluster_id: str) -> float:
    c = ctx.cluster(cluster_id)
    if c is None:
        return 0.0
    targets = ctx.request.regions or ((ctx.request.user_region,) if ctx.request.user_region else ())
    known = [c.link_latency_ms[r] for r in targets if r in c.link_latency_ms]
    if not known:
        return 1.0 if not targets or c.region in targets else 0.5
    return max(0.0, 1.0 - min(known) / 300.0)


def _cost(ctx: Context, cluster_id: str) -> float:
    c = ctx.cluster(cluster_id)
    cost = cost_per_gpu_hour(c) if c else 0.0
    if cost <= 0:
        return 1.0
    return ctx.cheapest / cost if ctx.cheapest > 0 else 0.0


def _energy(ctx: Context, cluster_id: str) -> float:
    """The fleet's lowest effective energy price now over this cluster's (1: the cheapest or
    greenest place to draw power this hour). Without any cluster's hourly profile every
    cluster scores 1: the flat declared price is already part of `cost`."""
    c = ctx.cluster(cluster_id)
    if not ctx.energy:
        return 1.0
    if c is None:
        return 0.0
    price = effective_price(c, ctx.energy.get(cluster_id), ctx.now_ms, ctx.policy.renewable_weight)
    if price <= 0:
        return 1.0
    return ctx.greenest / price


def _fit(ctx: Context, cluster_id: str) -> float:
    return ctx.index.fill_after(cluster_id, ctx.request.shape)


def _work(ctx: Context, cluster_id: str) -> float:
    """With a work size: half for finishing by the deadline, half for the least cost of a run
    that meets it (where a cluster has room now) over this cluster's (1: the cheapest such run;
    a run that misses the deadline scores at most 0.5, below every one that meets it); 0 where
    no catalogue figure allows an estimate."""
    found = ctx.estimates.get(cluster_id)
    if found is None:
        return 0.0
    if found.cost <= 0 or ctx.cheapest_work <= 0:
        return 1.0 if found.meets_deadline else 0.5
    cheaper = min(1.0, ctx.cheapest_work / found.cost)
    return (0.5 if found.meets_deadline else 0.0) + 0.5 * cheaper


def _estimates(ctx: Context) -> None:
    """Each cluster's best estimate of the request's work: on the kinds of chip it has enough
    nodes of for the gang (else every kind that matches), priced at the cluster's GPU-hour."""
    work, shape = ctx.request.work, ctx.request.shape
    assert work is not None
    ctx.estimates = {}
    with_room: set[str] = set()
    for cluster_id in _cluster_ids(ctx.index):
        facts = ctx.cluster(cluster_id)
        if facts is None:
            continue
        kinds = [
            k for k, n in ctx.index.fitting_kinds(cluster_id, shape).items() if n >= shape.workers
        ]
        if kinds:
            with_room.add(cluster_id)
        kinds = kinds or [
            m for m in ctx.index.models(cluster_id) if shape.matches(m, ctx.index.facts.catalogue)
        ]
        found = best(
            [
                e
                for kind in sorted(kinds)
                if (
                    e := estimate(
                        work,
                        kind,
                        shape.gpus,
                        cost_per_gpu_hour(facts),
                        ctx.now_ms,
                        ctx.index.facts.catalogue,
                        ctx.measured,
                    )
                )
                is not None
            ]
        )
        if found is not None:
            ctx.estimates[cluster_id] = found
    # The least cost is taken among the clusters with room for the gang now (the others are
    # out of the running at this attempt), among runs that meet the deadline where any does.
    now = [e for c, e in ctx.estimates.items() if c in with_room] or list(ctx.estimates.values())
    meeting = [e.cost for e in now if e.meets_deadline]
    ctx.cheapest_work = min(meeting or [e.cost for e in now], default=0.0)


def _preference(ctx: Context, cluster_id: str) -> float:
    order = ctx.policy.cluster_preference
    return 1.0 / (order.index(cluster_id) + 1) if cluster_id in order else 0.0


def _spread(ctx: Context, cluster_id: str) -> float:
    # Replicas of one service in different clusters fail independently.
    return 1.0 / (1 + ctx.request.spread.get(cluster_id, 0))


SCORERS: dict[str, Scorer] = {
    "locality": _locality,
    "latency": _latency,
    "cost": _cost,
    "fit": _fit,
    "preference": _preference,
    "spread": _spread,
    "energy": _energy,
    "work": _work,
}


def rank_clusters(ctx: Context) -> list[ClusterScore]:
    """Every cluster, feasible ones first by score, then the rejected with their reasons."""
    facts = ctx.index.facts
    weights = ctx.policy.weights
    ctx.cheapest = _cheapest(facts)
    if weights.get("energy") and ctx.energy:
        ctx.greenest = min(
            (
                p
                for c in facts.clusters.values()
                if (
                    p := effective_price(
                        c, ctx.energy.get(c.cluster_id), ctx.now_ms, ctx.policy.renewable_weight
                    )
                )
                > 0
            ),
            default=0.0,
        )
    # The work scorer judges only requests that say their size (the others' decisions are as
    # they were before it existed); for those, the cost of the whole run on the chip it would
    # get replaces the cost of a GPU-hour, which knows nothing of the chip's speed.
    work = ctx.request.work is not None and bool(weights.get("work"))
    if work:
        _estimates(ctx)
    skipped = "cost" if work else "work"
    scorers = [
        (name, SCORERS[name], weights[name])
        for name in sorted(weights)
        if weights[name] and name != skipped
    ]
    filters = [
        ("residency", _residency),
        ("data", _data_here),
        *((name, FILTERS[name]) for name in ctx.policy.filters),
    ]
    out = []
    for cluster_id in _cluster_ids(ctx.index):
        reason = rejected_by = None
        for name, check in filters:
            reason = check(ctx, cluster_id)
            if reason is not None:
                rejected_by = name
                break
        if reason is not None:
            out.append(ClusterScore(cluster_id, 0.0, {}, reason, rejected_by))
            continue
        parts = {name: round(score(ctx, cluster_id), 6) for name, score, _ in scorers}
        total = round(sum(w * parts[name] for name, _, w in scorers), 6)
        out.append(ClusterScore(cluster_id, total, parts))
    out.sort(key=lambda s: (s.rejected is not None, -s.total, s.cluster_id))
    return out


def _cheapest(facts: FleetFacts) -> float:
    """The lowest GPU-hour cost in the fleet (what the cost score is relative to), once per
    observation."""
    cached = facts.memo.get("cheapest")
    if cached is None:
        cached = facts.memo["cheapest"] = min(
            (c for c in (cost_per_gpu_hour(f) for f in facts.clusters.values()) if c > 0),
            default=0.0,
        )
    return cached


def _cluster_ids(index: CapacityIndex) -> list[str]:
    cached = index.facts.memo.get("cluster_ids")
    if cached is None:
        cached = index.facts.memo["cluster_ids"] = sorted(
            set(index.facts.clusters) | set(index.buckets)
        )
    return cached


@dataclass(frozen=True, slots=True)
class Attempt:
    """A placement attempt: where (one placement per cluster part), why, what else was there."""

    placements: tuple[Placement, ...]
    reason: str
    alternatives: tuple[ClusterScore, ...]
    prewarms: tuple[DatasetPrewarm, ...] = ()
    workers: int = 0  # workers placed (an elastic job may get fewer than asked)

    @property
    def placed(self) -> bool:
        return bool(self.placements)


def _explain(score: ClusterScore) -> str:
    return (
        f"{score.cluster_id} scores {score.total} ("
        + ", ".join(f"{k} {v}" for k, v in score.parts.items())
        + ")"
    )


def _queued_reason(scores: list[ClusterScore]) -> str:
    return (
        "; ".join(f"{s.cluster_id}: {s.rejected}" for s in scores if s.rejected)
        or "no clusters in the view"
    )


def _prewarm(ctx: Context, cluster_id: str) -> DatasetPrewarm | None:
    d = ctx.request.dataset
    if d is None or cluster_id in d.replicas:
        return None
    target = ctx.cluster(cluster_id)

    def distance(replica: str) -> tuple[float, str]:
        source = ctx.cluster(replica)
        if target is None or source is None:
            return 1e9, replica
        return target.link_latency_ms.get(source.region, 1e9), replica

    sources = sorted(d.replicas, key=distance)
    rate = _prewarm_rate(ctx) or ctx.policy.interconnect_gbps
    return DatasetPrewarm(
        d.dataset_id,
        cluster_id,
        sources[0] if sources else None,
        d.size_bytes,
        round(transfer_s(d.size_bytes, rate), 3),
        rate,
    )


def _reserve(index: CapacityIndex, gang: Gang) -> None:
    for node, mask in gang.workers:
        index.reserve(node, mask)


def _unreserve_gang(index: CapacityIndex, gang: Gang) -> None:
    for node, mask in gang.workers:
        index.release(node, mask)


def unreserve(index: CapacityIndex, placements: tuple[Placement, ...] | list[Placement]) -> None:
    for placement in placements:
        for node, mask in refs_by_node(placement.gpus).items():
            index.release(node, mask)


def place_gang(ctx: Context) -> Attempt:
    """The whole gang in the best cluster that holds it."""
    scores = rank_clusters(ctx)
    top = tuple(s for s in scores if s.rejected is None)[: ctx.policy.alternatives]
    shown = top + tuple(s for s in scores if s.rejected is not None)
    for score in scores:
        if score.rejected is not None:
            break
        shape = ctx.request.shape
        found = ctx.estimates.get(score.cluster_id)
        if found is not None:
            shape = one_kind(shape, found.kind)  # the chip the estimate is for
        gang = ctx.index.select_gang(score.cluster_id, shape)
        if isinstance(gang, str):
            continue
        _reserve(ctx.index, gang)
        placement = to_placement(gang, shape, ctx.index)
        prewarm = _prewarm(ctx, score.cluster_id)
        estimated = [found.describe()] if found is not None else []
        return Attempt(
            (placement,),
            "; ".join([_explain(score), *estimated, *placement.reasons]),
            shown,
            (prewarm,) if prewarm else (),
            ctx.request.shape.workers,
        )
    return Attempt((), _queued_reason(scores), shown)


def place_split(ctx: Context) -> Attempt:
    """Whole pipeline replicas over several clusters, the best-scored first; all or none."""
    shape = ctx.request.shape
    unit = shape.replica_workers if shape.workers % shape.replica_workers == 0 else shape.workers
    replicas = shape.workers // unit
    one = replace(shape, workers=unit)
    scores = rank_clusters(replace_request(ctx, shape=one, gpu_ms=0))
    placements: list[Placement] = []
    held: dict[str, int] = {}
    left = replicas
    for score in scores:
        if score.rejected is not None or not left:
            break
        fits = min(left, ctx.index.fitting_nodes(score.cluster_id, one) // unit)
        while fits:
            part = replace(shape, workers=fits * unit)
            scoped = _holding(replace_request(ctx, shape=part, gpu_ms=0), held)
            block = _quota(scoped, score.cluster_id)
            gang = ctx.index.select_gang(score.cluster_id, part) if block is None else block
            if not isinstance(gang, str):
                _reserve(ctx.index, gang)
                placements.append(to_placement(gang, part, ctx.index))
                held[score.cluster_id] = held.get(score.cluster_id, 0) + part.gpus
                left -= fits
                break
            fits -= 1
    shown = _shown(ctx, scores)
    if left:
        unreserve(ctx.index, placements)
        return Attempt(
            (),
            f"no single cluster holds the job, and split by pipeline replicas "
            f"{replicas - left} of {replicas} replicas fit: " + _queued_reason(scores),
            shown,
        )
    prewarms = tuple(p for p in (_prewarm(ctx, pl.cluster_id) for pl in placements) if p)
    where = ", ".join(f"{pl.cluster_id} ({len(pl.workers)} workers)" for pl in placements)
    return Attempt(
        tuple(placements),
        f"split across clusters by whole pipeline replicas: {where}",
        shown,
        prewarms,
        shape.workers,
    )


def place_federated(ctx: Context) -> Attempt:
    """One participant (the job's gang) in each region where its dataset lives, in a cluster
    that holds the data there: no data moves. All regions or none."""
    d = ctx.request.dataset
    assert d is not None
    local = replace_request(ctx, data_only=True)
    scores = rank_clusters(local)
    shown = _shown(ctx, scores)
    region_of = {c: f.region for c in d.replicas if (f := ctx.cluster(c)) is not None}
    regions = sorted({r for r in region_of.values() if not d.residency or r in d.residency})
    if not regions:
        return Attempt(
            (),
            f"federated: dataset {d.dataset_id} has no replica in a cluster of its regions",
            shown,
        )
    shape = ctx.request.shape
    block = quota_block(
        ctx.tenant_policy,
        ctx.usage_of(),
        Request(shape.gpus * len(regions), {}, ctx.request.gpu_ms * len(regions)),
    )
    if block is not None:
        return Attempt((), f"federated, {len(regions)} participants: {block}", shown)
    placements: list[Placement] = []
    where = []
    for region in regions:
        here = [s for s in scores if region_of.get(s.cluster_id) == region]
        for score in here:
            if score.rejected is not None:
                continue
            gang = ctx.index.select_gang(score.cluster_id, shape)
            if isinstance(gang, str):
                continue
            _reserve(ctx.index, gang)
            placements.append(to_placement(gang, shape, ctx.index))
            where.append(f"{region} ({score.cluster_id})")
            break
        else:
            unreserve(ctx.index, placements)
            return Attempt(
                (),
                f"federated: no room in {region}, where its data lives: "
                + (_queued_reason(here) if any(s.rejected for s in here) else "no cluster fits"),
                shown,
            )
    return Attempt(
        tuple(placements),
        "federated: one participant in each region its data lives in, "
        + ", ".join(where)
        + "; only model updates cross regions",
        shown,
        (),
        shape.workers * len(placements),
    )


def place_replicas(ctx: Context, replicas: int) -> Attempt:
    """Service replicas one by one, each to the best cluster given those already placed (the
    spread scorer keeps them apart); all `replicas` or none."""
    base = ctx.request
    spread: dict[str, int] = dict(base.spread)
    gangs: list[Gang] = []
    first_scores: list[ClusterScore] | None = None
    one = replace(base.shape, workers=1)
    held: dict[str, int] = {}
    for _ in range(replicas):
        scores = rank_clusters(_holding(replace_request(ctx, shape=one, spread=dict(spread)), held))
        if first_scores is None:
            first_scores = scores
        chosen = None
        for score in scores:
            if score.rejected is not None:
                break
            gang = ctx.index.select_gang(score.cluster_id, one)
            if not isinstance(gang, str):
                chosen = gang
                break
        if chosen is None:
            for gang in gangs:
                _unreserve_gang(ctx.index, gang)
            return Attempt(
                (),
                f"{len(gangs)} of {replicas} replicas fit: " + _queued_reason(scores),
                _shown(ctx, scores),
            )
        _reserve(ctx.index, chosen)
        gangs.append(chosen)
        spread[chosen.cluster_id] = spread.get(chosen.cluster_id, 0) + 1
        held[chosen.cluster_id] = held.get(chosen.cluster_id, 0) + one.per_worker
    by_cluster: dict[str, list[Gang]] = {}
    for gang in gangs:
        by_cluster.setdefault(gang.cluster_id, []).append(gang)
    placements = tuple(
        to_placement(
            Gang(
                cluster,
                tuple(w for g in group for w in g.workers),
                tuple(sorted({leaf for g in group for leaf in g.leaves})),
                0,
            ),
            replace(one, workers=len(group)),
            ctx.index,
        )
        for cluster, group in sorted(by_cluster.items())
    )
    where = ", ".join(f"{p.cluster_id} x{len(p.workers)}" for p in placements)
    return Attempt(
        placements,
        f"{replicas} replicas over {len(placements)} cluster(s): {where}",
        _shown(ctx, first_scores or []),
        (),
        replicas,
    )


def _shown(ctx: Context, scores: list[ClusterScore]) -> tuple[ClusterScore, ...]:
    return tuple(s for s in scores if s.rejected is None)[: ctx.policy.alternatives] + tuple(
        s for s in scores if s.rejected is not None
    )


def _holding(ctx: Context, held: Mapping[str, int]) -> Context:
    """The context as if the tenant already held `held` GPUs per cluster (the parts of one
    placement placed so far), so quotas count the whole placement."""
    if not held:
        return ctx
    usage = ctx.usage_of()
    clusters = dict(usage.cluster_gpus)
    for cluster, n in held.items():
        clusters[cluster] = clusters.get(cluster, 0) + n
    scoped = replace(usage, gpus=usage.gpus + sum(held.values()), cluster_gpus=clusters)
    return Context(
        ctx.index,
        ctx.policy,
        ctx.tenants,
        {**ctx.usage, ctx.request.tenant: scoped},
        ctx.request,
        ctx.cheapest,
    )


def replace_request(ctx: Context, **changes: Any) -> Context:
    return Context(
        ctx.index, ctx.policy, ctx.tenants, ctx.usage, replace(ctx.request, **changes), ctx.cheapest
    )
