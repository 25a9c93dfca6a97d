"""The service registry's publisher: every inference replica a cluster agent runs, as a
ReplicaEndpoint on the replicas topic (its address, state and load), which the router folds.

One thread per agent publishes at once when a replica changes (ready, promoted, draining,
gone: the agent sets `registry_wake`) and otherwise every `registry_s` with the load each
replica reports at `/v1/load`. What state a replica is in is the pure `registry.replica_state`.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fleetline.agents.cluster import workloads as procs
from fleetline.agents.cluster.reconcile import Order
from fleetline.agents.cluster.registry import endpoint_record, replica_state
from fleetline.processors.scheduling.services import REPLICA_KIND
from fleetline.schemas.records import ReplicaEndpoint, ReplicaState
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.loop import produce
from fleetline.streams.records import Output

if TYPE_CHECKING:
    from fleetline.agents.cluster.agent import ClusterAgent


class ReplicaRegistry:
    """One agent's replicas, published."""

    def __init__(self, agent: ClusterAgent) -> None:
        self.agent = agent
        # This host's certificate, shown to its replicas when it reads their load.
        settings = agent.settings
        self._tls = settings.tls.client_context() if settings.tls else None

    def run(self, stop: threading.Event) -> None:
        agent = self.agent
        producer = kafka_clients.producer(
            agent.settings.kafka, {"linger.ms": 0, **kafka_clients.ACROSS_LINKS}
        )
        published: dict[str, str] = {}  # replica -> the state last published
        try:
            while not stop.is_set():
                agent.registry_wake.clear()
                with agent.lock:
                    workloads = [w for runs in agent.running.values() for w in runs]
                seen = set()
                for workload in workloads:
                    order = agent.orders.get(workload.job)
                    if order is None or order.kind != REPLICA_KIND or workload.reported:
                        continue
                    if workload.job in seen:
                        continue  # an older run of the replica: the current one speaks
                    seen.add(workload.job)
                    record = self.endpoint(workload, order)
                    published[workload.job] = record["state"]
                    produce(producer, self.output(record))
                for replica in sorted(set(published) - seen):
                    if published.pop(replica) != "GONE":
                        order = agent.orders.get(replica)
                        if order is not None:
                            record = self.record(order, "GONE", None, {})
                            produce(producer, self.output(record))
                producer.poll(0)
                agent.registry_wake.wait(agent.registry_s)
        finally:
            producer.flush(5)

    def endpoint(self, workload: procs.Workload, order: Order) -> ReplicaEndpoint:
        lines = workload.serving_lines()
        address = (lines.get("ready") or lines.get("listening") or {}).get("address")
        load: dict[str, Any] = {}
        if address and workload.alive:
            answer = get_json(f"{address}/v1/load", self.agent.probe_timeout_s, self._tls)
            # A busy replica that is slow to say how busy it is keeps what it said last: only
            # its exit, a stop or its own word takes it out of the registry.
            load = answer if answer is not None else workload.serving.get("load", {})
            workload.serving["load"] = load
        alive = workload.alive
        state = replica_state(
            order, alive, workload.stop_deadline is not None, "ready" in lines, load
        )
        return self.record(order, state, address, load, lines.get("ready") or {})

    def record(
        self,
        order: Order,
        state: ReplicaState,
        address: str | None,
        load: Mapping[str, Any],
        ready: Mapping[str, Any] | None = None,
    ) -> ReplicaEndpoint:
        agent = self.agent
        return endpoint_record(
            order,
            agent.cluster_id,
            agent.region,
            int(time.time() * 1000),
            state,
            address,
            load,
            int(agent.registry_s * 1000),
            ready,
        )

    def output(self, record: ReplicaEndpoint) -> Output:
        topics = self.agent.topics
        return Output(
            topics.replicas,
            record["replica"].encode(),
            self.agent.codec.encode(topics.record_of(topics.replicas), record),
        )


def get_json(
    url: str, timeout_s: float, tls: ssl.SSLContext | None = None
) -> dict[str, Any] | None:
    """A GET's JSON body, or None when it does not answer in time (any status: a draining
    replica says so with a 503 and its load)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=tls) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (OSError, ValueError):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
