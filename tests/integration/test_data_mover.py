"""The simulated data mover (the cluster layer's stand-in for dataset prewarms): an order is
answered once it would be done, and an order taken but not answered is answered after a
restart. It runs on its own (`fleetline agent data-mover`) and in `fleetline serve`."""

from __future__ import annotations

import threading

import pytest

from fleetline.agents.data_mover import SimulatedDataMover
from fleetline.processors.scheduling.client import read_topic
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS, fresh_topics, wait_until

pytestmark = pytest.mark.services
CODEC = default_codec()


def order(dataset: str) -> bytes:
    return CODEC.encode(
        "DatasetPrewarm",
        {
            "dataset_id": dataset,
            "tenant": "acme",
            "job": "acme/train",
            "decision_id": "7.0",
            "ts": BASE_MS,
            "from_cluster": "eu-west-a",
            "to_cluster": "us-east-a",
            "size_bytes": 10**12,
            "estimated_s": 800.0,
            "rate_gbps": 10.0,
        },
    )


def answers(settings, topics) -> list[str]:
    requests = (
        CODEC.decode(m.value()).record
        for m in read_topic(settings.kafka, topics.scheduler_requests)
    )
    return [r["key"] for r in requests if r["kind"] == "DATASET_READY"]


def run(mover: SimulatedDataMover, until) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=mover.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(until, 60, what="the data mover")
    finally:
        stop.set()
        thread.join(30)


def test_an_order_taken_but_not_answered_is_answered_after_a_restart(settings):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    producer = kafka_clients.producer(settings.kafka)
    producer.produce(topics.prewarms, key=b"web-corpus", value=order("web-corpus"))
    producer.flush(10)
    # Stopped after taking the order and before its copy would be done: nothing is answered.
    slow = SimulatedDataMover(settings.kafka, topics, speedup=1.0, max_delay_s=600)
    run(slow, lambda: slow.received == 1)
    assert slow.moved == [] and answers(settings, topics) == []
    # The next mover of the group gets the order again and answers it.
    quick = SimulatedDataMover(settings.kafka, topics, speedup=1.0, max_delay_s=0.1)
    run(quick, lambda: quick.moved == ["web-corpus@us-east-a"])
    assert answers(settings, topics) == ["web-corpus@us-east-a"]
    # Answered orders are committed: a third mover answers only what is new.
    producer.produce(topics.prewarms, key=b"logs", value=order("logs"))
    producer.flush(10)
    third = SimulatedDataMover(settings.kafka, topics, speedup=1.0, max_delay_s=0.1)
    run(third, lambda: third.moved == ["logs@us-east-a"])
    assert third.received == 1
    assert answers(settings, topics) == ["web-corpus@us-east-a", "logs@us-east-a"]


def test_serve_and_the_agent_command_run_the_mover(settings, monkeypatch):
    from fleetline import app as composition
    from fleetline.cli import main
    from tests.services import service_env

    for name, value in service_env(settings).items():
        monkeypatch.setenv(name, value)
    seen = []

    class _Stop(Exception):
        pass

    def build(config, options):
        seen.append(options.data_mover)
        raise _Stop

    monkeypatch.setattr(composition, "build", build)
    for flags in ([], ["--data-mover"]):
        with pytest.raises(_Stop):
            main(["serve", "--no-api", *flags])
    assert seen == [False, True]
