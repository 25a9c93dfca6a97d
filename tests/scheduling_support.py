"""Test helpers for the scheduler: simulated fleets as views, and a driver that feeds requests
with sequential positions and a pinned clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import yaml

from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator, cluster_info
from fleetline.processors.scheduling.capacity import CapacityIndex, observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import Decision, Effect, WorkloadOrder
from fleetline.processors.scheduling.placement import (
    Placement,
    Unplaceable,
    place,
    training_shape,
)
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.specs import TrainingJobSpec
from fleetline.processors.view.fold import fold_telemetry
from fleetline.processors.view.model import ResourceView
from tests.fleet_events import fold
from tests.support import BASE_MS

# Three 32-GPU clusters in three regions (the last with H100s too, unlike the demo's).
THREE = [
    ClusterSpec("us-east-a", "us-east", 4),
    ClusterSpec("eu-west-a", "eu-west", 4),
    ClusterSpec("ap-south-a", "ap-south", 4),
]


def fleet_view(
    clusters: list[ClusterSpec], seconds: int = 2, faults: Iterable[Fault] = (), seed: int = 5
) -> tuple[ResourceView, FleetSimulator]:
    """The view after `seconds` one-second intervals of a simulated fleet, with cluster facts."""
    sim = FleetSimulator(clusters, seed=seed, faults=list(faults))
    events: list[tuple[str, dict]] = [
        ("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in clusters
    ]
    events += [("NodeState", r) for r in sim.initial_states(BASE_MS)]
    view = fold(events)
    advance(view, sim, 1, seconds)
    return view, sim


def advance(view: ResourceView, sim: FleetSimulator, first: int, last: int) -> ResourceView:
    from fleetline.processors.view.model import gpu_sample

    for t in range(first, last + 1):
        ts = BASE_MS + t * 1000
        fold([("NodeState", r) for r in sim.state_changes(ts)], view)
        for record in sim.telemetry(ts):
            if not sim.cluster_link_up(record["cluster_id"], ts):
                continue
            fold_telemetry(
                view,
                record["cluster_id"],
                record["region"],
                record["node_id"],
                record["seq"],
                record["ts"],
                [gpu_sample(g) for g in record["gpus"]],
            )
    return view


def index_of_view(view: ResourceView) -> CapacityIndex:
    """An index over the view with the view's own allocations taken (a view read on its own;
    the scheduler keeps its allocations itself)."""
    taken: dict[str, int] = {}
    for node, index in view.gpu_owner:
        taken[node] = taken.get(node, 0) | (1 << index)
    return CapacityIndex(observe(view), taken)


def place_training(
    view: ResourceView, cluster_id: str, job: TrainingJobSpec
) -> Placement | Unplaceable:
    """Where one training job's gang would go in a view's cluster, allocations counted."""
    return place(index_of_view(view), cluster_id, training_shape(job))


def training(
    name: str,
    workers: int = 1,
    per_worker: int = 8,
    tensor: int = 8,
    pipeline: int = 1,
    tenant: str = "acme",
    priority: str = "normal",
    communication: str = "heavy",
    accelerator: str = "H100",
    **extra: Any,
) -> dict:
    spec = {
        "accelerator": accelerator,
        "gpus_per_worker": per_worker,
        "workers": workers,
        "parallelism": {
            "tensor": tensor,
            "pipeline": pipeline,
            "data": workers * per_worker // (tensor * pipeline),
        },
        "communication": communication,
        "priority_class": priority,
        **extra,
    }
    return {
        "apiVersion": "fleetline/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": tenant},
        "spec": spec,
    }


def service(
    name: str,
    replicas: int,
    per_replica: int = 1,
    regions=("eu-west",),
    tenant: str = "acme",
    priority: str = "high",
    accelerator: str = "H100",
    **extra: Any,
) -> dict:
    return {
        "apiVersion": "fleetline/v1",
        "kind": "InferenceService",
        "metadata": {"name": name, "tenant": tenant},
        "spec": {
            "model": "m",
            "accelerator": accelerator,
            "gpus_per_replica": per_replica,
            "replicas": {"min": replicas, "max": replicas},
            "latency_target_ms": 100,
            "regions": list(regions),
            "priority_class": priority,
            **extra,
        },
    }


def dataset(name: str, size: str, replicas: list[str], tenant: str = "acme") -> dict:
    return {
        "apiVersion": "fleetline/v1",
        "kind": "Dataset",
        "metadata": {"name": name, "tenant": tenant},
        "spec": {"size": size, "replicas": replicas},
    }


class Driver:
    """Feeds a Scheduler requests at positions 0, 1, 2, ... with event times the test sets."""

    def __init__(
        self,
        view: ResourceView,
        policy: SchedulingPolicy | None = None,
        now_ms: int = BASE_MS + 10_000,
        agents: bool = True,
    ) -> None:
        self.view = view
        # Stand in for the cluster agents: every RUN order is reported running at once.
        self.agents = agents
        self.scheduler = Scheduler(policy)
        self.now_ms = now_ms
        self.positions = itertools.count()
        self.log: list[tuple[dict, Any]] = []  # (request, facts) as fed, for replays
        self.effects: list[Effect] = []
        self.last_facts = None
        self.tick()

    def feed(self, request: dict, facts=None) -> list[Effect]:
        self.log.append((request, facts))
        effects = self.scheduler.step(request, next(self.positions), facts)
        self.effects.extend(effects)
        for order in effects if self.agents else ():
            if isinstance(order, WorkloadOrder) and order.action == "RUN":
                self.report(order, "RUNNING")
        return effects

    def report(self, order: WorkloadOrder, phase: str, **fields: Any) -> list[Effect]:
        """A cluster agent's report on the workload an order started."""
        return self.feed(
            self._request(
                "PROGRESS",
                order.job,
                order.tenant,
                phase=phase,
                cluster_id=order.cluster_id,
                epoch=order.epoch,
                attempt=order.attempt,
                **fields,
            )
        )

    def _request(self, kind: str, key: str, tenant: str, **fields: Any) -> dict:
        return new_request(kind, key, tenant, self.now_ms, f"r{len(self.log)}", **fields)

    def tick(self, seconds: float = 0, view: ResourceView | None = None) -> list[Effect]:
        self.now_ms += int(seconds * 1000)
        if view is not None:
            self.view = view
        # Observed as the live ticker does: reusing the facts of nodes that did not change.
        facts = self.last_facts = observe(self.view, self.last_facts)
        return self.feed(self._request("TICK", "", "", view_offsets=facts.offsets), facts)

    def submit(self, document: dict | str) -> list[Effect]:
        if isinstance(document, str):
            document = yaml.safe_load(document)
        # Keyed from the raw document, so invalid specs reach the scheduler too.
        meta = document["metadata"]
        key = (
            f"dataset:{meta['name']}"
            if document["kind"] == "Dataset"
            else f"{meta['tenant']}/{meta['name']}"
        )
        return self.feed(
            self._request("SUBMIT", key, meta["tenant"], spec_json=canonical_json(document))
        )

    def delete(self, key: str, tenant: str | None = None) -> list[Effect]:
        return self.feed(self._request("DELETE", key, tenant or key.split("/")[0], actor="tester"))

    def progress(self, key: str, phase: str, checkpoint_ms: int | None = None) -> list[Effect]:
        return self.feed(
            self._request(
                "PROGRESS", key, key.split("/")[0], phase=phase, checkpoint_ms=checkpoint_ms
            )
        )

    def tenant(self, policy: dict) -> list[Effect]:
        return self.feed(
            self._request(
                "TENANT_POLICY",
                policy["tenant"],
                policy["tenant"],
                spec_json=canonical_json(policy),
            )
        )

    def load(self, service: str, **measure: Any) -> list[Effect]:
        """A router's SERVICE_LOAD: one second of `requests` (default 100) from eu-west."""
        payload = {
            "router": "r",
            "window_ms": 1000,
            "requests": 100,
            "by_region": {"eu-west": measure.pop("requests", 100)},
            "latency_ms": {"p50": 20.0, "p95": 40.0, "p99": 60.0},
            "utilisation": 0.5,
            "queue": 0,
            **measure,
        }
        payload["requests"] = sum(payload["by_region"].values())
        return self.feed(
            self._request(
                "SERVICE_LOAD", service, service.split("/")[0], spec_json=canonical_json(payload)
            )
        )

    def dataset_ready(self, dataset_id: str, cluster: str, tenant: str = "acme") -> list[Effect]:
        return self.feed(self._request("DATASET_READY", f"{dataset_id}@{cluster}", tenant))

    def dataset_progress(
        self, dataset_id: str, cluster: str, report: dict[str, Any], tenant: str = "acme"
    ) -> list[Effect]:
        """The data mover's DATASET_PROGRESS: {copied_bytes, total_bytes} or {error}."""
        return self.feed(
            self._request(
                "DATASET_PROGRESS",
                f"{dataset_id}@{cluster}",
                tenant,
                spec_json=canonical_json(report),
            )
        )

    def decisions(self, job: str | None = None, outcome: str | None = None) -> list[Decision]:
        return [
            e
            for e in self.effects
            if isinstance(e, Decision)
            and (job is None or e.job == job)
            and (outcome is None or e.outcome == outcome)
        ]

    def last(self, job: str) -> Decision:
        return self.decisions(job)[-1]

    def job(self, key: str):
        return self.scheduler.jobs[key]

    def nodes_of(self, key: str) -> set[str]:
        return {n for nodes in self.job(key).allocation.values() for n in nodes}
