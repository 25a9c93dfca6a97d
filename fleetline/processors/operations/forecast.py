"""Capacity forecasting: GPU demand per cluster and GPU model, weeks ahead, from its hourly
history, with prediction intervals; a back-test on held-out weeks against the seasonal-naive
baseline; and the capacity request a forecast raises when it crosses what a cluster has.

The model is a linear regression on a trend and Fourier terms of the day and the week (the
daily and weekly cycles), fitted by least squares to the hourly series, with the weekly profile
free to differ by hour (168 hour-of-week means of what the Fourier terms leave). Intervals are
empirical: quantiles of the in-sample residuals. Pure: the history comes in as numbers (the
shell reads it from ClickHouse), nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

HOURS_PER_DAY = 24
HOURS_PER_WEEK = 168
DAILY_HARMONICS = 4
WEEKLY_HARMONICS = 3

Series = NDArray[np.float64]


def _design(hours: NDArray[np.float64]) -> NDArray[np.float64]:
    """Columns: 1, trend, and sine/cosine pairs of the daily and weekly cycles."""
    columns = [np.ones_like(hours), hours / HOURS_PER_WEEK]
    for period, harmonics in ((HOURS_PER_DAY, DAILY_HARMONICS), (HOURS_PER_WEEK, WEEKLY_HARMONICS)):
        for k in range(1, harmonics + 1):
            angle = 2 * np.pi * k * hours / period
            columns += [np.sin(angle), np.cos(angle)]
    return np.column_stack(columns)


@dataclass(frozen=True)
class Forecast:
    start_hour: int  # hours since the epoch of the first forecast hour
    mean: Series
    lower: Series  # the interval's bounds at `coverage`
    upper: Series
    coverage: float


@dataclass(frozen=True)
class SeasonalModel:
    """Trend + daily and weekly Fourier terms + an hour-of-week correction, fitted to a series
    whose first value is at `start_hour` (hours since the epoch, so hour-of-week is aligned)."""

    coef: Series
    profile: Series  # 168 hour-of-week means of what the regression leaves
    residuals: Series
    start_hour: int
    length: int

    @classmethod
    def fit(cls, series: Sequence[float] | Series, start_hour: int = 0) -> SeasonalModel:
        y = np.asarray(series, dtype=np.float64)
        if len(y) < 2 * HOURS_PER_WEEK:
            raise ValueError(f"needs at least two weeks of hourly history, got {len(y)} hours")
        hours = np.arange(start_hour, start_hour + len(y), dtype=np.float64)
        x = _design(hours)
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        left = y - x @ coef
        slot = hours.astype(np.int64) % HOURS_PER_WEEK
        sums = np.bincount(slot, weights=left, minlength=HOURS_PER_WEEK)
        counts = np.bincount(slot, minlength=HOURS_PER_WEEK)
        # Shrunk toward 0 by the number of weeks seen: one week's noise is not a profile.
        profile = np.asarray(sums / (counts + 1.0), dtype=np.float64)
        residuals = np.asarray(left - profile[slot], dtype=np.float64)
        return cls(np.asarray(coef, dtype=np.float64), profile, residuals, start_hour, len(y))

    def predict(self, horizon_h: int, coverage: float = 0.9) -> Forecast:
        first = self.start_hour + self.length
        hours = np.arange(first, first + horizon_h, dtype=np.float64)
        mean = _design(hours) @ self.coef + self.profile[hours.astype(np.int64) % HOURS_PER_WEEK]
        tail = (1 - coverage) / 2
        low, high = np.quantile(self.residuals, [tail, 1 - tail])
        # Further ahead is less certain: the trend's error grows with the horizon.
        widen = np.sqrt(1 + np.arange(horizon_h) / max(self.length, 1))
        mean = np.maximum(mean, 0.0)
        return Forecast(
            first, mean, np.maximum(mean + low * widen, 0.0), mean + high * widen, coverage
        )


def seasonal_naive(history: Sequence[float] | Series, horizon_h: int) -> Series:
    """The baseline: each hour ahead is the same hour of the last week seen."""
    y = np.asarray(history, dtype=np.float64)
    last_week = y[-HOURS_PER_WEEK:]
    return np.asarray([last_week[h % HOURS_PER_WEEK] for h in range(horizon_h)], dtype=np.float64)


def smape(actual: Series, predicted: Series) -> float:
    """Symmetric mean absolute percentage error, in percent (0 where both are 0)."""
    a, p = np.asarray(actual, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    denominator = np.abs(a) + np.abs(p)
    terms = np.divide(2 * np.abs(a - p), denominator, out=np.zeros_like(a), where=denominator > 0)
    return float(100 * terms.mean())


@dataclass(frozen=True)
class BackTest:
    weeks_held_out: int
    model_smape: float
    baseline_smape: float
    coverage: float  # share of held-out hours inside the model's interval
    folds: int

    @property
    def beats_baseline(self) -> bool:
        return self.model_smape < self.baseline_smape


def back_test(
    series: Sequence[float] | Series,
    start_hour: int = 0,
    weeks_held_out: int = 4,
    folds: int = 4,
    interval: float = 0.9,
) -> BackTest:
    """Rolling-origin back-test: for each of `folds` origins, fit on the history before it and
    forecast the next `weeks_held_out` weeks; sMAPE of the model and of the seasonal-naive
    baseline over every held-out hour, and how often the interval held the truth."""
    y = np.asarray(series, dtype=np.float64)
    horizon = weeks_held_out * HOURS_PER_WEEK
    model_err, base_err, inside, total = [], [], 0, 0
    for fold in range(folds, 0, -1):
        cut = len(y) - fold * HOURS_PER_WEEK - horizon + HOURS_PER_WEEK
        if cut < 2 * HOURS_PER_WEEK or cut + horizon > len(y):
            continue
        history, actual = y[:cut], y[cut : cut + horizon]
        model = SeasonalModel.fit(history, start_hour)
        forecast = model.predict(horizon, interval)
        model_err.append(smape(actual, forecast.mean))
        base_err.append(smape(actual, seasonal_naive(history, horizon)))
        inside += int(((actual >= forecast.lower) & (actual <= forecast.upper)).sum())
        total += horizon
    if not model_err:
        raise ValueError("the series is too short to hold out any week")
    return BackTest(
        weeks_held_out,
        float(np.mean(model_err)),
        float(np.mean(base_err)),
        inside / total,
        len(model_err),
    )


@dataclass(frozen=True)
class Crossing:
    """The first forecast hour whose upper bound needs more GPUs than the cluster has."""

    hour: int  # hours since the epoch
    needed_gpus: float
    capacity_gpus: int
    lead_time_h: int


def first_crossing(forecast: Forecast, capacity_gpus: int, lead_time_h: int) -> Crossing | None:
    """The first hour the interval's upper bound needs more than `capacity_gpus`, if any
    (whether it falls within `lead_time_h`, and so a request is already late, is the
    caller's to say)."""
    over = np.nonzero(forecast.upper > capacity_gpus)[0]
    if len(over) == 0:
        return None
    first = int(over[0])
    return Crossing(
        forecast.start_hour + first, float(forecast.upper[first]), capacity_gpus, lead_time_h
    )


def simulated_demand(
    weeks: int,
    seed: int,
    base: float = 400.0,
    growth_per_week: float = 4.0,
    daily: float = 120.0,
    weekend_drop: float = 0.35,
    noise: float = 40.0,
) -> Series:
    """A year (or any number of weeks) of hourly GPU demand with a daily cycle (peaking in the
    afternoon), quieter weekends, growth and noise: the back-test's input."""
    rng = np.random.default_rng(seed)
    hours = np.arange(weeks * HOURS_PER_WEEK, dtype=np.float64)
    day = np.sin(2 * np.pi * ((hours % HOURS_PER_DAY) / HOURS_PER_DAY - 0.375))
    weekday = (hours // HOURS_PER_DAY) % 7
    weekend = np.where(weekday >= 5, 1 - weekend_drop, 1.0)
    trend = base + growth_per_week * hours / HOURS_PER_WEEK
    demand = (trend + daily * day) * weekend + rng.normal(0, noise, len(hours))
    return np.maximum(demand, 0.0)


def capacity_plan(
    hours: Sequence[int],
    demand: Sequence[float],
    capacity_gpus: int,
    horizon_weeks: int,
    lead_time_h: int,
    coverage: float = 0.9,
) -> dict[str, object]:
    """The forecast of an hourly demand history (hours since the epoch; gaps carry the last
    value), its back-test where the history allows, and whether (and when) it needs more
    than `capacity_gpus` within the horizon: what `fleetline forecast` and the API show."""
    if not hours:
        raise ValueError("no demand history")
    first, last = int(hours[0]), int(hours[-1])
    filled = np.zeros(last - first + 1)
    seen = dict(zip((int(h) for h in hours), (float(d) for d in demand), strict=True))
    value = 0.0
    for i in range(len(filled)):
        value = seen.get(first + i, value)
        filled[i] = value
    model = SeasonalModel.fit(filled, first)
    horizon = horizon_weeks * HOURS_PER_WEEK
    forecast = model.predict(horizon, coverage)
    crossing = first_crossing(forecast, capacity_gpus, lead_time_h)
    test: BackTest | None = None
    if len(filled) >= 6 * HOURS_PER_WEEK:
        test = back_test(filled, first, weeks_held_out=min(4, len(filled) // HOURS_PER_WEEK - 3))
    days = []
    for d in range(0, horizon, HOURS_PER_DAY):
        window = slice(d, d + HOURS_PER_DAY)
        days.append(
            {
                "day_start_hour": forecast.start_hour + d,
                "peak_mean": round(float(forecast.mean[window].max()), 2),
                "peak_upper": round(float(forecast.upper[window].max()), 2),
                "low_lower": round(float(forecast.lower[window].min()), 2),
            }
        )
    return {
        "history_hours": len(filled),
        "capacity_gpus": capacity_gpus,
        "coverage": coverage,
        "days": days,
        "crossing": None
        if crossing is None
        else {
            "hour": crossing.hour,
            "hours_ahead": crossing.hour - forecast.start_hour,
            "needed_gpus": round(crossing.needed_gpus, 2),
            "late": crossing.hour - forecast.start_hour < lead_time_h,
        },
        "back_test": None
        if test is None
        else {
            "weeks_held_out": test.weeks_held_out,
            "folds": test.folds,
            "model_smape_pct": round(test.model_smape, 3),
            "seasonal_naive_smape_pct": round(test.baseline_smape, 3),
            "beats_baseline": test.beats_baseline,
            "interval_coverage": round(test.coverage, 4),
        },
    }
