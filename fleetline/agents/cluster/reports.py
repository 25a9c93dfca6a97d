"""What a workload's progress lines say to the fleet, pure: each line of the contract's
progress file (`progress`, `checkpoint`, `tuned`, `resumed`, `ready`, ...) -> the
WorkloadEvents the cluster agent publishes and the PROGRESS reports it sends the scheduler.
Lines of other kinds (`done`, `stopped`, `listening`) tell the agent itself, and say
nothing here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetline.schemas.records import WorkloadEventKind

# A line's kind -> the WorkloadEvent it is published as, and which of the line's fields fill
# which of the event's.
LINE_EVENTS: dict[str, tuple[WorkloadEventKind, dict[str, str]]] = {
    "progress": ("PROGRESS", {"step": "step", "loss": "loss", "samples_per_s": "samples_per_s"}),
    "checkpoint": (
        "CHECKPOINTED",
        {
            "step": "step",
            "checkpoint_uri": "uri",
            "bytes": "bytes",
            "seconds": "seconds",
            "detail": "detail",  # a federated round's regions, into the audit log
        },
    ),
}


@dataclass(frozen=True)
class Event:
    """A WorkloadEvent to publish, with its fields."""

    kind: WorkloadEventKind
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    """A PROGRESS request to the scheduler, with its phase and fields."""

    phase: str
    fields: Mapping[str, Any] = field(default_factory=dict)


def said(line: Mapping[str, Any]) -> list[Event | Report]:
    """What one progress line says, in the order it is published."""
    kind = line.get("event")
    out: list[Event | Report] = []
    if isinstance(kind, str) and kind in LINE_EVENTS:
        event, fields = LINE_EVENTS[kind]
        values = {f: line.get(src) for f, src in fields.items()}
        if kind == "progress" and line.get("exchange_ms") is not None:
            values["detail"] = exchange_detail(line)
        out.append(Event(event, values))
    if kind == "checkpoint":
        out.append(
            Report(
                "CHECKPOINT",
                {
                    "step": line.get("step"),
                    "checkpoint_ms": line.get("ts"),
                    "detail": line.get("uri"),
                },
            )
        )
    elif kind == "tuned":
        out.append(
            Event(
                "PROGRESS",
                {
                    "step": line.get("step"),
                    "seconds": line.get("checkpoint_interval_s"),
                    "detail": f"checkpoint interval {line.get('checkpoint_interval_s')} s "
                    f"(was {line.get('previous')} s), from step {line.get('step')}",
                },
            )
        )
    elif kind == "resumed":
        out.append(
            Event(
                "RESTORED",
                {"step": line.get("step"), "detail": f"resumed from {line.get('checkpoint')}"},
            )
        )
    elif kind == "world":
        parts = line.get("parts") or []
        out.append(
            Event(
                "PROGRESS",
                {
                    "step": line.get("step"),
                    "detail": f"a world of {line.get('world_size')} workers: "
                    + ", ".join(
                        f"{p.get('cluster_id')} ranks {p.get('first_rank')}-"
                        f"{int(p.get('first_rank', 0)) + int(p.get('workers', 1)) - 1}"
                        for p in parts
                        if isinstance(p, Mapping)
                    ),
                },
            )
        )
    elif kind in ("peer_lost", "dataplane_failed"):
        out.append(
            Event(
                "PROGRESS",
                {"step": line.get("step"), "detail": f"data plane: {line.get('error')}"},
            )
        )
    elif kind == "ready":
        out.append(
            Event(
                "PROGRESS",
                {
                    "seconds": line.get("start_s"),
                    "detail": f"ready at {line.get('address')}, serving "
                    f"{line.get('checkpoint')} (model loaded in {line.get('load_s')}s)",
                },
            )
        )
    return out


def exchange_detail(line: Mapping[str, Any]) -> str:
    """What a data-parallel step's exchange costs, as a progress line of the root says it."""
    crossing = line.get("cross_bytes_per_step") or 0
    if line.get("round") is not None:
        return (
            f"federated round {line.get('round')}: {', '.join(line.get('regions') or ())} "
            f"contributed; {line.get('exchange_ms')} ms a round averaging, {crossing} bytes a "
            "step across regions (model updates only)"
        )
    text = f"data plane: {line.get('exchange_ms')} ms a step exchanging gradients"
    return text + (f", {crossing} bytes a step across clusters" if crossing else "")
