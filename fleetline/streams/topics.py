"""Topic names and their settings: one place that says what each topic holds and how it is kept."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from fleetline.streams.events import (
    ALLOCATION,
    AUDIT_EVENT,
    AUDIT_RECORD,
    CAPACITY_SUMMARY,
    CLUSTER_HEALTH,
    CLUSTER_INFO,
    CLUSTER_SIGNAL,
    COMMAND_RESULT,
    DATASET_PREWARM,
    DATASET_STATE,
    IDENTITY_EVENT,
    LOG_RECORD,
    NODE_COMMAND,
    NODE_STATE,
    NODE_TELEMETRY,
    OPS_EVENT,
    REPAIR_TICKET,
    REPLICA_ENDPOINT,
    SCHEDULER_REQUEST,
    SCHEDULING_DECISION,
    WORKLOAD_EVENT,
    WORKLOAD_ORDER,
)

DAY_MS = 24 * 3600 * 1000
# The topics the resource view folds are stamped by the broker when it appends, so a message's
# timestamp says when the system saw it and `replay --at` can find that moment in the log.
LOG_APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}


# The kinds of process that reach Kafka, each its own principal on a secured broker
# (streams/access.py turns who writes and reads each topic into ACLs). The control plane
# (`serve`: view, scheduler, sinks, audit, operations, health, API) and the operator's
# read-only commands read every topic; the agents read what their specs name.
CONTROL_PLANE = "control-plane"
NODE_AGENT = "node-agent"
CLUSTER_AGENT = "cluster-agent"
ROUTER = "router"
DATA_MOVER = "data-mover"
OPERATOR = "operator"
SERVICE_KINDS = (CONTROL_PLANE, NODE_AGENT, CLUSTER_AGENT, ROUTER, DATA_MOVER, OPERATOR)
EVERY_PROCESS = (CONTROL_PLANE, NODE_AGENT, CLUSTER_AGENT, ROUTER, DATA_MOVER)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    doc: str = ""
    record: str | None = None  # the Avro record every message holds (None: not Avro)
    key: str = ""  # what the message key is
    # Who may append to it and who reads it besides the control plane and the operator.
    writers: tuple[str, ...] = (CONTROL_PLANE,)
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topics:
    """Topic names under one prefix, so test runs and deployments never share a topic by accident.

    Telemetry and node state are keyed by node id, with the same partition count and the murmur2
    partitioner, so one node's telemetry and state land in the same partition number and a
    processor's store partition can hold both (co-partitioning, as in Kafka Streams).
    """

    prefix: str = "fleetline"
    node_partitions: int = 6
    audit_partitions: int = 3

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}.telemetry.node"

    @property
    def node_state(self) -> str:
        return f"{self.prefix}.state.node"

    @property
    def commands(self) -> str:
        return f"{self.prefix}.commands.node"

    @property
    def command_results(self) -> str:
        return f"{self.prefix}.commands.result"

    @property
    def clusters(self) -> str:
        return f"{self.prefix}.state.cluster"

    @property
    def datasets(self) -> str:
        return f"{self.prefix}.state.dataset"

    @property
    def summaries(self) -> str:
        return f"{self.prefix}.view.summaries"

    @property
    def allocations(self) -> str:
        return f"{self.prefix}.scheduler.allocations"

    @property
    def scheduler_requests(self) -> str:
        return f"{self.prefix}.scheduler.requests"

    @property
    def decisions(self) -> str:
        return f"{self.prefix}.scheduler.decisions"

    @property
    def prewarms(self) -> str:
        return f"{self.prefix}.scheduler.prewarms"

    @property
    def orders(self) -> str:
        return f"{self.prefix}.cluster.orders"

    @property
    def ops(self) -> str:
        return f"{self.prefix}.ops.events"

    @property
    def tickets(self) -> str:
        return f"{self.prefix}.ops.tickets"

    @property
    def replicas(self) -> str:
        return f"{self.prefix}.services.replicas"

    @property
    def logs(self) -> str:
        return f"{self.prefix}.logs"

    @property
    def workloads(self) -> str:
        return f"{self.prefix}.cluster.workloads"

    @property
    def cluster_signals(self) -> str:
        return f"{self.prefix}.cluster.signals"

    @property
    def identities(self) -> str:
        return f"{self.prefix}.identities"

    @property
    def emergency(self) -> str:
        return f"{self.prefix}.emergency"

    @property
    def node_topics(self) -> tuple[str, str]:
        """The co-partitioned topics keyed by node id: partition p of each holds the same nodes."""
        return (self.telemetry, self.node_state)

    @property
    def fleet_topics(self) -> tuple[str, str, str, str]:
        """The small single-partition topics every view instance reads whole (global tables)."""
        return (self.clusters, self.datasets, self.allocations, self.emergency)

    @property
    def audit_requests(self) -> str:
        return f"{self.prefix}.audit.requests"

    @property
    def audit_log(self) -> str:
        return f"{self.prefix}.audit.log"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}.deadletter"

    def changelog(self, application_id: str, store: str) -> str:
        return f"{self.prefix}.{application_id}.{store}.changelog"

    def record_of(self, topic: str) -> str:
        """The Avro record every message of `topic` holds, as its spec names it (producers
        encode with this, so a topic's record is named in one place)."""
        records = _records(self)
        record = records.get(topic)
        if record is None:
            raise KeyError(f"{topic} is no topic of prefix {self.prefix!r} with an Avro record")
        return record

    def specs(self) -> list[TopicSpec]:
        return [
            TopicSpec(
                self.telemetry,
                self.node_partitions,
                {
                    "cleanup.policy": "delete",
                    "retention.ms": str(7 * DAY_MS),
                    "compression.type": "producer",
                    **LOG_APPEND_TIME,
                },
                "NodeTelemetry, one record per node per interval, keyed by node id",
                record=NODE_TELEMETRY,
                key="node id",
                writers=(NODE_AGENT,),
            ),
            TopicSpec(
                self.node_state,
                self.node_partitions,
                {
                    "cleanup.policy": "compact",
                    "min.compaction.lag.ms": str(3600 * 1000),
                    **LOG_APPEND_TIME,
                },
                "NodeState, keyed by node id; compacted to the latest state of each node",
                record=NODE_STATE,
                key="node id",
                writers=(NODE_AGENT,),
                readers=(CLUSTER_AGENT,),
            ),
            TopicSpec(
                self.commands,
                self.node_partitions,
                {"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS)},
                "NodeCommand, keyed by node id; each agent reads its nodes' partitions",
                record=NODE_COMMAND,
                key="node id",
                readers=(NODE_AGENT,),
            ),
            TopicSpec(
                self.command_results,
                self.node_partitions,
                {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)},
                "CommandResult, the agents' acknowledgements, keyed by node id",
                record=COMMAND_RESULT,
                key="node id",
                writers=(NODE_AGENT,),
            ),
            TopicSpec(
                self.clusters,
                1,
                {"cleanup.policy": "compact", **LOG_APPEND_TIME},
                "ClusterInfo, keyed by cluster id; compacted to each cluster's latest facts",
                record=CLUSTER_INFO,
                key="cluster id",
                readers=(CLUSTER_AGENT, ROUTER),
            ),
            TopicSpec(
                self.datasets,
                1,
                {"cleanup.policy": "compact", **LOG_APPEND_TIME},
                "DatasetState, keyed by dataset id; compacted to each dataset's replicas",
                record=DATASET_STATE,
                key="dataset id",
            ),
            TopicSpec(
                self.summaries,
                1,
                {
                    "cleanup.policy": "compact",
                    # A TICK names an offset of this topic; a replay reads every summary below
                    # it, so none is compacted away while the node topics still hold its week.
                    "min.compaction.lag.ms": str(7 * DAY_MS),
                },
                "CapacitySummary, keyed by nodes/<cluster>/<shard>, cluster/<id> or "
                "dataset/<id>: what the view shards publish of the fleet for a scheduler that "
                "folds no view of its own",
                record=CAPACITY_SUMMARY,
                key="nodes/<cluster>/<shard>, cluster/<id> or dataset/<id>",
            ),
            TopicSpec(
                self.allocations,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1", **LOG_APPEND_TIME},
                "Allocation, keyed by job id; kept forever so replay sees every binding",
                record=ALLOCATION,
                key="job id (tenant/name)",
            ),
            TopicSpec(
                self.scheduler_requests,
                1,
                # LogAppendTime: a revocation holds from the moment the broker appended it
                # (identity/writers.py), the same in the live fold and in every replay.
                {"cleanup.policy": "delete", "retention.ms": "-1", **LOG_APPEND_TIME},
                "SchedulerRequest: desired state, reports and ticks, in one total order; "
                "kept forever, it is what a replay of the decisions folds",
                record=SCHEDULER_REQUEST,
                key="job key (tenant/name), dataset:<name>, <dataset>@<cluster>, a tenant, "
                "or - for POLICY and TICK",
                # Which writer may make which kind of request is the scheduler's check
                # (identity/authority.py); the broker only keeps other kinds of process out.
                writers=(CONTROL_PLANE, CLUSTER_AGENT, DATA_MOVER, ROUTER),
            ),
            TopicSpec(
                self.decisions,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1"},
                "SchedulingDecision, keyed by job: every decision with its reasons",
                record=SCHEDULING_DECISION,
                key="job key (tenant/name)",
            ),
            TopicSpec(
                self.prewarms,
                1,
                {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)},
                "DatasetPrewarm orders for the data movers, keyed by dataset@cluster",
                record=DATASET_PREWARM,
                key="<dataset>@<cluster>",
                readers=(DATA_MOVER,),
            ),
            TopicSpec(
                self.orders,
                1,
                {"cleanup.policy": "compact", "min.compaction.lag.ms": str(3600 * 1000)},
                "WorkloadOrder, keyed by job; compacted to each job's latest order, which is the "
                "desired state the cluster agents reconcile",
                record=WORKLOAD_ORDER,
                key="job key (tenant/name)",
                readers=(CLUSTER_AGENT,),
            ),
            TopicSpec(
                self.replicas,
                1,
                {
                    "cleanup.policy": "compact",
                    "min.compaction.lag.ms": str(600 * 1000),
                    "delete.retention.ms": str(600 * 1000),
                },
                "ReplicaEndpoint, keyed by replica: the global service registry (each "
                "inference replica's endpoint, region, readiness and load), compacted to each "
                "replica's latest record",
                record=REPLICA_ENDPOINT,
                key="replica (tenant/service.rN)",
                writers=(CLUSTER_AGENT,),
                readers=(ROUTER,),
            ),
            TopicSpec(
                self.workloads,
                1,
                {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS), **LOG_APPEND_TIME},
                "WorkloadEvent from the cluster agents (transitions, steps, checkpoints), "
                "keyed by job",
                record=WORKLOAD_EVENT,
                key="job key (tenant/name)",
                writers=(CLUSTER_AGENT,),
            ),
            TopicSpec(
                self.cluster_signals,
                1,
                {"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS), **LOG_APPEND_TIME},
                "ClusterSignal: cluster heartbeats, the control plane's clock ticks and cluster "
                "cordons, in one total order for the health fold",
                record=CLUSTER_SIGNAL,
                key="cluster id",
                writers=(CONTROL_PLANE, CLUSTER_AGENT),
                readers=(CLUSTER_AGENT,),
            ),
            TopicSpec(
                self.emergency,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1", **LOG_APPEND_TIME},
                "ClusterHealth: cluster health changes, cluster down, partitions and fences, "
                "keyed by cluster; read by the view and every cluster agent",
                record=CLUSTER_HEALTH,
                key="cluster id",
                readers=(CLUSTER_AGENT,),
            ),
            TopicSpec(
                self.identities,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1", **LOG_APPEND_TIME},
                "IdentityEvent: writer identities enrolled and revoked; every fold that checks "
                "a writer reads it whole, so a revocation holds in live folds and replays alike",
                record=IDENTITY_EVENT,
                key="writer (kind:name)",
            ),
            TopicSpec(
                self.audit_requests,
                self.audit_partitions,
                {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)},
                "AuditEvent as emitted by the API, CLI and processors, and by the audit linker for "
                "every decision, order and workload transition, keyed by tenant",
                record=AUDIT_EVENT,
                key="tenant (_fleet for fleet-wide events)",
                writers=(CONTROL_PLANE, OPERATOR),
            ),
            TopicSpec(
                self.audit_log,
                self.audit_partitions,
                {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"},
                "AuditRecord: one hash chain per partition; never compacted or expired",
                record=AUDIT_RECORD,
                key="tenant (_fleet for fleet-wide events)",
            ),
            TopicSpec(
                self.ops,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1"},
                "OpsEvent: what the operations processor folds (observations of the view, "
                "ticket moves, its policy, capacity requests) in one total order; kept forever, "
                "it is what a replay of its actions folds",
                record=OPS_EVENT,
                key="ticket id, cluster/model, or - for OBSERVE and OPS_POLICY",
            ),
            TopicSpec(
                self.tickets,
                1,
                {"cleanup.policy": "delete", "retention.ms": "-1"},
                "RepairTicket: every change of every repair ticket, keyed by ticket id",
                record=REPAIR_TICKET,
                key="ticket id",
            ),
            TopicSpec(
                self.logs,
                1,
                {"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS)},
                "LogRecord: structured log lines of every fleetline process, keyed by process",
                record=LOG_RECORD,
                key="process",
                writers=EVERY_PROCESS,
            ),
            TopicSpec(
                self.dead_letter,
                1,
                {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)},
                "messages no processor could handle: original bytes, reason in headers",
                key="the original message's key",
                writers=(CONTROL_PLANE, NODE_AGENT),
            ),
        ]

    def changelog_spec(
        self,
        application_id: str,
        store: str,
        partitions: int | None = None,
        readers: tuple[str, ...] = (),
    ) -> TopicSpec:
        return TopicSpec(
            self.changelog(application_id, store),
            self.node_partitions if partitions is None else partitions,
            {"cleanup.policy": "compact"},
            f"changelog of {application_id}'s {store} store",
            readers=readers,
        )


@functools.cache
def _records(topics: Topics) -> dict[str, str]:
    return {spec.name: spec.record for spec in topics.specs() if spec.record is not None}
