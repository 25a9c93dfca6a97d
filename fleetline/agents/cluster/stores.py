"""A cluster agent's part of the checkpoint data plane: each job's checkpoints in each
cluster's own store, and what a run is told of them.

Before a training run starts, the job's newest complete checkpoint (among those its order's
fence admits) is brought into this cluster's store from whichever cluster holds it (the
ciphertext copied as it is, verified on arrival) and the run is told which one to resume from;
a serving replica is told where its model's weights are. Checkpoints are sealed under the
tenant's key, derived from the deployment's object-encryption key.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetline.agents.cluster.reconcile import Order
from fleetline.config import Settings
from fleetline.storage.checkpoints import Checkpoints, best_of, cluster_bucket, tenant_key
from fleetline.storage.objects import ObjectStore
from fleetline.streams.topics import Topics

# Where what the data plane did is reported: the agent's WorkloadEvents (order, kind, fields).
EventSink = Callable[..., None]


@dataclass
class JobStores:
    settings: Settings
    topics: Topics
    cluster_id: str

    def __post_init__(self) -> None:
        self._master = self.settings.object_key()

    def checkpoints(self, cluster_id: str, order: Order) -> tuple[str, Checkpoints]:
        """(bucket, the job's checkpoints there) in a cluster's own store."""
        bucket = cluster_bucket(self.settings.s3.bucket, cluster_id)
        store = ObjectStore.from_settings(self.settings.s3, bucket)
        if cluster_id == self.cluster_id:
            store.ensure_bucket()
        name = order.job.split("/", 1)[-1]
        key = tenant_key(self._master, order.tenant) if self._master else None
        # One folder per deployment (topic prefix) and per submission (trace id): a job
        # submitted again under the same name starts afresh, and never reads another run's.
        prefix = f"checkpoints/{self.topics.prefix}/{order.tenant}/{name}/{order.trace_id}"
        return bucket, Checkpoints(store, prefix, key)

    def serving_env(self, order: Order, body: Mapping[str, Any]) -> dict[str, str]:
        """A replica's storage and serving environment: its model's prefix in this cluster's
        store (one per deployment, tenant and model: every replica serves the same bytes)."""
        bucket = cluster_bucket(self.settings.s3.bucket, self.cluster_id)
        ObjectStore.from_settings(self.settings.s3, bucket).ensure_bucket()
        serving = body.get("serving") or {}
        env = {
            **self.settings.s3.as_env(),
            "FLEETLINE_CHECKPOINT_BUCKET": bucket,
            "FLEETLINE_MODEL": str(body.get("model", "model")),
            "FLEETLINE_MODEL_PREFIX": f"models/{self.topics.prefix}/{order.tenant}/"
            f"{body.get('model', 'model')}",
            "FLEETLINE_SERVE_CONCURRENCY": str(serving.get("concurrency", 4)),
            "FLEETLINE_SERVE_COMPUTE_MS": str(serving.get("compute_ms", 20.0)),
        }
        if self._master:
            env["FLEETLINE_CHECKPOINT_KEY"] = base64.b64encode(
                tenant_key(self._master, order.tenant)
            ).decode()
        return env

    def prepare(self, order: Order, event: EventSink) -> tuple[dict[str, str], str | None]:
        """Bring the job's newest complete checkpoint into this cluster's store (from any
        cluster it ran in), reporting each copy and each checkpoint passed over; (the
        workload's storage environment, what it resumes from)."""
        clusters = [self.cluster_id, *(c for c in order.resume_from if c != self.cluster_id)]
        if order.first_rank:
            # Another part of a split job: the part with rank 0 reads the checkpoint and hands
            # it to every worker; nothing is copied here.
            clusters = clusters[:1]
        located = [self.checkpoints(c, order) for c in clusters]
        bucket, own = located[0]
        sources = [store for _, store in located]
        best = best_of(sources, order.admits)
        for cluster_id, store in zip(clusters, sources, strict=True):
            for why in store.skipped:
                event(order, "RESTORED", from_cluster=cluster_id, detail=f"passed over: {why}")
        restored = None
        if best is not None:
            source, manifest = best
            if source is not own:
                size, seconds = source.copy_to(own, manifest.name)
                event(
                    order,
                    "RESTORED",
                    step=manifest.step,
                    checkpoint_uri=f"s3://{bucket}/{own.prefix}/{manifest.name}",
                    bytes=size,
                    seconds=round(seconds, 4),
                    from_cluster=clusters[sources.index(source)],
                    detail="copied sealed under the tenant's key"
                    if manifest.sealed
                    else "copied unsealed: no object-encryption key is configured",
                )
            restored = f"{manifest.name} (step {manifest.step})"
        env = {
            **self.settings.s3.as_env(),
            "FLEETLINE_CHECKPOINT_BUCKET": bucket,
            "FLEETLINE_CHECKPOINT_PREFIX": own.prefix,
            # The one to resume from (empty: start afresh), so that the workload never picks a
            # checkpoint the fence rules out.
            "FLEETLINE_RESUME_CHECKPOINT": best[1].name if best is not None else "",
        }
        if own.key is not None:
            env["FLEETLINE_CHECKPOINT_KEY"] = base64.b64encode(own.key).decode()
        return env, restored
