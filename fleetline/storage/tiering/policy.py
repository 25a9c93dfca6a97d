"""What tiering decides, pure: the data classes and their retention, the manifests that make a
copy exist, how partitions are named."""

from __future__ import annotations

import builtins
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from fleetline.errors import ConfigError

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
HOT, WARM, COLD = "hot", "warm", "cold"


@dataclass(frozen=True)
class DataClass:
    """A hot table that tiers, how its rows are ordered, and how long each tier keeps them."""

    table: str
    ts_column: str = "ts"
    order_by: tuple[str, ...] = ("cluster_id", "node_id", "gpu_index", "ts")
    hot_ms: int = DAY_MS
    warm_ms: int = 7 * DAY_MS
    cold_ms: int | None = None  # None: cold archives are kept for ever
    # Tenants whose rows cold keeps for another time than `cold_ms` (None: for ever).
    tenant_cold_ms: tuple[tuple[str, int | None], ...] = ()
    # The column naming a row's tenant; None for GPU samples, whose tenant is the one the
    # scheduler had allocated the GPU to at the sample's time (the gpu_allocations table).
    tenant_column: str | None = None
    # What tells one row from another (late rows for a moved hour are the hot rows not among
    # the warm copies): a sample is one GPU of one Kafka message.
    identity: tuple[str, ...] = ("source_topic", "source_partition", "source_offset", "gpu_index")
    # Whether the hot table is partitioned by the hour (a moved hour's partition is dropped);
    # the record tables are partitioned by the month or the day, so a moved hour's rows are
    # deleted instead.
    hourly_partitions: bool = True
    # Whether queries read the cold archives in place (`source_sql`) rather than what
    # `restore` rehydrated: for a small table whose old rows still answer today's questions
    # (the allocation in force on a GPU may be months old).
    cold_in_place: bool = False


GPU_SAMPLES = DataClass("gpu_samples")
# A record table's event time: its `ts` column is MATERIALIZED from `ts_ms`, which Parquet
# copies (the table's stored columns) hold alone.
EVENT_TIME = "fromUnixTimestamp64Milli(ts_ms, 'UTC')"
# A record stored by a sink: one Kafka message.
SOURCED = ("source_topic", "source_partition", "source_offset")


def _record_table(
    table: str,
    order_by: tuple[str, ...],
    hot_days: float,
    warm_days: float,
    cold_days: float | None = None,
    identity: tuple[str, ...] = SOURCED,
    **kwargs: object,
) -> DataClass:
    return DataClass(
        table,
        ts_column=EVENT_TIME,
        order_by=order_by,
        hot_ms=int(hot_days * DAY_MS),
        warm_ms=int(warm_days * DAY_MS),
        cold_ms=None if cold_days is None else int(cold_days * DAY_MS),
        hourly_partitions=False,
        identity=identity,
        **kwargs,  # type: ignore[arg-type]
    )


# Every table that tiers, by the name of its query macro ($samples, $decisions, ...), with its
# default lifetime. Decisions, allocations and the audit log are kept for ever once cold (they
# are what an incident review or an audit asks for years later); logs and node states age out.
# Repair tickets and energy prices stay hot: a few rows a day, read as current state.
LIFETIMES: dict[str, DataClass] = {
    "samples": GPU_SAMPLES,
    "decisions": _record_table(
        "scheduling_decisions", ("tenant", "job", "ts_ms"), 30, 90, tenant_column="tenant"
    ),
    # One allocation record binds one GPU; a sample's tenant is the allocation in force then.
    "allocations": _record_table(
        "gpu_allocations",
        ("node_id", "gpu_index", "ts_ms"),
        30,
        90,
        tenant_column="tenant",
        identity=(*SOURCED, "gpu_index"),
        cold_in_place=True,
    ),
    "workloads": _record_table(
        "workload_events", ("tenant", "job", "ts_ms"), 7, 30, 365, tenant_column="tenant"
    ),
    "logs": _record_table("logs", ("process", "ts_ms"), 3, 14, 90),
    "node_states": _record_table("node_states", ("cluster_id", "node_id", "ts_ms"), 7, 30, 365),
    # Archived, never deleted before its retention (none by default), never per tenant.
    "audit": _record_table(
        "audit_log", ("partition", "seq"), 90, 365, identity=("source_topic", "partition", "seq")
    ),
}


def check_lifetimes(lifetimes: dict[str, DataClass]) -> None:
    """Refuse lifetimes that would lose what another table's rows need (pure): GPU samples are
    attributed to tenants through the allocations, so while a tenant's samples are kept
    apart, the allocations must be kept at least as long; the audit log is never purged by
    tenant."""

    def longest(data: DataClass) -> int | None:  # None: for ever
        kept = [data.cold_ms, *(keep for _, keep in data.tenant_cold_ms)]
        return None if None in kept else max(k for k in kept if k is not None)

    for name, data in lifetimes.items():
        if data.hot_ms < HOUR_MS or data.warm_ms < 0:
            raise ConfigError(f"{name}: keep rows hot for an hour at least, and warm for >= 0")
    samples, allocations = lifetimes.get("samples"), lifetimes.get("allocations")
    if samples is not None and allocations is not None and samples.tenant_cold_ms:
        need, have = longest(samples), allocations.cold_ms
        if have is not None and (need is None or have < need):
            raise ConfigError(
                "allocations: their cold archives must be kept as long as any GPU sample "
                "(tenant retention attributes samples through them): "
                f"{'for ever' if need is None else f'{need / DAY_MS:g} days'}, not "
                f"{have / DAY_MS:g} days"
            )
    audit = lifetimes.get("audit")
    if audit is not None and audit.tenant_cold_ms:
        raise ConfigError("audit: the audit log is kept whole, never purged by tenant")


EVERYONE_ELSE = "*"  # in a purge: the rows of every tenant without its own retention


def retention_plan(data: DataClass, day_ms: int, now_ms: int) -> tuple[str, ...] | None:
    """What policy lets go of a cold day at `now_ms` (pure): None when the whole archive may
    be deleted, else the tenants whose rows may be (EVERYONE_ELSE: every tenant without its
    own retention, and rows of no tenant); () when nothing may."""
    end = day_ms + DAY_MS

    def expired(keep_ms: int | None) -> bool:
        return keep_ms is not None and end <= now_ms - keep_ms

    overrides = dict(data.tenant_cold_ms)
    gone = sorted(tenant for tenant, keep_ms in overrides.items() if expired(keep_ms))
    if expired(data.cold_ms):
        if len(gone) == len(overrides):
            return None
        gone.append(EVERYONE_ELSE)
    return tuple(sorted(gone))


@dataclass(frozen=True)
class Manifest:
    table: str
    tier: str
    # warm: the hour, YYYYMMDDHH (late rows moved after it: YYYYMMDDHH-late<n>); cold: the
    # day, YYYYMMDD
    partition: str
    key: str
    rows: int
    checksum: str  # sum(cityHash64(row)) over the rows, as ClickHouse computes it
    min_ts_ms: int
    max_ts_ms: int
    bytes: int
    sources: tuple[str, ...] = ()  # cold: the warm keys (and earlier archives) it replaced
    purged: tuple[str, ...] = ()  # cold: tenants whose rows retention has removed

    def as_json(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: builtins.bytes) -> Manifest:
        raw = json.loads(data)
        raw["sources"] = tuple(raw.get("sources", ()))
        raw["purged"] = tuple(raw.get("purged", ()))
        return cls(**raw)


@dataclass
class TierStats:
    to_warm: int = 0
    to_cold: int = 0
    completed_after_crash: int = 0
    expired: int = 0
    purged: int = 0  # cold archives rewritten without the rows of tenants retention let go
    rows_moved: int = 0
    refused: list[str] = field(default_factory=list)


def hour_of(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y%m%d%H")


def partition_start_ms(partition: str) -> int:
    partition = partition.split("-", 1)[0]  # an hour's late objects belong to the hour
    fmt = "%Y%m%d%H" if len(partition) == 10 else "%Y%m%d"
    return int(datetime.strptime(partition, fmt).replace(tzinfo=UTC).timestamp() * 1000)
