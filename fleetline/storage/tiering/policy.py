"""What tiering decides, pure: the data classes and their retention, the manifests that make a
copy exist, how partitions are named."""

from __future__ import annotations

import builtins
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

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


GPU_SAMPLES = DataClass("gpu_samples")
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
