"""Ready queries for the common questions, over all tiers (`$samples` macros, see tiers.py).

Each takes a time range; the tiered store reads only the tiers that overlap it. Job wait times
and utilisation by tenant need the scheduler's decisions in ClickHouse (the scheduling issue)
and are not here yet.
"""

from __future__ import annotations

READY: dict[str, tuple[str, str]] = {
    "utilisation-by-cluster-hour": (
        "GPU utilisation per cluster per hour",
        "SELECT cluster_id, toStartOfHour(ts) AS hour, round(avg(gpu_util_pct), 2) AS "
        "avg_util_pct, uniqExact(gpu_uuid) AS gpus, count() AS samples FROM $samples "
        "GROUP BY cluster_id, hour ORDER BY cluster_id, hour"),
    "utilisation-by-cluster": (
        "GPU utilisation per cluster over the range",
        "SELECT cluster_id, round(avg(gpu_util_pct), 2) AS avg_util_pct, count() AS samples "
        "FROM $samples GROUP BY cluster_id ORDER BY cluster_id"),
    "degraded-gpu-history": (
        "GPUs per hour with RDMA loss >= 0.1%, NVLink errors rising, or XID events",
        "SELECT toStartOfHour(ts) AS hour, cluster_id, node_id, gpu_index, "
        "round(max(rdma_packet_loss_ratio), 6) AS max_rdma_loss, "
        "max(nvlink_errors_total) - min(nvlink_errors_total) AS nvlink_errors, "
        "arrayDistinct(arrayFlatten(groupArray(xid_codes))) AS xids FROM $samples "
        "GROUP BY hour, cluster_id, node_id, gpu_index "
        "HAVING max_rdma_loss >= 0.001 OR nvlink_errors > 0 OR length(xids) > 0 "
        "ORDER BY hour, cluster_id, node_id, gpu_index"),
    "top-energy-consumers": (
        "Nodes by energy drawn in the range (kWh, from mean power x time covered)",
        "SELECT cluster_id, node_id, round(avg(power_w) * uniqExact(gpu_index) * "
        "(dateDiff('second', min(ts), max(ts)) + 1) / 3.6e6, 3) AS kwh, "
        "round(avg(power_w), 1) AS avg_gpu_power_w FROM $samples "
        "GROUP BY cluster_id, node_id ORDER BY kwh DESC LIMIT 20"),
}
