"""Local real services (Kafka brokers, S3 server) for the slice and the tests."""

from fleetline.infra.kafka import KafkaBroker, KafkaCluster
from fleetline.infra.s3 import ObjectStoreServer
from fleetline.infra.services import LocalServices

__all__ = ["KafkaBroker", "KafkaCluster", "LocalServices", "ObjectStoreServer"]
