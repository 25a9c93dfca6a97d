"""What a GPU sample must satisfy beyond its Avro schema (GpuSample): stated once, in two forms.

`gpu_sample_problem` judges one sample (the decoder's `check_telemetry`, the view's fold);
`gpu_samples_broken` judges an Arrow batch of them at once (the hot sink). A test holds the two
equal over generated samples, NaN and the bounds included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the decoder and the fold judge records without loading Arrow
    import pyarrow as pa

UTIL_MIN, UTIL_MAX = 0.0, 100.0
# The GpuSample fields the rules read.
RULE_FIELDS = frozenset({"gpu_util_pct", "fb_used_mib", "fb_total_mib"})


def gpu_sample_problem(gpu_util_pct: float, fb_used_mib: int, fb_total_mib: int) -> str | None:
    """What is wrong with one GPU's sample, or None."""
    if not UTIL_MIN <= gpu_util_pct <= UTIL_MAX:  # NaN included
        return f"gpu_util_pct {gpu_util_pct} is outside {UTIL_MIN:g}-{UTIL_MAX:g}"
    if fb_used_mib > fb_total_mib:
        return f"fb_used_mib {fb_used_mib} exceeds fb_total_mib {fb_total_mib}"
    return None


def gpu_samples_broken(
    columns: Mapping[str, pa.Array | pa.ChunkedArray],
) -> pa.Array | pa.ChunkedArray:
    """True for each row `gpu_sample_problem` would name (null where an input is null)."""
    import pyarrow.compute as pc

    util = columns["gpu_util_pct"]
    # Asked as "within bounds", then inverted: every comparison with NaN is false.
    within = pc.and_(pc.greater_equal(util, UTIL_MIN), pc.less_equal(util, UTIL_MAX))
    return pc.or_(pc.invert(within), pc.greater(columns["fb_used_mib"], columns["fb_total_mib"]))
