"""Start and stop every local service fleetline's slice and tests use."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.infra.kafka import KafkaBroker
from fleetline.infra.s3 import ObjectStoreServer


def _port(hostport: str, what: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{what} must be host:port, got {hostport!r}")
    return host, int(port)


@dataclass(frozen=True)
class LocalServices:
    broker: KafkaBroker
    object_store: ObjectStoreServer

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalServices:
        first = settings.kafka.bootstrap_servers.split(",")[0]
        kafka_host, kafka_port = _port(first, "FLEETLINE_KAFKA_BOOTSTRAP")
        s3_host, s3_port = _port(settings.s3.endpoint, "FLEETLINE_S3_ENDPOINT")
        return cls(
            broker=KafkaBroker(
                settings.cache_dir, port=kafka_port, controller_port=kafka_port + 1, host=kafka_host
            ),
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
            ("kafka_fetch_s", self.broker.fetch),
            ("s3_build_s", self.object_store.build),
            ("kafka_start_s", self.broker.start),
            ("s3_start_s", self.object_store.start),
        )
        for name, step in steps:
            began = time.monotonic()
            step()
            timings[name] = time.monotonic() - began
        return timings

    def stop(self) -> None:
        self.object_store.stop()
        self.broker.stop()

    def status(self) -> dict[str, bool]:
        s3 = self.object_store
        return {
            f"kafka {self.broker.bootstrap_servers}": self.broker.process.answers(),
            f"s3 {s3.host}:{s3.port}": s3.process.answers(),
        }
