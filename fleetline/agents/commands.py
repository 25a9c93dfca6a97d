"""Commands to node agents: the pure decision, and the loop that reads a node's command topic.

`apply_command(control, command)` decides what a command does to a node's control state and
what the agent answers; it has no I/O and no clock. `CommandLoop` is the shell: it reads the
command-topic partitions that hold its nodes' keys, applies each command to the collector, and
acknowledges it with a CommandResult (through the spool) before committing the offset. Applied
command ids are remembered on disk, so a command redelivered after a crash is answered DUPLICATE
and not applied twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from fleetline.agents.durable import write_atomically
from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StreamError
from fleetline.processors.view.model import CORDONED_LABEL
from fleetline.schemas.records import NodeLifecycle
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import dead_letter_headers
from fleetline.streams.partitioner import partition_for
from fleetline.streams.serde import AvroCodec

log = logging.getLogger(__name__)

MIN_POWER_CAP_W = 100.0
MAX_POWER_CAP_W = 1000.0
CONFIG_KEYS = {"interval_ms": (100, 60_000)}
REMEMBERED_COMMANDS = 1000
# Answers while a group's coordinator is being found or loaded: asked again, they pass.
_COORDINATOR_SETTLING = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    }
)


@dataclass(frozen=True)
class NodeControl:
    """What commands set on one node."""

    state: NodeLifecycle = "UP"
    cordoned: bool = False
    power_cap_w: float | None = None
    config_version: str | None = None
    interval_ms: int | None = None
    applied: tuple[str, ...] = ()  # the last command ids applied, newest last


@dataclass(frozen=True)
class Decision:
    control: NodeControl
    outcome: str
    message: str


def reserved_labels() -> frozenset[str]:
    """The label keys `control_labels` writes: no one else may set them."""
    return frozenset({CORDONED_LABEL, "config_version"})


def control_labels(control: NodeControl) -> dict[str, str]:
    """The NodeState labels that say what commands set: cordoned (read by the view and the
    scheduler: no new work) and the applied config version."""
    labels = {CORDONED_LABEL: str(control.cordoned).lower()}
    if control.config_version:
        labels["config_version"] = control.config_version
    return labels


def apply_command(control: NodeControl, command: Mapping[str, Any]) -> Decision:
    """Decide one command's effect on a node's control state (pure)."""
    command_id = command["command_id"]
    if command_id in control.applied:
        return Decision(control, "DUPLICATE", f"command {command_id} was applied before")
    kind = command["kind"]
    remember = (*control.applied, command_id)[-REMEMBERED_COMMANDS:]
    match kind:
        case "DRAIN":
            return Decision(
                replace(control, state="DRAINING", applied=remember),
                "APPLIED",
                "draining: no new work, running work finishes",
            )
        case "CORDON":
            return Decision(
                replace(control, cordoned=True, applied=remember), "APPLIED", "cordoned"
            )
        case "UNCORDON":
            # The way back from DRAIN too: the node takes new work again.
            message = "uncordoned" + ("; draining ended" if control.state == "DRAINING" else "")
            return Decision(
                replace(control, cordoned=False, state="UP", applied=remember), "APPLIED", message
            )
        case "SET_POWER_CAP":
            cap = command.get("power_cap_w")
            if cap is None or not MIN_POWER_CAP_W <= cap <= MAX_POWER_CAP_W:
                return Decision(
                    control,
                    "REJECTED",
                    f"power_cap_w must be {MIN_POWER_CAP_W:.0f}-{MAX_POWER_CAP_W:.0f} W, got {cap}",
                )
            return Decision(
                replace(control, power_cap_w=float(cap), applied=remember),
                "APPLIED",
                f"power cap {cap:.0f} W on every GPU",
            )
        case "APPLY_CONFIG":
            version = command.get("config_version")
            if not version:
                return Decision(control, "REJECTED", "APPLY_CONFIG needs a config_version")
            config = dict(command.get("config") or {})
            unknown = sorted(set(config) - set(CONFIG_KEYS))
            if unknown:
                return Decision(
                    control, "REJECTED", f"unknown settings {unknown}; known: {sorted(CONFIG_KEYS)}"
                )
            interval = control.interval_ms
            if "interval_ms" in config:
                low, high = CONFIG_KEYS["interval_ms"]
                raw = config["interval_ms"]
                if not raw.isdigit() or not low <= int(raw) <= high:
                    return Decision(
                        control,
                        "REJECTED",
                        f"interval_ms must be an integer {low}-{high}, got {raw!r}",
                    )
                interval = int(raw)
            return Decision(
                replace(control, config_version=version, interval_ms=interval, applied=remember),
                "APPLIED",
                f"config {version} applied",
            )
        case _:
            return Decision(control, "REJECTED", f"this agent does not know command {kind}")


def result_record(command: Mapping[str, Any], decision: Decision, ts_ms: int) -> dict[str, Any]:
    return {
        "command_id": command["command_id"],
        "cluster_id": command["cluster_id"],
        "node_id": command["node_id"],
        "ts": ts_ms,
        "outcome": decision.outcome,
        "message": decision.message,
        "node_state": decision.control.state,
        "cordoned": decision.control.cordoned,
        "config_version": decision.control.config_version,
    }


class ControlStore:
    """The nodes' control state on disk (one JSON file, replaced atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.controls: dict[str, NodeControl] = {}
        if path.exists():
            raw = json.loads(path.read_text())
            self.controls = {
                node: NodeControl(**{**c, "applied": tuple(c["applied"])})
                for node, c in raw.items()
            }

    def get(self, node_id: str) -> NodeControl:
        return self.controls.get(node_id, NodeControl())

    def put(self, node_id: str, control: NodeControl) -> None:
        self.controls[node_id] = control
        write_atomically(self.path, json.dumps({n: asdict(c) for n, c in self.controls.items()}))


# Applies a decided control state to the hardware (NVML) or the simulator.
Effector = Callable[[str, NodeControl], None]


class ResultPublisher(Protocol):
    """Where command results go: the agent's spool and producer."""

    def publish_results(self, records: list[dict[str, Any]]) -> Any: ...

    def flush(self) -> Any: ...


@dataclass
class CommandLoop:
    kafka: KafkaSettings
    codec: AvroCodec
    commands_topic: str
    dead_letter_topic: str
    node_ids: list[str]
    partitions: int
    store: ControlStore
    effect: Effector
    group_id: str
    handled: int = 0
    dead_letters: int = 0
    _consumer: Consumer | None = field(default=None, init=False)
    _dlq: Any = field(default=None, init=False)

    def open(self) -> None:
        self._consumer = Consumer(
            self.kafka.client_config(
                **{
                    "group.id": self.group_id,
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                }
            )
        )
        mine = sorted({partition_for(n.encode(), self.partitions) for n in self.node_ids})
        # Read only the partitions our nodes' keys land in, resuming at our committed offsets.
        wanted = [TopicPartition(self.commands_topic, p) for p in mine]
        deadline = time.monotonic() + 60
        while True:
            try:
                committed = self._consumer.committed(wanted, timeout=30)
                break
            except KafkaException as exc:
                # A broker that just started is still loading its group coordinator, and a new
                # group's coordinator may answer "not coordinator" until its metadata settles.
                error = exc.args[0]
                settling = error.retriable() or error.code() in _COORDINATOR_SETTLING
                if not settling or time.monotonic() > deadline:
                    raise StreamError(f"reading the agent's command offsets: {exc}") from None
                time.sleep(0.5)
        self._consumer.assign(committed)
        self._dlq = kafka_clients.producer(self.kafka)

    def poll(
        self, publisher: ResultPublisher, ts_ms: int, timeout_s: float = 0.0
    ) -> list[dict[str, Any]]:
        """Handle the commands waiting; return the results. Offsets are committed only after
        the results are acknowledged by Kafka."""
        assert self._consumer is not None, "open() first"
        messages = self._consumer.consume(500, timeout_s)
        if not messages:
            return []
        results = []
        ours = set(self.node_ids)
        for msg in messages:
            error = msg.error()
            if error is not None:
                raise FleetlineError(f"reading {self.commands_topic}: {error.str()}")
            try:
                command = self.codec.decode(msg.value(), expect="NodeCommand").record
            except FleetlineError as exc:
                self.dead_letters += 1
                self._dlq.produce(
                    self.dead_letter_topic,
                    key=msg.key(),
                    value=msg.value(),
                    headers=dead_letter_headers(msg, self.group_id, exc),
                )
                continue
            if command["node_id"] not in ours:
                continue  # another node's command sharing the partition
            node_id = command["node_id"]
            decision = apply_command(self.store.get(node_id), command)
            if decision.outcome == "APPLIED":
                try:
                    self.effect(node_id, decision.control)
                except FleetlineError as exc:
                    # The hardware refused (e.g. no permission to set a power cap): say so,
                    # and keep the control state as it was.
                    decision = Decision(self.store.get(node_id), "FAILED", str(exc))
                else:
                    self.store.put(node_id, decision.control)
            results.append(result_record(command, decision, ts_ms))
            self.handled += 1
        publisher.publish_results(results)
        publisher.flush()
        self._dlq.flush(30)
        self._consumer.commit(
            offsets=kafka_clients.topic_partitions(kafka_clients.next_offsets(messages)),
            asynchronous=False,
        )
        return results

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
