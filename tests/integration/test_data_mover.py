"""The data mover copies a dataset's real objects between two clusters' stores for the
scheduler's prewarms: at the rate the tenant's bandwidth quota grants, each object verified by
its digest on arrival, resumed where it was after a SIGKILL, a torn or tampered object fetched
again and never passed; the job waits Queued, holding no GPUs, until the copy is done."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest

from fleetline.agents.data_mover import DataMover
from fleetline.agents.dataplane.prewarm import (
    MANIFEST,
    CopyError,
    Mask,
    copy_dataset,
    mask_key,
    upload,
)
from fleetline.app import Options
from fleetline.config import Settings
from fleetline.demo.prewarm_story import dataset_objects
from fleetline.processors.scheduling.client import read_topic, submit
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.specs import dataset_prefix
from fleetline.storage.checkpoints import cluster_bucket
from fleetline.storage.objects import ObjectStore
from fleetline.streams.serde import default_codec
from tests.services import KILLED_MEMBER_SESSION_MS, service_env
from tests.stack import Stack, now_ms, running_stack
from tests.support import wait_until

pytestmark = pytest.mark.services
CODEC = default_codec()
QUOTA_GBPS = 0.064  # 8 MB/s: 48 MiB take ~6 s
OBJECTS = 24
OBJECT_BYTES = 2 << 20


def store(settings: Settings, cluster: str) -> ObjectStore:
    return ObjectStore.from_settings(settings.s3, cluster_bucket(settings.s3.bucket, cluster))


def requests(stack: Stack, kind: str, key: str) -> list[dict[str, Any]]:
    return [
        r
        for r in (
            CODEC.decode(m.value()).record
            for m in read_topic(stack.settings.kafka, stack.topics.scheduler_requests)
        )
        if r["kind"] == kind and r["key"] == key
    ]


def send(stack: Stack, kind: str, key: str, tenant: str, body: dict[str, Any]) -> None:
    submit(
        stack.settings.kafka,
        stack.topics,
        [
            new_request(
                kind,
                key,
                tenant,
                now_ms(),
                uuid.uuid4().hex,
                spec_json=json.dumps(body),
                actor="test",
            )
        ],
    )


def job_spec(name: str, tenant: str, dataset: str | None, steps: int) -> dict[str, Any]:
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": tenant},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": 8,
            "workers": 1,
            **({"dataset": dataset} if dataset else {}),
            "workload": {"steps": steps, "step_delay_ms": 10, "report_every_steps": 50},
        },
    }


@pytest.fixture
def stack(services: Settings):
    # The mover runs apart (`fleetline agent data-mover`), so that it can be SIGKILLed alone.
    options = Options(tick_interval_s=0.3, clock_interval_s=0.25, data_mover=False)
    with running_stack(services, ["ca", "cb"], options, prefix="prewarm") as built:
        yield built


def test_a_prewarm_copies_real_objects_at_the_quota_through_a_sigkill_and_the_job_waits_gpu_less(
    stack: Stack, tmp_path
):
    name = f"corpus-{uuid.uuid4().hex[:8]}"
    prefix = dataset_prefix("acme", name)
    source, target = store(stack.settings, "ca"), store(stack.settings, "cb")
    data = dataset_objects(name, OBJECTS, OBJECT_BYTES >> 20)
    upload(source, prefix, data)
    ticket = f"{name}@cb"
    send(
        stack,
        "TENANT_POLICY",
        "acme",
        "acme",
        {"tenant": "acme", "quota": {"bandwidth_gbps": QUOTA_GBPS}},
    )
    send(
        stack,
        "SUBMIT",
        f"dataset:{name}",
        "acme",
        {
            "apiVersion": "fleetline/v1",
            "kind": "Dataset",
            "metadata": {"name": name, "tenant": "acme"},
            "spec": {"size": OBJECTS * OBJECT_BYTES, "replicas": ["ca"]},
        },
    )
    # Another tenant's long job fills ca, where the data is: acme's job can only go to cb.
    send(stack, "SUBMIT", "other/fill", "other", job_spec("fill", "other", None, 100_000))
    wait_until(lambda: stack.phase("other/fill") in ("Starting", "Running"), 60, "the filler")
    send(stack, "SUBMIT", "acme/train", "acme", job_spec("train", "acme", name, 200))

    def waiting() -> dict[str, Any] | None:
        job = stack.job("acme/train")
        return job if job and "waiting for data in cb" in (job["queued_reason"] or "") else None

    wait_until(waiting, 60, "the job to wait for its data")
    # The killed mover's group membership lapses in 10 s, not 45, for the next to take over.
    env = {**os.environ, **service_env(stack.settings, killed_members=True)}
    command = [
        sys.executable,
        "-m",
        "fleetline.cli",
        "agent",
        "data-mover",
        "--topic-prefix",
        stack.topics.prefix,
    ]
    with open(tmp_path / "mover.log", "wb") as log:
        mover = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:

        def under_way() -> bool:
            """Its first progress report (after ~1 s of ~6: the kill comes mid-copy)."""
            assert mover.poll() is None, (tmp_path / "mover.log").read_text()
            return bool(requests(stack, "DATASET_PROGRESS", ticket))

        wait_until(under_way, 60, "the copy to be under way", every_s=0.1)
        mover.send_signal(signal.SIGKILL)
        mover.wait(10)
    finally:
        if mover.poll() is None:
            mover.kill()
    # The job waits, holding no GPU, and says how far its data is.
    job = waiting()
    assert job is not None and not job["allocation"], job
    assert " % of " + name in job["queued_reason"]
    assert requests(stack, "DATASET_READY", ticket) == []
    assert not target.keys(prefix + MANIFEST)
    # One object that arrived before the kill is tampered with in cb (same size).
    arrived = sorted(k for k in target.keys(prefix) if k != prefix + MANIFEST)
    assert arrived, "nothing was copied before the kill"
    tampered = arrived[0]
    target.put(tampered, b"\0" * OBJECT_BYTES)

    # The next mover takes the order up where it was: the tampered object fetched again.
    kafka = dataclasses.replace(stack.settings.kafka, session_timeout_ms=KILLED_MEMBER_SESSION_MS)
    again = DataMover(kafka, stack.settings.s3, stack.topics)
    stop = threading.Event()
    thread = threading.Thread(target=again.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: again.moved == [ticket], 90, "the copy to be done")
    finally:
        stop.set()
        thread.join(30)
    report = again.reports[ticket]
    assert tampered.removeprefix(prefix) in report.refetched
    assert report.kept_bytes > 0 and report.copied_bytes < report.total_bytes  # resumed
    # Its rate held to the tenant's quota, within 10 %.
    assert 0.9 * QUOTA_GBPS * 1e9 <= report.rate_bps <= 1.1 * QUOTA_GBPS * 1e9, report
    # Every byte in cb is the source's, and the manifest marks the replica complete.
    for key, body in data.items():
        assert hashlib.sha256(target.get(prefix + key)).digest() == hashlib.sha256(body).digest()
    assert target.get(prefix + MANIFEST) == source.get(prefix + MANIFEST)
    assert len(requests(stack, "DATASET_READY", ticket)) == 1
    # Then, and only then, the job is placed: where its data now is.
    decisions: list[dict[str, Any]] = []

    def placed() -> bool:
        decisions[:] = [
            r for r in stack.records(stack.topics.decisions) if r["job"] == "acme/train"
        ]
        return any(d["outcome"] == "PLACED" for d in decisions)

    wait_until(placed, 60, "the job to be placed", every_s=0.5)
    outcomes = [d["outcome"] for d in decisions]
    assert outcomes.index("PLACED") > outcomes.index("QUEUED"), outcomes
    first = next(d for d in decisions if d["outcome"] == "PLACED")
    assert first["placements"][0]["cluster_id"] == "cb", first["reason"]


def test_a_source_that_does_not_match_its_manifest_is_never_marked_ready(services: Settings):
    name = f"broken-{uuid.uuid4().hex[:8]}"
    prefix = dataset_prefix("acme", name)
    source, target = store(services, "src"), store(services, "dst")
    upload(source, prefix, {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000})
    source.put(prefix + "b.bin", b"B" * 1000)  # changed after its manifest was written
    with pytest.raises(CopyError, match=r"b\.bin: its digest did not match the manifest after 3"):
        copy_dataset(source, target, prefix, 1e9, threading.Event())
    assert not target.keys(prefix + MANIFEST)
    # Nothing under the prefix at all: said so.
    with pytest.raises(CopyError, match="no objects under"):
        copy_dataset(
            source, target, f"datasets/acme/none-{uuid.uuid4().hex[:6]}/", 1e9, threading.Event()
        )


def test_serve_runs_the_mover_unless_told_not_to(settings, monkeypatch):
    from fleetline import app as composition
    from fleetline.cli import main

    for name, value in service_env(settings).items():
        monkeypatch.setenv(name, value)
    seen = []

    class _Stop(Exception):
        pass

    def build(config, options):
        seen.append(options.data_mover)
        raise _Stop

    monkeypatch.setattr(composition, "build", build)
    for flags in ([], ["--no-data-mover"]):
        with pytest.raises(_Stop):
            main(["serve", "--no-api", *flags])
    assert seen == [True, False]


def test_a_copy_out_of_its_region_masks_the_sensitive_fields_of_every_record(
    services: Settings,
):
    name = f"records-{uuid.uuid4().hex[:8]}"
    prefix = dataset_prefix("acme", name)
    source, target = store(services, "src"), store(services, "dst")
    records = {
        f"part-{i}.jsonl": "".join(
            json.dumps({"patient": f"p-{i}-{n}", "email": f"u{n}@example.org", "score": n}) + "\n"
            for n in range(50)
        ).encode()
        for i in range(3)
    }
    upload(source, prefix, records)
    mask = Mask(("patient", "email"), mask_key(os.urandom(32), "acme"))
    report = copy_dataset(source, target, prefix, 1e9, threading.Event(), mask=mask)
    assert report is not None and report.total_bytes == sum(map(len, records.values()))
    for key, body in records.items():
        copied = target.get(prefix + key)
        rows = [json.loads(line) for line in copied.decode().splitlines()]
        originals = [json.loads(line) for line in body.decode().splitlines()]
        # No clear value of a sensitive field arrived; the rest did, record by record.
        assert b"p-" not in copied and b"@example.org" not in copied
        assert [r["score"] for r in rows] == [o["score"] for o in originals]
        assert [r["patient"] for r in rows] == [mask.value(o["patient"]) for o in originals]
    # The target's manifest describes what it holds: the masked bytes.
    manifest = json.loads(target.get(prefix + MANIFEST))
    for entry in manifest["objects"]:
        held = target.get(prefix + entry["key"])
        assert hashlib.sha256(held).hexdigest() == entry["sha256"] and len(held) == entry["size"]
