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

from dataclasses import dataclass

from fleetline.processors.view.accelerators import Accelerator
from fleetline.processors.view.catalogue import Catalogue

DEFAULT_PRECISION = "bf16"


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
        return (
            f"est. {self.step_s:.3g} s/step, {self.run_s / 3600:.3g} h on {self.gpus} "
            f"{self.kind.model} ({self.precision} {self.peak_tflops:g} TFLOPS x "
            f"{self.efficiency:g} of peak), cost {self.cost:.2f}{deadline}"
        )


def estimate(
    work: WorkSize,
    kind: Accelerator,
    gpus: int,
    cost_per_gpu_hour: float,
    now_ms: int,
    catalogue: Catalogue,
) -> Estimate | None:
    """The job on `gpus` chips of `kind` (None: the catalogue has no figure for it)."""
    capability = catalogue.of(kind)
    peak = capability.peak(work.precision) if capability else None
    if capability is None or not peak or gpus <= 0:
        return None
    step_s = work.pflop_per_step * 1000 / (gpus * peak * capability.efficiency)
    run_s = step_s * work.steps
    return Estimate(
        kind=kind,
        precision=work.precision,
        peak_tflops=peak,
        efficiency=capability.efficiency,
        gpus=gpus,
        step_s=step_s,
        run_s=run_s,
        cost=run_s / 3600 * gpus * cost_per_gpu_hour,
        finish_ms=now_ms + int(run_s * 1000),
        deadline_ms=work.deadline_ms,
    )


def best(estimates: list[Estimate]) -> Estimate | None:
    """The estimate to prefer: one that meets the deadline before one that misses it, then the
    least cost, then the soonest finish, then the model id (a total order: replay is exact)."""
    return min(
        estimates,
        key=lambda e: (not e.meets_deadline, e.cost, e.finish_ms, e.kind),
        default=None,
    )
