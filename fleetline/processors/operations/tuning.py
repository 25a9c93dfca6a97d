"""Tuning from history: the checkpoint interval of a running job from the measured failure
rate of the GPUs it runs on and its measured checkpoint cost (Daly's higher-order optimum of
Young's formula), and a batch-size hint from the memory headroom its GPUs show. Each
recommendation carries its inputs, so a person (or the policy that applies it) sees why.
Pure: the measurements come in as numbers; the shell reads them from ClickHouse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Zero failures in a short history is not an infinite MTBF: half a failure is assumed
# (the Jeffreys prior for a Poisson rate), so the interval stays finite and grows with evidence.
PRIOR_FAILURES = 0.5


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that loses least to checkpoints and failures:
    Daly (2006), sqrt(2CM)[1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M; C is the cost
    of one checkpoint, M the job's mean time between failures (Young's sqrt(2CM) to first
    order)."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError("checkpoint cost and MTBF must be positive")
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - (
        checkpoint_s
    )


@dataclass(frozen=True)
class Recommendation:
    job: str
    kind: str  # checkpoint_interval, batch_size
    current: float | None
    recommended: float
    summary: str
    inputs: dict[str, Any]

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Recommendation:
        return cls(**data)


def checkpoint_interval(
    job: str,
    gpus: int,
    current_s: float | None,
    failures: int,
    gpu_hours: float,
    checkpoint_seconds: Sequence[float],
) -> Recommendation | None:
    """Daly's interval for a job on `gpus` GPUs whose kind failed `failures` times in
    `gpu_hours` of service, from the median of its measured checkpoint times (None without a
    measured checkpoint or any service time)."""
    if not checkpoint_seconds or gpu_hours <= 0 or gpus <= 0:
        return None
    cost = sorted(checkpoint_seconds)[len(checkpoint_seconds) // 2]
    rate = (failures + PRIOR_FAILURES) / gpu_hours  # per GPU-hour
    mtbf_s = 3600 / (rate * gpus)
    interval = daly_interval_s(max(cost, 1e-3), mtbf_s)
    return Recommendation(
        job,
        "checkpoint_interval",
        current_s,
        round(interval, 1),
        f"checkpoint every {interval / 60:.1f} min (now {_minutes(current_s)}): the job's "
        f"{gpus} GPUs fail every {mtbf_s / 3600:.1f} h together and a checkpoint costs "
        f"{cost:.2f} s",
        {
            "gpus": gpus,
            "failures": failures,
            "gpu_hours": round(gpu_hours, 2),
            "failure_rate_per_gpu_hour": rate,
            "job_mtbf_s": round(mtbf_s, 1),
            "checkpoint_cost_s": cost,
            "checkpoints_measured": len(checkpoint_seconds),
            "formula": "Daly: sqrt(2CM)[1 + sqrt(C/2M)/3 + C/18M] - C",
        },
    )


def batch_size(
    job: str, fb_used_p95_mib: float, fb_total_mib: float, margin: float = 0.1
) -> Recommendation | None:
    """How much larger (or smaller) the per-GPU batch could be, from the 95th percentile of
    the memory its GPUs used, keeping `margin` free: a factor, when it is worth saying
    (at least 1.25 up, or under 1 when the GPUs are nearly full)."""
    if fb_total_mib <= 0 or fb_used_p95_mib <= 0:
        return None
    factor = fb_total_mib * (1 - margin) / fb_used_p95_mib
    if 1.0 <= factor < 1.25:
        return None
    used = fb_used_p95_mib / fb_total_mib
    return Recommendation(
        job,
        "batch_size",
        1.0,
        round(factor, 2),
        f"scale the per-GPU batch by {factor:.2f}: its GPUs use {used:.0%} of their memory at "
        f"the 95th percentile ({margin:.0%} kept free)",
        {
            "fb_used_p95_mib": fb_used_p95_mib,
            "fb_total_mib": fb_total_mib,
            "margin": margin,
        },
    )


def _minutes(seconds: float | None) -> str:
    return "unset" if seconds is None else f"{seconds / 60:.1f} min"


def recommend(
    failure_rows: Sequence[Sequence[Any]],
    cost_rows: Sequence[Sequence[Any]],
    memory_rows: Sequence[Sequence[Any]],
    jobs: Sequence[Mapping[str, Any]],
) -> list[tuple[Recommendation, Mapping[str, Any]]]:
    """Every recommendation for the running training jobs (with the document each would
    change), from the stored history: failures per cluster and model (`failure_history_sql`),
    checkpoint seconds per job (`checkpoint_costs_sql`), memory per job (`memory_by_job_sql`)
    and the scheduler's job records. The same for `fleetline tune`, the API and the operations
    processor's own schedule."""
    history: dict[str, tuple[int, float]] = {}
    for cluster_id, _model, failures, hours in failure_rows:
        seen = history.get(cluster_id, (0, 0.0))
        history[cluster_id] = (seen[0] + int(failures), seen[1] + float(hours))
    costs = {job: [float(s) for s in seconds] for job, seconds in cost_rows}
    memory = {job: (float(p95), float(total)) for job, p95, total in memory_rows}
    found: list[tuple[Recommendation, Mapping[str, Any]]] = []
    for job in sorted(jobs, key=lambda j: str(j["key"])):
        if job["phase"] != "Running" or job["kind"] != "TrainingJob":
            continue
        clusters = sorted(job["allocation"])
        failures = sum(history.get(c, (0, 0.0))[0] for c in clusters)
        hours = sum(history.get(c, (0, 0.0))[1] for c in clusters)
        gpus = sum(int(m).bit_count() for n in job["allocation"].values() for m in n.values())
        current = job["document"]["spec"].get("checkpoint_interval_s", 1800)
        for rec in (
            checkpoint_interval(
                job["key"], gpus, current, failures, hours, costs.get(job["key"], [])
            ),
            batch_size(job["key"], *memory.get(job["key"], (0.0, 0.0))),
        ):
            if rec is not None:
                found.append((rec, job["document"]))
    return found
