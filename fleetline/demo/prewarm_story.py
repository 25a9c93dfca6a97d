"""`fleetline run`'s prewarm story: a dataset of real objects in one cluster's store, a job
that can only run in another, and the data mover copying it there first.

The scenario's `prewarm` section names the cluster that holds the data, how many objects of how
many MiB (pseudo-random bytes), and the documents to apply (the Dataset and the job), applied
once the timeline and the other stories are over. The story follows the job: Queued, holding no
GPUs, while the copy runs ("waiting for data in C: 42 %"), then placed where its data now is;
and it checks every copied object against the source.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetline.agents.data_mover import DataMover
from fleetline.agents.dataplane.prewarm import MANIFEST, upload
from fleetline.config import Settings
from fleetline.errors import ObjectMissing, StoryStalled
from fleetline.processors.scheduling.client import submit_specs
from fleetline.processors.scheduling.specs import dataset_prefix
from fleetline.storage.checkpoints import cluster_bucket
from fleetline.storage.objects import ObjectStore
from fleetline.streams.topics import Topics


def dataset_objects(name: str, count: int, mib: int) -> dict[str, bytes]:
    """`count` shards of `mib` MiB of pseudo-random bytes (nothing a store could compress)."""
    return {
        f"shard-{i:03d}.bin": hashlib.shake_256(f"{name}/{i}".encode()).digest(mib << 20)
        for i in range(count)
    }


STAND_IN_OBJECTS, STAND_IN_MIB = 4, 1  # what stands in for a declared dataset's bytes


def seed_dataset(
    settings: Settings,
    document: Mapping[str, Any],
    count: int = STAND_IN_OBJECTS,
    mib: int = STAND_IN_MIB,
) -> dict[str, bytes]:
    """Real objects for a scenario's Dataset in each of its replicas' stores (a simulated fleet's
    datasets declare terabytes; `count` objects of `mib` MiB stand in for them, so a prewarm
    copies real bytes); the objects, by key."""
    spec, meta = document["spec"], document["metadata"]
    prefix = dataset_prefix(meta["tenant"], meta["name"], spec.get("source"))
    objects = dataset_objects(meta["name"], count, mib)
    for cluster in spec.get("replicas") or ():
        bucket = cluster_bucket(settings.s3.bucket, cluster)
        upload(ObjectStore.from_settings(settings.s3, bucket), prefix, objects)
    return objects


def follow_a_prewarm(
    settings: Settings,
    topics: Topics,
    mover: DataMover | None,
    plan: Mapping[str, Any],
    clusters: Sequence[str],
    job_of: Callable[[str], dict[str, Any] | None],
    say: Callable[[str], None],
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    documents = list(plan["apply"])
    dataset = next(d for d in documents if d["kind"] == "Dataset")
    job_doc = next(d for d in documents if d["kind"] != "Dataset")
    tenant, name = dataset["metadata"]["tenant"], dataset["metadata"]["name"]
    job = f"{job_doc['metadata']['tenant']}/{job_doc['metadata']['name']}"
    prefix = dataset_prefix(tenant, name, dataset["spec"].get("source"))
    source_cluster = plan["cluster"]

    def store(cluster: str) -> ObjectStore:
        return ObjectStore.from_settings(settings.s3, cluster_bucket(settings.s3.bucket, cluster))

    # The stores outlive a run: a copy an earlier run left elsewhere would be kept, not copied.
    for cluster in clusters:
        if cluster != source_cluster:
            with contextlib.suppress(ObjectMissing):
                for key in store(cluster).keys(prefix):
                    store(cluster).delete(key)
    placed_at = {**dataset, "spec": {**dataset["spec"], "replicas": [source_cluster]}}
    objects = seed_dataset(settings, placed_at, int(plan["objects"]), int(plan["object_mib"]))
    total = sum(len(b) for b in objects.values())
    began = time.monotonic()
    submit_specs(settings.kafka, topics, documents, "fleetline-run", int(time.time() * 1000))
    say(f"{job} submitted; its dataset {name} ({total} bytes) is in {source_cluster}")
    seen: list[str] = []
    placed_in: str | None = None
    while time.monotonic() - began < timeout_s:
        record = job_of(job) or {}
        reason = record.get("queued_reason") or ""
        if record.get("allocation"):
            placed_in = sorted(record["allocation"])[0]
            break
        if reason.startswith("waiting for data") and reason not in seen:
            seen.append(reason)
            say(f"t+{time.monotonic() - began:.1f}s: {job} is Queued, holding no GPUs: {reason}")
        time.sleep(0.2)
    if placed_in is None:
        raise StoryStalled(f"the prewarm story: {job} was not placed in {timeout_s:.0f}s")
    ticket = f"{name}@{placed_in}"
    report = mover.reports.get(ticket) if mover is not None else None
    target = store(placed_in)
    identical = all(
        hashlib.sha256(target.get(prefix + key)).digest() == hashlib.sha256(body).digest()
        for key, body in objects.items()
    ) and bool(target.keys(prefix + MANIFEST))
    quota = next(
        (
            p["quota"].get("bandwidth_gbps")
            for p in plan.get("tenant_policies", ())
            if p.get("tenant") == tenant
        ),
        None,
    )
    story = {
        "job": job,
        "dataset": name,
        "from": source_cluster,
        "to": placed_in,
        "objects": len(objects),
        "bytes": total,
        "progress": seen,
        "identical": identical,
        "quota_gbps": quota,
        "copy_s": round(report.elapsed_s, 2) if report else None,
        "rate_gbps": round(report.rate_bps / 1e9, 4) if report else None,
    }
    say(
        f"t+{time.monotonic() - began:.1f}s: {job} placed in {placed_in}, where its data now "
        "is" + ("" if identical else " (BUT the copy differs from the source)")
    )
    return story
