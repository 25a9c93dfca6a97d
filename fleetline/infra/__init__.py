"""Local real services (Kafka broker, S3 server) for the slice and the tests."""

from fleetline.infra.kafka import KafkaBroker
from fleetline.infra.s3 import ObjectStoreServer
from fleetline.infra.services import LocalServices

__all__ = ["KafkaBroker", "LocalServices", "ObjectStoreServer"]
