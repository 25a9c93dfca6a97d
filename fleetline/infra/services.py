"""Start and stop every local service fleetline's slice and tests use."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.infra.kafka import KafkaCluster
from fleetline.infra.s3 import ObjectStoreServer


def _port(hostport: str, what: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{what} must be host:port, got {hostport!r}")
    return host, int(port)


@dataclass(frozen=True)
class LocalServices:
    kafka: KafkaCluster
    object_store: ObjectStoreServer

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        brokers: int | None = None,
        listen: str | None = None,
        secure: bool | None = None,
    ) -> LocalServices:
        """The services the settings point at. Kafka is `brokers` brokers from the first
        bootstrap server's port on (every other port: each broker's controller takes the next);
        by default as many as the bootstrap list names, or as the running cluster recorded.
        With `listen`, Kafka (its listeners and the address it advertises) and the S3 server
        run on that address instead of the settings' host, at the settings' ports. With
        `secure`, Kafka takes SASL/SCRAM clients under ACLs only (None: as it was started)."""
        servers = [
            _port(s.strip(), "FLEETLINE_KAFKA_BOOTSTRAP")
            for s in settings.kafka.bootstrap_servers.split(",")
        ]
        if listen is not None:
            servers = [(listen, port) for _, port in servers]
        kafka_host, kafka_port = servers[0]
        if brokers is None and len(servers) > 1:
            brokers = len(servers)
        kafka = KafkaCluster.recorded(
            settings.cache_dir, kafka_host, kafka_port, brokers, secure=secure
        )
        if len(servers) > 1:
            expected = [(b.host, b.port) for b in kafka.brokers]
            if servers != expected:
                raise ConfigError(
                    f"FLEETLINE_KAFKA_BOOTSTRAP lists {settings.kafka.bootstrap_servers}; local "
                    f"brokers run on {kafka.bootstrap_servers} (each next broker two ports up)"
                )
        s3_host, s3_port = _port(settings.s3.endpoint, "FLEETLINE_S3_ENDPOINT")
        s3_host = listen or s3_host
        return cls(
            kafka=kafka,
            object_store=ObjectStoreServer(
                settings.cache_dir,
                settings.s3.access_key,
                settings.s3.secret_key,
                port=s3_port,
                host=s3_host,
                region=settings.s3.region,
            ),
        )

    def start(self) -> dict[str, float]:
        """Start both services (building/fetching first if needed); seconds each step took."""
        timings: dict[str, float] = {}
        steps = (
            ("kafka_fetch_s", self.kafka.fetch),
            ("s3_build_s", self.object_store.build),
            ("kafka_start_s", self.kafka.start),
            ("s3_start_s", self.object_store.start),
        )
        for name, step in steps:
            began = time.monotonic()
            step()
            timings[name] = time.monotonic() - began
        return timings

    def stop(self) -> None:
        self.object_store.stop()
        self.kafka.stop()

    def client_env(self, kind: str | None = None) -> dict[str, str]:
        """The FLEETLINE_* variables that point clients at these services (on a secured broker,
        as a process of `kind`: its principal's credentials)."""
        s3 = self.object_store
        env = {
            "FLEETLINE_KAFKA_BOOTSTRAP": self.kafka.bootstrap_servers,
            "FLEETLINE_S3_ENDPOINT": f"{s3.host}:{s3.port}",
        }
        if self.kafka.secrets is not None and kind is not None:
            env.update(self.kafka.secrets.client_env(kind))
        return env

    def status(self) -> dict[str, bool]:
        s3 = self.object_store
        return {**self.kafka.answers(), f"s3 {s3.host}:{s3.port}": s3.process.answers()}
