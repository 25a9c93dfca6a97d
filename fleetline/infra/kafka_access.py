"""A secured local broker's principals and ACLs (`fleetline infra start --secure`).

The broker takes SASL/SCRAM-SHA-512 only, with Kafka's StandardAuthorizer and no access where
no ACL allows it. Its credentials file (owner-only, in the broker's run folder) holds the
admin's and controllers' passwords and one principal per kind of process (`streams/topics.py`
SERVICE_KINDS); `grant` gives each kind exactly the topics of one deployment prefix that the
topics' specs name for it (`streams/access.py`). A process is given its kind's credentials as
FLEETLINE_KAFKA_CONF_* settings (`client_env`).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetline.errors import ConfigError, ServiceError
from fleetline.streams.access import grants
from fleetline.streams.topics import SERVICE_KINDS, TopicSpec

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"
CONTROLLER = "controller"


@dataclass(frozen=True)
class KafkaSecrets:
    admin: str
    controller: str
    kinds: dict[str, str]  # principal (a service kind) -> password

    @classmethod
    def load_or_create(cls, path: Path) -> KafkaSecrets:
        """The broker's credentials, made (random, owner-only) the first time."""
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Kafka credentials {path}: {exc}") from None
        made = cls(
            secrets.token_urlsafe(24),
            secrets.token_urlsafe(24),
            {kind: secrets.token_urlsafe(24) for kind in SERVICE_KINDS},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(asdict(made), handle)
        return made

    def client_conf(self, principal: str) -> dict[str, str]:
        """librdkafka settings that sign in as `principal` (a kind, or the admin)."""
        password = self.admin if principal == ADMIN else self.kinds.get(principal)
        if password is None:
            raise ConfigError(
                f"no Kafka principal {principal!r}; known: {ADMIN}, {', '.join(self.kinds)}"
            )
        return {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": MECHANISM,
            "sasl.username": principal,
            "sasl.password": password,
        }

    def principals(self) -> dict[str, dict[str, str]]:
        """Every kind's sign-in (KafkaSettings.principals of a launcher)."""
        return {kind: self.client_conf(kind) for kind in self.kinds}

    def client_env(self, principal: str) -> dict[str, str]:
        """The FLEETLINE_KAFKA_CONF_* variables a process of that kind is started with."""
        return {
            "FLEETLINE_KAFKA_CONF_" + key.upper().replace(".", "_"): value
            for key, value in self.client_conf(principal).items()
        }


def broker_properties(secrets_: KafkaSecrets, host: str, port: int, cport: int) -> dict[str, str]:
    """What a broker's server.properties says when it is secured: clients and brokers sign in
    with SCRAM on the client listener, controllers with PLAIN on theirs (SCRAM credentials live
    in the metadata the controllers serve, so they cannot be the controllers' own)."""
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    return {
        "listeners": f"CLIENT://{host}:{port},CONTROLLER://{host}:{cport}",
        "advertised.listeners": f"CLIENT://{host}:{port}",
        "inter.broker.listener.name": "CLIENT",
        "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,CLIENT:SASL_PLAINTEXT",
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.client.sasl.enabled.mechanisms": MECHANISM,
        "listener.name.client.scram-sha-512.sasl.jaas.config": (
            f'{scram} required username="{ADMIN}" password="{secrets_.admin}";'
        ),
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": (
            f'{plain} required username="{CONTROLLER}" password="{secrets_.controller}" '
            f'user_{CONTROLLER}="{secrets_.controller}";'
        ),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{ADMIN};User:{CONTROLLER}",
        "allow.everyone.if.no.acl.found": "false",
    }


def format_args(secrets_: KafkaSecrets) -> list[str]:
    """The storage format's flag that puts the admin's SCRAM credential in the first metadata."""
    return [f"--add-scram={MECHANISM}=[name={ADMIN},password={secrets_.admin}]"]


def _admin(bootstrap: str, secrets_: KafkaSecrets):  # type: ignore[no-untyped-def]
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap, **secrets_.client_conf(ADMIN)})


def create_principals(bootstrap: str, secrets_: KafkaSecrets, timeout_s: float = 60.0) -> None:
    """One SCRAM user per kind of process (what is there already is set again)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    admin = _admin(bootstrap, secrets_)
    upserts = [
        UserScramCredentialUpsertion(
            kind, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode()
        )
        for kind, password in secrets_.kinds.items()
    ]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for future in admin.alter_user_scram_credentials(upserts).values():
                future.result(timeout=30)
            return
        except KafkaException as exc:  # the controller may still be electing itself
            if time.monotonic() > deadline:
                raise ServiceError(f"creating Kafka's principals: {exc}") from None
            time.sleep(1.0)


def grant(bootstrap: str, secrets_: KafkaSecrets, prefix: str, specs: Iterable[TopicSpec]) -> int:
    """The ACLs of one deployment (topics under `prefix`): each kind reads and writes what its
    grant names, the control plane also creates topics and runs transactions; every kind may
    use consumer groups and see the prefix's topics (names and partitions, not contents).
    Returns how many bindings were created."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    allow, literal, prefixed = (
        AclPermissionType.ALLOW,
        ResourcePatternType.LITERAL,
        (ResourcePatternType.PREFIXED),
    )
    topic, group, txn = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.TRANSACTIONAL_ID
    bindings = []

    def allows(kind: str, resource: ResourceType, name: str, pattern, *operations) -> None:  # type: ignore[no-untyped-def]
        for operation in operations:
            bindings.append(
                AclBinding(resource, name, pattern, f"User:{kind}", "*", operation, allow)
            )

    for kind, g in grants(specs).items():
        allows(kind, topic, f"{prefix}.", prefixed, AclOperation.DESCRIBE)
        allows(kind, group, "*", literal, AclOperation.READ, AclOperation.DESCRIBE)
        for name in sorted(g.writes):
            allows(kind, topic, name, literal, AclOperation.WRITE)
        for name in sorted(g.reads):
            allows(kind, topic, name, literal, AclOperation.READ)
        if g.reads_prefix:
            allows(kind, topic, f"{prefix}.", prefixed, AclOperation.READ)
        if g.creates_topics:
            allows(
                kind,
                topic,
                f"{prefix}.",
                prefixed,
                AclOperation.CREATE,
                AclOperation.DESCRIBE_CONFIGS,
            )
        if g.transactional:
            allows(kind, txn, "*", literal, AclOperation.WRITE, AclOperation.DESCRIBE)
    admin = _admin(bootstrap, secrets_)
    for binding, future in admin.create_acls(bindings).items():
        try:
            future.result(timeout=30)
        except Exception as exc:
            raise ServiceError(f"creating the Kafka ACL {binding}: {exc}") from None
    return len(bindings)
