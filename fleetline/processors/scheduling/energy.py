"""Energy as a scheduling dimension: each cluster's electricity price and renewable share hour
by hour, what a GPU-hour's energy costs there at a given time, and when a deferrable job should
start so that it runs in the cheapest (greenest) hours and still meets its deadline.

A cluster's `EnergyProfile` reaches the scheduler as an ENERGY request in its log (from
`fleetline energy apply`), so a replay prices every hour as the
decision did. Without a profile a cluster's energy costs its declared flat price (ClusterInfo)
with no renewable share. Nothing here reads a clock: times are the requests' event times.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.processors.scheduling.capacity import ClusterFacts

HOUR_MS = 3_600_000
DAY_HOURS = 24
# What one GPU draws under a training load, kW: an H100 SXM near its 700 W limit.
GPU_POWER_KW = 0.7


@dataclass(frozen=True)
class PriceWindow:
    """A published price for an exact interval (a day-ahead or intraday market's slot)."""

    from_ms: int
    to_ms: int
    price_per_kwh: float
    renewable_share: float = 0.0


@dataclass(frozen=True)
class EnergyProfile:
    """A cluster's electricity over a day (UTC hours 0-23, repeating): price per kWh and the
    share of renewable supply, as a day-ahead market and the grid operator publish them; and
    `windows` that override it for exact intervals."""

    cluster_id: str
    price_per_kwh: tuple[float, ...]
    renewable_share: tuple[float, ...]
    windows: tuple[PriceWindow, ...] = ()
    pue: float | None = None  # the facility's, when the profile says (else the cluster's)

    def __post_init__(self) -> None:
        if self.pue is not None and self.pue < 1:
            raise InvalidEventError(f"energy profile of {self.cluster_id}: pue {self.pue} < 1")
        for name, values in (
            ("price_per_kwh", self.price_per_kwh),
            ("renewable_share", self.renewable_share),
        ):
            if len(values) != DAY_HOURS:
                raise InvalidEventError(
                    f"energy profile of {self.cluster_id}: {name} needs {DAY_HOURS} hourly "
                    f"values, got {len(values)}"
                )
            if any(v < 0 for v in values):
                raise InvalidEventError(f"energy profile of {self.cluster_id}: {name} below 0")
        shares = [*self.renewable_share, *(w.renewable_share for w in self.windows)]
        if any(not 0 <= v <= 1 for v in shares):
            raise InvalidEventError(
                f"energy profile of {self.cluster_id}: renewable_share is a fraction (0-1)"
            )
        for w in self.windows:
            if w.to_ms <= w.from_ms or w.price_per_kwh < 0:
                raise InvalidEventError(
                    f"energy profile of {self.cluster_id}: window {w} is empty or priced below 0"
                )

    def at(self, ts_ms: int) -> tuple[float, float]:
        """(price per kWh, renewable share) at `ts_ms`: its window's, else its hour's."""
        for w in self.windows:
            if w.from_ms <= ts_ms < w.to_ms:
                return w.price_per_kwh, w.renewable_share
        hour = (ts_ms // HOUR_MS) % DAY_HOURS
        return self.price_per_kwh[hour], self.renewable_share[hour]

    def boundaries(self) -> list[int]:
        """Where the windows start and end (prices change there, besides on the hour)."""
        return sorted({t for w in self.windows for t in (w.from_ms, w.to_ms)})

    def as_data(self) -> dict[str, Any]:
        return {
            "cluster_id": self.cluster_id,
            "price_per_kwh": list(self.price_per_kwh),
            "renewable_share": list(self.renewable_share),
            "windows": [
                {
                    "from_ms": w.from_ms,
                    "to_ms": w.to_ms,
                    "price_per_kwh": w.price_per_kwh,
                    "renewable_share": w.renewable_share,
                }
                for w in self.windows
            ],
            "pue": self.pue,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> EnergyProfile:
        try:
            return cls(
                str(data["cluster_id"]),
                tuple(float(v) for v in data["price_per_kwh"]),
                tuple(float(v) for v in data.get("renewable_share") or [0.0] * DAY_HOURS),
                tuple(
                    PriceWindow(
                        int(w["from_ms"]),
                        int(w["to_ms"]),
                        float(w["price_per_kwh"]),
                        float(w.get("renewable_share", 0.0)),
                    )
                    for w in data.get("windows") or ()
                ),
                None if data.get("pue") is None else float(data["pue"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEventError(f"energy profile: {exc!r}") from None


def effective_price(
    cluster: ClusterFacts,
    profile: EnergyProfile | None,
    ts_ms: int,
    renewable_weight: float,
) -> float:
    """What a kWh a GPU draws costs the operator at `ts_ms` in `cluster`, facility overhead
    (PUE) included, discounted by `renewable_weight` x the renewable share: the scheduler's
    single measure of "cheaper or greener"."""
    if profile is None:
        price, renewable, pue = cluster.energy_price_per_kwh, 0.0, cluster.pue
    else:
        (price, renewable), pue = profile.at(ts_ms), profile.pue or cluster.pue
    return price * pue * (1.0 - renewable_weight * renewable)


def mean_price(
    cluster: ClusterFacts,
    profile: EnergyProfile | None,
    start_ms: int,
    runtime_ms: int,
    renewable_weight: float,
) -> float:
    """The effective price averaged over [start, start + runtime), segment by segment (hours
    and the profile's windows)."""
    if runtime_ms <= 0:
        return effective_price(cluster, profile, start_ms, renewable_weight)
    marks = profile.boundaries() if profile is not None else []
    total, at, end = 0.0, start_ms, start_ms + runtime_ms
    while at < end:
        following = next((m for m in marks if m > at), end)
        step = min(end, (at // HOUR_MS + 1) * HOUR_MS, following) - at
        total += step * effective_price(cluster, profile, at, renewable_weight)
        at += step
    return total / runtime_ms


@dataclass(frozen=True)
class Deferral:
    """Where a deferrable job's start was put and why (the inputs, for `explain`)."""

    start_ms: int
    cluster_id: str
    price_now: float  # the best mean effective price over the run if it started now
    price_then: float  # ... if it starts at start_ms
    latest_start_ms: int

    def reason(self) -> str:
        saving = 1 - self.price_then / self.price_now if self.price_now else 0.0
        return (
            f"deferred to a cheaper window: starts at {_hhmm(self.start_ms)} UTC in "
            f"{self.cluster_id} at {self.price_then:.4f}/kWh effective vs {self.price_now:.4f} "
            f"now ({saving:.0%} less); must start by {_hhmm(self.latest_start_ms)} UTC to meet "
            "its deadline"
        )


def _hhmm(ts_ms: int) -> str:
    minutes = (ts_ms // 60_000) % (24 * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def best_start(
    now_ms: int,
    deadline_ms: int,
    runtime_ms: int,
    clusters: Iterable[ClusterFacts],
    profiles: Mapping[str, EnergyProfile],
    renewable_weight: float,
    min_saving: float,
    slack_ms: int,
) -> Deferral | None:
    """The start, now or where a price changes (an hour, a window) up to the latest start that
    still meets the deadline with `slack_ms` to spare, whose run costs least in the cheapest
    of `clusters`; None when starting now is within `min_saving` of the best (no reason to
    wait) or there is no time to wait."""
    latest = deadline_ms - runtime_ms - slack_ms
    candidates = list(clusters)
    if latest <= now_ms or not candidates:
        return None

    def cost(start: int) -> tuple[float, str]:
        return min(
            (
                mean_price(c, profiles.get(c.cluster_id), start, runtime_ms, renewable_weight),
                c.cluster_id,
            )
            for c in candidates
        )

    now_cost, _ = cost(now_ms)
    best = (now_cost, now_ms, "")
    starts = set(range((now_ms // HOUR_MS + 1) * HOUR_MS, latest + 1, HOUR_MS))
    for c in candidates:
        profile = profiles.get(c.cluster_id)
        if profile is not None:
            starts.update(m for m in profile.boundaries() if now_ms < m <= latest)
    for start in sorted(starts):
        price, cluster_id = cost(start)
        if price < best[0]:
            best = (price, start, cluster_id)
    price, start, cluster_id = best
    if start == now_ms or now_cost <= 0 or price > now_cost * (1 - min_saving):
        return None
    return Deferral(start, cluster_id, now_cost, price, latest)
