"""Names of the event records on fleetline's topics, and the rules a record must keep."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.streams.telemetry_rules import gpu_sample_problem

NODE_TELEMETRY = "fleetline.telemetry.NodeTelemetry"
NODE_STATE = "fleetline.telemetry.NodeState"
GPU_SAMPLE = "fleetline.telemetry.GpuSample"
CLUSTER_INFO = "fleetline.fleet.ClusterInfo"
CAPACITY_SUMMARY = "fleetline.fleet.CapacitySummary"
DATASET_STATE = "fleetline.fleet.DatasetState"
ALLOCATION = "fleetline.scheduling.Allocation"
AUDIT_EVENT = "fleetline.audit.AuditEvent"
AUDIT_RECORD = "fleetline.audit.AuditRecord"
SCHEDULER_REQUEST = "fleetline.scheduling.SchedulerRequest"
SCHEDULING_DECISION = "fleetline.scheduling.SchedulingDecision"
DATASET_PREWARM = "fleetline.scheduling.DatasetPrewarm"
WORKLOAD_ORDER = "fleetline.cluster.WorkloadOrder"
WORKLOAD_EVENT = "fleetline.cluster.WorkloadEvent"
CLUSTER_SIGNAL = "fleetline.cluster.ClusterSignal"
CLUSTER_HEALTH = "fleetline.cluster.ClusterHealth"
LOG_RECORD = "fleetline.observability.LogRecord"
NODE_COMMAND = "fleetline.commands.NodeCommand"
COMMAND_RESULT = "fleetline.commands.CommandResult"
OPS_EVENT = "fleetline.operations.OpsEvent"
REPAIR_TICKET = "fleetline.operations.RepairTicket"
REPLICA_ENDPOINT = "fleetline.serving.ReplicaEndpoint"
IDENTITY_EVENT = "fleetline.identity.IdentityEvent"


def check_telemetry(record: Mapping[str, Any]) -> None:
    """Raise InvalidEventError if a decoded NodeTelemetry breaks a rule Avro cannot express."""
    for gpu in record["gpus"]:
        problem = gpu_sample_problem(gpu["gpu_util_pct"], gpu["fb_used_mib"], gpu["fb_total_mib"])
        if problem is not None:
            raise InvalidEventError(
                f"{record['node_id']} seq {record['seq']} gpu {gpu['gpu_index']}: {problem}"
            )
