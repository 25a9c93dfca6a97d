"""A tiering process for tests/test_tiers.py to kill: `python -m tests.tier_child crash STEP TIER`
loads the test telemetry into an embedded ClickHouse folder and SIGKILLs itself right after
STEP of the first TIER move; `check` reopens the folder in a new process and prints, as JSON,
what the union view holds against the reference before and after the next pass completes it.

chdb admits one data folder per process, so the killed process and the checker cannot be the
test process itself."""

from __future__ import annotations

import json
import os
import signal
import sys

from fleetline.config import S3Settings
from fleetline.storage.clickhouse import connect
from fleetline.storage.tiers import COLD, DAY_MS, WARM
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
    store = tiers(settings, client, db)
    store.rebuild_view()
    cold = store.manifests(COLD)
    cold_until = max((m.max_ts_ms for m in cold), default=0)
    recent = f"ts > fromUnixTimestamp64Milli({cold_until}, 'UTC')"
    before = [fingerprint(store, store.union_view), fingerprint(store, f"{db}.reference", recent)]
    store.run_once(NOW)
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
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
