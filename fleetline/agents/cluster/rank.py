"""One worker of a run as its launcher starts it: `python -m fleetline.agents.cluster.rank
COMMAND...` under `mpirun` (the process backend) or `srun` (Slurm), one process per worker.

It says the worker's place in the workload contract's words before the workload starts:
FLEETLINE_LOCAL_RANK (the launcher's rank: Open MPI's, PMIx's or Slurm's), FLEETLINE_RANK
(global: FLEETLINE_RANK_BASE, the first rank of this cluster's part, plus the local one), the
worker's GPUs (FLEETLINE_WORKERS) where the manager has not set them, and a progress file of
its own beside rank 0's (which the cluster agent reads). Under the process backend it joins the
run's signal group (FLEETLINE_SIGNAL_GROUP), so the agent's SIGTERM reaches every worker, and
not `mpirun`, which would kill them before their checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def local_rank(env: dict[str, str]) -> int:
    for name in LAUNCHER_RANKS:
        if env.get(name):
            return int(env[name])
    return 0


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the worker this process is, from its launcher's."""
    local = local_rank(env)
    out = dict(env)
    out["FLEETLINE_LOCAL_RANK"] = str(local)
    out["FLEETLINE_RANK"] = str(int(env.get("FLEETLINE_RANK_BASE") or 0) + local)
    try:
        workers = json.loads(env.get("FLEETLINE_WORKERS") or "[]")
    except ValueError:
        workers = []
    if "CUDA_VISIBLE_DEVICES" not in env and local < len(workers):
        out["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in workers[local].get("gpus", ()))
    if local and env.get("FLEETLINE_PROGRESS_FILE"):
        out["FLEETLINE_PROGRESS_FILE"] = f"{env['FLEETLINE_PROGRESS_FILE']}.rank{local}"
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: rank COMMAND...", file=sys.stderr)
        return 2
    env = worker_env(dict(os.environ))
    group = env.get("FLEETLINE_SIGNAL_GROUP")
    if group:
        with contextlib.suppress(OSError, ValueError):
            os.setpgid(0, int(group))
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
