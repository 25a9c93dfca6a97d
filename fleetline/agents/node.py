"""The agent for one real accelerator server: the device port's readings (NVML, AMD SMI) ->
NodeTelemetry/NodeState -> spool -> Kafka, and its node's commands applied to the chips."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleetline.agents.commands import (
    CommandLoop,
    ControlStore,
    NodeControl,
    control_labels,
    reserved_labels,
)
from fleetline.agents.devices import Devices
from fleetline.agents.fleet import SequenceStore
from fleetline.agents.runtime import SENDS, TelemetryPublisher
from fleetline.agents.simulator import AGENT_VERSION
from fleetline.agents.spool import DiskSpool
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.identity.writers import Writer, WriterKind
from fleetline.schemas.records import NodeState, NodeTelemetry, NodeTopology
from fleetline.storage.crypto import cipher_for
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import AvroCodec
from fleetline.streams.topics import Topics

_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")


def operator_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels an operator gives a node, checked: a key the agent itself sets (`cordoned`,
    `config_version`: what commands did) or the old `accelerator` label (the hardware says
    that now) is refused, as is a key that is not label-shaped."""
    for key in labels:
        if key in reserved_labels() or key == "accelerator":
            why = (
                "the agent reads the GPUs' model from the driver"
                if key == "accelerator"
                else "the agent sets it from the commands it applied"
            )
            raise ConfigError(f"--label {key}=...: {key!r} is not the operator's to set ({why})")
        if not _LABEL_KEY.match(key):
            raise ConfigError(
                f"--label {key!r}: a key is letters, digits, '.', '_', '-' and '/', "
                "at most 63, starting and ending with a letter or digit"
            )
    return dict(labels)


@dataclass(frozen=True)
class NodeIdentity:
    cluster_id: str
    region: str
    node_id: str
    leaf_switch: str | None = None
    spine_switch: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class NodeAgent:
    identity: NodeIdentity
    devices: Devices
    publisher: TelemetryPublisher
    controls: ControlStore
    sequences: SequenceStore
    commands: CommandLoop | None = None
    interval_ms: int = 1000
    heartbeat_every: int = 10
    latest_telemetry: list[NodeTelemetry] = field(default_factory=list)
    _seq: int = 0

    @classmethod
    def create(
        cls,
        settings: Settings,
        codec: AvroCodec,
        topics: Topics,
        identity: NodeIdentity,
        devices: Devices,
        state_dir: Path,
        interval_ms: int = 1000,
        commands: bool = True,
    ) -> NodeAgent:
        publisher = TelemetryPublisher(
            kafka_clients.producer(
                settings.kafka.writing_as(
                    Writer(WriterKind.NODE, f"{identity.cluster_id}/{identity.node_id}")
                ),
                SENDS,
            ),
            codec,
            topics,
            DiskSpool(state_dir / "spool", cipher=cipher_for(settings.object_key())),
        )
        agent = cls(
            identity,
            devices,
            publisher,
            ControlStore(state_dir / "controls.json"),
            SequenceStore(state_dir / "sequences.json"),
            interval_ms=interval_ms,
        )
        agent._seq = agent.sequences.load().get(identity.node_id, 0)
        control = agent.controls.get(identity.node_id)
        if control.interval_ms:
            agent.interval_ms = control.interval_ms
        if commands:
            agent.commands = CommandLoop(
                kafka=settings.kafka,
                codec=codec,
                commands_topic=topics.commands,
                dead_letter_topic=topics.dead_letter,
                node_ids=[identity.node_id],
                partitions=topics.node_partitions,
                store=agent.controls,
                effect=agent._apply,
                group_id=f"{topics.prefix}.agent.{identity.node_id}",
            )
            agent.commands.open()
        return agent

    def _next_seq(self) -> int:
        self._seq += 1
        self.sequences.save({self.identity.node_id: self._seq})
        return self._seq

    def _apply(self, node_id: str, control: NodeControl) -> None:
        if control.power_cap_w is not None:
            self.devices.set_power_limit(control.power_cap_w)
        if control.interval_ms:
            self.interval_ms = control.interval_ms

    def state(self, ts_ms: int) -> NodeState:
        control = self.controls.get(self.identity.node_id)
        topology: NodeTopology = {
            **self.devices.topology(),
            "leaf_switch": self.identity.leaf_switch,
            "spine_switch": self.identity.spine_switch,
        }
        labels = {**self.identity.labels, **control_labels(control)}
        spool = self.publisher.spool
        accelerator = self.devices.accelerator()
        return {
            "cluster_id": self.identity.cluster_id,
            "region": self.identity.region,
            "node_id": self.identity.node_id,
            "seq": self._next_seq(),
            "ts": ts_ms,
            "state": control.state,
            "reason": None,
            "labels": labels,
            "topology": topology,
            "agent_version": AGENT_VERSION,
            "agent_spool_bytes": spool.size_bytes,
            "agent_spool_dropped": spool.dropped,
            "accelerator": accelerator.as_record() if accelerator is not None else None,
        }

    def telemetry(self, ts_ms: int) -> NodeTelemetry:
        return {
            "cluster_id": self.identity.cluster_id,
            "region": self.identity.region,
            "node_id": self.identity.node_id,
            "seq": self._next_seq(),
            "ts": ts_ms,
            "interval_ms": self.interval_ms,
            "gpus": self.devices.sample(),
            "agent_version": AGENT_VERSION,
            "collector": self.devices.collector,
        }

    def run(self, stop: threading.Event, max_ticks: int | None = None) -> int:
        """Sample every interval of wall time (the shell's clock) until stopped."""
        ticks = 0
        self.publisher.publish_states([self.state(_now_ms())])
        next_at = time.monotonic()
        while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
            next_at += self.interval_ms / 1000
            stop.wait(max(0.0, next_at - time.monotonic()))
            ts = _now_ms()
            ticks += 1
            sample = self.telemetry(ts)
            self.latest_telemetry = [sample]  # what /metrics shows under DCGM names
            self.publisher.publish_telemetry([sample])
            if ticks % self.heartbeat_every == 0:
                self.publisher.publish_states([self.state(ts)])
            if self.commands is not None and self.commands.poll(self.publisher, ts):
                self.publisher.publish_states([self.state(ts)])
            self.publisher.pump()
        self.publisher.flush()
        return ticks

    def close(self) -> None:
        if self.commands is not None:
            self.commands.close()
        self.publisher.spool.close()
        self.devices.close()


def _now_ms() -> int:
    return int(time.time() * 1000)
