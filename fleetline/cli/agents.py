"""Node agents: `agent node` on an accelerator server, `agent simulator` for a simulated
fleet, and `command`, which sends a node's agent a command."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import typer

from fleetline.cli.common import (
    MetricsHost,
    MetricsPort,
    TopicPrefix,
    exit_with,
    expose_metrics,
    pairs,
    settings,
    ship_logs,
)
from fleetline.errors import ConfigError
from fleetline.streams.topics import DATA_MOVER, NODE_AGENT

agent = typer.Typer(
    help="Run a node agent: real accelerators (NVML, AMD SMI), or a simulated fleet",
    no_args_is_help=True,
)

IntervalMs = Annotated[int, typer.Option(min=1, help="sampling interval")]
Ticks = Annotated[int | None, typer.Option(min=1, help="stop after this many intervals")]
StateDir = Annotated[
    Path | None, typer.Option(help="spool and control state (default: .cache/agent)")
]


def node(
    devices: Annotated[
        str,
        typer.Option(
            metavar="auto|nvml|amdsmi",
            help="the device library the chips are read through (auto: the first that finds "
            "any); a library missing or failing is named in the log and the node is reported "
            "with no accelerators",
        ),
    ] = "auto",
    cluster_id: Annotated[str, typer.Option(help="this node's cluster")] = "local",
    region: Annotated[str, typer.Option(help="this node's region")] = "local",
    node_id: Annotated[
        str | None, typer.Option(help="this node's id (default: the host name)")
    ] = None,
    leaf_switch: Annotated[
        str | None, typer.Option(help="the node's leaf switch, if known")
    ] = None,
    spine_switch: Annotated[
        str | None, typer.Option(help="the spine switch above its leaf, if known")
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE",
            help="a label on the node (repeatable), e.g. --label pool=training",
        ),
    ] = None,
    topic_prefix: TopicPrefix = "fleetline",
    interval_ms: IntervalMs = 1000,
    ticks: Ticks = None,
    state_dir: StateDir = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
) -> None:
    """The node agent on a real accelerator server (NVIDIA through NVML, AMD through AMD SMI):
    NodeTelemetry every interval and NodeState heartbeats through an on-disk spool; applies the
    node's commands. The chips' vendor, model and memory and their interconnect domains (NVLink
    islands, xGMI hives) are read from the driver; labels and switches are the operator's."""
    from fleetline.agents.devices import open_devices
    from fleetline.agents.node import NodeAgent, NodeIdentity, operator_labels
    from fleetline.observability import logs, metrics
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec
    from fleetline.streams.topics import Topics

    labels = operator_labels(pairs(label, "--label"))  # before anything is opened
    config = settings("kafka", kind=NODE_AGENT)
    topics = Topics(topic_prefix)
    kafka_clients.ensure_topics(config.kafka, topics.specs())
    identity = NodeIdentity(
        cluster_id,
        region,
        node_id or socket.gethostname(),
        leaf_switch=leaf_switch,
        spine_switch=spine_switch,
        labels=labels,
    )
    node = NodeAgent.create(
        config,
        default_codec(),
        topics,
        identity,
        open_devices(devices),
        state_dir or config.cache_dir / "agent",
        interval_ms=interval_ms,
    )
    expose_metrics(
        metrics_host,
        metrics_port,
        f"agent/{identity.node_id}",
        metrics.DcgmCollector(metrics.telemetry_readings(lambda: node.latest_telemetry)),
        metrics.spool_collector(lambda: {cluster_id: node.publisher.figures()}),
    )
    shipped = ship_logs(config, topics, f"agent/{identity.node_id}", cluster_id)
    try:
        sent = node.run(threading.Event(), max_ticks=ticks)
    finally:
        node.close()
        logs.unship(shipped)
    print(f"{identity.node_id}: {sent} intervals sent to {topics.telemetry}")


agent.command(name="node")(node)
# The command's name before other vendors' chips were read; reads through `--devices` as `node`.
agent.command(name="nvml", hidden=True)(node)


@agent.command()
def simulator(
    clusters: Annotated[
        int,
        typer.Option(min=1, max=78, help="eu-west-a, us-east-a, ap-south-a, then eu-west-b, ..."),
    ] = 3,
    nodes: Annotated[int, typer.Option(min=1, help="nodes per cluster")] = 4,
    processes: Annotated[
        int,
        typer.Option(
            min=1,
            help="agent processes sharing the clusters (each simulates every Nth cluster, with "
            "its own spool and state under STATE_DIR/part-I): one process drives about 2,000 "
            "nodes at 1 Hz",
        ),
    ] = 1,
    # Set only by the parent of several processes, for each child: which clusters are its.
    part: Annotated[int | None, typer.Option(hidden=True, min=0)] = None,
    seed: Annotated[int, typer.Option()] = 7,
    faults: Annotated[
        Path | None,
        typer.Option(help="a YAML fault script (see tests/scenarios/degraded-fabric.yaml)"),
    ] = None,
    topic_prefix: TopicPrefix = "fleetline",
    interval_ms: IntervalMs = 1000,
    ticks: Ticks = None,
    state_dir: StateDir = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
) -> None:
    """A simulated fleet's agents, paced in real time."""
    from fleetline.agents.fleet import FleetAgent
    from fleetline.agents.simulator import FleetSimulator, default_clusters, load_faults
    from fleetline.observability import logs, metrics
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec
    from fleetline.streams.topics import Topics

    # SIGTERM ends collection like the last tick: what is spooled is sent before exiting. Set
    # first, so a SIGTERM while the agent is still starting (topics, spool) ends it as cleanly.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = settings("kafka", kind=NODE_AGENT)
    topics = Topics(topic_prefix)
    kafka_clients.ensure_topics(config.kafka, topics.specs())
    state_dir = state_dir or config.cache_dir / "agent"
    if processes > 1 and part is None:
        exit_with(_run_parts(processes, clusters))
        return
    part = part or 0
    start_ms = (int(time.time() * 1000) // interval_ms) * interval_ms
    fleet = FleetSimulator(
        default_clusters(nodes, clusters)[part::processes],
        seed=seed + part,
        interval_ms=interval_ms,
        faults=load_faults(faults, start_ms) if faults else [],
    )
    agents = FleetAgent.create(
        config,
        default_codec(),
        topics,
        fleet,
        state_dir / f"part-{part}" if processes > 1 else state_dir,
        # Its own command group: a node's commands reach the process that simulates it.
        agent_id="sim" if processes == 1 else f"sim-{part}",
    )
    expose_metrics(
        metrics_host,
        metrics_port,
        "agent/simulator",
        metrics.DcgmCollector(metrics.telemetry_readings(lambda: agents.latest_telemetry)),
        metrics.spool_collector(agents.spool_metrics),
    )
    shipped = ship_logs(config, topics, "agent/simulator")
    tick = 0
    try:
        agents.start(start_ms)
        while (ticks is None or tick < ticks) and not stop.is_set():
            tick += 1
            agents.tick(start_ms + tick * interval_ms)
            stop.wait(max(0.0, start_ms / 1000 + tick * interval_ms / 1000 - time.time()))
        agents.flush()
    finally:
        agents.close()
        logs.unship(shipped)
    print(
        f"{len(fleet.nodes)} simulated nodes: {tick} intervals sent to {topics.telemetry}; "
        f"spools: {agents.spool_metrics()}"
    )


def _run_parts(processes: int, clusters: int) -> int:
    """Run the simulator as `processes` children, each with every Nth cluster, until they all
    end (SIGTERM and Ctrl-C are passed on); the worst exit status."""
    if processes > clusters:
        raise ConfigError(f"{processes} processes for {clusters} clusters: some would idle")
    children = [
        subprocess.Popen([sys.executable, "-m", "fleetline.cli", *sys.argv[1:], "--part", str(i)])
        for i in range(processes)
    ]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        return max(child.wait() for child in children)
    except KeyboardInterrupt:
        forward(signal.SIGINT, None)
        return max(child.wait() for child in children)


class CommandKind(StrEnum):
    DRAIN = "DRAIN"
    CORDON = "CORDON"
    UNCORDON = "UNCORDON"
    SET_POWER_CAP = "SET_POWER_CAP"
    APPLY_CONFIG = "APPLY_CONFIG"


def command(
    node_id: Annotated[str, typer.Argument(help="the node")],
    kind: Annotated[CommandKind, typer.Argument(help="what to do")],
    cluster_id: Annotated[str, typer.Option(help="the node's cluster")],
    power_cap_w: Annotated[float | None, typer.Option(help="SET_POWER_CAP: watts")] = None,
    config_version: Annotated[str | None, typer.Option(help="APPLY_CONFIG: its version")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help="APPLY_CONFIG setting, e.g. interval_ms=5000"
        ),
    ] = None,
    command_id: Annotated[str | None, typer.Option(help="default: a new random id")] = None,
) -> None:
    """Send a command to a node's agent through the API (platform admins; issued by the
    signed-in caller, audited); its CommandResult lands on <prefix>.commands.result."""
    from fleetline.cli.client import api

    answer = api().call(
        "POST",
        f"/v1/nodes/{quote(node_id, safe='')}/commands",
        body={
            "cluster_id": cluster_id,
            "kind": str(kind),
            "power_cap_w": power_cap_w,
            "config_version": config_version,
            "config": pairs(set_, "--set"),
            "command_id": command_id,
        },
    )
    print(f"sent {kind} {answer['command_id']} to {node_id} (offset {answer['offset']})")


@agent.command(name="data-mover")
def data_mover(
    topic_prefix: TopicPrefix = "fleetline",
    copies: Annotated[int, typer.Option(min=1, help="copies carried out at once")] = 4,
) -> None:
    """The data mover on its own: carries out the scheduler's dataset prewarms, copying each
    dataset's objects between the clusters' stores (digests verified, at the granted rate),
    and answers DATASET_READY (until interrupted; a copy cut short goes on after a restart)."""
    from fleetline.agents.data_mover import DataMover
    from fleetline.identity.writers import Writer, WriterKind
    from fleetline.processors.scheduling.runtime import scheduler_topics
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.topics import Topics

    config = settings("kafka", "s3", kind=DATA_MOVER)
    topics = Topics(topic_prefix)
    kafka_clients.ensure_topics(config.kafka, scheduler_topics(topics))
    # Its reports are a mover's: it may report only the copies the scheduler ordered.
    mover = DataMover(
        config.kafka.writing_as(Writer(WriterKind.MOVER, "data-mover")),
        config.s3,
        topics,
        copies=copies,
        object_key=config.object_key(),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        mover.run(stop)
    print(f"{len(mover.moved)} prewarms done, {len(mover.failed)} failed")


def register(app: typer.Typer) -> None:
    app.add_typer(agent, name="agent")
    app.command(name="command")(command)
