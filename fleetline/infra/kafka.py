"""A real single-node Apache Kafka broker (KRaft, combined broker+controller) on loopback.

The broker jars come from Maven Central through `mvn dependency:copy-dependencies` on
`kafka-broker.pom.xml` and are cached under the repository's ignored cache folder; the broker
then runs as `java -cp <jars> kafka.Kafka server.properties`.
"""

from __future__ import annotations

import base64
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceError
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
        lines = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{self.host}:{self.controller_port}",
            "listeners": (
                f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # One broker: every internal topic has a single replica.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
        }
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

    def format(self) -> bool:
        """Format KRaft storage once; True if it was formatted now."""
        if (self.data_dir / "meta.properties").exists():
            return False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "server.properties"
        config.write_text(self.server_properties())
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        run_checked(
            # The = form: a base64 id may start with "-", which argparse would take for an option.
            self._java(
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                f"--config={config}",
            ),
            what="formatting Kafka KRaft storage",
        )
        return True

    def start(self, timeout_s: float = 120.0) -> float:
        """Fetch, format and start the broker; return seconds until it answered (0 if it ran)."""
        self.fetch()
        self.format()
        config = self.run_dir / "server.properties"
        config.write_text(self.server_properties())
        return self.process.start(self._java("kafka.Kafka", str(config)), timeout_s=timeout_s)

    def stop(self) -> bool:
        return self.process.stop(timeout_s=60.0)

    def wipe(self) -> None:
        """Stop the broker and delete its data (topics, offsets)."""
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
