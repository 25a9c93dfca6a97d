"""Runs a simulated fleet's node agents in one process.

Each cluster gets its own spool and producer, as its nodes' agents would, so a cluster that
loses its link to Kafka (a `cluster_link_loss` fault) keeps collecting into its spool and drains
it in order once the link is back, while the other clusters carry on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetline.agents.commands import CommandLoop, ControlStore, NodeControl, control_labels
from fleetline.agents.durable import write_if_room
from fleetline.agents.runtime import SENDS, TelemetryPublisher
from fleetline.agents.simulator import FleetSimulator, SimNode
from fleetline.agents.spool import DiskSpool
from fleetline.config import Settings
from fleetline.identity.writers import Writer, WriterKind
from fleetline.schemas.records import NodeLifecycle, NodeState, NodeTelemetry
from fleetline.storage.crypto import cipher_for
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import AvroCodec
from fleetline.streams.topics import Topics


@dataclass
class FleetAgent:
    simulator: FleetSimulator
    publishers: dict[str, TelemetryPublisher]
    controls: ControlStore
    sequences: SequenceStore | None = None
    commands: CommandLoop | None = None
    heartbeat_every: int = 10
    ticks: int = 0
    latest_telemetry: list[NodeTelemetry] = field(default_factory=list)
    # Nodes whose control state a command changed this interval: their NodeState follows.
    _changed: list[str] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        settings: Settings,
        codec: AvroCodec,
        topics: Topics,
        simulator: FleetSimulator,
        state_dir: Path,
        *,
        commands: bool = True,
        spool_max_bytes: int = 256 * 2**20,
        agent_id: str = "sim",
        message_timeout_ms: int | None = None,
    ) -> FleetAgent:
        publishers = {
            cluster.cluster_id: TelemetryPublisher(
                kafka_clients.producer(
                    settings.kafka.writing_as(
                        *(
                            Writer(WriterKind.NODE, f"{n.cluster_id}/{n.node_id}")
                            for n in simulator.nodes
                            if n.cluster_id == cluster.cluster_id
                        )
                    ),
                    {**SENDS, "message.timeout.ms": message_timeout_ms}
                    if message_timeout_ms is not None
                    else SENDS,
                ),
                codec,
                topics,
                DiskSpool(
                    state_dir / "spool" / cluster.cluster_id,
                    max_bytes=spool_max_bytes,
                    segment_bytes=min(8 * 2**20, spool_max_bytes // 4),
                    cipher=cipher_for(settings.object_key()),
                ),
            )
            for cluster in simulator.clusters
        }
        sequences = SequenceStore(state_dir / "sequences.json")
        agent = cls(
            simulator, publishers, ControlStore(state_dir / "controls.json"), sequences=sequences
        )
        # A restarted agent goes on numbering where it stopped, or the folds would take its
        # new events for replays of old ones.
        simulator.resume_sequences(sequences.load())
        for node_id, control in agent.controls.controls.items():
            agent._apply(node_id, control, announce=False)
        if commands:
            agent.commands = CommandLoop(
                kafka=settings.kafka,
                codec=codec,
                commands_topic=topics.commands,
                dead_letter_topic=topics.dead_letter,
                node_ids=[n.node_id for n in simulator.nodes],
                partitions=topics.node_partitions,
                store=agent.controls,
                effect=agent._apply,
                group_id=f"{topics.prefix}.agent.{agent_id}",
            )
            agent.commands.open()
        return agent

    def _apply(self, node_id: str, control: NodeControl, announce: bool = True) -> None:
        if control.power_cap_w is not None:
            self.simulator.set_power_limit(node_id, control.power_cap_w)
        if announce:
            self._changed.append(node_id)

    def _state(self, node: SimNode, ts_ms: int) -> NodeState:
        control = self.controls.get(node.node_id)
        spool = self.publishers[node.cluster_id].spool
        state: NodeLifecycle = "DOWN" if self.simulator.is_down(node.node_id) else control.state
        return self.simulator.node_state(
            node,
            ts_ms,
            state,
            labels=control_labels(control),
            spool=(spool.size_bytes, spool.dropped),
        )

    def start(self, ts_ms: int) -> int:
        states = [self._state(node, ts_ms) for node in self.simulator.nodes]
        sent = self._send("state", states, ts_ms)
        if self.sequences is not None:
            self.sequences.save(self.simulator.sequence_numbers())
        return sent

    def _send(
        self, kind: str, records: Sequence[NodeState] | Sequence[NodeTelemetry], ts_ms: int
    ) -> int:
        by_cluster: dict[str, list[Mapping[str, Any]]] = {}
        for record in records:
            by_cluster.setdefault(record["cluster_id"], []).append(record)
        for cluster_id, group in by_cluster.items():
            link = self.simulator.cluster_link_up(cluster_id, ts_ms)
            self.publishers[cluster_id].publish(kind, group, send=link)
        return len(records)

    def tick(self, ts_ms: int) -> dict[str, int]:
        """One sampling interval: state changes, heartbeats, telemetry, commands."""
        self.ticks += 1
        states = self.simulator.state_changes(ts_ms)
        if self.ticks % self.heartbeat_every == 0:
            states += [self._state(node, ts_ms) for node in self.simulator.nodes]
        sent = {"states": self._send("state", states, ts_ms)}
        telemetry = self.simulator.telemetry(ts_ms)
        self.latest_telemetry = telemetry  # what /metrics shows under DCGM names
        sent["telemetry"] = self._send("telemetry", telemetry, ts_ms)
        if self.commands is not None:
            sent["commands"] = len(self.commands.poll(_ResultRouter(self.publishers), ts_ms))
        if self._changed:
            changed = [self._state(self.simulator.node(n), ts_ms) for n in self._changed]
            sent["states"] += self._send("state", changed, ts_ms)
            self._changed = []
        if self.sequences is not None:
            self.sequences.save(self.simulator.sequence_numbers())
        for cluster_id, publisher in self.publishers.items():
            if self.simulator.cluster_link_up(cluster_id, ts_ms):
                publisher.pump()
        return sent

    def flush(self, timeout_s: float = 60.0) -> None:
        for publisher in self.publishers.values():
            publisher.flush(timeout_s)

    def spool_metrics(self) -> dict[str, dict[str, int]]:
        return {cluster: p.figures() for cluster, p in self.publishers.items()}

    def close(self) -> None:
        if self.commands is not None:
            self.commands.close()
        for publisher in self.publishers.values():
            publisher.spool.close()


@dataclass
class SequenceStore:
    """The last seq of each node, on disk (written after every interval).

    With the disk full the file keeps its last content and the agent goes on: an agent that
    then dies and restarts before there is room again numbers some records again from the
    older mark, and consumers drop those as repeats (the one loss a full disk can cause,
    counted in `unsaved`)."""

    path: Path
    unsaved: int = 0

    def load(self) -> dict[str, int]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self, sequences: dict[str, int]) -> None:
        if not write_if_room(self.path, json.dumps(sequences)):
            self.unsaved += 1


@dataclass
class _ResultRouter:
    """Routes command results to the publisher of the command's cluster."""

    publishers: dict[str, TelemetryPublisher]
    used: set[str] = field(default_factory=set)

    def publish_results(self, records: list[dict[str, Any]]) -> None:
        by_cluster: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            by_cluster.setdefault(record["cluster_id"], []).append(record)
        for cluster_id, group in by_cluster.items():
            self.publishers[cluster_id].publish_results(group)
            self.used.add(cluster_id)

    def flush(self) -> None:
        # Results must be durable before the command offsets are committed.
        for cluster_id in self.used:
            self.publishers[cluster_id].flush(60)
        self.used.clear()
