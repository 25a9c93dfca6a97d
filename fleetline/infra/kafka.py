"""Real Apache Kafka brokers (KRaft, each a combined broker+controller) on loopback: one, or a
replicated cluster of several whose controllers form the quorum.

The broker jars come through `mvn dependency:copy-dependencies` on `kafka-broker.pom.xml` and are
cached under the repository's ignored cache folder; each broker then runs as
`java -cp <jars> kafka.Kafka server.properties`.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceError
from fleetline.infra.kafka_access import (
    KafkaSecrets,
    broker_properties,
    create_principals,
    format_args,
)
from fleetline.infra.process import ServiceProcess, run_checked

KAFKA_VERSION = "4.1.1"
_HERE = Path(__file__).resolve().parent
POM = _HERE / "kafka-broker.pom.xml"
LOG4J = _HERE / "kafka-log4j2.properties"


@dataclass(frozen=True)
class KafkaBroker:
    cache_dir: Path
    port: int = 19092
    controller_port: int = 19093
    host: str = "127.0.0.1"
    heap: str = "512m"
    node_id: int = 1
    # controller.quorum.voters: every member's id@host:controller_port ("" = this broker alone).
    voters: str = ""
    # How many brokers the cluster has: the replication of internal topics and the defaults a
    # topic created without its own replication takes (at most 3, and min.insync.replicas 2).
    cluster_size: int = 1
    # Set: SASL/SCRAM and ACLs (`infra start --secure`, see kafka_access.py); None: PLAINTEXT.
    secrets: KafkaSecrets | None = None

    @property
    def libs_dir(self) -> Path:
        return self.cache_dir / f"kafka-{KAFKA_VERSION}" / "libs"

    @property
    def run_dir(self) -> Path:
        return self.cache_dir / "run" / f"kafka-{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def process(self) -> ServiceProcess:
        return ServiceProcess("kafka", self.run_dir, self.host, self.port)

    def fetch(self) -> bool:
        """Resolve the broker jars once; True if they had to be downloaded."""
        marker = self.libs_dir / ".complete"
        if marker.exists():
            return False
        if shutil.which("mvn") is None:
            raise ServiceError("mvn is not on PATH; install Maven to fetch the Kafka broker jars")
        if shutil.which("java") is None:
            raise ServiceError("java is not on PATH; the Kafka broker needs Java 17 or newer")
        shutil.rmtree(self.libs_dir, ignore_errors=True)
        run_checked(
            [
                "mvn",
                "-q",
                "-B",
                "-f",
                str(POM),
                f"-Dmaven.repo.local={self.cache_dir / 'm2'}",
                f"-Dkafka.version={KAFKA_VERSION}",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={self.libs_dir}",
                "-DincludeScope=runtime",
            ],
            what="fetching the Kafka broker jars",
            log=self.cache_dir / "logs" / "kafka-fetch.log",
        )
        if not (self.libs_dir / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
            raise ServiceError(f"mvn finished but kafka_2.13-{KAFKA_VERSION}.jar is missing")
        marker.touch()
        return True

    def server_properties(self) -> str:
        replicas = str(min(3, self.cluster_size))
        in_sync = str(min(2, self.cluster_size))
        lines = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters
            or f"{self.node_id}@{self.host}:{self.controller_port}",
            "listeners": (
                f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # Internal topics and topics created without a replication of their own take the
            # cluster's: one replica on one broker; three, two of them in sync for a write to
            # be acknowledged, on three or more (a broker can be lost without losing a write).
            "default.replication.factor": replicas,
            "min.insync.replicas": in_sync,
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": in_sync,
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": in_sync,
            # No leader from outside the in-sync set: an acknowledged write is never dropped.
            "unclean.leader.election.enable": "false",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
        }
        if self.secrets is not None:
            lines.update(
                broker_properties(self.secrets, self.host, self.port, self.controller_port)
            )
        return "".join(f"{key}={value}\n" for key, value in lines.items())

    def _java(self, main: str, *args: str) -> list[str]:
        return [
            "java",
            f"-Xms{self.heap}",
            f"-Xmx{self.heap}",
            f"-Dlog4j2.configurationFile={LOG4J}",
            "-cp",
            f"{self.libs_dir}/*",
            main,
            *args,
        ]

    def format(self, cluster_id: str | None = None) -> bool:
        """Format KRaft storage once (every member of a cluster with the same id); True if it
        was formatted now."""
        if (self.data_dir / "meta.properties").exists():
            return False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "server.properties"
        config.write_text(self.server_properties())
        cluster_id = cluster_id or new_cluster_id()
        run_checked(
            # The = form: a base64 id may start with "-", which argparse would take for an option.
            self._java(
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                f"--config={config}",
                *(format_args(self.secrets) if self.secrets is not None else ()),
            ),
            what="formatting Kafka KRaft storage",
        )
        return True

    def start(self, timeout_s: float = 120.0) -> float:
        """Fetch, format and start the broker; return seconds until it answered (0 if it ran)."""
        self.fetch()
        self.format()
        return self.process.start(self.argv(), timeout_s=timeout_s)

    def argv(self) -> list[str]:
        """The broker's command, its configuration written afresh."""
        config = self.run_dir / "server.properties"
        config.write_text(self.server_properties())
        return self._java("kafka.Kafka", str(config))

    def stop(self) -> bool:
        return self.process.stop(timeout_s=60.0)

    def wipe(self) -> None:
        """Stop the broker and delete its data (topics, offsets)."""
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


@dataclass(frozen=True)
class KafkaCluster:
    """One or more brokers on loopback, each also a controller of the KRaft quorum: broker i
    listens on `port + 2i` and its controller on the port after. The first broker's run folder
    records the layout, so `fleetline infra stop` finds every member."""

    brokers: tuple[KafkaBroker, ...]

    @classmethod
    def on_loopback(
        cls,
        cache_dir: Path,
        host: str,
        port: int,
        size: int = 1,
        heap: str = "512m",
        secure: bool = False,
    ) -> KafkaCluster:
        if size < 1:
            raise ServiceError(f"a Kafka cluster needs at least one broker, not {size}")
        ports = [(port + 2 * i, port + 2 * i + 1) for i in range(size)]
        voters = (
            ",".join(f"{i + 1}@{host}:{c}" for i, (_, c) in enumerate(ports)) if size > 1 else ""
        )
        return cls(
            tuple(
                KafkaBroker(
                    cache_dir,
                    port=p,
                    controller_port=c,
                    host=host,
                    heap=heap,
                    node_id=i + 1,
                    voters=voters,
                    cluster_size=size,
                    secrets=(
                        KafkaSecrets.load_or_create(credentials_path(cache_dir, port))
                        if secure
                        else None
                    ),
                )
                for i, (p, c) in enumerate(ports)
            )
        )

    @classmethod
    def recorded(
        cls,
        cache_dir: Path,
        host: str,
        port: int,
        size: int | None = None,
        secure: bool | None = None,
    ) -> KafkaCluster:
        """The cluster whose first broker listens on `port`: `size` brokers, or as many as its
        layout file says (one when there is none); secured when `secure`, or (None) when its
        layout says it was."""
        first = KafkaBroker(cache_dir, port=port, controller_port=port + 1, host=host)
        try:
            layout = json.loads(_layout(first).read_text())
        except (FileNotFoundError, ValueError):
            layout = {}
        if size is None:
            size = int(layout.get("brokers", 1))
        if secure is None:
            secure = bool(layout.get("secure", False))
        return cls.on_loopback(cache_dir, host, port, size, secure=secure)

    @property
    def secrets(self) -> KafkaSecrets | None:
        return self.first.secrets

    @property
    def first(self) -> KafkaBroker:
        return self.brokers[0]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(b.bootstrap_servers for b in self.brokers)

    def fetch(self) -> bool:
        return self.first.fetch()

    def start(self, timeout_s: float = 180.0) -> float:
        """Fetch, format and start every broker; seconds until all answered (0 if all ran).
        They are spawned together: a member of a quorum does not serve before a majority runs."""
        layout = _layout(self.first)
        secure = self.secrets is not None
        if layout.exists():
            recorded = json.loads(layout.read_text())
            if int(recorded["brokers"]) != len(self.brokers):
                raise ServiceError(
                    f"the Kafka data under {self.first.run_dir} belongs to a cluster of "
                    f"{recorded['brokers']} broker(s), not {len(self.brokers)}; run "
                    "`fleetline infra wipe` first"
                )
            if bool(recorded.get("secure", False)) != secure:
                raise ServiceError(
                    f"the Kafka data under {self.first.run_dir} is of a "
                    f"{'secured' if recorded.get('secure') else 'plaintext'} broker; run "
                    "`fleetline infra wipe` first to change that"
                )
        self.fetch()
        cluster_id = new_cluster_id()
        for broker in self.brokers:
            broker.format(cluster_id)
        layout.parent.mkdir(parents=True, exist_ok=True)
        layout.write_text(json.dumps({"brokers": len(self.brokers), "secure": secure}))
        began = time.monotonic()
        spawned = [(b, b.process.spawn(b.argv())) for b in self.brokers]
        if all(proc is None for _, proc in spawned):
            return 0.0
        for broker, proc in spawned:
            if proc is not None:
                broker.process.await_port(proc, began, timeout_s)
        if self.secrets is not None:
            create_principals(self.bootstrap_servers, self.secrets)
        return time.monotonic() - began

    def stop(self) -> bool:
        stopped = [b.stop() for b in self.brokers]
        return any(stopped)

    def wipe(self) -> None:
        """Stop every broker and delete their data (topics, offsets) and the layout. The data
        goes, so nothing is worth a controlled shutdown: brokers stopped one by one wait for a
        quorum that the ones stopped before took away (a minute for three)."""
        for broker in self.brokers:
            broker.process.kill()
            shutil.rmtree(broker.run_dir, ignore_errors=True)

    def answers(self) -> dict[str, bool]:
        return {f"kafka {b.bootstrap_servers}": b.process.answers() for b in self.brokers}

    def kill(self, index: int) -> bool:
        """SIGKILL one broker (the fault-injection tests); True if it ran."""
        return self.brokers[index].process.kill()

    def restart(self, index: int, timeout_s: float = 120.0) -> float:
        """Start one stopped or killed broker again on its data."""
        broker = self.brokers[index]
        return broker.process.start(broker.argv(), timeout_s=timeout_s)


def credentials_path(cache_dir: Path, port: int) -> Path:
    """Where a secured cluster (first broker on `port`) keeps its credentials."""
    return cache_dir / "run" / f"kafka-{port}" / "credentials.json"


def _layout(first: KafkaBroker) -> Path:
    return first.run_dir / "cluster.json"
