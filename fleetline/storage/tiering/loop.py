"""The tiering pass over every table with a lifetime, run every so often in the process that
owns the store."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.config import S3Settings
from fleetline.errors import FleetlineError
from fleetline.observability import metrics
from fleetline.storage.objects import ObjectStore
from fleetline.storage.tiering.policy import LIFETIMES, DataClass, check_lifetimes
from fleetline.storage.tiering.store import TieredStore

log = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class TierLoop:
    """Runs the tiering pass of every table every `every_s` seconds in the process that owns
    the store."""

    name = "tiering"

    def __init__(self, stores: Sequence[TieredStore], every_s: float) -> None:
        self.stores = list(stores)
        self.every_s = every_s
        self.ready = threading.Event()

    def run(self, stop: threading.Event) -> None:
        self.ready.set()
        while not stop.wait(self.every_s):
            failed = False
            for store in self.stores:
                failed |= not self.run_once(store)
            metrics.TIER_RUNS.labels("failed" if failed else "succeeded").inc()
            if not failed:
                metrics.TIER_LAST_SUCCESS.set(wall_clock_ms() / 1000)

    @staticmethod
    def run_once(store: TieredStore) -> bool:
        """One table's pass; False if it failed (the next pass retries: every move is
        restartable, and one table's failure does not hold the others back)."""
        stats = store.stats
        before = (stats.to_warm, stats.to_cold, stats.rows_moved)
        try:
            store.run_once(wall_clock_ms())
        except FleetlineError as exc:
            log.warning("tiering pass over %s failed: %s", store.data.table, exc)
            return False
        metrics.TIER_PARTITIONS.labels("warm").inc(stats.to_warm - before[0])
        metrics.TIER_PARTITIONS.labels("cold").inc(stats.to_cold - before[1])
        metrics.TIER_ROWS.inc(stats.rows_moved - before[2])
        return True


def tiered_stores(
    client: Client,
    database: str,
    objects: ObjectStore,
    s3: S3Settings,
    lifetimes: dict[str, DataClass] | None = None,
    **options: Any,
) -> dict[str, TieredStore]:
    """The tiers of every table with a lifetime (`LIFETIMES`, with `lifetimes` in place of
    their defaults), by macro name; the samples' store attributes tenants through the
    allocations' tiers."""
    chosen = {**LIFETIMES, **(lifetimes or {})}
    check_lifetimes(chosen)
    stores = {
        name: TieredStore(client, database, objects, s3, data, **options)
        for name, data in chosen.items()
    }
    if "samples" in stores and "allocations" in stores:
        stores["samples"].allocations = stores["allocations"]
    return stores
