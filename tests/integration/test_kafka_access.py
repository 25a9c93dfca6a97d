"""A secured broker (`fleetline infra start --secure`): SASL/SCRAM only, and each kind of
process allowed exactly the topics its specs name. A client without credentials, with a wrong
password or as another service's principal cannot write a control topic."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from fleetline.app import deployment_topics
from fleetline.config import KafkaSettings, Settings
from fleetline.infra.kafka import KafkaCluster
from fleetline.infra.kafka_access import KafkaSecrets, grant
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.topics import (
    CLUSTER_AGENT,
    CONTROL_PLANE,
    DATA_MOVER,
    NODE_AGENT,
    OPERATOR,
    ROUTER,
    SERVICE_KINDS,
    Topics,
)
from tests.support import fresh_topics

PORT = 26092  # below the ephemeral range; beside the tests' broker (29092), chaos (28092)
THREE_BROKERS = 26100  # 26100-26105: three brokers and their controllers


@dataclasses.dataclass
class Secured:
    bootstrap: str
    secrets: KafkaSecrets
    topics: Topics


@pytest.fixture(scope="module")
def secured(services: Settings) -> Iterator[Secured]:
    cluster = KafkaCluster.on_loopback(services.cache_dir, "127.0.0.1", PORT, secure=True)
    cluster.wipe()
    cluster = KafkaCluster.on_loopback(services.cache_dir, "127.0.0.1", PORT, secure=True)
    assert cluster.secrets is not None
    try:
        cluster.start()
        topics = fresh_topics()
        specs = deployment_topics(topics)
        # The control plane creates its deployment's topics, as `serve` does at start.
        control = KafkaSettings(
            cluster.bootstrap_servers, cluster.secrets.client_conf(CONTROL_PLANE)
        )
        grant(cluster.bootstrap_servers, cluster.secrets, topics.prefix, specs)
        kafka_clients.ensure_topics(control, specs)
        yield Secured(cluster.bootstrap_servers, cluster.secrets, topics)
    finally:
        cluster.wipe()


def appended(secured: Secured, topic: str, conf: dict[str, str]) -> str | None:
    """None when the broker took one message on `topic` from a client with `conf`, else the
    error's name."""
    producer = Producer(
        {"bootstrap.servers": secured.bootstrap, "message.timeout.ms": 6000, **conf}
    )
    outcome: list[KafkaError | None] = []
    producer.produce(topic, b"x", on_delivery=lambda err, msg: outcome.append(err))
    producer.flush(15)
    assert outcome, "no delivery report"
    return None if outcome[0] is None else outcome[0].name()


def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(secured):
    topic = secured.topics.scheduler_requests
    assert appended(secured, topic, {}) is not None  # PLAINTEXT to a SASL listener
    wrong = {**secured.secrets.client_conf(CONTROL_PLANE), "sasl.password": "guess"}
    assert appended(secured, topic, wrong) is not None
    assert appended(secured, topic, secured.secrets.client_conf(CONTROL_PLANE)) is None


@pytest.mark.parametrize(
    ("topic", "writers"),
    [
        # A router reports services' load; which writer may make which kind of request is the
        # scheduler's check (tests/integration/test_writer_authority.py).
        ("scheduler_requests", {CONTROL_PLANE, CLUSTER_AGENT, DATA_MOVER, ROUTER}),
        ("commands", {CONTROL_PLANE}),
        ("emergency", {CONTROL_PLANE}),
        ("audit_log", {CONTROL_PLANE}),
        ("telemetry", {NODE_AGENT}),
    ],
)
def test_each_principal_writes_only_what_its_topics_specs_name(secured, topic, writers):
    name = getattr(secured.topics, topic)
    for kind in SERVICE_KINDS:
        error = appended(secured, name, secured.secrets.client_conf(kind))
        if kind in writers:
            assert error is None, (kind, name, error)
        else:
            assert error == "TOPIC_AUTHORIZATION_FAILED", (kind, name, error)


def test_an_agent_reads_its_own_topics_and_not_the_audit_chain(secured):
    def read_error(kind: str, topic: str) -> str | None:
        consumer = Consumer(
            {
                "bootstrap.servers": secured.bootstrap,
                "group.id": f"t-{uuid.uuid4().hex[:8]}",
                **secured.secrets.client_conf(kind),
            }
        )
        try:
            consumer.assign([TopicPartition(topic, 0, 0)])
            for _ in range(20):
                msg = consumer.poll(0.5)
                if msg is not None and msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        return None
                    return msg.error().name()
                if msg is not None:
                    return None
            return None
        finally:
            consumer.close()

    topics = secured.topics
    assert read_error(NODE_AGENT, topics.audit_log) == "TOPIC_AUTHORIZATION_FAILED"
    assert read_error(ROUTER, topics.audit_log) == "TOPIC_AUTHORIZATION_FAILED"
    assert read_error(CLUSTER_AGENT, topics.orders) is None
    assert read_error(OPERATOR, topics.audit_log) is None  # read-only commands see everything


def test_a_process_of_another_kind_starts_on_the_topics_the_control_plane_made(secured):
    """Each process ensures its topics at start (`fleetline cluster-agent`, `agent node`, ...);
    on a secured broker only the control plane may create them, and the broker refuses any
    other principal even a topic that exists: the others find them made and start."""
    from fleetline.processors.health.runtime import health_topics

    for kind in (CLUSTER_AGENT, NODE_AGENT, DATA_MOVER, ROUTER):
        as_kind = KafkaSettings(secured.bootstrap, secured.secrets.client_conf(kind))
        kafka_clients.ensure_topics(as_kind, health_topics(secured.topics), timeout_s=20)
    # Nor does a refused creation make a topic that was missing.
    missing = fresh_topics()
    as_agent = KafkaSettings(secured.bootstrap, secured.secrets.client_conf(CLUSTER_AGENT))
    kafka_clients.ensure_topics(as_agent, missing.specs()[:1], timeout_s=20)
    operator = KafkaSettings(secured.bootstrap, secured.secrets.client_conf(OPERATOR))
    listed = kafka_clients.admin_client(operator).list_topics(timeout=10).topics
    assert missing.specs()[0].name not in listed


def test_the_control_plane_runs_under_its_own_principal(secured, services):
    """`serve`'s processors (transactions, changelogs, consumer groups, sinks) need no more
    than the control plane's grant: a spec applied is decided, and an operator reads it."""
    from fleetline.app import Options, build
    from fleetline.processors.scheduling.client import decisions_of, submit
    from tests.scheduling_support import training
    from tests.services import started, submits
    from tests.support import wait_until

    def as_(kind: str) -> Settings:
        return dataclasses.replace(
            services,
            kafka=dataclasses.replace(
                services.kafka,
                bootstrap_servers=secured.bootstrap,
                client_overrides=secured.secrets.client_conf(kind),
            ),
            clickhouse_database=f"t_{uuid.uuid4().hex[:12]}",
        )

    fleet = build(
        as_(CONTROL_PLANE),
        Options(topics=secured.topics, tick_interval_s=0.3, data_mover=False, audit=True),
    )
    with started(fleet):
        submit(as_(CONTROL_PLANE).kafka, secured.topics, submits(training("secured")))
        operator = as_(OPERATOR).kafka
        wait_until(
            lambda: any(d["job"] == "acme/secured" for d in decisions_of(operator, secured.topics)),
            60,
            "a decision about acme/secured",
        )


def test_a_command_reaching_the_secured_broker_without_or_with_bad_credentials_says_which(
    secured, services, monkeypatch
):
    """One line each, naming what is wrong (exit 77), never "not answering"; and a process on
    the broker's own host finds its kind's credentials where `infra start --secure` made them."""
    from fleetline.cli.common import settings
    from fleetline.errors import NotPermitted

    with pytest.raises(NotPermitted) as bare:
        kafka_clients.probe(KafkaSettings(secured.bootstrap))
    assert "closed the connection of a client without credentials" in str(bare.value)
    assert "fleetline infra credentials KIND" in str(bare.value)
    wrong = {**secured.secrets.client_conf(ROUTER), "sasl.password": "guess"}
    with pytest.raises(NotPermitted) as refused:
        kafka_clients.probe(KafkaSettings(secured.bootstrap, wrong))
    assert "refused the sign-in of principal 'router'" in str(refused.value)
    assert "Authentication failed" in str(refused.value)
    assert "\n" not in str(bare.value) + str(refused.value)

    monkeypatch.setenv("FLEETLINE_KAFKA_BOOTSTRAP", secured.bootstrap)
    monkeypatch.setenv("FLEETLINE_CACHE_DIR", str(services.cache_dir))
    for name in [n for n in os.environ if n.startswith("FLEETLINE_KAFKA_CONF_")]:
        monkeypatch.delenv(name)
    as_router = settings("kafka", kind=ROUTER).kafka
    assert as_router.client_overrides["sasl.username"] == ROUTER
    assert settings("kafka").kafka.client_overrides["sasl.username"] == OPERATOR
    assert "sasl.username" not in settings(kind=None).kafka.client_overrides


def test_the_control_plane_refuses_to_start_on_topics_its_principal_was_not_granted(
    secured, services
):
    """`serve --topic-prefix P` against a broker that granted another prefix stops at once in
    one line naming the grant to make, not with a traceback per service and a 500 per write."""
    from fleetline.app import Options, build
    from fleetline.errors import NotPermitted

    control = dataclasses.replace(
        services,
        kafka=dataclasses.replace(
            services.kafka,
            bootstrap_servers=secured.bootstrap,
            client_overrides=secured.secrets.client_conf(CONTROL_PLANE),
        ),
    )
    ungranted = fresh_topics()
    with pytest.raises(NotPermitted) as refused:
        build(control, Options(topics=ungranted, data_mover=False))
    assert str(refused.value).startswith(
        f"Kafka at {secured.bootstrap} lets principal 'control-plane' neither create nor see"
    )
    assert f"`fleetline infra start --secure --topic-prefix {ungranted.prefix}`" in str(
        refused.value
    )


def test_a_secured_cluster_of_three_brokers_enforces_the_same_grants(services):
    """Three brokers (KRaft voters on SASL too, replicas fetched between brokers as the
    inter-broker principal), each partition on all three: the grants hold wherever a
    partition's leader is."""
    from confluent_kafka.admin import AdminClient

    def cluster() -> KafkaCluster:
        return KafkaCluster.on_loopback(
            services.cache_dir, "127.0.0.1", THREE_BROKERS, size=3, secure=True
        )

    cluster().wipe()
    three = cluster()
    assert three.secrets is not None
    try:
        three.start()
        topics = fresh_topics()
        written = {topics.commands, topics.emergency, topics.decisions}
        specs = [spec for spec in deployment_topics(topics) if spec.name in written]
        grant(three.bootstrap_servers, three.secrets, topics.prefix, specs)
        control = KafkaSettings(three.bootstrap_servers, three.secrets.client_conf(CONTROL_PLANE))
        kafka_clients.ensure_topics(control, specs)
        admin = AdminClient(dict(control.client_config()))
        partitions = admin.list_topics(topics.commands, timeout=30).topics[topics.commands]
        replicas = {len(p.replicas) for p in partitions.partitions.values()}
        leaders = {
            p.leader
            for spec in specs
            for p in admin.list_topics(spec.name, timeout=30).topics[spec.name].partitions.values()
        }
        assert replicas == {3} and leaders == {1, 2, 3}, (replicas, leaders)
        secured = Secured(three.bootstrap_servers, three.secrets, topics)
        for topic in sorted(written):
            assert appended(secured, topic, three.secrets.client_conf(CONTROL_PLANE)) is None
            for kind in (NODE_AGENT, ROUTER):
                refused = appended(secured, topic, three.secrets.client_conf(kind))
                assert refused == "TOPIC_AUTHORIZATION_FAILED", (kind, topic, refused)
        assert appended(secured, topics.commands, {}) is not None  # no credentials
    finally:
        cluster().wipe()
