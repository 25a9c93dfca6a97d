"""A training job's time and cost on each kind of chip, from its size and the accelerator
catalogue. Pure: time is the `now_ms` the caller passes.

    step time = PFLOP per step / (GPUs x peak TFLOPS in its precision x share of peak)
    cost      = step time x steps x GPUs x the cluster's cost per GPU-hour

The share of peak is the catalogue's figure for the model (a model FLOPs utilisation a tuned
training step reaches); the precision is the spec's, bf16 when it names none (what large
training runs in). The estimate ignores communication: a gang is placed inside one
interconnect domain where it can be, and the catalogue's share is taken from whole steps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetline.processors.view.accelerators import Accelerator
from fleetline.processors.view.catalogue import Catalogue

DEFAULT_PRECISION = "bf16"
# Intervals between checkpoint reports a model must have been measured over before its
# measured share of peak replaces the catalogue's.
MIN_MEASURED_INTERVALS = 3


@dataclass
class Measured:
    """What sized jobs computed on one model in one precision, against its peak (the
    scheduler's state of record, keyed by `measured_key`)."""

    achieved_tflop: float = 0.0
    peak_tflop: float = 0.0
    intervals: int = 0

    @property
    def efficiency(self) -> float:
        return self.achieved_tflop / self.peak_tflop if self.peak_tflop > 0 else 0.0

    def as_data(self) -> dict[str, Any]:
        return {
            "achieved_tflop": self.achieved_tflop,
            "peak_tflop": self.peak_tflop,
            "intervals": self.intervals,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Measured:
        return cls(float(data["achieved_tflop"]), float(data["peak_tflop"]), int(data["intervals"]))


def measured_key(model: str, precision: str) -> str:
    return f"{model}/{precision}"


@dataclass(frozen=True)
class WorkSize:
    """What a job computes (its spec's `work` and `precision`)."""

    pflop_per_step: float
    steps: int
    precision: str
    deadline_ms: int | None = None


@dataclass(frozen=True)
class Estimate:
    kind: Accelerator
    precision: str
    peak_tflops: float
    efficiency: float
    gpus: int
    step_s: float
    run_s: float
    cost: float  # the whole run, in the clusters' price unit
    finish_ms: int
    deadline_ms: int | None
    measured_intervals: int = 0  # 0: the catalogue's share of peak

    @property
    def meets_deadline(self) -> bool:
        return self.deadline_ms is None or self.finish_ms <= self.deadline_ms

    def describe(self) -> str:
        """The estimate and its inputs, for the decision's reason."""
        deadline = (
            ""
            if self.deadline_ms is None
            else (
                "; finishes before its deadline"
                if self.meets_deadline
                else f"; finishes {(self.finish_ms - self.deadline_ms) / 3_600_000:.2f} h "
                "after its deadline"
            )
        )
        share = (
            f"{self.efficiency:.3g} of peak measured over {self.measured_intervals} intervals"
            if self.measured_intervals
            else f"{self.efficiency:g} of peak"
        )
        return (
            f"est. {self.step_s:.3g} s/step, {self.run_s / 3600:.3g} h on {self.gpus} "
            f"{self.kind.model} ({self.precision} {self.peak_tflops:g} TFLOPS x "
            f"{share}), cost {self.cost:.2f}{deadline}"
        )


def estimate(
    work: WorkSize,
    kind: Accelerator,
    gpus: int,
    cost_per_gpu_hour: float,
    now_ms: int,
    catalogue: Catalogue,
    measured: Mapping[str, Measured] | None = None,
) -> Estimate | None:
    """The job on `gpus` chips of `kind` (None: the catalogue has no figure for it), at the
    share of peak `measured` for the model and precision once it spans
    MIN_MEASURED_INTERVALS, else the catalogue's."""
    capability = catalogue.of(kind)
    peak = capability.peak(work.precision) if capability else None
    if capability is None or not peak or gpus <= 0:
        return None
    efficiency, intervals = capability.efficiency, 0
    found = (measured or {}).get(measured_key(kind.model, work.precision))
    if found is not None and found.intervals >= MIN_MEASURED_INTERVALS and found.efficiency > 0:
        efficiency, intervals = found.efficiency, found.intervals
    step_s = work.pflop_per_step * 1000 / (gpus * peak * efficiency)
    run_s = step_s * work.steps
    return Estimate(
        kind=kind,
        precision=work.precision,
        peak_tflops=peak,
        efficiency=efficiency,
        gpus=gpus,
        step_s=step_s,
        run_s=run_s,
        cost=run_s / 3600 * gpus * cost_per_gpu_hour,
        finish_ms=now_ms + int(run_s * 1000),
        deadline_ms=work.deadline_ms,
        measured_intervals=intervals,
    )


# The estimate as `describe` writes it into a decision's reason (a reason has other parts).
_DESCRIBED = re.compile(r"est\. [^;]*(?:; finishes [^;]*)?")


def described_in(reason: str) -> str | None:
    """The estimate a decision's reason carries, as `Estimate.describe` wrote it, or None."""
    found = _DESCRIBED.search(reason)
    return found.group(0) if found else None


def interval_share(
    pflop_per_step: float, steps: int, seconds: float, gpus: int, peak_tflops: float
) -> tuple[float, float] | None:
    """(TFLOP computed, TFLOP the chips' peak allowed) over one interval between two reports;
    None where it is no measurement: a share of peak above 1 says the job's stated size does
    not match what it runs (or the run is simulated), and is not believed."""
    if steps <= 0 or seconds <= 0 or gpus <= 0 or peak_tflops <= 0:
        return None
    achieved = steps * pflop_per_step * 1000
    possible = seconds * gpus * peak_tflops
    return (achieved, possible) if achieved <= possible else None


def best(estimates: list[Estimate]) -> Estimate | None:
    """The estimate to prefer: one that meets the deadline before one that misses it, then the
    least cost, then the soonest finish, then the model id (a total order: replay is exact)."""
    return min(
        estimates,
        key=lambda e: (not e.meets_deadline, e.cost, e.finish_ms, e.kind),
        default=None,
    )
