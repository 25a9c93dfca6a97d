"""The tiering pass, run every so often in the process that owns the store."""

from __future__ import annotations

import logging
import threading
import time

from fleetline.errors import FleetlineError
from fleetline.observability import metrics
from fleetline.storage.tiering.store import TieredStore

log = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class TierLoop:
    """Runs the tiering pass every `every_s` seconds in the process that owns the store."""

    name = "tiering"

    def __init__(self, store: TieredStore, every_s: float) -> None:
        self.store = store
        self.every_s = every_s
        self.ready = threading.Event()

    def run(self, stop: threading.Event) -> None:
        self.ready.set()
        while not stop.wait(self.every_s):
            stats = self.store.stats
            before = (stats.to_warm, stats.to_cold, stats.rows_moved)
            try:
                self.store.run_once(wall_clock_ms())
            except FleetlineError as exc:  # the next pass retries; every move is restartable
                log.warning("tiering pass failed: %s", exc)
                metrics.TIER_RUNS.labels("failed").inc()
                continue
            metrics.TIER_RUNS.labels("succeeded").inc()
            metrics.TIER_LAST_SUCCESS.set(wall_clock_ms() / 1000)
            metrics.TIER_PARTITIONS.labels("warm").inc(stats.to_warm - before[0])
            metrics.TIER_PARTITIONS.labels("cold").inc(stats.to_cold - before[1])
            metrics.TIER_ROWS.inc(stats.rows_moved - before[2])
