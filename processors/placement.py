"""In-cluster, topology-aware gang placement: a pure function of the resource view and a job.

All workers or none (gang). Each worker takes `gpus_per_worker` GPUs on one node; a
tensor-parallel group sits inside one NVLink island when it fits in one (else it takes whole
nodes); the workers gather under as few leaf switches as possible, so pipeline stages talk
through one leaf; communication-heavy jobs never get degraded GPUs (light ones may); nodes
already partly used are filled first (best fit), so whole nodes stay free for big jobs.

The result carries its reasons: where it went and why, or why it cannot go. Cross-cluster
choice, quotas, priorities and preemption are the next layers of the scheduling issue.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetline.processors.specs import TrainingJob
from fleetline.processors.view import (
    DEGRADED,
    HEALTHY,
    NodeView,
    ResourceView,
    gpu_health,
    node_status,
)

GpuRef = tuple[str, int]


@dataclass(frozen=True)
class Placement:
    cluster_id: str
    workers: tuple[tuple[GpuRef, ...], ...]  # one tuple of GPUs per worker, in rank order
    leaves: tuple[str, ...]
    reasons: tuple[str, ...]

    @property
    def gpus(self) -> tuple[GpuRef, ...]:
        return tuple(ref for worker in self.workers for ref in worker)


@dataclass(frozen=True)
class Unplaceable:
    cluster_id: str
    reason: str


def usable_gpus(view: ResourceView, node: NodeView, allow_degraded: bool) -> set[int]:
    """The node's GPUs a new job may take: node UP, GPU not failed, not allocated, and not
    degraded unless the job tolerates it."""
    if node_status(view, node) != "UP":
        return set()
    out = set()
    for index, gpu in node.gpus.items():
        health, _ = gpu_health(node, gpu)
        if (node.node_id, index) in view.gpu_owner:
            continue
        if health == HEALTHY or (health == DEGRADED and allow_degraded):
            out.add(index)
    return out


def _islands(node: NodeView) -> list[list[int]]:
    return node.islands or [sorted(node.gpus)]


def _pick_on_node(node: NodeView, free: set[int], need: int, tensor: int) -> tuple[int, ...] | None:
    """`need` free GPUs of the node in groups of `tensor`, each group inside one island when a
    group fits in one; the tightest islands first (best fit)."""
    islands = _islands(node)
    widest = max((len(i) for i in islands), default=0)
    if tensor > widest:
        # The group spans islands: it must be the whole node (NVLink through the node's switch).
        everything = sorted(g for i in islands for g in i)
        return tuple(everything) if need == len(everything) and set(everything) <= free else None
    picked: list[int] = []
    groups = need // tensor
    spare = sorted(([g for g in island if g in free] for island in islands), key=len)
    for island_free in spare:
        while groups and len(island_free) >= tensor:
            picked.extend(island_free[:tensor])
            island_free = island_free[tensor:]
            groups -= 1
    return tuple(sorted(picked)) if groups == 0 else None


def place_training(view: ResourceView, cluster_id: str,
                   job: TrainingJob) -> Placement | Unplaceable:
    per_worker = job.gpus_per_worker
    tensor = min(job.parallelism.tensor, per_worker)
    allow_degraded = job.communication == "light"
    nodes = [n for n in view.nodes.values() if n.cluster_id == cluster_id]
    if not nodes:
        return Unplaceable(cluster_id, "the cluster has no nodes in the view")
    accel = job.accelerator.lower()
    candidates: dict[str, tuple[NodeView, tuple[int, ...]]] = {}
    for node in nodes:
        model = node.labels.get("accelerator", "")
        if accel and accel not in model.lower():
            continue
        free = usable_gpus(view, node, allow_degraded)
        choice = _pick_on_node(node, free, per_worker, tensor)
        if choice is not None:
            candidates[node.node_id] = (node, choice)
    if len(candidates) < job.workers:
        why = ("healthy " if not allow_degraded else "") + f"{job.accelerator} GPUs"
        return Unplaceable(cluster_id, f"needs {job.workers} nodes with {per_worker} free {why} "
                           f"in NVLink groups of {tensor}; {len(candidates)} have them")
    # Leaves holding the most usable workers first; within a leaf, the fullest nodes first.
    by_leaf: dict[str, list[tuple[NodeView, tuple[int, ...]]]] = {}
    for node, choice in candidates.values():
        by_leaf.setdefault(node.leaf_switch or "unknown", []).append((node, choice))

    def used(node: NodeView) -> int:
        return len(node.gpus) - len(usable_gpus(view, node, True))

    for members in by_leaf.values():
        members.sort(key=lambda nc: (-used(nc[0]), nc[0].node_id))
    # The fewest leaves that hold the gang: one leaf that fits it alone (the one whose
    # chosen nodes are already the most used, then the smallest), else the largest first.
    def fill(leaf: str) -> int:
        return sum(used(n) for n, _ in by_leaf[leaf][:job.workers])

    fitting = sorted((leaf for leaf, m in by_leaf.items() if len(m) >= job.workers),
                     key=lambda leaf: (-fill(leaf), len(by_leaf[leaf]), leaf))
    order = fitting[:1] or sorted(by_leaf, key=lambda leaf: (-len(by_leaf[leaf]), leaf))
    chosen: list[tuple[NodeView, tuple[int, ...]]] = []
    leaves: list[str] = []
    for leaf in order:
        for member in by_leaf[leaf]:
            if len(chosen) == job.workers:
                break
            chosen.append(member)
            if leaf not in leaves:
                leaves.append(leaf)
    reasons = [f"{job.workers} workers x {per_worker} GPUs under {len(leaves)} leaf switch(es)",
               f"tensor-parallel groups of {tensor} inside one NVLink island"
               if tensor <= max(len(i) for i in _islands(chosen[0][0])) else
               f"tensor-parallel groups of {tensor} take whole nodes"]
    if not allow_degraded:
        reasons.append("no degraded GPUs (communication-heavy)")
    return Placement(cluster_id,
                     tuple(tuple((n.node_id, g) for g in choice) for n, choice in chosen),
                     tuple(leaves), tuple(reasons))
