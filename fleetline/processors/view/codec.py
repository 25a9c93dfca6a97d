"""The resource view as plain data: for snapshots, for exports and for comparing two views.

`to_data` is canonical (sorted keys, lists in a fixed order), so two views are equal exactly when
their data are equal, and a snapshot's checksum does not depend on dict insertion order.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from typing import Any

from fleetline.errors import IntegrityError
from fleetline.processors.view.accelerators import of_node_state
from fleetline.processors.view.catalogue import of_record
from fleetline.processors.view.model import (
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
)

FORMAT = "fleetline.view/1"
_GPU_SLOTS = ("sample", *(s for s in GpuState.__slots__ if s != "sample"))
# `epoch` is a cache key for readers in this process, not part of the view.
_NODE_SLOTS = tuple(s for s in NodeView.__slots__ if s not in ("gpus", "epoch"))


def to_data(view: ResourceView) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "policy": view.policy.as_dict(),
        "offsets": {
            topic: {str(p): o for p, o in sorted(parts.items())}
            for topic, parts in sorted(view.offsets.items())
        },
        "node_events": view.node_events,
        "fleet_events": view.fleet_events,
        "watermark_ms": view.watermark_ms,
        "nodes": {node_id: _node_data(view.nodes[node_id]) for node_id in sorted(view.nodes)},
        "clusters": {k: view.clusters[k].as_data() for k in sorted(view.clusters)},
        "cluster_health": {k: vars(view.cluster_health[k]) for k in sorted(view.cluster_health)},
        "datasets": {k: vars(view.datasets[k]) for k in sorted(view.datasets)},
        "allocations": {k: _allocation_data(view.allocations[k]) for k in sorted(view.allocations)},
    }


def _node_data(node: NodeView) -> dict[str, Any]:
    data = {slot: getattr(node, slot) for slot in _NODE_SLOTS}
    data["accelerator"] = node.accelerator.as_record()
    data["gpus"] = [
        [getattr(node.gpus[i], slot) for slot in _GPU_SLOTS] for i in sorted(node.gpus)
    ]  # `sample` first: a list in the JSON
    return data


def _allocation_data(allocation: JobAllocation) -> dict[str, Any]:
    data = dict(vars(allocation))
    data["gpus"] = sorted([node_id, index] for node_id, index in allocation.gpus)
    if data["share_eighths"] is None:
        del data["share_eighths"]  # whole GPUs: as snapshots were before shares
    return data


def from_data(data: dict[str, Any]) -> ResourceView:
    if data.get("format") != FORMAT:
        raise IntegrityError(f"not a view snapshot of format {FORMAT}: {data.get('format')!r}")
    view = ResourceView(policy=HealthPolicy.from_dict(data["policy"]))
    view.offsets = {
        topic: {int(p): o for p, o in parts.items()} for topic, parts in data["offsets"].items()
    }
    view.node_events = data["node_events"]
    view.fleet_events = data["fleet_events"]
    view.watermark_ms = data["watermark_ms"]
    for node_id, node_data in data["nodes"].items():
        node = NodeView(node_id, node_data["cluster_id"], node_data["region"])
        for slot in _NODE_SLOTS:
            if slot != "accelerator":
                setattr(node, slot, node_data[slot])
        node.state = NodeStatus(node.state)
        # Snapshots written before NodeState v3 have no accelerator: the label, as the fold.
        node.accelerator = of_node_state(node_data)
        for values in node_data["gpus"]:
            gpu = GpuState(Sample._make(values[0]))
            for slot, value in zip(_GPU_SLOTS[1:], values[1:], strict=True):
                setattr(gpu, slot, value)
            gpu.health = Health(gpu.health)
            node.gpus[gpu.index] = gpu
        view.nodes[node_id] = node
    view.clusters = {
        k: ClusterInfo(
            **{
                **v,
                # Absent from snapshots written before operators declared models.
                "accelerator_models": tuple(of_record(m) for m in v.get("accelerator_models", ())),
            }
        )
        for k, v in data["clusters"].items()
    }
    view.datasets = {k: DatasetInfo(**v) for k, v in data["datasets"].items()}
    # Absent from snapshots written before clusters had a health state.
    view.cluster_health = {
        k: ClusterHealthInfo(**v) for k, v in data.get("cluster_health", {}).items()
    }
    for job_id, alloc in data["allocations"].items():
        gpus = {(node_id, index) for node_id, index in alloc["gpus"]}
        view.allocations[job_id] = JobAllocation(**{**alloc, "gpus": gpus})
        for ref in gpus:
            view.gpu_owner.setdefault(ref, job_id)  # a shared GPU: its first sharer by id
    return view


def encode(view: ResourceView) -> tuple[bytes, str]:
    """Gzipped canonical JSON of the view and the SHA-256 of the uncompressed JSON."""
    raw = json.dumps(to_data(view), sort_keys=True, separators=(",", ":")).encode()
    return gzip.compress(raw, compresslevel=3, mtime=0), hashlib.sha256(raw).hexdigest()


def decode(blob: bytes, sha256: str | None = None) -> ResourceView:
    try:
        raw = gzip.decompress(blob)
    except (OSError, EOFError) as exc:
        raise IntegrityError(f"view snapshot does not decompress: {exc}") from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise IntegrityError("view snapshot does not match its checksum")
    try:
        return from_data(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"view snapshot is malformed: {type(exc).__name__}: {exc}") from None
