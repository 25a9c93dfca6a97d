"""A SIGKILL loop on the cluster agent running a training job: killed and started again several
times while its workload runs (the workload process runs on, as it would on a real node). Each
new agent re-adopts the workload, so the job is started once, exits once with 0 and succeeds;
its progress is reported once per step, in order, and each checkpoint once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fleetline.app import Options
from fleetline.config import Settings
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.scheduling.client import submit
from tests.chaos.conftest import rounds
from tests.services import submits
from tests.stack import Stack, running_stack
from tests.support import wait_until

# A restarted agent takes a few seconds to heartbeat again: the cluster must not be declared
# lost meanwhile (that is another fault, tested in tests/integration/test_cluster_control.py).
POLICY = ClusterHealthPolicy(suspect_after_ms=8_000, lost_after_ms=20_000)


@pytest.fixture(scope="module")
def stack(services: Settings) -> Iterator[Stack]:
    options = Options(tick_interval_s=0.3, health_policy=POLICY, clock_interval_s=0.25)
    with running_stack(services, ("ka", "kb"), options, "agent-kills") as built:
        yield built


def test_a_cluster_agent_killed_again_and_again_starts_its_job_once(stack) -> None:
    job = {
        "kind": "TrainingJob",
        "metadata": {"name": "enduring", "tenant": "acme"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": 2,
            "workers": 1,
            "workload": {"steps": 400, "checkpoint_every_steps": 100, "step_delay_ms": 40},
        },
    }
    submit(stack.settings.kafka, stack.topics, submits(job))
    key = "acme/enduring"
    wait_until(
        lambda: any(e["event"] == "RUNNING" for e in stack.events(key)), 60, "the job to run"
    )
    running = next(e for e in stack.events(key) if e["event"] == "RUNNING")
    cluster = running["cluster_id"]
    kills = rounds(3, 6)
    for _ in range(kills):
        time.sleep(1.5)
        stack.kill_agent(cluster)
        stack.start_agent(cluster)
    wait_until(lambda: stack.phase(key) == "Succeeded", 120, "the job to succeed")
    events = stack.events(key)
    starts = [(e["epoch"], e["attempt"]) for e in events if e["event"] == "STARTING"]
    assert starts == [(running["epoch"], running["attempt"])]
    assert [e["exit_code"] for e in events if e["event"] == "EXITED"] == [0]
    assert {e["cluster_id"] for e in events} == {cluster}
    steps = [e["step"] for e in events if e["event"] == "PROGRESS"]
    assert steps == sorted(set(steps)) and steps[-1] == 400
    checkpoints = [e["step"] for e in events if e["event"] == "CHECKPOINTED"]
    assert checkpoints == sorted(set(checkpoints)) and checkpoints
