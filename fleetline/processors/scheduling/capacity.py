"""What the scheduler sees of the fleet: facts observed from the resource view, and an index of
free GPUs as bitmasks per node, bucketed so a gang's feasibility is a sum over a few buckets.

`observe(view)` is a pure function of the view at some offsets: per node its topology (leaf and
spine switch, NVLink islands as masks), which GPUs a new job may take (`healthy`; `degraded` only
for jobs that tolerate it), which GPUs running jobs must leave (`lost`: failed GPUs, or the whole
node when it is DOWN or unreachable), and the clusters' and datasets' facts. It ignores the
view's own allocations: the scheduler is their only writer and keeps them itself.

`CapacityIndex` adds the scheduler's allocations (`taken`) and keeps each cluster's schedulable
nodes in buckets keyed by (accelerator, islands, free healthy mask, free degraded mask). Gangs
are placed by `select_gang`: each worker's GPUs on one node, tensor-parallel groups inside one
NVLink island (the whole node when a group is wider than an island), whole pipeline replicas
under one leaf switch where they fit, the tightest nodes first (best fit).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.processors.view.accelerators import MIB_PER_GB, Accelerator, suits
from fleetline.processors.view.catalogue import Catalogue
from fleetline.processors.view.catalogue import builtin as catalogue
from fleetline.processors.view.fold import node_status
from fleetline.processors.view.model import (
    ClusterHealth,
    NodeStatus,
    NodeView,
    ResourceView,
    declared_catalogue,
)
from fleetline.processors.view.summary import (
    CLUSTER,
    DATASET,
    NODES,
    ClusterTerms,
    NodeCapacity,
    capacity_of,
    cluster_health,
    cluster_terms,
    node_capacity,
    terms_of,
)

# At home in the view's summary (what a shard publishes); the scheduler's code names them here.
from fleetline.processors.view.summary import NodeFacts as NodeFacts
from fleetline.processors.view.summary import mask_of as mask_of

GpuRef = tuple[str, int]
Offsets = dict[str, dict[int, int]]


def indices_of(mask: int) -> tuple[int, ...]:
    out = []
    i = 0
    while mask:
        if mask & 1:
            out.append(i)
        mask >>= 1
        i += 1
    return tuple(out)


@lru_cache(maxsize=65536)
def pick(islands: tuple[int, ...], free: int, need: int, tensor: int) -> int:
    """`need` GPUs of `free` (a mask) in groups of `tensor`, each group inside one island, the
    tightest islands first; the chosen mask, or 0 when they are not there. A group wider than
    every island takes the whole node, which must then be free."""
    if need <= 0:
        return 0
    widest = max((i.bit_count() for i in islands), default=0)
    if tensor > widest:
        everything = 0
        for island in islands:
            everything |= island
        return (
            everything if need == everything.bit_count() and free & everything == everything else 0
        )
    groups = need // tensor
    chosen = 0
    spare = sorted((free & island for island in islands), key=lambda m: (m.bit_count(), m))
    for island_free in spare:
        while groups and island_free.bit_count() >= tensor:
            taken = 0
            for index in indices_of(island_free)[:tensor]:
                taken |= 1 << index
            chosen |= taken
            island_free &= ~taken
            groups -= 1
    return chosen if groups == 0 else 0


@dataclass(frozen=True)
class ClusterFacts:
    cluster_id: str
    region: str
    kind: str
    price_per_gpu_hour: float
    energy_price_per_kwh: float
    pue: float
    link_latency_ms: dict[str, float]
    # healthy, degraded: takes new work; suspect, recovering, cordoned: keeps what it runs,
    # takes nothing new; lost: its jobs move; unreachable, retired, empty.
    health: ClusterHealth
    health_reason: str = ""


@dataclass(frozen=True)
class DatasetFacts:
    dataset_id: str
    tenant: str
    size_bytes: int
    replicas: tuple[str, ...]
    residency: tuple[str, ...] = ()  # the regions its data may be in; empty: any


# (the view's node object, its epoch, its status, its capacity)
NodeEntry = tuple[NodeView, int, NodeStatus, NodeCapacity]


@dataclass
class FleetFacts:
    """The part of a view the scheduler decides on, and the view position it came from."""

    nodes: dict[str, NodeFacts]
    lost: dict[str, int]  # node -> GPUs running jobs must leave (failed, node down/unreachable)
    clusters: dict[str, ClusterFacts]
    datasets: dict[str, DatasetFacts]
    view_version: int = 0
    offsets: Offsets = field(default_factory=dict)
    watermark_ms: int = 0
    _lost_reasons: dict[str, str] = field(default_factory=dict)
    # Values derived from these facts alone, computed once (cheapest GPU-hour, cluster ids).
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # The accelerator catalogue with the models the clusters' operators declared.
    catalogue: Catalogue = field(default_factory=catalogue, repr=False, compare=False)
    # What the next observation of the same view may reuse, per node.
    node_cache: dict[str, NodeEntry] = field(default_factory=dict, repr=False, compare=False)
    # What the next observation of the same summaries may reuse: key -> (record, capacities).
    summary_cache: dict[str, tuple[Mapping[str, Any], list[NodeCapacity]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def lost_reason(self, node_id: str) -> str:
        return self._lost_reasons.get(node_id, f"{node_id} is gone from the view")


def usable_gpus(facts: FleetFacts) -> dict[str, int]:
    """Usable GPUs per cluster (none in a cluster out of reach), once per observation."""
    cached: dict[str, int] | None = facts.memo.get("room")
    if cached is None:
        cached = {}
        for node in facts.nodes.values():
            cached[node.cluster_id] = (
                cached.get(node.cluster_id, 0) + (node.healthy | node.degraded).bit_count()
            )
        for cluster_id, cluster in facts.clusters.items():
            if not cluster.health.takes_work:
                cached[cluster_id] = 0
        facts.memo["room"] = cached
    return cached


@dataclass
class _Fleet:
    """Facts being gathered, node by node, then cluster by cluster."""

    nodes: dict[str, NodeFacts] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    counts: dict[str, list[int]] = field(default_factory=dict)  # [nodes, unreachable, gpus, bad]
    regions: dict[str, str] = field(default_factory=dict)

    def add(self, capacity: NodeCapacity, region: str) -> None:
        facts = capacity.facts
        self.nodes[facts.node_id] = facts
        if capacity.lost:
            self.lost[facts.node_id] = capacity.lost
            self.reasons[facts.node_id] = capacity.lost_reason
        c = self.counts.setdefault(facts.cluster_id, [0, 0, 0, 0])
        self.regions.setdefault(facts.cluster_id, region)
        c[0] += 1
        c[1] += facts.status == "UNREACHABLE"
        c[2] += facts.present.bit_count()
        c[3] += capacity.bad

    def clusters(self, terms: Mapping[str, ClusterTerms]) -> dict[str, ClusterFacts]:
        out: dict[str, ClusterFacts] = {}
        for cluster_id in sorted(set(self.counts) | set(terms)):
            t = terms.get(cluster_id)
            n, unreachable, gpus, bad = self.counts.get(cluster_id, [0, 0, 0, 0])
            health = cluster_health(
                nodes=n,
                unreachable=unreachable,
                gpus=gpus,
                unusable=bad,
                retired=t is not None and t.retired,
                declared=t.health if t is not None else None,
            )
            declared = t is not None and t.declared
            out[cluster_id] = ClusterFacts(
                cluster_id=cluster_id,
                region=t.region if t is not None and declared else self.regions.get(cluster_id, ""),
                kind=t.kind if t is not None else "UNKNOWN",
                price_per_gpu_hour=t.price_per_gpu_hour if t is not None else 0.0,
                energy_price_per_kwh=t.energy_price_per_kwh if t is not None else 0.0,
                pue=t.pue if t is not None else 1.0,
                link_latency_ms=dict(t.link_latency_ms) if t is not None else {},
                health=health,
                health_reason=t.health_reason if t is not None else "",
            )
        return out


def observe(view: ResourceView, previous: FleetFacts | None = None) -> FleetFacts:
    """The scheduler's facts from the view, the same whatever order the view's dicts are in.

    With `previous` (an earlier observation of the same live view), a node whose object, epoch
    and status are unchanged keeps its facts object: observing 10,000 nodes then costs a
    dictionary lookup each, and `CapacityIndex.refresh` re-buckets only the nodes that moved.
    """
    fleet = _Fleet()
    cache = previous.node_cache if previous is not None else {}
    fresh: dict[str, NodeEntry] = {}
    for node_id in sorted(view.nodes):
        node = view.nodes[node_id]
        status = node_status(view, node)
        entry = cache.get(node_id)
        if entry is None or entry[0] is not node or entry[1] != node.epoch or entry[2] != status:
            entry = (node, node.epoch, status, node_capacity(node, status))
        fresh[node_id] = entry
        fleet.add(entry[3], node.region)
    datasets = {
        d: DatasetFacts(d, info.tenant, info.size_bytes, tuple(info.replicas))
        for d, info in sorted(view.datasets.items())
    }
    return FleetFacts(
        fleet.nodes,
        fleet.lost,
        fleet.clusters(cluster_terms(view)),
        datasets,
        view.version,
        {t: dict(sorted(ps.items())) for t, ps in sorted(view.offsets.items())},
        view.watermark_ms,
        fleet.reasons,
        node_cache=fresh,
        catalogue=declared_catalogue(view.clusters),
    )


def observe_summaries(
    summaries: Mapping[str, Mapping[str, Any]],
    offsets: Offsets,
    previous: FleetFacts | None = None,
) -> FleetFacts:
    """The scheduler's facts from the view shards' capacity summaries (by key, as read up to
    `offsets` of the summaries topic): what `observe` makes of the view they summarise. With
    `previous`, a summary record that is the same object as before is not read again."""
    fleet = _Fleet()
    cache = previous.summary_cache if previous is not None else {}
    fresh: dict[str, tuple[Mapping[str, Any], list[NodeCapacity]]] = {}
    terms: dict[str, ClusterTerms] = {}
    datasets: dict[str, DatasetFacts] = {}
    capacities: list[tuple[NodeCapacity, str]] = []
    for key in sorted(summaries):
        record = summaries[key]
        kind = record["kind"]
        if kind == NODES:
            seen = cache.get(key)
            if seen is None or seen[0] is not record:
                cluster_id = record["cluster_id"]
                seen = (record, [capacity_of(cluster_id, n) for n in record["nodes"]])
            fresh[key] = seen
            capacities.extend((c, record["region"]) for c in seen[1])
        elif kind == CLUSTER and record["cluster"] is not None:
            terms[record["cluster_id"]] = terms_of(record["region"], record["cluster"])
        elif kind == DATASET and record["dataset"] is not None:
            d = record["dataset"]
            datasets[d["dataset_id"]] = DatasetFacts(
                d["dataset_id"], d["tenant"], d["size_bytes"], tuple(d["replicas"])
            )
    # Node by node in id order, as a whole view is observed, whichever shards hold them.
    for capacity, region in sorted(capacities, key=lambda c: c[0].facts.node_id):
        fleet.add(capacity, region)
    return FleetFacts(
        fleet.nodes,
        fleet.lost,
        fleet.clusters(terms),
        dict(sorted(datasets.items())),
        sum(o for ps in offsets.values() for o in ps.values()),
        {t: dict(sorted(ps.items())) for t, ps in sorted(offsets.items())},
        0,
        fleet.reasons,
        summary_cache=fresh,
    )


def fenced_facts(facts: FleetFacts, fenced: Mapping[str, str]) -> FleetFacts:
    """The observation with the fenced nodes taking no new work (the same object when none of
    them is in it, so an unfenced fleet costs nothing)."""
    hit = [n for n in fenced if n in facts.nodes and facts.nodes[n].schedulable]
    if not hit:
        return facts
    nodes = dict(facts.nodes)
    for node_id in hit:
        nodes[node_id] = replace(nodes[node_id], healthy=0, degraded=0, schedulable=False)
    return replace(facts, nodes=nodes, memo={}, node_cache=facts.node_cache)


# accelerator, islands, free healthy, free degraded
BucketKey = tuple[Accelerator, tuple[int, ...], int, int]


def computes(accelerator: Accelerator, precision: str, known: Catalogue | None = None) -> bool:
    """Whether the chip has `precision`'s arithmetic, as the catalogue says (a model it does
    not list is not trusted with work that needs a precision: nobody said it has it)."""
    capability = (known or catalogue()).of(accelerator)
    return capability is not None and bool(capability.peak(precision))


@dataclass(frozen=True, slots=True)
class GangShape:
    """What one placement asks of a cluster: `workers` x `per_worker` GPUs in groups of `tensor`
    inside one interconnect domain (an NVLink island, an xGMI hive), `replica_workers`
    consecutive workers forming one pipeline (a data-parallel replica)."""

    accelerators: tuple[str, ...]  # normalised models or families; empty: any
    workers: int
    per_worker: int
    tensor: int
    replica_workers: int
    allow_degraded: bool
    min_memory_mib: int = 0
    precision: str | None = None  # only chips whose catalogue entry computes in it

    @property
    def gpus(self) -> int:
        return self.workers * self.per_worker

    def matches(self, accelerator: Accelerator, known: Catalogue | None = None) -> bool:
        """Whether chips of this kind may take it (`known`: the fleet's catalogue, declared
        models included; the shipped one without)."""
        if not suits(accelerator, self.accelerators, self.min_memory_mib):
            return False
        return self.precision is None or computes(accelerator, self.precision, known)

    def wants(self) -> str:
        """What GPUs it asks for, in words: `h100 or h200 GPUs with 80+ GB`, `GPUs`, `GPUs
        computing fp8`."""
        models = " or ".join(self.accelerators)
        memory = f" with {self.min_memory_mib / MIB_PER_GB:.4g}+ GB" if self.min_memory_mib else ""
        arithmetic = f" computing {self.precision}" if self.precision else ""
        return f"{models} GPUs{memory}{arithmetic}".strip()


def one_kind(shape: GangShape, kind: Accelerator) -> GangShape:
    """The shape narrowed to one kind of chip (its model, at least its memory)."""
    return replace(
        shape, accelerators=(kind.model,), min_memory_mib=max(shape.min_memory_mib, kind.memory_mib)
    )


@dataclass(frozen=True, slots=True)
class Gang:
    cluster_id: str
    workers: tuple[tuple[str, int], ...]  # (node, GPU mask) per worker, in rank order
    leaves: tuple[str, ...]
    replicas_split: int  # pipeline replicas that had to span leaf switches

    def refs(self) -> tuple[GpuRef, ...]:
        return tuple((node, i) for node, mask in self.workers for i in indices_of(mask))


class CapacityIndex:
    """Free GPUs per node given the observed facts and the scheduler's allocations.

    Schedulable nodes sit in buckets: cluster -> (model, islands, free healthy, free degraded)
    -> leaf switch -> nodes. A cluster has a few dozen distinct keys however many nodes it has,
    so whether a gang fits is a sum over keys, and choosing its leaves a walk over keys and
    leaves, never over every node.
    """

    def __init__(self, facts: FleetFacts, taken: dict[str, int] | None = None) -> None:
        self.facts = facts
        self.taken: dict[str, int] = {m: v for m, v in (taken or {}).items() if v}
        self.buckets: dict[str, dict[BucketKey, dict[str, set[str]]]] = {}
        self.counts: dict[str, dict[BucketKey, int]] = {}
        self.version: dict[str, int] = {}
        self._models: dict[str, set[Accelerator]] = {}
        self._fits: dict[tuple[str, GangShape], tuple[int, list[tuple[int, BucketKey, int]]]] = {}
        self._takes: dict[tuple[Any, ...], tuple[FleetFacts, bool]] = {}
        for node in facts.nodes.values():
            self._enter(node)

    def _enter(self, node: NodeFacts) -> None:
        """Know the node's cluster and model; bucket it when it takes new work."""
        self.buckets.setdefault(node.cluster_id, {})
        self.counts.setdefault(node.cluster_id, {})
        self.version.setdefault(node.cluster_id, 0)
        self._models.setdefault(node.cluster_id, set()).add(node.accelerator)
        if node.schedulable:
            self._add(node)

    def _key(self, node: NodeFacts) -> BucketKey:
        taken = self.taken.get(node.node_id, 0)
        return (node.accelerator, node.islands, node.healthy & ~taken, node.degraded & ~taken)

    def _add(self, node: NodeFacts) -> None:
        key = self._key(node)
        cluster = node.cluster_id
        self.buckets[cluster].setdefault(key, {}).setdefault(node.leaf, set()).add(node.node_id)
        counts = self.counts[cluster]
        counts[key] = counts.get(key, 0) + 1
        self.version[cluster] += 1

    def _remove(self, node: NodeFacts) -> None:
        key = self._key(node)
        cluster = node.cluster_id
        leaves = self.buckets[cluster][key]
        members = leaves[node.leaf]
        members.discard(node.node_id)
        if not members:
            del leaves[node.leaf]
        counts = self.counts[cluster]
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
            del self.buckets[cluster][key]
        self.version[cluster] += 1

    def reserve(self, node_id: str, mask: int) -> None:
        """Take GPUs for a job; InvalidEventError if any is taken already (no double booking)."""
        held = self.taken.get(node_id, 0)
        if held & mask:
            raise InvalidEventError(
                f"{node_id} GPU(s) {list(indices_of(held & mask))} are already allocated"
            )
        node = self.facts.nodes.get(node_id)
        schedulable = node if node is not None and node.schedulable else None
        if schedulable is not None:
            self._remove(schedulable)
        self.taken[node_id] = held | mask
        if schedulable is not None:
            self._add(schedulable)

    def release(self, node_id: str, mask: int) -> None:
        held = self.taken.get(node_id, 0)
        node = self.facts.nodes.get(node_id)
        schedulable = node if node is not None and node.schedulable else None
        if schedulable is not None:
            self._remove(schedulable)
        rest = held & ~mask
        if rest:
            self.taken[node_id] = rest
        else:
            self.taken.pop(node_id, None)
        if schedulable is not None:
            self._add(schedulable)

    def refresh(self, facts: FleetFacts) -> None:
        """Move to a newer observation, re-bucketing only the nodes whose facts changed (the
        result equals a fresh index over `facts` with the same GPUs taken)."""
        old = self.facts.nodes
        new = facts.nodes
        for node_id, before in old.items():
            if new.get(node_id) is not before and before.schedulable:
                self._remove(before)
        self.facts = facts
        for node_id, after in new.items():
            if old.get(node_id) is not after:
                self._enter(after)
        if len(new) != len(old) or any(n not in new for n in old):
            # Nodes left the fleet: models and clusters are recounted from what is there.
            self._models = {}
            for node in new.values():
                self._models.setdefault(node.cluster_id, set()).add(node.accelerator)
            for cluster_id in [c for c in self.buckets if c not in self._models]:
                del self.buckets[cluster_id]
                del self.counts[cluster_id]

    def clusters(self) -> list[str]:
        return sorted(self.buckets)

    def fitting(self, cluster_id: str, shape: GangShape) -> list[tuple[int, BucketKey, int]]:
        """(free GPUs, key, the worker's GPU mask) of the keys whose nodes can host one worker,
        tightest first; cached until the cluster changes."""
        version = self.version.get(cluster_id, 0)
        cached = self._fits.get((cluster_id, shape))
        if cached is not None and cached[0] == version:
            return cached[1]
        need, tensor = shape.per_worker, min(shape.tensor, shape.per_worker)
        out = []
        for key in self.counts.get(cluster_id, {}):
            accelerator, islands, free_h, free_d = key
            if not shape.matches(accelerator, self.facts.catalogue):
                continue
            free = free_h | free_d if shape.allow_degraded else free_h
            if free.bit_count() < need:
                continue
            chosen = pick(islands, free, need, tensor)
            if chosen:
                out.append((free.bit_count(), key, chosen))
        out.sort()
        if len(self._fits) > 4096:
            self._fits.clear()
        self._fits[(cluster_id, shape)] = (version, out)
        return out

    def fitting_nodes(self, cluster_id: str, shape: GangShape) -> int:
        """How many nodes could host one worker of the shape."""
        counts = self.counts.get(cluster_id, {})
        return sum(counts[key] for _, key, _ in self.fitting(cluster_id, shape))

    def fill_after(self, cluster_id: str, shape: GangShape) -> float:
        """The share of GPUs in use on the nodes a placement would take, after taking them (1.0:
        the gang fills its nodes exactly; low: it would break into free nodes)."""
        counts = self.counts.get(cluster_id, {})
        left = shape.workers
        used = total = 0
        for free_count, key, _ in self.fitting(cluster_id, shape):
            if left <= 0:
                break
            count = min(left, counts[key])
            size = sum(i.bit_count() for i in key[1])
            used += count * (size - free_count + shape.per_worker)
            total += count * size
            left -= count
        return used / total if total else 0.0

    def fitting_kinds(self, cluster_id: str, shape: GangShape) -> dict[Accelerator, int]:
        """How many nodes of each kind of chip could host one worker of the shape."""
        counts = self.counts.get(cluster_id, {})
        kinds: dict[Accelerator, int] = {}
        for _, key, _ in self.fitting(cluster_id, shape):
            kinds[key[0]] = kinds.get(key[0], 0) + counts[key]
        return kinds

    def select_gang(self, cluster_id: str, shape: GangShape) -> Gang | str:
        """The nodes and GPUs for every worker, or why the cluster cannot hold the gang. A gang
        never mixes kinds of chip (their vendors' collectives do not talk to each other): in a
        cluster of several, the kind with the most nodes that fit is tried first."""
        kinds = self.fitting_kinds(cluster_id, shape)
        if len(kinds) > 1:
            for kind in sorted(kinds, key=lambda k: (-kinds[k], k)):
                gang = self._select_gang(cluster_id, one_kind(shape, kind))
                if not isinstance(gang, str):
                    return gang
            held = ", ".join(f"{kinds[k]} {k.model}" for k in sorted(kinds))
            return (
                f"needs {shape.workers} nodes of one kind of chip with {shape.per_worker} free "
                f"{shape.wants()}; of those that fit, {held}"
            )
        return self._select_gang(cluster_id, shape)

    def _select_gang(self, cluster_id: str, shape: GangShape) -> Gang | str:
        buckets = self.buckets.get(cluster_id, {})
        counts = self.counts.get(cluster_id, {})
        fitting = self.fitting(cluster_id, shape)
        available = sum(counts[key] for _, key, _ in fitting)
        need = shape.workers
        if available < need:
            kind = "" if shape.allow_degraded else "healthy "
            return (
                f"needs {need} nodes with {shape.per_worker} free {kind}"
                f"{shape.wants()} in tensor-parallel groups of "
                f"{min(shape.tensor, shape.per_worker)} (one NVLink island or interconnect "
                f"domain each); {available} have them"
            )
        if need == 1:
            # The tightest nodes, in the leaf with the fewest of them: filling leaves that are
            # mostly used keeps whole leaves free for gangs.
            _, key, chosen = fitting[0]
            members = buckets[key]
            leaf = min(members, key=lambda lf: (len(members[lf]), lf))
            return Gang(cluster_id, ((min(members[leaf]), chosen),), (leaf,), 0)
        # Per leaf, the keys it has nodes of, tightest first: (free, key, mask, count).
        by_leaf: dict[str, list[tuple[int, BucketKey, int, int]]] = {}
        for free_count, key, chosen in fitting:
            for leaf, nodes in buckets[key].items():
                by_leaf.setdefault(leaf, []).append((free_count, key, chosen, len(nodes)))
        totals = {leaf: sum(item[3] for item in items) for leaf, items in by_leaf.items()}

        def take(leaf: str, count: int, skip: int = 0) -> list[tuple[str, int]]:
            """`count` nodes of a leaf, tightest first, after skipping the first `skip`."""
            out: list[tuple[str, int]] = []
            for _, key, chosen, _ in by_leaf[leaf]:
                for node_id in sorted(buckets[key][leaf]):
                    if skip:
                        skip -= 1
                        continue
                    if len(out) == count:
                        return out
                    out.append((node_id, chosen))
            return out

        def tightness(leaf: str) -> int:
            left, free = need, 0
            for free_count, _, _, count in by_leaf[leaf]:
                n = min(left, count)
                free += n * free_count
                left -= n
                if not left:
                    break
            return free

        alone = [leaf for leaf, total in totals.items() if total >= need]
        if alone:
            best = min(alone, key=lambda leaf: (tightness(leaf), totals[leaf], leaf))
            return Gang(cluster_id, tuple(take(best, need)), (best,), 0)
        # Whole pipeline replicas under one leaf each, the leaves that hold the most first.
        per_replica = shape.replica_workers if need % shape.replica_workers == 0 else need
        order = sorted(
            totals, key=lambda leaf: (-(totals[leaf] // per_replica), -totals[leaf], leaf)
        )
        picked: list[tuple[str, int]] = []
        leaves: list[str] = []
        used: dict[str, int] = {}
        replicas = need // per_replica
        for leaf in order:
            whole = min(totals[leaf] // per_replica, replicas)
            if whole:
                picked.extend(take(leaf, whole * per_replica))
                used[leaf] = whole * per_replica
                leaves.append(leaf)
                replicas -= whole
        split = replicas
        if replicas:
            # Fragmented: the remaining replicas span leaves, the fullest leftovers first.
            rest = sorted(order, key=lambda lf: (-(totals[lf] - used.get(lf, 0)), lf))
            for leaf in rest:
                spare = totals[leaf] - used.get(leaf, 0)
                if not spare or len(picked) == need:
                    continue
                picked.extend(take(leaf, min(spare, need - len(picked)), used.get(leaf, 0)))
                if leaf not in leaves:
                    leaves.append(leaf)
        return Gang(cluster_id, tuple(picked), tuple(leaves), split)

    def free_nodes(self, cluster_id: str, shape: GangShape) -> Iterator[tuple[str, str]]:
        """(leaf, node) of every node that can host one worker as it is."""
        buckets = self.buckets.get(cluster_id, {})
        for _, key, _ in self.fitting(cluster_id, shape):
            for leaf, nodes in buckets[key].items():
                for node_id in nodes:
                    yield leaf, node_id

    def free_gpus(self, cluster_id: str, shape: GangShape) -> int:
        """Free GPUs in the cluster of the kind the shape asks for."""
        total = 0
        for (accelerator, _, free_h, free_d), count in self.counts.get(cluster_id, {}).items():
            if not shape.matches(accelerator, self.facts.catalogue):
                continue
            total += (free_h | free_d if shape.allow_degraded else free_h).bit_count() * count
        return total

    def all_models(self) -> set[Accelerator]:
        """The kinds of GPU anywhere in the fleet."""
        return set().union(*self._models.values())

    def takes(self, cluster_id: str, shape: GangShape) -> bool:
        """Whether any kind of GPU the cluster has may take the shape; cached per observation
        (every ranking asks it of every cluster)."""
        key = (cluster_id, shape.accelerators, shape.min_memory_mib, shape.precision)
        cached = self._takes.get(key)
        if cached is not None and cached[0] is self.facts:
            return cached[1]
        known = self.facts.catalogue
        takes = any(shape.matches(m, known) for m in self.models(cluster_id))
        if len(self._takes) > 4096:
            self._takes.clear()
        self._takes[key] = (self.facts, takes)
        return takes

    def models(self, cluster_id: str) -> set[Accelerator]:
        """The kinds of GPU the cluster's nodes have (schedulable now or not)."""
        return self._models.get(cluster_id, set())

    def fragmentation(self, cluster_id: str | None = None) -> dict[str, Any]:
        """Free healthy GPUs, and the share of them stranded on partly used nodes (a whole free
        node is what the largest gangs need)."""
        free = stranded = whole_nodes = 0
        for cluster, counts in self.counts.items():
            if cluster_id is not None and cluster != cluster_id:
                continue
            for (_, islands, free_h, _), n in counts.items():
                size = 0
                for island in islands:
                    size |= island
                count = free_h.bit_count() * n
                free += count
                if free_h == size:
                    whole_nodes += n
                else:
                    stranded += count
        return {
            "free_gpus": free,
            "stranded_gpus": stranded,
            "whole_free_nodes": whole_nodes,
            "fragmentation": round(stranded / free, 6) if free else 0.0,
        }
