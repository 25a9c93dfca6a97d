"""Log lines of every fleetline process in ClickHouse (`logs`), searchable by SQL and joined
to decisions, workload events and the audit log by `trace_id`. A record sink."""

from __future__ import annotations

from fleetline.storage.scheduling_sink import TableDestination

LOGS = "logs"


class LogTable(TableDestination):
    name = "logs"
    table = LOGS
    columns = (
        "ts_ms",
        "level",
        "logger",
        "process",
        "host",
        "cluster_id",
        "message",
        "trace_id",
        "fields",
        "source_partition",
        "source_offset",
        "source_topic",
    )
