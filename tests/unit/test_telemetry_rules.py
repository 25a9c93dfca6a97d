"""A GPU sample's rules beyond its schema hold the same in both forms: one sample at a time
(the decoder, the fold) and an Arrow batch at once (the hot sink)."""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest

from fleetline.errors import InvalidEventError
from fleetline.processors.view.fold import fold_telemetry
from fleetline.processors.view.model import ResourceView, Sample
from fleetline.streams.events import check_telemetry
from fleetline.streams.telemetry_rules import gpu_sample_problem, gpu_samples_broken

EDGES = [0.0, 100.0, -0.0, -1e-3, 100.001, math.nan, math.inf, -math.inf, 50.0]


def generated(n: int, seed: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        util = rng.choice(EDGES) if rng.random() < 0.4 else rng.uniform(-20.0, 120.0)
        total = rng.choice([0, 1, 80 * 1024, 2**40])
        used = max(0, total + rng.choice([-1, 0, 1, -(total // 2), 5]))
        # The hot sink's column is float32, and the decoder reads Avro's float the same way.
        out.append((float(np.float32(util)), used, total))
    return out


def test_the_batch_form_flags_exactly_the_samples_the_scalar_form_names() -> None:
    samples = generated(5000, seed=7)
    columns = {
        "gpu_util_pct": pa.array([s[0] for s in samples], pa.float32()),
        "fb_used_mib": pa.array([s[1] for s in samples], pa.uint64()),
        "fb_total_mib": pa.array([s[2] for s in samples], pa.uint64()),
    }
    batch = gpu_samples_broken(columns).to_pylist()
    scalar = [gpu_sample_problem(*s) is not None for s in samples]
    assert batch == scalar
    # Both kinds of sample are generated, and every edge value among them.
    assert 0 < sum(scalar) < len(scalar)
    assert any(math.isnan(s[0]) for s in samples)


@pytest.mark.parametrize(
    ("util", "used", "total", "problem"),
    [
        (100.0, 10, 10, None),
        (0.0, 0, 0, None),
        (math.nan, 0, 1, "gpu_util_pct nan is outside 0-100"),
        (-0.5, 0, 1, "gpu_util_pct -0.5 is outside 0-100"),
        (5.0, 11, 10, "fb_used_mib 11 exceeds fb_total_mib 10"),
    ],
)
def test_one_sample_is_named_with_what_is_wrong(util, used, total, problem) -> None:
    assert gpu_sample_problem(util, used, total) == problem


def sample(util: float) -> Sample:
    return Sample(
        0, "GPU-0", "h100", util, None, 1, 2, None, None, None, None, 40.0, 100.0, None, 0, 0, []
    )


def test_the_decoder_and_the_fold_refuse_a_nan_utilisation_alike() -> None:
    record = {"node_id": "n1", "seq": 3, "gpus": [sample(math.nan)._asdict()]}
    with pytest.raises(InvalidEventError, match="n1 seq 3 gpu 0: gpu_util_pct nan"):
        check_telemetry(record)
    with pytest.raises(InvalidEventError, match="n1 seq 3 gpu 0: gpu_util_pct nan"):
        fold_telemetry(ResourceView(), "c", "r", "n1", 3, 1000, [sample(math.nan)])
