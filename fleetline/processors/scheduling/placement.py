"""In-cluster, topology-aware gang placement: a pure function of the capacity index and a job.

All workers or none (gang). Each worker takes `gpus_per_worker` GPUs on one node; a
tensor-parallel group sits inside one NVLink island when it fits in one (else it takes whole
nodes); a pipeline replica (tensor x pipeline GPUs) sits under one leaf switch where possible and
data-parallel replicas spread across leaves; communication-heavy jobs never get degraded GPUs
(light ones may); nodes already partly used are filled first (best fit), so whole nodes stay free
for big jobs. The index does the search (`processors/capacity.py`); this module speaks jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetline.processors.scheduling.capacity import (
    CapacityIndex,
    Gang,
    GangShape,
    GpuRef,
    indices_of,
    mask_of,
)
from fleetline.processors.scheduling.specs import InferenceServiceSpec, TrainingJobSpec
from fleetline.processors.view.catalogue import domain_word


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


def training_shape(job: TrainingJobSpec, workers: int | None = None) -> GangShape:
    per_replica_gpus = job.parallelism.tensor * job.parallelism.pipeline
    return GangShape(
        accelerators=job.accelerators,
        workers=workers or job.workers,
        per_worker=job.gpus_per_worker,
        tensor=min(job.parallelism.tensor, job.gpus_per_worker),
        replica_workers=max(1, per_replica_gpus // job.gpus_per_worker),
        allow_degraded=job.communication == "light",
        min_memory_mib=job.min_gpu_memory_mib,
        precision=job.precision,
    )


def inference_shape(service: InferenceServiceSpec, replicas: int) -> GangShape:
    # A replica serves from one node; a single-GPU replica may use a degraded GPU (its
    # collective traffic is nil), a sharded one may not.
    return GangShape(
        accelerators=service.accelerators,
        workers=replicas,
        per_worker=service.whole_gpus,
        tensor=service.whole_gpus,
        replica_workers=1,
        allow_degraded=service.whole_gpus == 1,
        min_memory_mib=service.min_gpu_memory_mib,
        precision=service.precision,
    )


def to_placement(gang: Gang, shape: GangShape, index: CapacityIndex) -> Placement:
    workers = tuple(tuple((node, i) for i in indices_of(mask)) for node, mask in gang.workers)
    kinds = sorted({index.facts.nodes[n].accelerator for n, _ in gang.workers})
    reasons = [
        f"{shape.workers} workers x {shape.per_worker} GPUs under {len(gang.leaves)} "
        "leaf switch(es)",
        "on " + " and ".join(k.describe() for k in kinds),
    ]
    tensor = min(shape.tensor, shape.per_worker)
    if tensor > 1:
        reasons.append(
            f"tensor-parallel groups of {tensor} inside one "
            f"{domain_word(kinds[0], index.facts.catalogue)}"
            if all(
                tensor <= max(i.bit_count() for i in index.facts.nodes[n].islands)
                for n, _ in gang.workers
            )
            else f"tensor-parallel groups of {tensor} take whole nodes"
        )
    if shape.replica_workers > 1:
        reasons.append(
            f"pipeline replicas of {shape.replica_workers} workers under one leaf"
            if not gang.replicas_split
            else f"{gang.replicas_split} pipeline replica(s) span leaf switches "
            "(no leaf had room for them whole)"
        )
    if not shape.allow_degraded:
        reasons.append(
            "no degraded GPUs (communication-heavy)"
            if shape.tensor > 1 or shape.workers > 1
            else "no degraded GPUs"
        )
    return Placement(gang.cluster_id, workers, gang.leaves, tuple(reasons))


def place(index: CapacityIndex, cluster_id: str, shape: GangShape) -> Placement | Unplaceable:
    if cluster_id not in index.buckets:
        return Unplaceable(cluster_id, "the cluster has no nodes in the view")
    gang = index.select_gang(cluster_id, shape)
    if isinstance(gang, str):
        return Unplaceable(cluster_id, gang)
    return to_placement(gang, shape, index)


def refs_by_node(refs: tuple[GpuRef, ...] | list[GpuRef]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node, index in refs:
        out[node] = out.get(node, 0) | mask_of((index,))
    return out
