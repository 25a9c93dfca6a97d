"""The global resource view: a deterministic fold of the fleet's event log.

`apply(view, event)` folds one decoded event. The view is built from five streams, each folded
independently of the others (telemetry and node state per node, cluster facts, datasets and
allocations per key), so the view after a given set of offsets is the same whatever order the
consumer happened to interleave the topics in: a replay of the same offsets reproduces it exactly.
Anything that combines streams (a node being unreachable, a failed GPU cleared by its node's
reboot, cluster capacity, tenant usage) is derived when read, from fields each stream keeps.

The fold mutates the view it is given and returns it: copying 80,000 GPUs per event would cost
more than the fold itself. It reads no clock, draws no random numbers and does no I/O; time is the
event time the records carry. `model.copy_view` gives an independent copy (for snapshots).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from fleetline.errors import ConfigError, InvalidEventError
from fleetline.processors.view.accelerators import of_node_state
from fleetline.processors.view.catalogue import of_record
from fleetline.processors.view.model import (
    DEGRADED,
    FAILED,
    HEALTHY,
    Change,
    ClusterHealthInfo,
    ClusterInfo,
    DatasetInfo,
    GpuState,
    Health,
    HealthPolicy,
    JobAllocation,
    NodeStatus,
    NodeView,
    ResourceView,
    Sample,
    gpu_sample,
)
from fleetline.schemas.records import Allocation, DatasetState, NodeState
from fleetline.schemas.records import ClusterHealth as ClusterHealthRecord
from fleetline.schemas.records import ClusterInfo as ClusterInfoRecord
from fleetline.streams.events import (
    ALLOCATION,
    CLUSTER_HEALTH,
    CLUSTER_INFO,
    DATASET_STATE,
    NODE_STATE,
    NODE_TELEMETRY,
)
from fleetline.streams.serde import Decoded
from fleetline.streams.telemetry_rules import gpu_sample_problem


def apply(view: ResourceView, event: Decoded) -> ResourceView:
    """Fold one event into the view. An event its stream has already passed is a no-op; an
    event breaking a rule raises InvalidEventError and leaves the view as it was."""
    record = event.record
    match event.schema.full_name:
        case name if name == NODE_TELEMETRY:
            fold_telemetry(
                view,
                record["cluster_id"],
                record["region"],
                record["node_id"],
                record["seq"],
                record["ts"],
                [gpu_sample(g) for g in record["gpus"]],
            )
        # The codec read each record by its schema: its TypedDict says what it holds.
        case name if name == NODE_STATE:
            _fold_node_state(view, cast(NodeState, record))
        case name if name == CLUSTER_INFO:
            _fold_cluster(view, cast(ClusterInfoRecord, record))
        case name if name == DATASET_STATE:
            _fold_dataset(view, cast(DatasetState, record))
        case name if name == ALLOCATION:
            _fold_allocation(view, cast(Allocation, record))
        case name if name == CLUSTER_HEALTH:
            _fold_cluster_health(view, cast(ClusterHealthRecord, record))
        case other:
            raise InvalidEventError(f"the resource view does not fold {other} events")
    return view


def forget(view: ResourceView, kind: str, key: str) -> ResourceView:
    """Fold a tombstone (a null value on a compacted topic): the entity is gone from the fleet."""
    match kind:
        case "node":
            if view.nodes.pop(key, None) is not None:
                view.changes.append(Change(view.watermark_ms, "node", key, "known", "removed"))
            view.node_events += 1
        case "cluster":
            view.clusters.pop(key, None)
            view.fleet_events += 1
        case "dataset":
            view.datasets.pop(key, None)
            view.fleet_events += 1
        case other:
            raise InvalidEventError(f"a tombstone means nothing for {other} records")
    return view


def _node(view: ResourceView, node_id: str, cluster_id: str, region: str) -> NodeView:
    node = view.nodes.get(node_id)
    if node is None:
        node = view.nodes[node_id] = NodeView(node_id, cluster_id, region)
    elif node.cluster_id != cluster_id:
        raise InvalidEventError(
            f"{node_id} is in cluster {node.cluster_id}, an event says {cluster_id}"
        )
    return node


def _check_gpus(node_id: str, seq: int, gpus: Sequence[Sample], vouched: bool) -> None:
    if not vouched:  # a batch the columnar decoder vouched for was checked as a whole
        for sample in gpus:
            problem = gpu_sample_problem(
                sample.gpu_util_pct, sample.fb_used_mib, sample.fb_total_mib
            )
            if problem is not None:
                raise InvalidEventError(f"{node_id} seq {seq} gpu {sample.gpu_index}: {problem}")
    if len({sample.gpu_index for sample in gpus}) != len(gpus):
        raise InvalidEventError(f"{node_id} seq {seq}: a gpu_index appears twice")


def fold_telemetry(
    view: ResourceView,
    cluster_id: str,
    region: str,
    node_id: str,
    seq: int,
    ts: int,
    gpus: Sequence[Sample],
    vouched: bool = False,
) -> bool:
    """Fold one NodeTelemetry record given as scalars and one `Sample` per GPU (the shape both
    the per-record and the columnar decoder produce). `vouched`: the columnar decoder has
    checked the samples' rules on its whole batch already. False when the record was one the
    node's stream had passed (a no-op)."""
    node = view.nodes.get(node_id)
    if node is not None and seq <= node.telemetry_seq:
        return False  # an agent re-sent it after an outage
    _check_gpus(node_id, seq, gpus, vouched)
    node = _node(view, node_id, cluster_id, region)
    _heard(view, node, seq, ts)
    policy = view.policy
    nvlink_limit = policy.nvlink_errors_per_interval
    loss_limit = policy.rdma_loss_ratio
    by_index = node.gpus
    for sample in gpus:
        index = sample.gpu_index
        gpu = by_index.get(index)
        if gpu is None or gpu.sample.gpu_uuid != sample.gpu_uuid:  # new, or the GPU was swapped
            gpu = by_index[index] = GpuState(sample)
            node.epoch += 1
            previous = sample
        else:
            previous = gpu.sample
            gpu.sample = sample
        gpu.last_ts = ts

        failure: str | None = None
        fault: str | None = None
        if sample.ecc_dbe_total > previous.ecc_dbe_total:
            failure = "ecc_dbe"
        if sample.xid_codes:
            vendor = node.accelerator.vendor
            degrade_codes, fail_codes = policy.codes(vendor)
            # NVIDIA calls its events XIDs; another vendor's are named with the vendor.
            word = "xid" if fail_codes is policy.fail_xids else f"{vendor} event"
            for code in sample.xid_codes:
                if code in fail_codes:
                    failure = f"{word} {code}"
                elif code in degrade_codes:
                    fault = f"{word} {code}"
        errors, before = sample.nvlink_errors_total, previous.nvlink_errors_total
        loss = sample.rdma_packet_loss_ratio
        if errors is not None and before is not None and errors - before >= nvlink_limit:
            fault = "nvlink_errors"
        elif loss is not None and loss >= loss_limit:
            fault = "rdma_loss"

        if failure is not None:
            view.changes.append(
                Change(ts, "gpu", f"{node_id}/{index}", gpu.health, FAILED, failure)
            )
            gpu.failure = failure
            node.epoch += 1
            gpu.failed_at_ms = ts
        if fault is not None:
            gpu.clean_samples = 0
            if gpu.health == HEALTHY or gpu.cause != fault:
                node.epoch += _set_health(view, node_id, gpu, DEGRADED, fault, ts)
        elif gpu.health == DEGRADED:
            gpu.clean_samples += 1
            if gpu.clean_samples >= policy.recover_after_samples:
                node.epoch += _set_health(view, node_id, gpu, HEALTHY, None, ts)
    return True


# Repeats. Most telemetry says again what its node's previous record said: the same GPUs, the
# same error counters, no error event, RDMA loss under the limit. On GPUs that are healthy such
# a record changes nothing but the node's seq and times and the GPUs' latest readings, so a
# run of them folds as its last record plus, for each one before it, `fold_repeat`. The
# counters must be equal (the fold acts on their change from one record to the next), and
# `quiet` is the rest of the rule; the batch decoder applies both to whole columns
# (`folder.repeats_of`).
REPEAT_FIELDS = ("gpu_index", "gpu_uuid", "ecc_dbe_total", "nvlink_errors_total")


def quiet(sample: Sample, policy: HealthPolicy) -> bool:
    """A reading the fold takes no action on, given the counters its GPU had before."""
    loss = sample.rdma_packet_loss_ratio
    return not sample.xid_codes and (loss is None or loss < policy.rdma_loss_ratio)


def repeats_fold(policy: HealthPolicy) -> bool:
    """Whether repeats may be folded as `fold_repeat` does: not when equal NVLink counters
    (a change of 0) reach the policy's threshold."""
    return policy.nvlink_errors_per_interval > 0


def settled(view: ResourceView, node_id: str, gpus: Sequence[Sample]) -> bool:
    """After a record was folded: its readings were quiet and left each of its GPUs healthy,
    so a repeat of it changes nothing `fold_repeat` does not do."""
    node = view.nodes[node_id]
    policy = view.policy
    by_index = node.gpus
    return all(
        quiet(sample, policy) and by_index[sample.gpu_index].health == HEALTHY for sample in gpus
    )


def fold_repeat(view: ResourceView, node_id: str, seq: int, ts: int) -> None:
    """Fold a repeat of the node's last record (`settled`) that a later repeat follows: what
    `fold_telemetry` would change but the GPUs' latest readings, which the last repeat of the
    run sets."""
    node = view.nodes[node_id]
    if seq > node.telemetry_seq:
        _heard(view, node, seq, ts)


def _heard(view: ResourceView, node: NodeView, seq: int, ts: int) -> None:
    """A telemetry record of the node was folded: its seq, its time and the view's."""
    node.telemetry_seq = seq
    if ts > node.telemetry_ts:
        node.telemetry_ts = ts
    if ts > view.watermark_ms:
        view.watermark_ms = ts
    view.node_events += 1


def gpu_health(node: NodeView, gpu: GpuState) -> tuple[Health, str | None]:
    """The GPU's health and its cause, joining its telemetry with its node's reboots."""
    if gpu.failed_at_ms is not None and gpu.failed_at_ms >= node.up_since_ms:
        return FAILED, gpu.failure
    return gpu.health, gpu.cause


def node_status(view: ResourceView, node: NodeView) -> NodeStatus:
    """UP, DRAINING or DOWN as the node declared it, or UNREACHABLE when an UP or DRAINING node
    has not been heard from for the policy's timeout, measured against the view's event time."""
    if node.state != NodeStatus.DOWN and (
        view.watermark_ms - node.last_heard_ms > view.policy.unreachable_after_ms
    ):
        return NodeStatus.UNREACHABLE
    return node.state


def takes_new_work(node: NodeView, status: NodeStatus) -> bool:
    """New work may land on the node: it is UP (not draining, down or out of reach) and not
    cordoned. What already runs on a draining or cordoned node stays."""
    return status == NodeStatus.UP and not node.cordoned


def _set_health(
    view: ResourceView, node_id: str, gpu: GpuState, health: Health, cause: str | None, ts: int
) -> int:
    """Move the GPU to `health`; 1 if that changed anything, else 0."""
    if health == gpu.health and cause == gpu.cause:
        return 0
    view.changes.append(Change(ts, "gpu", f"{node_id}/{gpu.index}", gpu.health, health, cause))
    gpu.health = health
    gpu.cause = cause
    gpu.health_since_ms = ts
    return 1


def _fold_node_state(view: ResourceView, record: NodeState) -> None:
    node = view.nodes.get(record["node_id"])
    if node is not None and record["seq"] <= node.state_seq:
        return
    topology = record["topology"]
    if topology["gpu_count"] < 0:
        raise InvalidEventError(f"{record['node_id']}: gpu_count {topology['gpu_count']} < 0")
    node = _node(view, record["node_id"], record["cluster_id"], record["region"])
    ts = record["ts"]
    before = node.state
    scheduled_before = node.scheduling_facts()
    state = NodeStatus(record["state"])
    if state == NodeStatus.UP and before == NodeStatus.DOWN:
        node.up_since_ms = ts
    if state != before:
        view.changes.append(Change(ts, "node", node.node_id, before, state, record["reason"]))
    node.state = state
    node.reason = record["reason"]
    node.labels = dict(record["labels"])
    node.accelerator = of_node_state(record)
    node.gpu_count = topology["gpu_count"]
    node.islands = [list(island) for island in topology["nvlink_islands"]]
    node.leaf_switch = topology["leaf_switch"]
    node.spine_switch = topology["spine_switch"]
    node.numa_nodes = list(topology.get("gpu_numa_nodes", []))
    node.nvlink_peers = {k: list(v) for k, v in topology.get("nvlink_peers", {}).items()}
    node.agent_version = record.get("agent_version")
    node.spool_bytes = record.get("agent_spool_bytes")
    node.spool_dropped = record.get("agent_spool_dropped")
    if scheduled_before != node.scheduling_facts():
        node.epoch += 1
    node.state_seq = record["seq"]
    if ts > node.state_ts:
        node.state_ts = ts
    if ts > view.watermark_ms:
        view.watermark_ms = ts
    view.node_events += 1


def _fold_cluster(view: ResourceView, record: ClusterInfoRecord) -> None:
    current = view.clusters.get(record["cluster_id"])
    if current is not None and record["seq"] <= current.seq:
        return
    pue = record["pue"]
    if pue is not None and pue < 1.0:
        raise InvalidEventError(f"cluster {record['cluster_id']}: pue {pue} is below 1")
    prices = {
        "price_per_gpu_hour": record["price_per_gpu_hour"],
        "energy_price_per_kwh": record["energy_price_per_kwh"],
    }
    for name, price in prices.items():
        if price is not None and price < 0:
            raise InvalidEventError(f"cluster {record['cluster_id']}: {name} is negative")
    try:
        models = tuple(of_record(m) for m in record.get("accelerator_models") or ())
    except ConfigError as exc:
        raise InvalidEventError(f"cluster {record['cluster_id']}: {exc}") from None
    view.clusters[record["cluster_id"]] = ClusterInfo(
        cluster_id=record["cluster_id"],
        region=record["region"],
        kind=record["kind"],
        price_per_gpu_hour=record["price_per_gpu_hour"],
        energy_price_per_kwh=record["energy_price_per_kwh"],
        pue=pue,
        link_latency_ms=dict(record["link_latency_ms"]),
        retired=record["retired"],
        seq=record["seq"],
        ts=record["ts"],
        accelerator_models=models,
    )
    view.fleet_events += 1


def _fold_cluster_health(view: ResourceView, record: ClusterHealthRecord) -> None:
    cluster_id = record["cluster_id"]
    current = view.cluster_health.get(cluster_id)
    if current is not None and record["seq"] < current.seq:
        return
    links = set(current.broken_links) if current is not None else set()
    if record["event"] == "PARTITION" and record["peer"]:
        (links.discard if record["link_up"] else links.add)(record["peer"])
    before = current.state if current is not None else "UNKNOWN"
    if record["state"] != before:
        view.changes.append(
            Change(record["ts"], "cluster", cluster_id, before, record["state"], record["reason"])
        )
    view.cluster_health[cluster_id] = ClusterHealthInfo(
        cluster_id=cluster_id,
        state=record["state"],
        since_ms=record["since_ms"],
        cordoned=record["cordoned"],
        reason=record["reason"]
        if record["event"] != "PARTITION" or current is None
        else current.reason,
        seq=record["seq"],
        ts=record["ts"],
        broken_links=sorted(links),
    )
    view.fleet_events += 1


def _fold_dataset(view: ResourceView, record: DatasetState) -> None:
    current = view.datasets.get(record["dataset_id"])
    if current is not None and record["seq"] <= current.seq:
        return
    if record["size_bytes"] < 0:
        raise InvalidEventError(f"dataset {record['dataset_id']}: size_bytes is negative")
    if record["deleted"]:
        view.datasets.pop(record["dataset_id"], None)
    else:
        view.datasets[record["dataset_id"]] = DatasetInfo(
            dataset_id=record["dataset_id"],
            tenant=record["tenant"],
            size_bytes=record["size_bytes"],
            replicas=sorted(set(record["replicas"])),
            seq=record["seq"],
            ts=record["ts"],
        )
    view.fleet_events += 1


def _sharers(view: ResourceView, ref: tuple[str, int]) -> set[str]:
    """The jobs holding a share of a GPU."""
    return {
        a.job_id for a in view.allocations.values() if a.share_eighths is not None and ref in a.gpus
    }


def _shares_with(view: ResourceView, ref: tuple[str, int], job_id: str, share: int | None) -> bool:
    """Whether a replica asking for `share` eighths of a GPU fits beside those holding it: only
    shares share, and never past the whole GPU."""
    if share is None:
        return False
    held = [a for a in view.allocations.values() if ref in a.gpus and a.job_id != job_id]
    if any(a.share_eighths is None for a in held):
        return False
    return sum(a.share_eighths or 0 for a in held) + share <= 8


def _fold_allocation(view: ResourceView, record: Allocation) -> None:
    job_id = record["job_id"]
    current = view.allocations.get(job_id)
    if current is not None and record["seq"] <= current.seq:
        return
    refs = {(ref["node_id"], ref["gpu_index"]) for ref in record["gpus"]}
    share = record.get("share_eighths")
    match record["kind"]:
        case "ALLOCATED":
            taken = sorted(
                ref
                for ref in refs
                if view.gpu_owner.get(ref, job_id) != job_id
                and not _shares_with(view, ref, job_id, share)
            )
            if taken:
                node_id, index = taken[0]
                raise InvalidEventError(
                    f"job {job_id}: {node_id}/{index} is already allocated to "
                    f"{view.gpu_owner[taken[0]]}"
                    + (" (its shares of the GPU would pass eight eighths)" if share else "")
                )
            if current is None:
                current = view.allocations[job_id] = JobAllocation(
                    job_id,
                    record["tenant"],
                    record["cluster_id"],
                    record["priority"],
                    set(),
                    record["seq"],
                    record["ts"],
                    share,
                )
            current.gpus |= refs
            for ref in refs:
                view.gpu_owner.setdefault(ref, job_id)
        case "RELEASED":
            if current is None:
                raise InvalidEventError(f"job {job_id}: released but never allocated")
            freed = refs or set(current.gpus)
            for ref in freed & current.gpus:
                if view.gpu_owner.get(ref) == job_id:
                    view.gpu_owner.pop(ref)
                    # A shared GPU stays taken while another replica holds a share of it.
                    others = (
                        sorted(_sharers(view, ref) - {job_id})
                        if current.share_eighths is not None
                        else []
                    )
                    if others:
                        view.gpu_owner[ref] = others[0]
            current.gpus -= freed
            if not current.gpus:
                del view.allocations[job_id]
                view.fleet_events += 1
                return
        case other:
            raise InvalidEventError(f"job {job_id}: unknown allocation kind {other}")
    current.seq = record["seq"]
    current.priority = record["priority"]
    view.fleet_events += 1


def compose(views: Iterable[ResourceView]) -> ResourceView:
    """Join views over disjoint node partitions (and the fleet topics) into one global view.

    Nodes come from the shard that holds them; cluster, dataset and allocation tables from the
    view that has folded the most fleet events (each instance reads those topics whole); offsets
    are the union, taking the furthest where two views read the same partition.
    """
    parts = list(views)
    if not parts:
        return ResourceView()
    policies = {part.policy for part in parts}
    if len(policies) > 1:
        raise InvalidEventError("cannot compose views folded under different health policies")
    out = ResourceView(policy=parts[0].policy)
    fleet_source: ResourceView | None = None
    for part in parts:
        for node_id, node in part.nodes.items():
            if node_id in out.nodes:
                raise InvalidEventError(f"{node_id} is in two shards; their partitions overlap")
            out.nodes[node_id] = node
        for topic, partitions in part.offsets.items():
            merged = out.offsets.setdefault(topic, {})
            for partition, offset in partitions.items():
                merged[partition] = max(offset, merged.get(partition, 0))
        out.watermark_ms = max(out.watermark_ms, part.watermark_ms)
        out.node_events += part.node_events
        if part.fleet_events and (
            fleet_source is None or part.fleet_events > fleet_source.fleet_events
        ):
            fleet_source = part
    if fleet_source is not None:
        out.clusters = fleet_source.clusters
        out.datasets = fleet_source.datasets
        out.allocations = fleet_source.allocations
        out.cluster_health = fleet_source.cluster_health
        out.gpu_owner = fleet_source.gpu_owner
        out.fleet_events = fleet_source.fleet_events
    return out
