"""Training checkpoints on the real S3 server: a run stopped anywhere resumes bit for bit, a
torn checkpoint (a part missing, a digest wrong, no manifest) is never resumed from, and a copy
to another cluster's store moves sealed bytes and is verified there."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleetline.config import Settings
from fleetline.errors import IntegrityError
from fleetline.storage.checkpoints import Checkpoints, best_of, checkpoint_name, tenant_key
from fleetline.storage.objects import ObjectStore
from tests.services import service_env
from tests.support import wait_until

pytestmark = pytest.mark.services
MASTER = os.urandom(32)


def store(settings: Settings, bucket: str, prefix: str, key: bytes | None) -> Checkpoints:
    objects = ObjectStore.from_settings(settings.s3, bucket)
    objects.ensure_bucket()
    return Checkpoints(objects, prefix, key)


def trainer_env(settings: Settings, bucket: str, prefix: str, progress: Path, **extra: str) -> dict:
    return {
        **os.environ,
        **service_env(settings),
        "FLEETLINE_CHECKPOINT_BUCKET": bucket,
        "FLEETLINE_CHECKPOINT_PREFIX": prefix,
        "FLEETLINE_CHECKPOINT_KEY": base64.b64encode(tenant_key(MASTER, "acme")).decode(),
        "FLEETLINE_PROGRESS_FILE": str(progress),
        "FLEETLINE_STEPS": "300",
        "FLEETLINE_CHECKPOINT_EVERY": "50",
        "FLEETLINE_REPORT_EVERY": "10",
        "FLEETLINE_SEED": "5",
        "OPENBLAS_NUM_THREADS": "1",
        **extra,
    }


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


TRAIN = [sys.executable, "-m", "fleetline.agents.workloads.train"]


def test_a_run_stopped_mid_way_and_resumed_ends_bit_identical(settings, tmp_path):
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    whole = tmp_path / "whole.jsonl"
    subprocess.run(TRAIN, env=trainer_env(settings, bucket, "whole", whole), check=True)
    reference = lines(whole)
    # The same job, stopped by SIGTERM part-way (it checkpoints on the way out), then resumed
    # under a new epoch.
    part = tmp_path / "part.jsonl"
    slow = trainer_env(settings, bucket, "split", part, FLEETLINE_STEP_DELAY_MS="10")
    child = subprocess.Popen(TRAIN, env=slow)
    wait_until(
        lambda: part.exists() and any(x["event"] == "checkpoint" for x in lines(part)),
        60,
        what="a first checkpoint",
    )
    time.sleep(0.3)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 0
    first = lines(part)
    assert first[-1]["event"] == "stopped"
    stopped_at = first[-1]["step"]
    assert 50 <= stopped_at < 300
    subprocess.run(
        TRAIN, env={**slow, "FLEETLINE_EPOCH": "2", "FLEETLINE_STEP_DELAY_MS": "0"}, check=True
    )
    second = lines(part)[len(first) :]
    assert second[0]["event"] == "resumed" and second[0]["step"] == stopped_at
    done = [x for x in second if x["event"] == "done"]
    assert done[0]["params_sha256"] == reference[-1]["params_sha256"]
    # The loss curve is the uninterrupted one, step for step.
    losses = {x["step"]: x["loss"] for x in reference if x["event"] == "progress"}
    resumed = {x["step"]: x["loss"] for x in first + second if x["event"] == "progress"}
    assert resumed == losses


def test_a_sealed_part_altered_in_place_fails_to_open(settings, tmp_path):
    """A sealed part is not hashed on restore: its decryption authenticates it, so one byte
    flipped at the same length is refused there."""
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    own = store(settings, bucket, "flip", tenant_key(MASTER, "acme"))
    manifest, _ = own.save(1, 10, {"a.bin": b"w" * 4096}, {})
    key = f"flip/{manifest.name}/a.bin"
    blob = bytearray(own.store.get(key))
    blob[100] ^= 0x01
    own.store.put(key, bytes(blob))
    with pytest.raises(IntegrityError, match="decryption failed"):
        own.load(manifest.name)
    assert own.latest() is None


def test_a_torn_checkpoint_is_never_resumed_from(settings, tmp_path):
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    key = tenant_key(MASTER, "acme")
    own = store(settings, bucket, "torn", key)
    for step in (10, 20, 30, 40):
        own.save(1, step, {"a.bin": bytes([step]) * 1000, "b.bin": b"x" * 10}, {})
    objects = own.store
    # 40: a part missing; 30: a part altered; 20: sealed under another tenant's key (its
    # manifest's data key does not open); 10: whole.
    objects.delete(f"torn/{checkpoint_name(1, 40)}/b.bin")
    objects.put(f"torn/{checkpoint_name(1, 30)}/a.bin", b"\x00" * 1000)
    other = Checkpoints(objects, "torn", tenant_key(MASTER, "globex"))
    with pytest.raises(IntegrityError):
        other.load(checkpoint_name(1, 20))
    # Under another key none is complete: each is passed over, none is handed to a workload.
    assert other.newest_complete() is None
    assert any("decryption failed" in why for why in other.skipped)
    found = own.latest()
    assert found is not None
    manifest, parts = found
    assert manifest.step == 20 and parts["a.bin"] == bytes([20]) * 1000
    assert any("b.bin is missing" in why for why in own.skipped)
    assert any("does not match its digest" in why for why in own.skipped)
    # A manifest that is not JSON is passed over too.
    objects.put(f"torn/{checkpoint_name(1, 50)}/MANIFEST.json", b"{not json")
    assert own.newest_complete().step == 20
    # Written parts without their manifest (a writer killed before the end) do not count.
    objects.put(f"torn/{checkpoint_name(1, 60)}/a.bin", b"partial")
    assert own.newest_complete().step == 20


def test_a_copy_to_another_cluster_moves_ciphertext_and_is_verified_there(settings):
    key = tenant_key(MASTER, "acme")
    source = store(settings, f"a-{uuid.uuid4().hex[:8]}", "checkpoints/acme/j", key)
    target = store(settings, f"b-{uuid.uuid4().hex[:8]}", "checkpoints/acme/j", key)
    secret = b"optimizer moments " * 1000
    manifest, _ = source.save(3, 120, {"optimizer.npz": secret}, {"note": "x"})
    best = best_of([target, source])
    assert best is not None and best[0] is source and best[1].step == 120
    size, seconds = source.copy_to(target, manifest.name)
    assert size == manifest.bytes and seconds >= 0
    stored = target.store.get(f"checkpoints/acme/j/{manifest.name}/optimizer.npz")
    assert secret[:32] not in stored  # sealed: no plaintext at rest or in transit
    assert target.load(manifest.name)[1]["optimizer.npz"] == secret
    # A newer epoch outranks a higher step of an older one (a fenced copy's later writes).
    source.save(2, 500, {"optimizer.npz": b"stale"}, {})
    best = best_of([target, source])
    assert best is not None and (best[1].epoch, best[1].step) == (3, 120)


@pytest.mark.parametrize("sealed", [True, False])
def test_a_checkpoint_from_files_goes_up_in_pieces_and_comes_back_to_files(
    settings, tmp_path, sealed
):
    """A part larger than a multipart piece is streamed up and down: the stored object is the
    same format as one saved from memory (load reads it), the restored file is bit for bit the
    source, and a part that does not check out leaves no file behind."""
    key = tenant_key(MASTER, "acme") if sealed else None
    own = store(settings, f"files-{uuid.uuid4().hex[:8]}", "checkpoints/acme/big", key)
    own.part_size = 5 << 20  # S3's smallest piece: a 12 MiB part goes up in three
    source = tmp_path / "source"
    source.mkdir()
    big, small = os.urandom(12 << 20) + b"tail", b"config: 1\n"
    (source / "weights.bin").write_bytes(big)
    (source / "config.yaml").write_bytes(small)
    manifest, _ = own.save_files(
        2, 400, {"weights.bin": source / "weights.bin", "config.yaml": source / "config.yaml"}, {}
    )
    stored = own.store.get(f"checkpoints/acme/big/{manifest.name}/weights.bin")
    assert (big[:64] in stored) is not sealed
    assert own.newest_complete() == manifest
    assert own.load(manifest.name)[1] == {"weights.bin": big, "config.yaml": small}
    restored = tmp_path / "restored"
    assert own.restore_files(manifest.name, restored) == manifest
    assert (restored / "weights.bin").read_bytes() == big
    assert sorted(p.name for p in restored.iterdir()) == ["config.yaml", "weights.bin"]
    # One byte flipped in the stored part: refused, and no file of it is left.
    flipped = bytearray(stored)
    flipped[len(flipped) // 2] ^= 1
    own.store.put(f"checkpoints/acme/big/{manifest.name}/weights.bin", bytes(flipped))
    again = tmp_path / "again"
    with pytest.raises(IntegrityError, match="decryption failed" if sealed else "digest"):
        own.restore_files(manifest.name, again)
    assert not (again / "weights.bin").exists()
    assert not list(again.glob(".*partial"))
    with pytest.raises(IntegrityError, match="not a plain file name"):
        own.save_files(2, 500, {"../escape": source / "config.yaml"}, {})
