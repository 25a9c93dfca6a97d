"""What would make a queued job fit: the constraint that binds it, and the smallest change that
would place it now, checked by running the placement again with that change made.

"Why is my job not running" gets a reason from every scheduler; this answers the next question
("what would it take") for every queued job at once. A change is only offered once the same
placement code the scheduler runs (`decide.try_place`) placed the job with it:

- quota: the tenant's GPU quota (or GPU-hour budget) raised by what the job lacks;
- capacity (or another tenant's reservation, or the inference pool's share): the fewest GPUs
  freed in one cluster, taken from the jobs there of the lowest priority first, named with the
  leaf switches the job would then land under;
- accelerator: another chip the fleet has, where the job names a model no free node has;
- region: another region for a service whose regions hold no room.

Pure: it reads the scheduler's state and leaves it as it found it (each trial's changes are
undone, and a trial that placed the job gives its GPUs back), so the live scheduler and a
replay may both ask it.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from fleetline.processors.scheduling.decide import request_for, shape_keys, try_place
from fleetline.processors.scheduling.pipeline import Attempt, unreserve
from fleetline.processors.scheduling.specs import InferenceServiceSpec, TrainingJobSpec
from fleetline.processors.scheduling.state import Job, SchedulerState
from fleetline.processors.scheduling.tenancy import HOUR_MS, Request, quota_block

# The most jobs a "GPUs freed" change may take GPUs from.
MAX_FREED = 64
# A trial: (binding constraint, the change in words, GPUs the change adds or frees, how to
# make it (the context manager undoes it), the cluster it is made in or None).
Trial = tuple[str, str, int, Callable[[], contextlib.AbstractContextManager[None]], str | None]


@dataclass(frozen=True)
class Fit:
    """One queued job: what binds it, and the change that would place it (None: none found)."""

    job: str
    tenant: str
    gpus: int
    binding: str  # quota, capacity, reservation, pool, accelerator, region, reachable, ...
    why: str  # the placement's own words for what binds it
    change: str | None = None
    places_in: str | None = None  # where the job goes once the change is made
    checked: bool = False  # the placement ran again with the change and placed it

    def as_data(self) -> dict[str, object]:
        return {
            "job": self.job,
            "tenant": self.tenant,
            "gpus": self.gpus,
            "binding": self.binding,
            "why": self.why,
            "change": self.change,
            "places_in": self.places_in,
            "checked": self.checked,
        }


def what_would_fit(s: SchedulerState, keys: list[str] | None = None) -> list[Fit]:
    """Every queued job (or those named), in queue order. Jobs of one shape (the scheduler's
    own key for "fails alike": tenant, priority, size, chips, data, the chip a checkpoint
    must resume on) get one answer, worked out for the first of them."""
    wanted = None if keys is None else set(keys)
    out = []
    seen: dict[tuple[Any, ...], Fit] = {}
    for job in s.queue():
        if wanted is not None and job.key not in wanted:
            continue
        shape = (*shape_keys(job)[1], job.ran_on if job.checkpoint_ms is not None else None)
        known = seen.get(shape)
        fit = fit_of(s, job) if known is None else replace(known, job=job.key)
        seen.setdefault(shape, fit)
        out.append(fit)
    return out


def fit_of(s: SchedulerState, job: Job) -> Fit:
    """One queued job: the first trial (of `_trials`' order) that the placement confirms, or
    the binding constraint alone when none does."""
    need = request_for(s, job).shape.gpus
    now = _placed(s, job)
    if now is not None:
        return Fit(job.key, job.tenant, need, "none", "it fits now", None, now, True)
    current = try_place(s, job)
    binding, why = _binding(current)
    for kind, change, _size, make, cluster_id in _trials(s, job, current, need):
        with make():
            placed = _placed(s, job)
        if placed is not None:
            said = _reason_of(current, kind, cluster_id) or (why if kind == binding else None)
            return Fit(job.key, job.tenant, need, kind, said or why, change, placed, True)
    return Fit(job.key, job.tenant, need, binding, why)


def _placed(s: SchedulerState, job: Job) -> str | None:
    """Where the job would go now (its GPUs given back at once), or None."""
    attempt = try_place(s, job)
    if not attempt.placed:
        return None
    unreserve(s.index, attempt.placements)
    return ",".join(p.cluster_id for p in attempt.placements)


def _binding(attempt: Attempt) -> tuple[str, str]:
    """The filter that ruled out most clusters (a tenant-wide quota rules out all)."""
    if attempt.reason.startswith("quota:"):
        return "quota", attempt.reason
    rejected = [a for a in attempt.alternatives if a.rejected]
    if not rejected:
        return "placement", attempt.reason
    counts = Counter(a.by or "filter" for a in rejected)
    kind = min(counts, key=lambda k: (-counts[k], k))
    return kind, next(
        f"{a.cluster_id}: {a.rejected}" for a in rejected if (a.by or "filter") == kind
    )


def _reason_of(attempt: Attempt, kind: str, cluster_id: str | None) -> str | None:
    """What ruled the job out where the change is made (or anywhere, for a fleet-wide one)."""
    if kind == "quota" and attempt.reason.startswith("quota:"):
        return attempt.reason
    return next(
        (
            f"{a.cluster_id}: {a.rejected}"
            for a in attempt.alternatives
            if a.by == kind and cluster_id in (None, a.cluster_id)
        ),
        None,
    )


def _trials(s: SchedulerState, job: Job, current: Attempt, need: int) -> Iterator[Trial]:
    """The changes worth trying, smallest of each kind first."""
    yield from _quota_trials(s, job, need)
    yield from _free_trials(s, job, _clusters_by(current, ("capacity", "reservation", "pool")))
    yield from _accelerator_trials(s, job, current)
    yield from _region_trials(s, job, current)


def _clusters_by(attempt: Attempt, kinds: tuple[str, ...]) -> list[str]:
    return sorted(a.cluster_id for a in attempt.alternatives if a.by in kinds)


def _quota_trials(s: SchedulerState, job: Job, need: int) -> Iterator[Trial]:
    policy = s.tenants.get(job.tenant, s.policy.default_tenant)
    if policy is None:
        return
    request = request_for(s, job)
    usage = s.usage_of(job.tenant)
    if quota_block(policy, usage, Request(need, {}, request.gpu_ms)) is None:
        return
    quota = policy.quota
    update: dict[str, int | float] = {}
    words = []
    if quota.gpus is not None and usage.gpus + need > quota.gpus:
        more = usage.gpus + need - quota.gpus
        update["gpus"] = quota.gpus + more
        words.append(
            f"tenant {job.tenant} quota +{more} GPUs ({quota.gpus} -> {quota.gpus + more})"
        )
    if quota.gpu_hours is not None and request.gpu_ms:
        spoken = usage.consumed_gpu_ms + usage.committed_gpu_ms + request.gpu_ms
        if spoken > quota.gpu_hours * HOUR_MS:
            hours = -(-(spoken - int(quota.gpu_hours * HOUR_MS)) // HOUR_MS)
            update["gpu_hours"] = quota.gpu_hours + hours
            words.append(f"tenant {job.tenant} budget +{hours} GPU-hours")
    if not update:
        return
    raised = policy.model_copy(update={"quota": quota.model_copy(update=update)})

    @contextlib.contextmanager
    def make() -> Iterator[None]:
        had = job.tenant in s.tenants
        before = s.tenants.get(job.tenant)
        s.tenants[job.tenant] = raised
        try:
            yield
        finally:
            if had and before is not None:
                s.tenants[job.tenant] = before
            else:
                del s.tenants[job.tenant]

    yield "quota", "; ".join(words), int(update.get("gpus", 0)), make, None


def _free_trials(s: SchedulerState, job: Job, cluster_ids: list[str]) -> Iterator[Trial]:
    """The fewest GPUs to free in one of `cluster_ids` for the job to fit there. A cluster's
    deficit (GPUs the job needs past what is free there) bounds what it can take from below,
    so the clusters are tried by it and the search stops once no cluster left can beat the
    best found."""
    shape = request_for(s, job).shape
    bounds = sorted((max(shape.gpus - s.index.free_gpus(c, shape), 0), c) for c in cluster_ids)
    best: Trial | None = None
    for bound, cluster_id in bounds:
        if best is not None and bound >= best[2]:
            break
        found = _fewest_freed(s, job, cluster_id, bound)
        if found is not None and (best is None or found[2] < best[2]):
            best = found
    if best is not None:
        yield best


def _fewest_freed(s: SchedulerState, job: Job, cluster_id: str, short: int) -> Trial | None:
    """The jobs holding GPUs in the cluster, lowest priority and fewest GPUs first: the
    shortest run of them whose GPUs, freed, place the job there (`short`: the GPUs it lacks
    there) (freeing more never hurts, so
    once a run that does is found, the shortest is searched by halves)."""
    holders = sorted(
        (s.jobs[k] for k in s.cluster_jobs.get(cluster_id, ()) if k in s.jobs and k != job.key),
        key=lambda j: (j.priority, j.gpus, j.key),
    )

    def freeing(n: int) -> list[tuple[str, int]]:
        return [
            (node, mask)
            for j in holders[:n]
            for node, mask in j.allocation.get(cluster_id, {}).items()
        ]

    @contextlib.contextmanager
    def made(masks: list[tuple[str, int]]) -> Iterator[None]:
        for node, mask in masks:
            s.index.release(node, mask)
        try:
            yield
        finally:
            for node, mask in masks:
                s.index.reserve(node, mask)

    def placed_here(n: int) -> Attempt | None:
        with made(freeing(n)):
            attempt = try_place(s, job)
            unreserve(s.index, attempt.placements)
        here = attempt.placed and cluster_id in {p.cluster_id for p in attempt.placements}
        return attempt if here else None

    # The shortest run that frees the cluster's deficit is the least that could do; from it the
    # run is doubled until the job fits, up to MAX_FREED jobs (a change that evicts more is no
    # small change, and releasing thousands of allocations costs seconds on a large fleet).
    low = 0
    while low < len(holders) and short > 0:
        short -= sum(m.bit_count() for m in holders[low].allocation.get(cluster_id, {}).values())
        low += 1
    low = max(low, 1)
    high = low
    while placed_here(high) is None:
        if high >= min(len(holders), MAX_FREED):
            return None
        low, high = high + 1, min(high * 2, len(holders), MAX_FREED)
    while low < high:
        mid = (low + high) // 2
        if placed_here(mid) is not None:
            high = mid
        else:
            low = mid + 1
    attempt = placed_here(low)
    assert attempt is not None
    masks = freeing(low)
    freed = sum(m.bit_count() for _, m in masks)
    leaves = sorted({leaf for p in attempt.placements for leaf in p.leaves if leaf})
    under = f" under leaf {', '.join(leaves)}" if leaves else ""
    names = ", ".join(j.key for j in holders[:low])
    return (
        "capacity",
        f"{freed} GPUs freed in {cluster_id}{under} (now held by {names})",
        freed,
        functools.partial(made, masks),
        cluster_id,
    )


def _accelerator_trials(s: SchedulerState, job: Job, current: Attempt) -> Iterator[Trial]:
    spec = job.spec
    if not isinstance(spec, TrainingJobSpec | InferenceServiceSpec) or not spec.accelerators:
        return
    models = sorted(
        {m.model for c in _clusters_by(current, ("accelerator",)) for m in s.index.models(c)}
    )
    for model in models:
        other = spec.model_copy(update={"accelerator": model})
        yield (
            "accelerator",
            f"accept {model} (it names {', '.join(spec.accelerators)})",
            0,
            functools.partial(_spec_as, job, other),
            None,
        )


def _region_trials(s: SchedulerState, job: Job, current: Attempt) -> Iterator[Trial]:
    spec = job.spec
    if not isinstance(spec, InferenceServiceSpec):
        return
    regions = sorted(
        {
            c.region
            for cid in _clusters_by(current, ("region",))
            if (c := s.facts.clusters.get(cid)) is not None and c.region
        }
    )
    for region in regions:
        other = spec.model_copy(update={"regions": (*spec.regions, region)})
        yield "region", f"allow region {region}", 0, functools.partial(_spec_as, job, other), None


@contextlib.contextmanager
def _spec_as(job: Job, spec: TrainingJobSpec | InferenceServiceSpec) -> Iterator[None]:
    before, scaling = job._spec, job.scaling
    job._spec = spec
    job.scaling = {k: v for k, v in scaling.items() if k != "regions"}
    try:
        yield
    finally:
        job._spec = before
        job.scaling = scaling
