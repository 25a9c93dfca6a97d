"""A tiering process for tests/test_tiers.py to kill: `python -m tests.tier_child crash STEP TIER`
loads the test telemetry into an embedded ClickHouse folder and SIGKILLs itself right after
STEP of the first TIER move; `check` reopens the folder in a new process and prints, as JSON,
what the union view holds against the reference before and after the next pass completes it.

`outage STEP TIER FLAGS` (tests/chaos/test_object_store_outage.py) stops the first pass right
after STEP of the first TIER move until the test has killed the S3 server (the files in the
FLAGS folder say when), lets the pass go on against the dead server, and, once the test has
started the server again, runs passes as `serve`'s tiering loop would until one succeeds, then
prints the same report with the failures the passes met.

chdb admits one data folder per process, so the killed process and the checker cannot be the
test process itself."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from fleetline.config import S3Settings
from fleetline.errors import FleetlineError
from fleetline.storage.clickhouse import connect
from fleetline.storage.tiering.policy import COLD, DAY_MS, WARM
from tests.integration.test_tiers import DAYS, NOW, fingerprint, load, tiers


class _Settings:
    def __init__(self) -> None:
        self.s3 = S3Settings(
            endpoint=os.environ["FLEETLINE_S3_ENDPOINT"], bucket=os.environ["FLEETLINE_S3_BUCKET"]
        )


def main(argv: list[str]) -> None:
    mode, path, db = argv[0], argv[1], argv[2]
    client = connect(f"chdb://{path}")
    settings = _Settings()
    if mode == "crash":
        step, tier = argv[3], argv[4]
        load(client, db)

        def kill(at: str, partition: str) -> None:
            if at == step and (len(partition) == 8) == (tier == COLD):
                os.kill(os.getpid(), signal.SIGKILL)  # no finally, no flush: a real death

        tiers(settings, client, db, on_step=kill).run_once(NOW)
        print(json.dumps({"killed": False}))
        return
    failures: list[str] = []
    if mode == "outage":
        step, tier, flags = argv[3], argv[4], Path(argv[5])
        load(client, db)

        def wait_for(name: str) -> None:
            deadline = time.monotonic() + 300
            while not (flags / name).exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"no {name} from the test in 300 s")
                time.sleep(0.05)

        def pause(at: str, partition: str) -> None:
            first = not (flags / "paused").exists()
            if first and at == step and (len(partition) == 8) == (tier == COLD):
                (flags / "paused").touch()
                wait_for("killed")

        store = tiers(settings, client, db, on_step=pause)
        try:
            store.run_once(NOW)
        except FleetlineError as exc:  # what serve's tiering loop logs before its next pass
            failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        (flags / "first-pass-over").touch()
        wait_for("restarted")
    store = tiers(settings, client, db)
    store.rebuild_view()
    cold = store.manifests(COLD)
    cold_until = max((m.max_ts_ms for m in cold), default=0)
    recent = f"ts > fromUnixTimestamp64Milli({cold_until}, 'UTC')"
    before = [fingerprint(store, store.union_view), fingerprint(store, f"{db}.reference", recent)]
    for _ in range(30):  # as the tiering loop does: pass after pass until one goes through
        try:
            store.run_once(NOW)
            break
        except FleetlineError as exc:
            failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            time.sleep(1)
    store.restore(NOW - DAYS * DAY_MS, NOW)
    after = [fingerprint(store, store.union_view), fingerprint(store, f"{db}.reference")]
    keys = store.objects.keys(f"{store.root}/{db}/gpu_samples/")
    data = {k for k in keys if k.endswith(".parquet")}
    named = {m.key for m in store.manifests(WARM)} | {m.key for m in store.manifests(COLD)}
    print(
        json.dumps(
            {
                "before": before,
                "after": after,
                "orphans": sorted(data - named),
                "refused": store.stats.refused,
                "completed_after_crash": store.stats.completed_after_crash,
                "failures": failures,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
