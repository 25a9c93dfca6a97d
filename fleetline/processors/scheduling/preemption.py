"""Preemption: which lower-priority jobs yield so that a gang fits, losing the least work.

Topology-aware: a node counts as freed only when the GPUs left after evicting some of its jobs
form the worker's NVLink groups (`pick`), so eviction frees whole islands or nodes rather than
scattered GPUs; the workers' nodes are taken under one leaf switch when one leaf has enough of
them. Among the ways to free a node, and among nodes, the cheapest wins: the cost of a victim is
the work it loses, GPU-seconds since its last checkpoint (a whole gang restarts from its
checkpoint, so a victim costs the same on every node it is on and is counted once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from fleetline.processors.scheduling.capacity import CapacityIndex, GangShape, pick
from fleetline.processors.view.accelerators import Accelerator

# Subsets of a node's victims tried exhaustively up to this many jobs on one node; beyond it
# only single victims and all of them (a node rarely holds more than eight jobs).
EXHAUSTIVE_UP_TO = 6


@dataclass(frozen=True)
class Eviction:
    victims: tuple[str, ...]
    lost_gpu_s: float
    leaves: tuple[str, ...]


def _node_options(
    free: int,
    islands: tuple[int, ...],
    usable: int,
    need: int,
    tensor: int,
    jobs: list[tuple[str, int, float]],
) -> tuple[float, tuple[str, ...]] | None:
    """The cheapest set of `jobs` (name, mask, cost) on one node whose eviction lets a worker
    fit, as (cost, names); None when none does."""
    if pick(islands, free, need, tensor):
        return 0.0, ()
    best: tuple[float, int, tuple[str, ...]] | None = None
    sizes: Iterable[int] = (
        range(1, len(jobs) + 1) if len(jobs) <= EXHAUSTIVE_UP_TO else (1, len(jobs))
    )
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


@dataclass(frozen=True)
class Victims:
    """The jobs in one cluster that a gang may evict: `order`, (work lost, job) from the least
    lost (GPU-seconds since its last checkpoint), then by job; `cost`, each one's loss by job.
    Their GPUs are read as the search reaches them, not beforehand (it usually stops after a
    few of them): `masks(job)` a victim's GPU mask per node of the cluster, `holders(node)` the
    jobs holding GPUs on a node, victims or not."""

    order: Sequence[tuple[float, str]]
    cost: Mapping[str, float]
    masks: Callable[[str], Mapping[str, int]]
    holders: Callable[[str], Iterable[str]]

    def on_node(self, node_id: str) -> list[tuple[str, int, float]]:
        """The victims holding GPUs on the node, (job, mask, loss) by job."""
        cost = self.cost
        return sorted(
            (job, self.masks(job)[node_id], cost[job])
            for job in self.holders(node_id)
            if job in cost
        )


def plan_eviction(
    index: CapacityIndex, cluster_id: str, shape: GangShape, victims: Victims
) -> Eviction | None:
    """The victims whose eviction lets the gang fit in the cluster, losing the least work; None
    when no such set exists.

    Branch and bound: a node is first looked at when its cheapest victim comes up, so a node not
    yet looked at costs at least the current victim's loss; the search stops once that passes
    the best gang found (whole-leaf totals count a shared victim once, which the bound allows
    for: every victim of a node not yet looked at is still to come)."""
    if not victims.order:
        return None
    need, tensor = shape.per_worker, min(shape.tensor, shape.per_worker)
    nodes = index.facts.nodes
    taken = index.taken
    costs = victims.cost
    matching: dict[Accelerator, bool] = {}  # a cluster has few kinds of chip, and many nodes

    def option(node_id: str) -> tuple[float, tuple[str, ...]] | None:
        node = nodes.get(node_id)
        if node is None or not node.schedulable:
            return None
        kind = node.accelerator
        matches = matching.get(kind)
        if matches is None:
            matches = matching[kind] = shape.matches(kind, index.facts.catalogue)
        if not matches:
            return None
        usable = node.healthy | (node.degraded if shape.allow_degraded else 0)
        if usable.bit_count() < need:
            return None
        free = usable & ~taken.get(node_id, 0)
        return _node_options(free, node.islands, usable, need, tensor, victims.on_node(node_id))

    def total(chosen: list[tuple[float, tuple[str, ...], str]]) -> tuple[float, tuple[str, ...]]:
        names = tuple(sorted({v for _, vs, _ in chosen for v in vs}))
        return sum(costs[v] for v in names), names

    workers = shape.workers
    options: dict[str, list[tuple[float, tuple[str, ...], str]]] = {}
    if workers > 1:
        # Nodes that are free already count too: they cost nothing.
        for leaf, node_id in index.free_nodes(cluster_id, shape):
            if not any(job in costs for job in victims.holders(node_id)):
                options.setdefault(leaf, []).append((0.0, (), node_id))
    best: tuple[float, int, str, tuple[str, ...], tuple[str, ...]] | None = None
    seen: set[str] = set()
    for bound, victim in victims.order:
        if best is not None and bound > best[0]:
            break
        for node_id in sorted(victims.masks(victim)):
            if node_id in seen:
                continue
            seen.add(node_id)
            found = option(node_id)
            if found is None:
                continue
            leaf = nodes[node_id].leaf
            if workers == 1:
                key = (found[0], len(found[1]), leaf, found[1], (leaf,))
                if found[1] and (best is None or key[:4] < best[:4]):
                    best = key
                continue
            candidates = options.setdefault(leaf, [])
            candidates.append((found[0], found[1], node_id))
            if len(candidates) >= workers:
                candidates.sort()
                cost, names = total(candidates[:workers])
                key = (cost, len(names), leaf, names, (leaf,))
                if names and (best is None or key[:3] < best[:3]):
                    best = key
    if best is None and workers > 1 and sum(len(o) for o in options.values()) >= workers:
        # No leaf holds the gang: the cheapest nodes wherever they are.
        flat = sorted((c, vs, n, leaf) for leaf, cs in options.items() for c, vs, n in cs)
        chosen = flat[:workers]
        cost, names = total([(c, vs, n) for c, vs, n, _ in chosen])
        leaves = tuple(sorted({leaf for *_, leaf in chosen}))
        if names:
            best = (cost, len(names), leaves[0], names, leaves)
    if best is None:
        return None
    cost, _, _, names, leaves = best
    return Eviction(names, cost, leaves)
