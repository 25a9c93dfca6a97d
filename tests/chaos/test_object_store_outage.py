"""The S3 server SIGKILLed in the middle of a tiering move and started again: the pass it broke
fails with a clear error (what `serve`'s tiering loop logs before its next pass), every row is
still in the union view exactly once, and the next pass completes the move; no object is left
that no manifest names, no row is lost or twice in any tier.

The server is one of the test's own on a port of its own (the session's stays up for the rest),
over a data folder that outlives the kill, as a real store's disks would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetline.infra.s3 import ObjectStoreServer
from fleetline.storage.tiering.policy import COLD, WARM
from tests.support import wait_until

PORT = int(os.environ.get("FLEETLINE_TEST_S3_CHAOS_PORT", "28000"))
ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def object_store(settings):
    server = ObjectStoreServer(
        settings.cache_dir, settings.s3.access_key, settings.s3.secret_key, port=PORT
    )
    server.wipe()
    server.start()
    try:
        yield server
    finally:
        server.wipe()


@pytest.mark.parametrize(
    ("step", "tier"),
    [("copied", WARM), pytest.param("verified", COLD, marks=pytest.mark.chaos_full)],
)
def test_the_s3_server_killed_mid_move_loses_and_duplicates_nothing(
    settings, object_store, tmp_path, step, tier
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    env = {
        **os.environ,
        "FLEETLINE_S3_ENDPOINT": f"127.0.0.1:{PORT}",
        "FLEETLINE_S3_BUCKET": settings.s3.bucket,
    }
    command = [
        sys.executable,
        "-m",
        "tests.integration.tier_child",
        "outage",
        str(tmp_path / "chdb"),
        settings.clickhouse_database,
        step,
        tier,
        str(flags),
    ]
    child = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(
            lambda: (flags / "paused").exists() or child.poll() is not None,
            300,
            what=f"the first pass at {step} of a {tier} move",
        )
        assert child.poll() is None, child.communicate()
        assert object_store.process.kill()  # SIGKILL: no flush, no goodbye
        (flags / "killed").touch()
        wait_until(
            lambda: (flags / "first-pass-over").exists() or child.poll() is not None,
            300,
            what="the broken pass to end",
        )
        time.sleep(1)
        object_store.start()
        (flags / "restarted").touch()
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    # The pass the outage broke said why; the union view held every row once meanwhile, and
    # the next pass completed the move.
    assert report["failures"], "the pass went through a dead S3 server without an error"
    assert any(
        "StorageError" in f or "QueryError" in f or "Unavailable" in f for f in report["failures"]
    ), report["failures"]
    assert report["before"][0] == report["before"][1]
    assert report["after"][0] == report["after"][1]
    assert report["orphans"] == [] and report["refused"] == []
