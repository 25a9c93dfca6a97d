"""GPU shares for inference replicas: the environment that confines a replica to its share of
a GPU (MPS client limits where an MPS control daemon runs, time-slicing where none does)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def gpu_sharing(
    workers: Sequence[tuple[str, Sequence[int]]],
    share: Any,
    memory_mib: Any,
    mps: bool,
) -> tuple[dict[str, str], str]:
    """The environment that confines a replica to its share of a GPU, and what was applied:
    MPS's per-client limits (its share of the SMs, its share of the GPU's memory when the
    GPU's size can be read) on a host whose MPS control daemon runs; time-slicing, the
    driver's default when several processes share a GPU, where none runs. Whole GPUs: none."""
    if not isinstance(share, int | float) or share >= 1 or not workers or not workers[0][1]:
        return {}, ""
    node, gpus = workers[0]
    percent = round(share * 100)
    env = {"FLEETLINE_GPU_SHARE": str(share), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
    total = memory_mib(gpus[0])
    if total:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={int(total * share)}M"
        memory = f"memory limit {int(total * share)} MiB of {total}"
    else:
        memory = "no memory limit (the GPU's size cannot be read here: no NVML)"
    mode = (
        "MPS"
        if mps
        else "time-sliced (no MPS control daemon runs here; its client limits are set for one)"
    )
    return env, (
        f"GPU share {share} of {node}/{gpus[0]}: {mode}, "
        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}, {memory}"
    )


def gpu_memory_mib(index: int) -> int | None:
    """A local GPU's memory, from NVML; None without NVML or that GPU."""
    from fleetline.agents.devices import DeviceError
    from fleetline.agents.devices.nvml import load_nvml

    try:
        nv = load_nvml()
    except DeviceError:
        return None
    try:
        nv.nvmlInit()
    except nv.NVMLError:
        return None  # no driver here
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        return int(nv.nvmlDeviceGetMemoryInfo(handle).total // 2**20)
    except nv.NVMLError:
        return None
    finally:
        nv.nvmlShutdown()


def mps_running() -> bool:
    """Whether an MPS control daemon answers on this host (its pipe directory exists)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return Path(pipe, "control").exists()
