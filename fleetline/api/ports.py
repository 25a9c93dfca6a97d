"""What the API's routes reach: the view, the audit store, ClickHouse and the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import HTTPException

from fleetline.processors.postmortem.report import Scope
from fleetline.processors.replay import AsOf
from fleetline.processors.view.read import ViewSource
from fleetline.storage.audit_store import AuditTable

# A read-only query -> {"columns": [...], "rows": [...]}; a ready query by name and range.
Sql = Callable[[str], dict[str, Any]]
ReadyQuery = Callable[[str, str, str | None], dict[str, Any]]
# A postmortem of [from_ms, to_ms] within a scope (processors/postmortem): its report.
Postmortem = Callable[[int, int, Scope], dict[str, Any]]
# ClusterInfo records appended to the clusters topic -> their offsets.
DeclareClusters = Callable[[list[dict[str, Any]]], list[int]]
# One record appended to a topic of the fleet (a ClusterSignal, a NodeCommand) -> its offset.
Append = Callable[[Mapping[str, Any]], int]


class JobsPort(Protocol):
    """The scheduler as the API reaches it: its request log, its committed state, its
    decisions (`processors/scheduling/runtime.KafkaJobs`)."""

    def submit(self, requests: list[dict[str, Any]]) -> list[int]: ...

    def jobs(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    def job(self, key: str) -> dict[str, Any] | None: ...

    def decisions(self, job: str) -> list[dict[str, Any]]: ...

    def fits(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every queued job's binding constraint and the smallest change that would place it
        (processors/postmortem/fit.py)."""
        ...

    def wait(
        self, keys: list[str], offsets: list[int], timeout_s: float
    ) -> dict[str, dict[str, Any]]:
        """The latest decision about each key made from its request (at `offsets`) or later,
        once each is settled (anything but QUEUED, or QUEUED for its data's copy) or
        `timeout_s` has passed; a key without one is missing."""
        ...


class OperationsPort(Protocol):
    """Automated operations as the API reaches it: repair tickets, and moving one
    (`processors/operations/runtime.KafkaOperations`)."""

    def tickets(self) -> list[dict[str, Any]]: ...

    def ticket(self, ticket_id: str) -> dict[str, Any] | None: ...

    def move(self, ticket_id: str, state: str, note: str, actor: str, ts: int) -> int: ...

    def append(self, events: Sequence[Mapping[str, Any]]) -> list[int]: ...


class HistoryPort(Protocol):
    """The view as it stood at a moment (`processors/replay.ViewHistory`)."""

    def at(self, at_ms: int) -> tuple[ViewSource, AsOf]: ...


@dataclass(frozen=True)
class Ports:
    view: ViewSource
    audit_table: AuditTable | None
    sql: Sql | None
    ready_query: ReadyQuery | None
    jobs: JobsPort | None
    clock: Callable[[], int]
    history: HistoryPort | None = None
    clusters: DeclareClusters | None = None
    operations: OperationsPort | None = None
    signals: Append | None = None
    commands: Append | None = None
    postmortems: Postmortem | None = None

    def audit(self) -> AuditTable:
        if self.audit_table is None:
            raise HTTPException(503, "the audit store is not configured on this server")
        return self.audit_table

    def view_at(self, at_ms: int) -> tuple[ViewSource, AsOf]:
        if self.history is None:
            raise HTTPException(503, "time travel (?at=) is not configured on this server")
        return self.history.at(at_ms)

    def declare_clusters(self) -> DeclareClusters:
        if self.clusters is None:
            raise HTTPException(503, "declaring clusters is not configured on this server")
        return self.clusters

    def signal(self) -> Append:
        if self.signals is None:
            raise HTTPException(503, "the cluster signal log is not configured on this server")
        return self.signals

    def command(self) -> Append:
        if self.commands is None:
            raise HTTPException(503, "node commands are not configured on this server")
        return self.commands

    def sql_port(self) -> Sql:
        if self.sql is None:
            raise HTTPException(503, "no ClickHouse store is configured on this server")
        return self.sql

    def ops(self) -> OperationsPort:
        if self.operations is None:
            raise HTTPException(503, "automated operations do not run on this server")
        return self.operations

    def postmortem(self) -> Postmortem:
        if self.postmortems is None:
            raise HTTPException(503, "postmortems are not configured on this server")
        return self.postmortems

    def scheduler(self) -> JobsPort:
        if self.jobs is None:
            raise HTTPException(503, "the scheduler is not configured on this server")
        return self.jobs
