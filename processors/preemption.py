"""Preemption: which lower-priority jobs yield so that a gang fits, losing the least work.

Topology-aware: a node counts as freed only when the GPUs left after evicting some of its jobs
form the worker's NVLink groups (`pick`), so eviction frees whole islands or nodes rather than
scattered GPUs; the workers' nodes are taken under one leaf switch when one leaf has enough of
them. Among the ways to free a node, and among nodes, the cheapest wins: the cost of a victim is
the work it loses, GPU-seconds since its last checkpoint (a whole gang restarts from its
checkpoint, so a victim costs the same on every node it is on and is counted once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import combinations

from fleetline.processors.capacity import CapacityIndex, GangShape, pick

# Subsets of a node's victims tried exhaustively up to this many jobs on one node; beyond it
# only single victims and all of them (a node rarely holds more than eight jobs).
EXHAUSTIVE_UP_TO = 6


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it."""

    job: str
    priority: int
    cluster_id: str
    masks: Mapping[str, int]  # node -> GPUs
    lost_gpu_s: float  # what eviction loses: GPU-seconds since the last checkpoint


@dataclass(frozen=True)
class Eviction:
    victims: tuple[str, ...]
    lost_gpu_s: float
    leaves: tuple[str, ...]


def _node_options(free: int, islands: tuple[int, ...], usable: int, need: int, tensor: int,
                  jobs: list[tuple[str, int, float]]) -> tuple[float, tuple[str, ...]] | None:
    """The cheapest set of `jobs` (name, mask, cost) on one node whose eviction lets a worker
    fit, as (cost, names); None when none does."""
    if pick(islands, free, need, tensor):
        return 0.0, ()
    best: tuple[float, int, tuple[str, ...]] | None = None
    sizes: Iterable[int] = (range(1, len(jobs) + 1) if len(jobs) <= EXHAUSTIVE_UP_TO
                            else (1, len(jobs)))
    for size in sizes:
        for group in combinations(jobs, size):
            freed = free
            cost = 0.0
            for _, mask, c in group:
                freed |= mask & usable
                cost += c
            if best is not None and (cost, size) >= best[:2]:
                continue
            if pick(islands, freed, need, tensor):
                best = (cost, size, tuple(sorted(name for name, _, _ in group)))
    return None if best is None else (best[0], best[2])


def plan_eviction(index: CapacityIndex, cluster_id: str, shape: GangShape, priority: int,
                  running: Iterable[Running]) -> Eviction | None:
    """The victims (all of priority below `priority`) whose eviction lets the gang fit in the
    cluster, losing the least work; None when no such set exists."""
    on_node: dict[str, list[tuple[str, int, float]]] = {}
    for job in running:
        if job.cluster_id != cluster_id or job.priority >= priority:
            continue
        for node, mask in job.masks.items():
            on_node.setdefault(node, []).append((job.job, mask, job.lost_gpu_s))
    if not on_node:
        return None
    need, tensor = shape.per_worker, min(shape.tensor, shape.per_worker)
    options: dict[str, list[tuple[float, tuple[str, ...], str]]] = {}
    for node_id, jobs in sorted(on_node.items()):
        node = index.facts.nodes.get(node_id)
        if node is None or node.status != "UP" or not shape.matches(node.model):
            continue
        usable = node.healthy | (node.degraded if shape.allow_degraded else 0)
        if usable.bit_count() < need:
            continue
        free = usable & ~index.taken.get(node_id, 0)
        found = _node_options(free, node.islands, usable, need, tensor, sorted(jobs))
        if found is not None:
            options.setdefault(node.leaf, []).append((found[0], found[1], node_id))
    # Nodes that are free already count too: they cost nothing.
    for (model, islands, free_h, free_d), nodes in index.buckets.get(cluster_id, {}).items():
        if not shape.matches(model):
            continue
        free = free_h | free_d if shape.allow_degraded else free_h
        if not pick(islands, free, need, tensor):
            continue
        for node_id in nodes:
            if node_id not in on_node:
                options.setdefault(index.facts.nodes[node_id].leaf, []).append(
                    (0.0, (), node_id))
    if sum(len(o) for o in options.values()) < shape.workers:
        return None
    costs = {job.job: job.lost_gpu_s for job in running}

    def total(chosen: list[tuple[float, tuple[str, ...], str]]) -> tuple[float, tuple[str, ...]]:
        victims = tuple(sorted({v for _, vs, _ in chosen for v in vs}))
        return sum(costs[v] for v in victims), victims

    best: tuple[float, int, str, tuple[str, ...], tuple[str, ...]] | None = None
    for leaf, candidates in options.items():
        if len(candidates) < shape.workers:
            continue
        candidates.sort()
        cost, victims = total(candidates[:shape.workers])
        key = (cost, len(victims), leaf, victims, (leaf,))
        if best is None or key[:3] < best[:3]:
            best = key
    if best is None:
        # No leaf holds the gang: the cheapest nodes wherever they are.
        flat = sorted((c, vs, n, leaf) for leaf, cs in options.items() for c, vs, n in cs)
        chosen = flat[:shape.workers]
        cost, victims = total([(c, vs, n) for c, vs, n, _ in chosen])
        leaves = tuple(sorted({leaf for *_, leaf in chosen}))
        best = (cost, len(victims), leaves[0], victims, leaves)
    cost, _, _, victims, leaves = best
    if not victims:
        return None  # it fits without evicting anyone: not a preemption
    return Eviction(victims, cost, leaves)
