"""Every table's lifetime (storage/tiering/policy.py): what tiers, and which lifetimes are
refused because another table's rows would be lost with them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetline.errors import ConfigError
from fleetline.storage.clickhouse import MIGRATIONS
from fleetline.storage.tiering.policy import (
    DAY_MS,
    EVENT_TIME,
    GPU_SAMPLES,
    HOUR_MS,
    LIFETIMES,
    check_lifetimes,
)


def test_every_table_a_sink_fills_with_events_has_a_lifetime() -> None:
    created = {
        ddl.split("{db}.", 1)[1].split()[0]
        for migration in MIGRATIONS
        for ddl in migration.statements
        if "CREATE TABLE" in ddl
    }
    tiered = {data.table for data in LIFETIMES.values()}
    # Kept hot on purpose: a few rows a day, read as current state.
    assert created - tiered == {"repair_tickets", "energy_prices"}
    for name, data in LIFETIMES.items():
        if data is GPU_SAMPLES:
            continue
        # Partitioned by the month or the day: a moved hour's rows are deleted, not its
        # partition dropped; time is read from ts_ms, which the Parquet copies hold.
        assert not data.hourly_partitions and data.ts_column == EVENT_TIME, name
        assert {"source_topic"} <= set(data.identity), name
    assert LIFETIMES["audit"].cold_ms is None and LIFETIMES["decisions"].cold_ms is None
    assert LIFETIMES["logs"].cold_ms == 90 * DAY_MS


def test_allocations_must_be_kept_while_samples_are_kept_apart_by_tenant() -> None:
    samples = replace(GPU_SAMPLES, cold_ms=30 * DAY_MS, tenant_cold_ms=(("acme", 60 * DAY_MS),))
    short = replace(LIFETIMES["allocations"], cold_ms=45 * DAY_MS)
    with pytest.raises(ConfigError, match="60 days, not 45 days"):
        check_lifetimes({**LIFETIMES, "samples": samples, "allocations": short})
    check_lifetimes(
        {**LIFETIMES, "samples": samples, "allocations": replace(short, cold_ms=60 * DAY_MS)}
    )
    forever = replace(samples, tenant_cold_ms=(("acme", None),))
    with pytest.raises(ConfigError, match="for ever, not 60 days"):
        check_lifetimes(
            {**LIFETIMES, "samples": forever, "allocations": replace(short, cold_ms=60 * DAY_MS)}
        )
    # Without tenant retention nothing is attributed, and the allocations may go first.
    check_lifetimes(
        {**LIFETIMES, "samples": replace(samples, tenant_cold_ms=()), "allocations": short}
    )


def test_the_audit_log_is_never_purged_by_tenant_and_hot_is_an_hour_at_least() -> None:
    audit = replace(LIFETIMES["audit"], tenant_cold_ms=(("acme", DAY_MS),))
    with pytest.raises(ConfigError, match="audit log is kept whole"):
        check_lifetimes({**LIFETIMES, "audit": audit})
    with pytest.raises(ConfigError, match="logs: keep rows hot for an hour"):
        check_lifetimes({**LIFETIMES, "logs": replace(LIFETIMES["logs"], hot_ms=HOUR_MS - 1)})
    check_lifetimes(dict(LIFETIMES))


def test_a_table_whose_pass_fails_holds_no_other_table_back() -> None:
    import threading

    from fleetline.errors import StorageError
    from fleetline.storage.tiering.loop import TierLoop
    from fleetline.storage.tiering.policy import TierStats

    passes: list[str] = []

    class Tiers:
        def __init__(self, table: str, fails: bool) -> None:
            self.data = LIFETIMES[table]
            self.stats = TierStats()
            self.fails = fails

        def run_once(self, now_ms: int) -> TierStats:
            passes.append(self.data.table)
            if self.fails:
                raise StorageError("the S3 server is down")
            self.stats.to_warm += 1
            return self.stats

    stores = [Tiers("logs", True), Tiers("decisions", False)]
    loop = TierLoop(stores, every_s=0.01)  # type: ignore[arg-type]
    stop = threading.Event()
    runner = threading.Thread(target=loop.run, args=(stop,))
    runner.start()
    for _ in range(500):  # 5 s at most
        if len(passes) >= 4:
            break
        stop.wait(0.01)
    stop.set()
    runner.join(5)
    assert passes[:4] == ["logs", "scheduling_decisions"] * 2
    assert stores[1].stats.to_warm >= 2
